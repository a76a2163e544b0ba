"""Counting over token-level traces in one pass, with no temporary the size of the trace.

Legend: ``T`` tokens, ``L`` MoE layers, ``K`` picks per token (top-k), ``E`` experts per layer, ``B`` batches,
``G`` GPUs.

A trace of a million tokens of a DeepSeek-V3-like model holds ``T * L * K`` = 464M picks. Counting them the
numpy way (a flat ``int64`` index per pick, then ``bincount``) makes an index array of 3.7 GB, and the pair
counts of co-activation and cross-layer transitions ``K`` times more. These kernels walk the picks once and add
into the result directly (numba, compiled once into numba's cache; they release the GIL), so memory is the
result alone and time is a few nanoseconds per pick.

A trace too large to hold (ten million DeepSeek-V3 tokens are 9.3 GB of ``int16`` ids) is memory-mapped from its
file (:func:`moebalance.core.load.read_load`), and every count here walks it in chunks of tokens
(:func:`token_chunks`), handing each chunk's pages back after use (:func:`release`): the file's pages stay in the
operating system's cache, not in this process, so memory stays flat whatever the trace's length.

Expert ids are stored compactly (:func:`id_dtype`: ``int16`` up to 32,767 experts, else ``int32``);
:func:`as_ids` checks and converts other integer arrays once, so the kernels see ids in range, in one of those
two types (numba compiles a variant per type and layout: read-only, memory-mapped ids get their own).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import numpy as np
from numba import njit

from moebalance.core.errors import InputError

__all__ = ["as_ids", "check_picks", "count_picks", "demand_counts", "distinct_served", "id_dtype", "pair_counts",
           "release", "token_chunks", "top_k", "transition_counts"]

#: Picks per chunk when a count walks a trace (64 MB of ``int16`` ids).
CHUNK_PICKS = 1 << 25


def _file_mapping(arr: np.ndarray) -> mmap.mmap | None:
    """The read-only file mapping ``arr`` views (a ``numpy.memmap`` opened with ``mode="r"``), else None."""
    base: object = arr
    while base is not None:
        mapping = getattr(base, "_mmap", None)
        if isinstance(base, np.memmap) and base.mode == "r" and isinstance(mapping, mmap.mmap):
            return mapping
        base = getattr(base, "base", None)
    return None


def release(arr: np.ndarray | None) -> None:
    """Hand the pages of ``arr`` back to the operating system where ``arr`` views a read-only file mapping (the
    whole pages it covers; a later read faults them in again from the page cache); a no-op for any other array
    (whose memory is never touched) and for None."""
    mm = None if arr is None else _file_mapping(arr)
    if mm is None or arr is None or arr.size == 0 or not arr.flags.c_contiguous:
        return
    start = np.frombuffer(mm, dtype=np.uint8).__array_interface__["data"][0]
    lo = arr.__array_interface__["data"][0] - start
    hi = lo + arr.nbytes
    page = mmap.PAGESIZE
    lo, hi = -(-lo // page) * page, (hi // page) * page  # whole pages inside the array only
    if hi > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def token_chunks(ids_TLK: np.ndarray, max_picks: int = CHUNK_PICKS) -> Iterator[tuple[int, int]]:
    """Token ranges ``(lo, hi)`` covering ``ids_TLK [T, L, K]``, each of at most ``max_picks`` picks (one token at
    least); each chunk is released (:func:`release`) once the loop moves past it."""
    T = ids_TLK.shape[0]
    per = max(1, int(np.prod(ids_TLK.shape[1:])))
    rows = max(1, max_picks // per)
    for lo in range(0, T, rows):
        hi = min(T, lo + rows)
        yield lo, hi
        release(ids_TLK[lo:hi])


def id_dtype(num_experts: int) -> np.dtype:
    """The compact dtype of expert ids in ``[0, num_experts)``: ``int16`` up to 32,767 experts, else ``int32``."""
    if num_experts > np.iinfo(np.int32).max:
        raise InputError(f"num_experts ({num_experts}) is above 2**31 - 1; expert ids are stored as 32-bit integers")
    return np.dtype(np.int16 if num_experts <= np.iinfo(np.int16).max else np.int32)


def as_ids(topk_ids: np.ndarray, num_experts: int, name: str = "topk_ids") -> np.ndarray:
    """``topk_ids`` in the compact dtype of ``num_experts``, C-contiguous (a copy only when needed).

    The range is checked before the cast, so an id that the compact type cannot hold is an error, never a wrap;
    the counting kernels below index by the ids without bounds checks and take ids only from here.
    """
    arr = np.asarray(topk_ids)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{name} has dtype {arr.dtype}; it must hold integer expert ids")
    target = id_dtype(num_experts)
    parts = (arr[lo:hi] for lo, hi in token_chunks(arr)) if arr.ndim == 3 else (arr,)
    for part in parts:  # a trace's ids a chunk at a time, their pages handed back
        if part.size:
            lo, hi = int(part.min()), int(part.max())
            if lo < 0 or hi >= num_experts:
                raise InputError(f"{name} holds expert id {lo if lo < 0 else hi}; ids must lie in [0, {num_experts})")
    return np.ascontiguousarray(arr, dtype=target)


@njit(cache=True, nogil=True)
def _check_picks(ids: np.ndarray, num_experts: int) -> tuple[int, int, int, int]:  # pragma: no cover - numba
    T, L, K = ids.shape
    seen = np.zeros(num_experts, dtype=np.int64)  # stamp of the (token, layer) that last picked each expert
    stamp = 0
    for t in range(T):
        for layer in range(L):
            stamp += 1
            for k in range(K):
                e = ids[t, layer, k]
                if e < 0 or e >= num_experts:
                    return 1, t, layer, k
                if seen[e] == stamp:
                    return 2, t, layer, k
                seen[e] = stamp
    return 0, 0, 0, 0


def check_picks(ids_TLK: np.ndarray, num_experts: int) -> None:
    """Raise :class:`InputError` naming the first pick out of ``[0, E)`` or repeated within a token's layer."""
    code, t, layer, k = 0, 0, 0, 0
    for lo, hi in token_chunks(ids_TLK):
        code, t, layer, k = _check_picks(ids_TLK[lo:hi], num_experts)
        t += lo
        if code:
            break
    if code == 1:
        raise InputError(f"topk_ids holds expert id {int(ids_TLK[t, layer, k])} (token {t}, layer {layer}); "
                         f"ids must lie in [0, {num_experts})")
    if code == 2:
        raise InputError(f"token {t} picks the same expert twice in layer {layer}; top-k picks are distinct")


