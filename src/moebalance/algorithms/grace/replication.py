"""GRACE-MoE's replication (Section 4.2, Eq. 2) and load prediction (Eq. 3), arrays in and out.

After "GRACE-MoE: Grouping and Replication with Locality-Aware Routing for Efficient Distributed MoE
Inference"; our readings of the hot-expert threshold and of Eq. 3 are in ``docs/papers/grace.md``.

- :func:`skew_ratio` and :func:`replica_count`: Eq. 2's ``rho = W_max / mean(W)`` (exact) and
  ``n = min(max(1, floor(rho)), G - 1)``;
- :func:`hot_experts`: the hot experts of the heaviest group for ``n`` replicas;
- :func:`place_copies`: each hot expert's ``n`` copies on the least-loaded GPUs that have room for one;
- :func:`predict_loads` and :func:`replica_shares`: Eq. 3's predicted GPU loads ``W'_g`` and the routing
  shares ``1 / W'_g`` of each replica (Alg. 3's weights);
- :func:`replicate_layer`: all of it for one layer, ``n`` lowered until the copies fit the memory left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np

from moebalance.core.errors import InputError

__all__ = [
    "LayerReplicas",
    "check_load",
    "hot_experts",
    "place_copies",
    "predict_loads",
    "replica_count",
    "replica_shares",
    "replicate_layer",
    "skew_ratio",
]


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


def place_copies(hot: np.ndarray, num_replicas: int, order: np.ndarray, room: np.ndarray,
                 limit: int | None = None) -> list[np.ndarray]:
    """The GPUs of each hot expert's ``n`` copies: for each expert in turn (hottest first), the first ``n`` GPUs
    of ``order`` (least-loaded first) with a free slot, one slot each.

    ``room [G]`` is each GPU's free slots; ``limit`` caps the copies in all (None: no cap). Returns the targets
    (sorted) of the longest prefix of ``hot`` whose experts all get ``n`` copies: without memory limits every
    hot expert gets the same ``n`` least-loaded GPUs, as Section 4.2 says; with them, a GPU that is full
    passes the next copies on to the next GPU of ``order``.

    Example: hot experts ``[5, 6]``, ``n = 1``, order ``[2, 1, 3]``, room ``[0, 1, 1, 1]``: ``[[2], [1]]``.
    """
    free = np.asarray(room, dtype=np.int64).copy()
    left = limit
    out: list[np.ndarray] = []
    for _ in np.asarray(hot).tolist():
        targets = order[free[order] >= 1][:num_replicas]
        if targets.size < num_replicas or (left is not None and left < num_replicas):
            break
        free[targets] -= 1
        if left is not None:
            left -= num_replicas
        out.append(np.sort(targets))
    return out


def predict_loads(group_load: np.ndarray, heaviest: int, targets: Sequence[np.ndarray],
                  hot_load: np.ndarray) -> np.ndarray:
    """Eq. 3: ``float64 [G]`` predicted loads after copying the hot experts of GPU ``heaviest``.

    Hot expert ``i`` (load ``hot_load[i]``, copies on GPUs ``targets[i]``, ``n_i`` of them) is split evenly over
    its ``n_i + 1`` instances: ``W_p,i = hot_load[i] / (n_i + 1)``; GPU ``heaviest`` keeps ``W_p,i`` of it and each
    target gains ``W_p,i``. When every hot expert has the same ``n`` targets this is Eq. 3 with
    ``W_r = sum(hot_load)``, ``W_p = W_r / (n + 1)`` (the printed ``W_max`` read as ``W_r``: ``docs/papers/grace.md``).
    Tokens are conserved.
    """
    out = np.asarray(group_load, dtype=np.float64).copy()
    for t, load in zip(targets, np.asarray(hot_load, dtype=np.float64).tolist(), strict=True):
        t = np.asarray(t, dtype=np.int64)
        if t.size == 0:
            continue
        wp = load / (t.size + 1)
        out[heaviest] += wp - load
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


@dataclass(frozen=True, slots=True)
class LayerReplicas:
    """One layer's replication (:func:`replicate_layer`)."""

    #: Eq. 2's ``n`` (1 for ``fixed``; 0 without load or with one GPU).
    wanted: int
    #: The ``n`` used, at most ``wanted`` (0: no replica fitted).
    num_replicas: int
    #: ``int64 [H]``: the hot experts copied, hottest first.
    hot: np.ndarray
    #: ``targets[i]``: the GPUs of ``hot[i]``'s copies (sorted).
    targets: tuple[np.ndarray, ...]
    #: Hot experts (of the hot set for the ``n`` used) left without a copy because memory ran out.
    left_out: int
    #: ``float64 [G]``: Eq. 3's predicted loads.
    predicted: np.ndarray


def replicate_layer(group_load: np.ndarray, expert_load: np.ndarray, gpu_of: np.ndarray, mode: Literal["dynamic", "fixed"],
                    room: np.ndarray, limit: int | None = None) -> LayerReplicas:
    """Section 4.2 for one layer: group loads ``W [G]``, expert loads ``[E]``, the GPU of each expert ``[E]``.

    ``n`` is Eq. 2's (``mode="dynamic"``) or 1 (``"fixed"``); the hot experts of the heaviest group (ties: lowest
    GPU id) get ``n`` copies each on the least-loaded other GPUs (ties: lowest id) with a free slot
    (:func:`place_copies`; ``room [G]`` free slots, ``limit`` copies in all). Where memory does not hold them,
    ``n`` is lowered (the hot set shrinks with it) until it does; at ``n = 1`` the hottest experts that fit are
    copied and the rest counted in ``left_out``.
    """
    W = np.asarray(group_load, dtype=np.float64)
    G = W.size
    wanted = 0
    if G > 1 and W.sum() > 0:
        wanted = replica_count(W) if mode == "dynamic" else 1
    h = int(np.argmax(W))
    members = np.flatnonzero(np.asarray(gpu_of) == h)
    order = np.lexsort((np.arange(G), W))
    order = order[order != h]
    hot = np.zeros(0, dtype=np.int64)
    for n in range(wanted, 0, -1):
        hot = hot_experts(np.asarray(expert_load)[members], members, n)
        targets = place_copies(hot, n, order, room, limit)
        if targets and (len(targets) == hot.size or n == 1):
            copied = hot[:len(targets)]
            return LayerReplicas(wanted, n, copied, tuple(targets), hot.size - copied.size,
                                 predict_loads(W, h, targets, np.asarray(expert_load, dtype=np.float64)[copied]))
    return LayerReplicas(wanted, 0, np.zeros(0, dtype=np.int64), (), hot.size, W.copy())
