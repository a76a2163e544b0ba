"""``eplb``: DeepSeek's Expert Parallelism Load Balancer as a policy.

Wraps the faithful :func:`moebalance.algorithms.eplb.rebalance_experts` (hierarchical when ``num_nodes`` divides
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

from moebalance.algorithms.eplb import eplb_plan
from moebalance.algorithms.packing import repair_duplicates
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import BudgetError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement

__all__ = ["eplb"]


def _preset_groups(load: LoadMatrix) -> int:
    if load.preset is None:
        return 1
    from moebalance.workloads.synth import PRESETS

    preset = PRESETS.get(load.preset)
    return 1 if preset is None else preset.num_groups


def eplb(*, load: LoadMatrix, cluster: Cluster, budget: Budget, num_groups: int | None = None,
         avoid_duplicates: bool = False) -> Placement:
    """DeepSeek EPLB with ``slots_per_gpu * G`` physical experts per layer."""
    E, L, G = load.num_experts, load.num_layers, cluster.num_gpus
    slots = budget.uniform_slots(E, G, L)
    groups = _preset_groups(load) if num_groups is None else num_groups
    if isinstance(groups, bool) or not isinstance(groups, int | np.integer) or groups < 1:
        raise BudgetError(f"num_groups ({groups!r}) must be a positive integer")
    weight = load.total()
    result = eplb_plan(weight, num_replicas=slots * G, num_groups=groups, num_nodes=cluster.num_nodes,
                       num_gpus=G)
    phy2log = result.physical_to_logical
    swaps = 0
    if not isinstance(avoid_duplicates, bool):
        raise BudgetError(f"avoid_duplicates ({avoid_duplicates!r}) must be true or false")
    if avoid_duplicates:
        slot_gpu = np.broadcast_to(np.arange(phy2log.shape[1]) // slots, phy2log.shape)
        phy2log, swaps = repair_duplicates(slot_gpu, phy2log, weight, cluster.gpus_per_node)
    mode = "hierarchical" if groups % cluster.num_nodes == 0 else "global"
    params = {**budget.as_params(), "num_groups": groups, "mode": mode, "slots_per_gpu": slots}
    if avoid_duplicates:
        params.update(avoid_duplicates=True, duplicate_swaps=swaps)
    return Placement.from_eplb(phy2log, cluster, num_experts=E, policy="eplb", params=params)
