"""Pieces shared by policies: greedy packing and building a :class:`Placement` from assignments."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from moebalance.cluster import Cluster
from moebalance.plan import Placement

__all__ = ["greedy_pack", "placement_from_assignment"]


def greedy_pack(weight: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Longest-processing-time packing, vectorised over layers.

    ``weight [L, N]`` items (e.g. experts or replicas) go, heaviest first (ties: lowest item index), to the
    least-loaded bin that still has room (ties: lowest bin index); ``capacity [L, G]`` counts the items
    each bin takes. Returns ``int64 [L, N]``, the bin of every item. Needs ``capacity.sum(1) >= N``.
    """
    L, N = weight.shape
    G = capacity.shape[1]
    assert capacity.shape[0] == L and np.all(capacity.sum(axis=1) >= N)
    order = np.argsort(-weight, axis=1, kind="stable")
    load = np.zeros((L, G), dtype=np.float64)
    used = np.zeros((L, G), dtype=np.int64)
    out = np.empty((L, N), dtype=np.int64)
    rows = np.arange(L)
    for j in range(N):
        item = order[:, j]
        g = np.argmin(np.where(used < capacity, load, np.inf), axis=1)
        out[rows, item] = g
        load[rows, g] += weight[rows, item]
        used[rows, g] += 1
    return out


def placement_from_assignment(gpu_of_slot: np.ndarray, expert_of_slot: np.ndarray, cluster: Cluster,
                              num_experts: int, policy: str, params: Mapping[str, Any]) -> Placement:
    """A plan from ``gpu_of_slot [L, P]`` and ``expert_of_slot [L, P]``; each GPU lists its experts sorted."""
    L, _P = gpu_of_slot.shape
    G = cluster.num_gpus
    # Sort slots by (gpu, expert) per layer, then cut each layer's row at the GPU boundaries.
    key = gpu_of_slot * num_experts + expert_of_slot
    order = np.argsort(key, axis=1, kind="stable")
    experts_sorted = np.take_along_axis(expert_of_slot, order, axis=1).tolist()
    bounds = np.cumsum(np.stack([np.bincount(row, minlength=G) for row in gpu_of_slot]), axis=1).tolist()
    layers = []
    for li in range(L):
        row, cut, start = experts_sorted[li], bounds[li], 0
        gpus = []
        for stop in cut:
            gpus.append(row[start:stop])
            start = stop
        layers.append(gpus)
    return Placement(layers, num_experts, cluster, policy=policy, params=params)
