"""Reading engines' files without tracebacks: ``.npy`` bytes checked before anything is allocated, and the model a
load's shape names (JSON goes through :func:`moebalance.core.io.read_json`, which refuses any depth or number size
in one line).

- :func:`read_npy_bytes`: a ``.npy`` image (vLLM's base64 ``routed_experts``): its header is read first, the size
  it claims checked against the machine (:func:`moebalance.core.limits.check_alloc`) and against the bytes that
  follow, and only then the array read.
- :func:`load_model`: the preset a load gets from its shape or from the model the caller names
  (:func:`moebalance.engines.layers.choose_model`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

from moebalance.core.errors import InputError
from moebalance.core.limits import check_alloc
from moebalance.engines.layers import choose_model

__all__ = ["load_model", "read_npy_bytes"]


def read_npy_bytes(data: bytes, source: str, what: str = "routed_experts") -> np.ndarray:
    """The array in the ``.npy`` image ``data``; integer dtypes only (module docstring)."""
    buf = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(buf)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(buf)
        else:
            raise ValueError(f".npy format version {version} (numpy.save writes 1.0 or 2.0)")
    except (ValueError, OSError, EOFError) as exc:
        first = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{source}: {what} is not a .npy array ({first})") from None
    if dtype.hasobject or dtype.kind not in "iu":
        raise InputError(f"{source}: {what} holds {dtype} values; it must hold integer expert ids")
    count = check_alloc(shape, dtype.itemsize, f"{source}: {what}",
                        "the .npy header claims more than any response holds (is the file damaged?)")
    body = len(data) - buf.tell()
    if body != count * dtype.itemsize:
        raise InputError(f"{source}: {what}'s .npy header claims shape {tuple(int(d) for d in shape)} "
                         f"({count * dtype.itemsize:,} bytes) but {body:,} bytes follow it (is it truncated?)")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=buf.tell())
    return arr.reshape(shape, order="F" if fortran else "C")


def load_model(num_rows: int, num_experts: int, layer_ids: Sequence[int] | None = None,
               loaded: Sequence[bool] | None = None, model: str | None = None) -> str | None:
    """The preset of a load of ``[num_rows, num_experts]`` (module docstring)."""
    return choose_model(num_rows, num_experts, layer_ids, loaded, model).preset
