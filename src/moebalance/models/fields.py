"""One validator for the fields of frozen descriptions: each field's rule is named once, a bad value is one line.

The real-model description (:class:`moebalance.models.ModelSpec` and its :class:`~moebalance.models.Attention`),
the GPU presets (:class:`moebalance.cost.hardware.GpuSpec`) and the trained LM's network config
(:class:`moebalance.lm.moe_lm.ModelConfig`) all check their fields here in ``__post_init__``; only the rules that
tie two fields together (``top_k <= num_experts``) stay with each class.

Example: ``check_fields(spec, positive=("num_layers",))`` on a spec with ``num_layers=0`` raises
``InputError("ModelSpec.num_layers (0) must be a positive integer")``. A numpy integer is accepted and stored back
as a Python ``int`` (so the description stays JSON-serialisable); ``True`` is never an integer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from moebalance.core.errors import InputError

__all__ = ["check_fields"]


def check_fields(obj: object, *, positive: Iterable[str] = (), non_negative: Iterable[str] = (),
                 text: Iterable[str] = (), flags: Iterable[str] = (), positive_reals: Iterable[str] = (),
                 non_negative_reals: Iterable[str] = (), choices: Mapping[str, tuple[object, ...]] | None = None,
                 label: str | None = None) -> None:
    """Check the named fields of ``obj`` (a frozen dataclass, in its ``__post_init__``).

    ``positive`` / ``non_negative``: integers ``>= 1`` / ``>= 0``; ``text``: non-empty strings; ``flags``: ``True``
    or ``False``; ``positive_reals`` / ``non_negative_reals``: finite numbers ``> 0`` / ``>= 0``; ``choices``: a
    field's allowed values. A message starts with ``label`` (default: the class name and a dot), then the field
    and the bad value.
    """
    where = f"{type(obj).__name__}." if label is None else label

    def refuse(name: str, value: object, what: str) -> None:
        raise InputError(f"{where}{name} ({value!r}) must be {what}")

    for minimum, names in ((1, positive), (0, non_negative)):
        for name in names:
            value = getattr(obj, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
                refuse(name, value, "a positive integer" if minimum else "an integer >= 0")
            if not isinstance(value, int):
                object.__setattr__(obj, name, int(value))  # a numpy integer, stored as a Python int
    for name in text:
        value = getattr(obj, name)
        if not isinstance(value, str) or not value:
            refuse(name, value, "a non-empty string")
    for name in flags:
        value = getattr(obj, name)
        if not isinstance(value, bool | np.bool_):
            refuse(name, value, "true or false")
        object.__setattr__(obj, name, bool(value))
    for strict, names in ((True, positive_reals), (False, non_negative_reals)):
        for name in names:
            value = getattr(obj, name)
            number = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
            # an int is finite however large (math.isfinite would overflow converting it to a float)
            if not number or not (isinstance(value, int) or math.isfinite(value)) or \
                    (value <= 0 if strict else value < 0):
                refuse(name, value, "a finite number > 0" if strict else "a finite number >= 0")
    for name, allowed in (choices or {}).items():
        value = getattr(obj, name)
        if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            refuse(name, value, " or ".join(repr(a) for a in allowed))
