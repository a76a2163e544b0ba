"""Size checks before allocation: an absurd size from a file or a flag is refused in one line, never a MemoryError.

Every reader and command that allocates an array whose size comes from user input (a header, a flag, an id in a
file) calls :func:`check_alloc` first with the shape it is about to allocate. The limit is the machine's physical
memory (``os.sysconf``), so a size that could never fit is named with its bytes and the fix; sizes that fit are
left to the allocator. Products are computed with Python integers, so nothing wraps.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from moebalance.core.errors import InputError

__all__ = ["MAX_TOKENS", "check_alloc", "check_count", "machine_memory_bytes"]

#: Tokens a load may hold, in one entry and summed over the whole load (:func:`moebalance.core.load.check_counts`).
#: Every sum of counts (per layer, per batch, over batches, over everything) is at most the total, so none wraps
#: int64, with room to add two such sums.
MAX_TOKENS = 2**62


def machine_memory_bytes() -> int:
    """Memory this process may use, in bytes: the machine's physical memory (64 GiB where the platform does not
    say), or the address-space limit (``ulimit -v``) where that is lower."""
    try:
        physical = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX
        physical = 64 * 2**30
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return physical
    return physical if soft == resource.RLIM_INFINITY or soft <= 0 else min(physical, int(soft))


def _human(nbytes: int) -> str:
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6)):
        if nbytes >= size:
            return f"{nbytes / size:,.1f} {unit}"
    return f"{nbytes:,} bytes"


def check_alloc(shape: Iterable[int], itemsize: int, what: str, fix: str = "") -> int:
    """Refuse, in one line, an array of ``shape`` x ``itemsize`` bytes that this machine cannot hold.

    ``what`` names the array as the user knows it (``"counts [B, L, E]"``), ``fix`` says what to change. Returns
    the number of elements. Negative dimensions are refused too.
    """
    dims = [int(d) for d in shape]
    if any(d < 0 for d in dims):
        raise InputError(f"{what} would have a negative size {dims}" + (f"; {fix}" if fix else ""))
    count = 1
    for d in dims:
        count *= d
    nbytes = count * int(itemsize)
    limit = machine_memory_bytes()
    if nbytes > limit:
        raise InputError(f"{what} of shape {dims} would take {_human(nbytes)}, more than this machine's "
                         f"{_human(limit)} of memory (or ulimit -v)" + (f"; {fix}" if fix else ""))
    return count


def check_count(value: int, name: str, maximum: int, fix: str = "") -> int:
    """``value`` as an int in ``[1, maximum]``, or a one-line error naming ``name``, the bound and the fix."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be an integer, not {value!r}")
    if not 1 <= value <= maximum:
        raise InputError(f"{name} = {value:,} is outside 1..{maximum:,}" + (f"; {fix}" if fix else ""))
    return value
