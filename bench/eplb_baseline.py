"""A straightforward, layer-at-a-time EPLB planner: the speed baseline of ``bench/bench_eplb.py``.

Written for this project from the algorithm's description in docs/papers/eplb.md, with no attempt at speed: one Python loop over layers, and inside it plain loops over
nodes, extra slots and items. Per layer:

1. Sum the load of each group of consecutive experts and fill the nodes with whole groups, heaviest
   group first, each to the least-loaded node that still has room (lowest node on equal loads).
2. On each node, give every expert one slot, then hand out the node's other slots one at a time to the
   expert whose load per replica is highest (lowest expert on ties).
3. On each node, fill its GPUs with its slots the same way as step 1, each slot carrying its expert's load
   divided by the expert's replica count; a slot's position on its GPU is the order it arrived in.

If ``num_nodes`` does not divide ``num_groups`` the whole cluster is treated as one node with one group.
Arithmetic is float32 throughout. "Heaviest first" means the order of ``torch.sort(descending=True)``,
ties included, because that order is part of the plan ``rebalance_experts`` returns; group sums use
``torch.sum`` for the same reason. Inputs are torch tensors; outputs are int64 CPU tensors
``(phy2log [L, P], log2phy [L, E, max_count], logcnt [L, E])``. Arguments are not validated.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["baseline_rebalance"]


def _fill_bins(loads: np.ndarray, num_bins: int) -> list[list[int]]:
    """Item ids (indices into the float32 vector ``loads``) in each of ``num_bins`` equal-size bins, in arrival order."""
    capacity = len(loads) // num_bins
    if capacity == 1:  # one item per bin: item i is bin i
        return [[item] for item in range(len(loads))]
    heaviest_first = torch.sort(torch.from_numpy(loads), descending=True).indices.tolist()
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    bin_load = np.zeros(num_bins, dtype=np.float32)
    for item in heaviest_first:
        best = -1
        for b in range(num_bins):
            if len(bins[b]) < capacity and (best < 0 or bin_load[b] < bin_load[best]):
                best = b
        bins[best].append(item)
        bin_load[best] = bin_load[best] + loads[item]  # float32 + float32
    return bins


def _spread_replicas(loads: np.ndarray, num_slots: int) -> tuple[list[int], list[int], np.ndarray]:
    """Slots for experts with float32 ``loads``: (expert of each slot, replica index of each slot, counts)."""
    num_experts = len(loads)
    expert_of_slot = list(range(num_experts))
    replica_of_slot = [0] * num_experts
    counts = np.ones(num_experts, dtype=np.int64)
    for _ in range(num_experts, num_slots):
        per_replica = loads / counts.astype(np.float32)
        busiest = int(np.argmax(per_replica))  # first maximum: lowest expert on ties
        expert_of_slot.append(busiest)
        replica_of_slot.append(int(counts[busiest]))
        counts[busiest] += 1
    return expert_of_slot, replica_of_slot, counts


def _plan_layer(
    load: np.ndarray, num_slots: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    num_experts = len(load)
    group_size = num_experts // num_groups
    slots_per_node = num_slots // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_slots // num_gpus

    group_loads = torch.from_numpy(load).view(num_groups, group_size).sum(-1).numpy()
    groups_on_node = _fill_bins(group_loads, num_nodes)

    expert = np.empty(num_slots, dtype=np.int64)
    replica = np.empty(num_slots, dtype=np.int64)
    count = np.empty(num_experts, dtype=np.int64)
    for node, groups in enumerate(groups_on_node):
        members = [g * group_size + j for g in groups for j in range(group_size)]
        member_loads = load[members]
        local_expert, local_replica, local_count = _spread_replicas(member_loads, slots_per_node)
        count[members] = local_count
        slot_loads = np.array(
            [member_loads[e] / np.float32(local_count[e]) for e in local_expert], dtype=np.float32
        )
        for gpu, node_slots in enumerate(_fill_bins(slot_loads, gpus_per_node)):
            for position, node_slot in enumerate(node_slots):
                slot = node * slots_per_node + gpu * slots_per_gpu + position
                expert[slot] = members[local_expert[node_slot]]
                replica[slot] = local_replica[node_slot]
    return expert, replica, count


def baseline_rebalance(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EPLB plan of ``weight`` ``[L, E]``, one layer at a time (see the module docstring)."""
    loads = weight.float().cpu().numpy()
    num_layers, num_experts = loads.shape
    if num_groups % num_nodes != 0:
        num_groups = num_nodes = 1
    phy2log = np.empty((num_layers, num_replicas), dtype=np.int64)
    rank = np.empty((num_layers, num_replicas), dtype=np.int64)
    logcnt = np.empty((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        phy2log[layer], rank[layer], logcnt[layer] = _plan_layer(
            loads[layer], num_replicas, num_groups, num_nodes, num_gpus
        )
    log2phy = np.full((num_layers, num_experts, int(logcnt.max())), -1, dtype=np.int64)
    for layer in range(num_layers):
        for slot in range(num_replicas):
            log2phy[layer, phy2log[layer, slot], rank[layer, slot]] = slot
    return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt)
