"""Fixed shares: GPU loads when every expert's tokens are split over GPUs in fixed proportions.

Legend: ``B`` batches, ``L`` layers, ``E`` experts, ``G`` GPUs. The ``uniform`` router (equal shares over
copies), the count-level ``random`` and ``wrr`` routers (their experts with one copy) and CRAFT's benefit
estimation all replay loads this way.
"""

from __future__ import annotations

import numpy as np

__all__ = ["apply_shares"]

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
