"""``eplb``: DeepSeek's Expert Parallelism Load Balancer as a policy.

Wraps the faithful :func:`moebalance.eplb.rebalance_experts` (hierarchical when ``num_nodes`` divides
``num_groups``, else global) on the load summed over the planning batches, with the same number of slots on
every GPU in every layer (``Budget.uniform_slots``). ``num_groups`` defaults to the model preset's expert
groups (DeepSeek-V3: 8) when the load names a preset, else 1 (global policy on more than one node).

Like the reference, the default may put two copies of one expert on one GPU (DeepSeek EPLB issue 22); the
plan then carries a warning. ``avoid_duplicates=True`` repairs them after the reference has run: each
surplus copy is swapped with a slot of another GPU (same node first, so hierarchical plans keep their
node-level grouping) that holds neither expert, choosing the swap that keeps the two GPUs' larger planned
load lowest. A surplus copy with no legal swap partner is left in place (the warning stays).
"""

from __future__ import annotations

import numpy as np

from moebalance.cluster import Cluster
from moebalance.eplb import eplb_plan
from moebalance.errors import BudgetError
from moebalance.load import LoadMatrix
from moebalance.plan import Placement
from moebalance.policies.budget import Budget

__all__ = ["eplb", "remove_duplicates"]


def _preset_groups(load: LoadMatrix) -> int:
    if load.preset is None:
        return 1
    from moebalance.synth import PRESETS

    preset = PRESETS.get(load.preset)
    return 1 if preset is None else preset.num_groups


def eplb(*, load: LoadMatrix, cluster: Cluster, budget: Budget, num_groups: int | None = None,
         avoid_duplicates: bool = False) -> Placement:
    """DeepSeek EPLB with ``slots_per_gpu * G`` physical experts per layer."""
    E, L, G = load.num_experts, load.num_layers, cluster.num_gpus
    slots = budget.uniform_slots(E, G, L)
    groups = _preset_groups(load) if num_groups is None else num_groups
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise BudgetError(f"num_groups ({groups!r}) must be a positive integer")
    weight = load.total()
    result = eplb_plan(weight, num_replicas=slots * G, num_groups=groups, num_nodes=cluster.num_nodes,
                       num_gpus=G)
    phy2log = result.physical_to_logical
    swaps = 0
    if avoid_duplicates:
        phy2log, swaps = remove_duplicates(phy2log, weight, cluster)
    mode = "hierarchical" if groups % cluster.num_nodes == 0 else "global"
    params = {**budget.as_params(), "num_groups": groups, "mode": mode, "slots_per_gpu": slots}
    if avoid_duplicates:
        params.update(avoid_duplicates=True, duplicate_swaps=swaps)
    return Placement.from_eplb(phy2log, cluster, num_experts=E, policy="eplb", params=params)


def remove_duplicates(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster) -> tuple[np.ndarray, int]:
    """Swap surplus same-GPU copies away; returns the new ``phy2log [L, P]`` and the number of swaps."""
    L, P = phy2log.shape
    G, gpn = cluster.num_gpus, cluster.gpus_per_node
    S = P // G
    out = phy2log.copy()
    swaps = 0
    slot_gpu = np.arange(P) // S
    for layer in range(L):
        row = out[layer]
        count = np.bincount(row, minlength=weight.shape[1])
        per_slot = weight[layer].astype(np.float64) / count  # planned tokens per replica
        host = np.zeros((G, weight.shape[1]), dtype=np.int64)  # copies of expert e on GPU g
        np.add.at(host, (slot_gpu, row), 1)
        gpu_load = np.bincount(slot_gpu, weights=per_slot[row], minlength=G)
        for g, e in np.argwhere(host > 1):
            while host[g, e] > 1:
                slot = int(np.flatnonzero((slot_gpu == g) & (row == e))[-1])
                f = row  # candidate partners: every slot p on GPU h != g with expert f
                h = slot_gpu
                legal = (h != g) & (host[g, f] == 0) & (host[h, e] == 0)
                if not legal.any():
                    break
                we, wf = per_slot[e], per_slot[f]
                cost = np.maximum(gpu_load[g] - we + wf, gpu_load[h] - wf + we)
                same_node = (h // gpn) == (g // gpn)
                # prefer the same node, then the lowest resulting load; ties: lowest slot
                key = np.where(legal, cost + np.where(same_node, 0.0, np.inf if (legal & same_node).any() else 0.0),
                               np.inf)
                p = int(np.argmin(key))
                fe, hp = int(row[p]), int(h[p])
                row[slot], row[p] = fe, e
                host[g, e] -= 1
                host[g, fe] += 1
                host[hp, fe] -= 1
                host[hp, e] += 1
                gpu_load[g] += per_slot[fe] - per_slot[e]
                gpu_load[hp] += per_slot[e] - per_slot[fe]
                swaps += 1
    return out, swaps
