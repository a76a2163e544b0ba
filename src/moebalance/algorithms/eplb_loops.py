"""DeepSeek EPLB's two sequential loops, compiled (numba): balanced packing and replication, row by row, with the
reference's float32 operations and tie order (:mod:`moebalance.algorithms.eplb` explains why they stay bit-identical).

Shapes: ``X`` rows (layers, or layers x nodes), ``n`` items per row, ``m`` packs; ``E`` experts, ``P`` slots.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

__all__ = ["pack_rows", "replicate_rows"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float32]


@njit(cache=True)
def _first(key: FloatArray, a: int, b: int, largest: bool) -> bool:
    """Entry ``a`` before entry ``b``: a smaller float32 key (a larger one with ``largest``), or the same key and a
    lower index: the order of the reference's first minimum (packing) and first maximum (replication)."""
    if key[a] == key[b]:
        return a < b
    return key[a] > key[b] if largest else key[a] < key[b]


@njit(cache=True)
def _sift_down(heap: IntArray, size: int, i: int, key: FloatArray, largest: bool) -> None:
    """Restore the heap ``heap[:size]`` (ordered by :func:`_first`) below position ``i``."""
    while True:
        child = 2 * i + 1
        if child >= size:
            return
        if child + 1 < size and _first(key, heap[child + 1], heap[child], largest):
            child += 1
        if not _first(key, heap[child], heap[i], largest):
            return
        heap[i], heap[child] = heap[child], heap[i]
        i = child


@njit(cache=True)
def pack_rows(sorted_weight: FloatArray, num_packs: int, per_pack: int) -> tuple[IntArray, IntArray]:
    """The packing loop, compiled: for each row its items heaviest first (``sorted_weight [X, n]``, float32), each to
    the open pack with the least float32 load, the lowest index on equal loads (full packs closed), kept in a
    min-heap of the open packs by (load, index); returns ``(pack, rank in pack)`` ``[X, n]``. Float32 sums as the
    reference's (numba keeps float32 + float32 in float32)."""
    num_rows, num_items = sorted_weight.shape
    chosen = np.empty((num_rows, num_items), dtype=np.int64)
    rank = np.empty((num_rows, num_items), dtype=np.int64)
    load = np.zeros(num_packs, dtype=np.float32)
    size = np.zeros(num_packs, dtype=np.int64)
    heap = np.empty(num_packs, dtype=np.int64)
    for r in range(num_rows):
        load[:] = 0.0
        size[:] = 0
        for p in range(num_packs):  # equal loads in index order: already a heap
            heap[p] = p
        open_packs = num_packs
        for k in range(num_items):
            best = heap[0]
            chosen[r, k] = best
            rank[r, k] = size[best]
            load[best] = load[best] + sorted_weight[r, k]
            size[best] += 1
            if size[best] == per_pack:  # full: out of the heap
                open_packs -= 1
                heap[0] = heap[open_packs]
            _sift_down(heap, open_packs, 0, load, False)
    return chosen, rank


@njit(cache=True)
def replicate_rows(weight: FloatArray, num_phy: int) -> tuple[IntArray, IntArray, IntArray]:
    """The replication loop, compiled: each extra slot to the expert with the largest float32 ``load / replicas``
    (the lowest index on ties), kept in a max-heap of the experts by (score, index); returns
    ``(phy2log, rank, logcnt)``."""
    num_rows, num_log = weight.shape
    phy2log = np.empty((num_rows, num_phy), dtype=np.int64)
    rank = np.zeros((num_rows, num_phy), dtype=np.int64)
    logcnt = np.ones((num_rows, num_log), dtype=np.int64)
    score = np.empty(num_log, dtype=np.float32)
    heap = np.empty(num_log, dtype=np.int64)
    for r in range(num_rows):
        for e in range(num_log):
            phy2log[r, e] = e
            score[e] = weight[r, e]
            heap[e] = e
        for start in range(num_log // 2 - 1, -1, -1):  # heapify
            _sift_down(heap, num_log, start, score, True)
        for slot in range(num_log, num_phy):
            best = heap[0]
            count = logcnt[r, best]
            phy2log[r, slot] = best
            rank[r, slot] = count
            logcnt[r, best] = count + 1
            score[best] = weight[r, best] / np.float32(count + 1)
            _sift_down(heap, num_log, 0, score, True)  # its score fell: sift it down
    return phy2log, rank, logcnt
