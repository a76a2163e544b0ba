"""Pieces shared by policies: greedy packing and building a :class:`Placement` from assignments."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.core.plan import Placement

__all__ = ["greedy_pack", "placement_from_assignment", "repair_duplicates"]


def greedy_pack(weight: np.ndarray, capacity: np.ndarray, item_expert: np.ndarray | None = None) -> np.ndarray:
    """Longest-processing-time packing with per-bin capacities, vectorised over layers.

    ``weight [L, N]`` items (experts, or replicas carrying ``W_e / r_e``) go, heaviest first (ties: lowest
    item index), to the least-loaded bin that still has room (ties: lowest bin index); ``capacity [L, G]``
    counts the items each bin takes. Items with weight ``-inf`` are padding: they are skipped and get bin -1.
    With ``item_expert [L, N]`` (the expert of each item), a bin never takes a second copy of an expert
    (CRAFT Section 4.2.2, step 5) unless every bin with room already holds one, which happens only when
    an expert has more replicas than there are bins with room. Returns ``int64 [L, N]``, the bin of each item.
    """
    L, N = weight.shape
    G = capacity.shape[1]
    valid = weight > -np.inf
    assert capacity.shape[0] == L and np.all(capacity.sum(axis=1) >= valid.sum(axis=1))
    order = np.argsort(-weight, axis=1, kind="stable")
    load = np.zeros((L, G), dtype=np.float64)
    used = np.zeros((L, G), dtype=np.int64)
    out = np.full((L, N), -1, dtype=np.int64)
    rows = np.arange(L)
    hosts = None
    if item_expert is not None:
        hosts = np.zeros((L, G, int(item_expert.max()) + 1), dtype=bool)
    for j in range(N):
        item = order[:, j]
        live = valid[rows, item]
        if not live.any():
            break  # padding sorts last: every remaining item is padding
        room = used < capacity
        if hosts is not None:
            assert item_expert is not None
            expert = item_expert[rows, item]
            fresh = room & ~hosts[rows, :, expert]
            room = np.where(fresh.any(axis=1, keepdims=True), fresh, room)
        g = np.argmin(np.where(room, load, np.inf), axis=1)
        r, g, item = rows[live], g[live], item[live]
        out[r, item] = g
        load[r, g] += weight[r, item]
        used[r, g] += 1
        if hosts is not None:
            hosts[r, g, expert[live]] = True
    return out


def placement_from_assignment(gpu_of_slot: np.ndarray, expert_of_slot: np.ndarray, cluster: Cluster,
                              num_experts: int, policy: str, params: Mapping[str, Any]) -> Placement:
    """A plan from ``gpu_of_slot [L, P]`` and ``expert_of_slot [L, P]``; each GPU lists its experts sorted.

    Slots with ``gpu_of_slot == -1`` are padding (layers with fewer slots than ``P``) and are dropped.
    """
    L = gpu_of_slot.shape[0]
    G = cluster.num_gpus
    # Sort slots by (gpu, expert) per layer (padding first), then cut each row at the GPU boundaries.
    key = np.where(gpu_of_slot < 0, -1, gpu_of_slot * num_experts + expert_of_slot)
    order = np.argsort(key, axis=1, kind="stable")
    experts_sorted = np.take_along_axis(expert_of_slot, order, axis=1).tolist()
    per_gpu = np.stack([np.bincount(row[row >= 0], minlength=G) for row in gpu_of_slot])
    padding = (gpu_of_slot < 0).sum(axis=1)
    bounds = (padding[:, None] + np.cumsum(per_gpu, axis=1)).tolist()
    layers = []
    for li in range(L):
        row, cut, start = experts_sorted[li], bounds[li], int(padding[li])
        gpus = []
        for stop in cut:
            gpus.append(row[start:stop])
            start = stop
        layers.append(gpus)
    return Placement(layers, num_experts, cluster, policy=policy, params=params)


def repair_duplicates(gpu_of_slot: np.ndarray, expert_of_slot: np.ndarray, weight: np.ndarray,
                      gpus_per_node: int) -> tuple[np.ndarray, int]:
    """Swap surplus same-GPU copies of an expert away, keeping every GPU's slot count.

    ``gpu_of_slot [L, P]`` (-1 for padding) and ``expert_of_slot [L, P]`` describe a plan; ``weight [L, E]``
    is the planned load. Each surplus copy of expert ``e`` on GPU ``g`` is swapped with a slot on another GPU
    ``h`` holding an expert ``f`` such that ``g`` has no ``f`` and ``h`` has no ``e``; among legal swaps, same
    node first, then the one keeping ``max(load_g, load_h)`` lowest, then the lowest slot. A copy with no
    legal partner stays (only possible when an expert has more replicas than GPUs can take).
    Returns the new ``expert_of_slot`` and the number of swaps.
    """
    L = gpu_of_slot.shape[0]
    E = weight.shape[1]
    G = int(gpu_of_slot.max()) + 1
    out = expert_of_slot.copy()
    swaps = 0
    for layer in range(L):
        live = np.flatnonzero(gpu_of_slot[layer] >= 0)
        h = gpu_of_slot[layer, live]
        row = out[layer, live]  # a copy: written back below
        count = np.bincount(row, minlength=E)
        per_slot = weight[layer].astype(np.float64) / np.maximum(count, 1)
        host = np.zeros((G, E), dtype=np.int64)
        np.add.at(host, (h, row), 1)
        if host.max(initial=0) < 2:
            continue
        gpu_load = np.bincount(h, weights=per_slot[row], minlength=G)
        for g, e in np.argwhere(host > 1):
            while host[g, e] > 1:
                slot = int(np.flatnonzero((h == g) & (row == e))[-1])
                legal = (h != g) & (host[g, row] == 0) & (host[h, e] == 0)
                if not legal.any():
                    break
                cost = np.maximum(gpu_load[g] - per_slot[e] + per_slot[row], gpu_load[h] - per_slot[row] + per_slot[e])
                same_node = (h // gpus_per_node) == (g // gpus_per_node)
                prefer = legal & same_node if (legal & same_node).any() else legal
                p = int(np.argmin(np.where(prefer, cost, np.inf)))
                f, hp = int(row[p]), int(h[p])
                row[slot], row[p] = f, e
                host[g, e] -= 1
                host[g, f] += 1
                host[hp, f] -= 1
                host[hp, e] += 1
                gpu_load[g] += per_slot[f] - per_slot[e]
                gpu_load[hp] += per_slot[e] - per_slot[f]
                swaps += 1
        out[layer, live] = row
    return out, swaps
