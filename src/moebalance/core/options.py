"""Frozen option sets built from ``key=value`` parameters: a policy's config, a router's options; and the
checks their ``__post_init__`` and the algorithms behind them share (:func:`check_choice`, :func:`check_int`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from moebalance.core.errors import InputError

__all__ = ["Options", "check_choice", "check_int"]


@dataclass(kw_only=True, frozen=True, slots=True)
class Options:
    """Base of a frozen, keyword-only option set, validated in ``__post_init__`` by each subclass."""

    #: What owns the options and what one option is called, for error messages.
    owner_kind: ClassVar[str] = "owner"
    option_word: ClassVar[str] = "option"

    @classmethod
    def from_params(cls, owner: str, params: Mapping[str, Any]) -> Options:
        """The options from ``params`` (e.g. parsed ``--set`` values); an unknown key names the known ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in params:
            if key not in names:
                hint = f"its {cls.option_word}s: {', '.join(names)}" if names else "it takes none"
                raise InputError(f"{cls.owner_kind} {owner!r} has no {cls.option_word} {key!r}; {hint}")
        return cls(**params)

    def as_params(self) -> dict[str, Any]:
        """The options as JSON values."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def check_choice(name: str, value: object, choices: tuple[str, ...], error: type[Exception] = InputError) -> str:
    """``value`` if it is one of ``choices``, else ``error`` naming them (also refuses non-strings from ``--set``).

    Example: ``check_choice("grouping", "spectral", ("hierarchical", "uniform"))`` raises
    ``grouping ('spectral') must be 'hierarchical' or 'uniform'``.
    """
    if not isinstance(value, str) or value not in choices:
        names = [repr(c) for c in choices]
        alternatives = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        raise error(f"{name} ({value!r}) must be {alternatives}")
    return value


def check_int(name: str, value: object, *, minimum: int | None = None, error: type[Exception] = InputError) -> int:
    """``value`` as an ``int`` (numpy integers accepted, booleans refused), at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or (minimum is not None and value < minimum):
        what = "an integer" if minimum is None else ("a non-negative integer" if minimum == 0 else
                                                     f"an integer >= {minimum}")
        raise error(f"{name} ({value!r}) must be {what}")
    return int(value)
