"""GRACE-MoE's replication (Section 4.2, Eq. 2) and load prediction (Eq. 3), arrays in and out.

After "GRACE-MoE: Grouping and Replication with Locality-Aware Routing for Efficient Distributed MoE
Inference"; our readings of the hot-expert threshold and of Eq. 3 are in ``docs/papers/grace.md``.

- :func:`skew_ratio` and :func:`replica_count`: Eq. 2's ``rho = W_max / mean(W)`` (exact) and
  ``n = min(max(1, floor(rho)), G - 1)``;
- :func:`hot_experts`: the hot experts of the heaviest group for ``n`` replicas;
- :func:`predict_loads` and :func:`replica_shares`: Eq. 3's predicted GPU loads ``W'_g`` and the routing
  shares ``1 / W'_g`` of each replica (Alg. 3's weights).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from moebalance.core.errors import InputError

__all__ = ["check_load", "hot_experts", "predict_loads", "replica_count", "replica_shares", "skew_ratio"]


def check_load(name: str, value: object, ndim: int, shape_text: str) -> np.ndarray:
    """``float64``: a load-like array of ``ndim`` dimensions with finite, non-negative entries."""
    try:
        a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"{name} ({type(value).__name__}) is not a numeric array; give {shape_text}") from None
    if a.ndim != ndim:
        raise InputError(f"{name} has shape {list(a.shape)}; give {shape_text}")
    bad = ~np.isfinite(a) | (a < 0)
    if bad.any():
        where = [int(i) for i in np.argwhere(bad)[0]]
        raise InputError(f"{name} has {int(bad.sum())} NaN, infinite or negative entries (the first, "
                         f"{a[tuple(where)]}, at {where}); give finite counts >= 0")
    return a


def skew_ratio(group_load: np.ndarray) -> Fraction:
    """Eq. 2's ``rho = W_max / mean(W) = G * W_max / sum(W)``, exact (a ``Fraction``; 0 if there is no load).

    Float division can land just below an integer (``9 / (18 / 14)`` is ``6.999999999999999``), which Eq. 2's
    ``floor`` would then lower by one; loads are converted to fractions exactly, so ``rho`` is too.
    Example: ``W = [9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]``: ``rho = 14 * 9 / 18 = 7``.
    """
    w = check_load("group_load", group_load, 1, "one load per GPU, [G]")
    total = sum((Fraction(float(v)) for v in w), Fraction(0))
    if total <= 0:
        return Fraction(0)
    return Fraction(float(w.max())) * w.size / total


def replica_count(group_load: np.ndarray) -> int:
    """Eq. 2: ``n = min(max(1, floor(W_max / mean(W))), G - 1)`` for the group loads ``W [G]`` (0 if all zero).

    ``rho`` is computed exactly (:func:`skew_ratio`). Example: ``W = [10, 2, 2, 2]``: ``rho = 10 / 4 = 2.5``,
    so ``n = 2``.
    """
    rho = skew_ratio(group_load)
    if rho <= 0:
        return 0
    return int(min(max(1, math.floor(rho)), np.size(group_load) - 1))


def hot_experts(expert_load: np.ndarray, experts: np.ndarray, num_replicas: int) -> np.ndarray:
    """The hot experts of the heaviest group: the smallest prefix of ``experts`` ranked by ``expert_load``
    (heaviest first, ties: lowest id) whose cumulative load strictly exceeds ``W_max * n / (1 + n)``, with
    ``W_max = sum(expert_load)``. Returns the ids, hottest first (empty if the group has no load).

    Example: loads ``[5, 50, 30, 15]`` of experts ``[7, 3, 4, 9]`` with ``n = 1`` -> ``[3, 4]``.
    """
    w = np.asarray(expert_load, dtype=np.float64)
    ids = np.asarray(experts, dtype=np.int64)
    total = w.sum()
    if total <= 0 or num_replicas < 1:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((ids, -w))
    threshold = total * num_replicas / (1 + num_replicas)
    count = int(np.argmax(np.cumsum(w[order]) > threshold)) + 1
    return ids[order[:count]]


def predict_loads(group_load: np.ndarray, heaviest: int, targets: np.ndarray, replicated_load: float) -> np.ndarray:
    """Eq. 3: ``float64 [G]`` predicted loads after replicating load ``W_r`` of GPU ``heaviest`` to ``targets``.

    ``W_p = W_r / (n + 1)`` (the printed ``W_max`` read as ``W_r``: ``docs/papers/grace.md``); ``W'_heaviest = W_max - W_r + W_p``,
    ``W'_i = W_i + W_p`` on each target, the rest unchanged. Tokens are conserved.
    """
    out = np.asarray(group_load, dtype=np.float64).copy()
    t = np.asarray(targets, dtype=np.int64)
    if t.size == 0:
        return out
    wp = replicated_load / (t.size + 1)
    out[heaviest] += wp - replicated_load
    out[t] += wp
    return out


def replica_shares(predicted: np.ndarray, hosts: np.ndarray) -> np.ndarray:
    """Routing shares of one expert's replicas on GPUs ``hosts``: ``1 / W'_g`` normalised (Alg. 3's weights).

    GPUs predicted to be idle (``W'_g = 0``, only possible without load) share equally.
    """
    p = np.asarray(predicted, dtype=np.float64)[np.asarray(hosts, dtype=np.int64)]
    if np.any(p <= 0):
        return np.full(p.size, 1.0 / p.size)
    inv = 1.0 / p
    return inv / inv.sum()