def count_picks(ids_TLK: np.ndarray, key_T: np.ndarray, num_keys: int, num_experts: int) -> np.ndarray:
    """``int64 [N, L, E]``: picks of expert ``e`` in layer ``l`` by the tokens whose key is ``n`` (``key_T`` in
    ``[0, N)``): with the tokens' batches, the load ``counts [B, L, E]``. Walks the ids in chunks."""
    out = np.zeros((num_keys, ids_TLK.shape[1], num_experts), dtype=np.int64)
    for lo, hi in token_chunks(ids_TLK):
        _count_picks(ids_TLK[lo:hi], key_T[lo:hi], out)
    return out


@njit(cache=True, nogil=True)
def _count_picks(ids_TLK: np.ndarray, key_T: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - numba
    """Add the picks of ``ids_TLK`` into ``out [N, L, E]`` by each token's key."""
    T, L, K = ids_TLK.shape
    for t in range(T):
        n = key_T[t]
        for layer in range(L):
            for k in range(K):
                out[n, layer, ids_TLK[t, layer, k]] += 1


@njit(cache=True, nogil=True)
def distinct_served(dest_TLK: np.ndarray, ids_TLK: np.ndarray, batch_T: np.ndarray, num_batches: int,
                    num_experts: int, num_gpus: int) -> np.ndarray:  # pragma: no cover - numba
    """``float64 [B, L, G]``: the distinct experts each GPU serves picks of, per batch and layer: ``dest_TLK`` the
    GPU of each pick (``-1``: dropped, counted nowhere), ``ids_TLK`` its expert, ``batch_T`` each token's batch.

    Tokens are visited batch by batch (a stable sort of ``batch_T``); a stamp per (GPU, expert) holds the last
    batch that counted it, so memory is ``G * E`` stamps besides the result."""
    T, L, K = ids_TLK.shape
    out = np.zeros((num_batches, L, num_gpus), np.float64)
    order = np.argsort(batch_T, kind="mergesort")
    stamp = np.empty(num_gpus * num_experts, np.int64)
    for layer in range(L):
        stamp[:] = -1
        for i in range(T):
            t = order[i]
            b = batch_T[t]
            for k in range(K):
                g = dest_TLK[t, layer, k]
                if g < 0:
                    continue
                key = g * num_experts + ids_TLK[t, layer, k]
                if stamp[key] != b:
                    stamp[key] = b
                    out[b, layer, g] += 1.0
    return out


def _pair_walk(ids_TLK: np.ndarray, num_experts: int, offset: int) -> np.ndarray:
    """``int64 [L - offset, E, E]``: :func:`_pairs` over the ids in chunks."""
    out = np.zeros((max(ids_TLK.shape[1] - offset, 0), num_experts, num_experts), dtype=np.int64)
    for lo, hi in token_chunks(ids_TLK):
        _pairs(ids_TLK[lo:hi], offset, out)
    return out


@njit(cache=True, nogil=True)
def _pairs(ids_TLK: np.ndarray, offset: int, out: np.ndarray) -> None:  # pragma: no cover - numba
    """Add to ``out [L - offset, E, E]`` the (token, pick, pick) with ``i`` in layer ``l`` and ``j`` in layer
    ``l + offset``."""
    T, L, K = ids_TLK.shape
    for layer in range(L - offset):  # layer outermost: one layer's [E, E] block stays in cache
        for t in range(T):
            for i in range(K):
                a = ids_TLK[t, layer, i]
                for j in range(K):
                    out[layer, a, ids_TLK[t, layer + offset, j]] += 1


def pair_counts(ids_TLK: np.ndarray, num_experts: int) -> np.ndarray:
    """``int64 [L, E, E]``: ordered pairs ``(i, j)`` of one token's picks in layer ``l``, ``i == j`` included.

    The diagonal is each expert's load; off the diagonal, tokens that picked both (each pair in both orders).
    """
    return _pair_walk(ids_TLK, num_experts, 0)


def transition_counts(ids_TLK: np.ndarray, num_experts: int) -> np.ndarray:
    """``int64 [L-1, E, E]``: (token, pick) pairs from expert ``i`` in layer ``l`` to ``j`` in layer ``l + 1``."""
    return _pair_walk(ids_TLK, num_experts, 1)


def demand_counts(ids_TLK: np.ndarray, src_T: np.ndarray, num_gpus: int, num_experts: int) -> np.ndarray:
    """``int64 [L, G, E]``: picks of expert ``e`` in layer ``l`` by the tokens living on GPU ``g``."""
    return np.ascontiguousarray(count_picks(ids_TLK, src_T, num_gpus, num_experts).transpose(1, 0, 2))


def top_k(scores_XE: np.ndarray, k: int) -> np.ndarray:
    """``int64 [X, min(k, E)]``: each row's ``k`` highest scores' columns, highest first, ties to the lower column:
    ``np.argsort(-scores, axis=1, kind="stable")[:, :k]``, in one pass over each row (a path table's rows are
    tens of thousands of experts' counts, and a full sort of each took most of its build)."""
    scores = np.ascontiguousarray(scores_XE, dtype=np.float64)
    if scores.ndim != 2 or isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"top_k needs a 2-D array of scores and k >= 1 (got shape {scores.shape}, k {k!r})")
    if np.isnan(scores).any():
        raise InputError("top_k: the scores hold NaN, which no order ranks")
    return _top_k(scores, min(int(k), scores.shape[1]))


@njit(cache=True, nogil=True)
def _top_k(scores: np.ndarray, k: int) -> np.ndarray:  # pragma: no cover - numba
    X, E = scores.shape
    out = np.empty((X, k), dtype=np.int64)
    vals = np.empty(k)
    for x in range(X):
        n = 0
        for e in range(E):
            v = scores[x, e]
            if n == k and v <= vals[k - 1]:  # no better than the k-th: an equal score keeps the lower column
                continue
            j = n if n < k else k - 1
            while j > 0 and vals[j - 1] < v:  # after every equal or higher score seen before (stable)
                vals[j] = vals[j - 1]
                out[x, j] = out[x, j - 1]
                j -= 1
            vals[j] = v
            out[x, j] = e
            if n < k:
                n += 1
    return out
