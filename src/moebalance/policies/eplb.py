"""``eplb``: DeepSeek's Expert Parallelism Load Balancer as a policy.

Wraps the faithful :func:`moebalance.algorithms.eplb.rebalance_experts` (hierarchical when ``num_nodes`` divides
``num_groups``, else global) on the load summed over the planning batches, with the same number of slots on
every GPU in every layer (:meth:`~moebalance.core.budget.Capacity.uniform_slots`). ``num_groups`` defaults to the model preset's expert
groups (DeepSeek-V3: 8) when the load names a preset, else 1 (global policy on more than one node).

Like the reference, the default may put two copies of one expert on one GPU (a known property of DeepSeek's reference); the
plan then carries a warning. ``avoid_duplicates=True`` repairs them after the reference has run: each
surplus copy is swapped with a slot of another GPU (same node first, so hierarchical plans keep their
node-level grouping) that holds neither expert, choosing the swap that keeps the two GPUs' larger planned
load lowest. A surplus copy with no legal swap partner is left in place (the warning stays).

``objective="worst"`` with ``workload_batches`` (the batch count of each of two or more workloads concatenated in
the load; ``moebalance plan`` fills it from several ``--load``) plans for the worst workload instead of their sum:
:func:`moebalance.algorithms.robust.eplb_worst`, EPLB's steps with a load per workload. The default
``objective="sum"`` is the reference on the summed load, whatever the workloads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.algorithms.eplb import eplb_plan
from moebalance.algorithms.packing import repair_duplicates
from moebalance.algorithms.robust import (
    check_workloads,
    eplb_worst,
    normalise,
    workload_loads,
    workload_starts,
)
from moebalance.core.budget import Capacity
from moebalance.core.cluster import Cluster
from moebalance.core.errors import BudgetError
from moebalance.core.load import LoadMatrix
from moebalance.core.options import check_int
from moebalance.core.plan import Placement
from moebalance.policies.base import Diagnostics, Planned, Policy, PolicyConfig

__all__ = ["EPLB", "EplbConfig", "EplbDiagnostics", "eplb"]


@dataclass(kw_only=True, frozen=True, slots=True)
class EplbConfig(PolicyConfig):
    """``num_groups``: expert groups for the hierarchical policy (None: the load's model's, else 1).
    ``avoid_duplicates``: repair same-GPU copies after the reference has run.
    ``objective``: ``"sum"`` (the reference on the summed load) or ``"worst"`` (the worst of the workloads); CRAFT's
    ``"gain"`` and ``"weighted"`` read as ``"sum"``, so that one ``--set objective=...`` can serve both policies.
    ``workload_batches``: each workload's batch count in the load, in order (None: one workload)."""

    num_groups: int | None = None
    avoid_duplicates: bool = False
    objective: str = "sum"
    workload_batches: list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_groups is not None:
            object.__setattr__(self, "num_groups", check_int("num_groups", self.num_groups, minimum=1,
                                                             error=BudgetError))
        if not isinstance(self.avoid_duplicates, bool):
            raise BudgetError(f"avoid_duplicates ({self.avoid_duplicates!r}) must be true or false")
        if self.objective in ("gain", "weighted"):  # CRAFT's Alg. 2 objectives, given to several policies at once
            object.__setattr__(self, "objective", "sum")  # (--set objective=weighted): EPLB has no allocation step
        object.__setattr__(self, "workload_batches", check_workloads(self.objective, self.workload_batches))

    def as_params(self) -> dict[str, object]:
        # the diagnostics record the groups used; avoid_duplicates only when set; the objective where it matters
        if self.workload_batches is None:
            return {}
        return {"objective": self.objective, "workload_batches": self.workload_batches}


@dataclass(kw_only=True, frozen=True, slots=True)
class EplbDiagnostics(Diagnostics):
    """The groups used, the policy EPLB ran (``"hierarchical"`` when the node count divides the groups, else
    ``"global"``), the equal slots per GPU, and the same-GPU copies swapped away (with ``avoid_duplicates``)."""

    num_groups: int
    mode: str
    slots_per_gpu: int
    duplicate_swaps: int | None = None

    def as_params(self) -> dict[str, object]:
        out: dict[str, object] = {"num_groups": self.num_groups, "mode": self.mode, "slots_per_gpu": self.slots_per_gpu}
        if self.duplicate_swaps is not None:
            out.update(avoid_duplicates=True, duplicate_swaps=self.duplicate_swaps)
        return out


def _model_groups(load: LoadMatrix) -> int:
    return 1 if load.model is None else load.model.num_groups


def eplb(load: LoadMatrix, cluster: Cluster, capacity: Capacity, config: EplbConfig) -> Planned:
    """DeepSeek EPLB with ``slots_per_gpu * G`` physical experts per layer."""
    E, G = load.num_experts, cluster.num_gpus
    slots, used = capacity.uniform_slots("eplb")
    groups = _model_groups(load) if config.num_groups is None else config.num_groups
    if config.objective == "worst":
        per_workload = workload_loads(load.counts, workload_starts(config.workload_batches, load.num_batches))
        phy2log = eplb_worst(per_workload, num_replicas=slots * G, num_groups=groups, num_nodes=cluster.num_nodes,
                             num_gpus=G)
        weight = normalise(per_workload).max(axis=0)  # what a same-GPU copy costs, for the repair below
    else:
        weight = load.total()
        phy2log = eplb_plan(weight, num_replicas=slots * G, num_groups=groups, num_nodes=cluster.num_nodes,
                            num_gpus=G).physical_to_logical
    swaps = None
    if config.avoid_duplicates:
        slot_gpu = np.broadcast_to(np.arange(phy2log.shape[1]) // slots, phy2log.shape)
        phy2log, swaps = repair_duplicates(slot_gpu, phy2log, weight, cluster.gpus_per_node)
    mode = "hierarchical" if groups % cluster.num_nodes == 0 else "global"
    plan = Placement.from_eplb(phy2log, cluster, num_experts=E, policy="eplb")
    return Planned(plan, EplbDiagnostics(num_groups=groups, mode=mode, slots_per_gpu=slots, duplicate_swaps=swaps),
                   used)


EPLB = Policy("eplb", EplbConfig, eplb)
