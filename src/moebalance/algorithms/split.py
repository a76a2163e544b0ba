"""Fixed shares: GPU loads when every expert's tokens are split over GPUs in fixed proportions.

Legend: ``B`` batches, ``L`` layers, ``E`` experts, ``G`` GPUs, ``T`` tokens, ``K`` top-k, ``R`` most copies of an
expert. The ``uniform`` router (equal shares over copies), the count-level ``random`` and ``wrr`` routers (their
experts with one copy) and CRAFT's benefit estimation all replay loads this way; on tokens, ``uniform``'s equal
split is dealt round-robin (:func:`round_robin_gpus`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["apply_shares", "round_robin_gpus"]

_CHUNK = 256  # batches per chunk: bounds temporary memory at ~CHUNK * L * (E + G) doubles


def apply_shares(counts: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """``counts [B, L, E] x shares [L, E, G] -> float64 [B, L, G]``: one ``[b, E] @ [E, G]`` product per layer.

    Chunked over batches to bound temporary memory. (A sparse gather over the few non-zero shares does less
    arithmetic but ran slower than this BLAS product; ``bench/bench_replay.py`` times the replay.)
    """
    B, L, _ = counts.shape
    out = np.empty((B, L, shares.shape[2]), dtype=np.float64)
    for lo in range(0, B, _CHUNK):
        hi = min(B, lo + _CHUNK)
        block = np.ascontiguousarray(counts[lo:hi].transpose(1, 0, 2), dtype=np.float64)  # [L, b, E]
        out[lo:hi] = np.matmul(block, shares).transpose(1, 0, 2)
    return out


@njit(cache=True, nogil=True)
def round_robin_gpus(ids_TLK: np.ndarray, batch_T: np.ndarray, replica_gpus_LER: np.ndarray,
                     reps_LE: np.ndarray) -> np.ndarray:  # pragma: no cover - numba
    """``int64 [T, L, K]``: the GPU of each pick when, in each layer, the ``i``-th pick of expert ``e`` in a batch
    (row-major (token, pick) order) goes to replica ``i mod r_e`` (replicas in GPU order, ``replica_gpus_LER``
    padded with -1)."""
    T, L, K = ids_TLK.shape
    out = np.empty((T, L, K), dtype=np.int64)
    seen = np.zeros(reps_LE.shape, dtype=np.int64)  # picks of each (layer, expert) so far in the current batch
    current = -1
    for t in range(T):
        if batch_T[t] != current:
            current = batch_T[t]
            seen[:, :] = 0
        for layer in range(L):
            for k in range(K):
                e = ids_TLK[t, layer, k]
                out[t, layer, k] = replica_gpus_LER[layer, e, seen[layer, e] % reps_LE[layer, e]]
                seen[layer, e] += 1
    return out
