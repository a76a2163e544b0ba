"""``eplb``: DeepSeek's Expert Parallelism Load Balancer as a policy.

Wraps the faithful :func:`moebalance.eplb.rebalance_experts` (hierarchical when ``num_nodes`` divides
``num_groups``, else global) on the load summed over the planning batches, with the same number of slots on
every GPU in every layer (``Budget.uniform_slots``). ``num_groups`` defaults to the model preset's expert
groups (DeepSeek-V3: 8) when the load names a preset, else 1 (global policy on more than one node).
Like the reference, it may put two copies of an expert on one GPU; the plan then carries a warning.
"""

from __future__ import annotations

from moebalance.cluster import Cluster
from moebalance.eplb import eplb_plan
from moebalance.errors import BudgetError
from moebalance.load import LoadMatrix
from moebalance.plan import Placement
from moebalance.policies.budget import Budget

__all__ = ["eplb"]


def _preset_groups(load: LoadMatrix) -> int:
    if load.preset is None:
        return 1
    from moebalance.synth import PRESETS

    preset = PRESETS.get(load.preset)
    return 1 if preset is None else preset.num_groups


def eplb(*, load: LoadMatrix, cluster: Cluster, budget: Budget, num_groups: int | None = None) -> Placement:
    """DeepSeek EPLB with ``slots_per_gpu * G`` physical experts per layer."""
    E, L, G = load.num_experts, load.num_layers, cluster.num_gpus
    slots = budget.uniform_slots(E, G, L)
    groups = _preset_groups(load) if num_groups is None else int(num_groups)
    if groups < 1:
        raise BudgetError(f"num_groups ({groups}) must be a positive integer")
    result = eplb_plan(load.total(), num_replicas=slots * G, num_groups=groups, num_nodes=cluster.num_nodes,
                       num_gpus=G)
    mode = "hierarchical" if groups % cluster.num_nodes == 0 else "global"
    params = {**budget.as_params(), "num_groups": groups, "mode": mode, "slots_per_gpu": slots}
    return Placement.from_eplb(result.physical_to_logical, cluster, num_experts=E, policy="eplb", params=params)
