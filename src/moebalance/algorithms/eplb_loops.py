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
def _lighter(load: FloatArray, a: int, b: int) -> bool:
    """Pack ``a`` before pack ``b``: less float32 load, or the same load and a lower index."""
    return load[a] < load[b] or (load[a] == load[b] and a < b)


@njit(cache=True)
def _sift_down(heap: IntArray, size: int, load: FloatArray) -> None:
    """Restore the min-heap ``heap[:size]`` (packs by :func:`_lighter`) after its root grew."""
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            return
        if child + 1 < size and _lighter(load, heap[child + 1], heap[child]):
            child += 1
        if not _lighter(load, heap[child], heap[i]):
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
            _sift_down(heap, open_packs, load)
    return chosen, rank


@njit(cache=True)
def _heavier(score: FloatArray, a: int, b: int) -> bool:
    """Expert ``a`` before expert ``b``: more float32 load per replica, or the same and a lower index."""
    return score[a] > score[b] or (score[a] == score[b] and a < b)


@njit(cache=True)
def _sift_max(heap: IntArray, size: int, i: int, score: FloatArray) -> None:
    """Restore the max-heap ``heap[:size]`` (experts by :func:`_heavier`) below position ``i``."""
    while True:
        child = 2 * i + 1
        if child >= size:
            return
        if child + 1 < size and _heavier(score, heap[child + 1], heap[child]):
            child += 1
        if not _heavier(score, heap[child], heap[i]):
            return
        heap[i], heap[child] = heap[child], heap[i]
        i = child


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
            _sift_max(heap, num_log, start, score)
        for slot in range(num_log, num_phy):
            best = heap[0]
            count = logcnt[r, best]
            phy2log[r, slot] = best
            rank[r, slot] = count
            logcnt[r, best] = count + 1
            score[best] = weight[r, best] / np.float32(count + 1)
            _sift_max(heap, num_log, 0, score)  # its score fell: sift it down
    return phy2log, rank, logcnt
