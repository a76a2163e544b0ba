"""``craft``: CRAFT as a policy, a thin adapter over :mod:`moebalance.algorithms.craft`.

After "CRAFT: Cost-Aware Expert Replica Allocation with Fine-Grained Layerwise Estimations" (our readings of
its open points: ``docs/papers/craft.md``). EPLB gives every layer the same number of replicas; CRAFT gives
``R * G`` extra replicas to the layers where they buy the most balancedness: benefit table (Alg. 1), ``R``
chosen at the knee under ``auto`` (Step 2), allocation DP (Alg. 2), interleaved capacities (Alg. 3) and
capacity-aware greedy placement (Section 4.2.2 step 5).

Budgets: ``replicas_per_gpu R`` (or ``auto``) as CRAFT plans; ``slots_per_gpu S`` is read as the same
replica memory, ``R = L * (S - E / G)`` (:meth:`~moebalance.core.budget.Capacity.replicas`, with a note in the
plan), so that CRAFT and EPLB compare under one budget.

``objective="worst"`` with ``workload_batches`` (the batch count of each of two or more workloads concatenated in
the load; ``moebalance plan`` fills it from several ``--load``) allocates and places for the worst workload:
the benefit table per workload, Alg. 2 for the worst of them (:mod:`moebalance.algorithms.robust`).
``objective="sum"`` is Alg. 2's ``"gain"`` on the summed load, the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from moebalance.algorithms.craft import (
    BenefitTable,
    Objective,
    auto_replicas_per_gpu,
    benefit_table,
    plan_from_table,
    plan_with_allocation,
    replica_ladder,
    uniform_allocation,
)
from moebalance.algorithms.packing import placement_from_assignment
from moebalance.algorithms.robust import (
    allocate_worst,
    check_workloads,
    normalise,
    plan_layers_worst,
    workload_loads,
    workload_starts,
    worst_benefit_tables,
)
from moebalance.core.budget import Capacity
from moebalance.core.cluster import Cluster
from moebalance.core.errors import BudgetError
from moebalance.core.load import LoadMatrix
from moebalance.core.options import check_choice
from moebalance.core.plan import Placement
from moebalance.policies.base import Diagnostics, Planned, Policy, PolicyConfig

__all__ = ["CRAFT", "CraftConfig", "CraftDiagnostics", "craft"]

Allocation = Literal["benefit", "uniform"]
CraftObjective = Literal["gain", "weighted", "sum", "worst"]


@dataclass(kw_only=True, frozen=True, slots=True)
class CraftConfig(PolicyConfig):
    """``objective``: Alg. 2's ``"gain"`` (sum of gains; ``"sum"`` is the same, the summed load's) or the printed
    ``"weighted"`` (``r * T``), or ``"worst"`` (the worst of the workloads). ``replica_counts``: the positive replica
    counts a layer may take (None: ``1, 2, 4, ..., G``; checked against ``G`` when planning). ``allocation``:
    ``"benefit"`` (Alg. 1-2) or ``"uniform"`` (the same replicas in every layer, the baseline CRAFT compares
    against). ``workload_batches``: each workload's batch count in the load, in order (None: one workload)."""

    objective: CraftObjective = "gain"
    replica_counts: list[int] | None = None
    allocation: Allocation = "benefit"
    workload_batches: list[int] | None = None

    def __post_init__(self) -> None:
        check_choice("objective", self.objective, ("gain", "weighted", "sum", "worst"), BudgetError)
        check_choice("allocation", self.allocation, ("benefit", "uniform"), BudgetError)
        if self.objective == "sum":
            object.__setattr__(self, "objective", "gain")
        batches = check_workloads("worst" if self.objective == "worst" else "sum", self.workload_batches)
        object.__setattr__(self, "workload_batches", batches)

    def as_params(self) -> dict[str, object]:
        return {} if self.workload_batches is None else {"workload_batches": self.workload_batches}


@dataclass(kw_only=True, frozen=True, slots=True)
class CraftDiagnostics(Diagnostics):
    """Under ``auto``: the ``R`` chosen at the knee and the mean gain of each candidate ``R = 1, 2, 4, ...``
    (the rest of CRAFT's record is in the plan's params: ladder, allocation, predicted gain)."""

    chosen: int | None = None
    auto_curve: list[float] | None = None

    @property
    def chosen_replicas_per_gpu(self) -> int | None:
        return self.chosen

    def as_params(self) -> dict[str, object]:
        if self.chosen is None:
            return {}
        return {"chosen_replicas_per_gpu": self.chosen, "auto_curve": self.auto_curve}


def _check_ladder(replica_counts: object, num_gpus: int) -> tuple[int, ...]:
    """The sorted distinct counts of a user's ``replica_counts``, each an integer in ``[1, G]``."""
    values = list(replica_counts) if isinstance(replica_counts, list | tuple) else []
    if not values or not all(isinstance(r, int | np.integer) and not isinstance(r, bool) and 1 <= r <= num_gpus
                             for r in values):
        raise BudgetError(f"replica_counts ({replica_counts!r}) must be a non-empty list of integers in "
                          f"[1, {num_gpus}] (replicas a layer may take), e.g. [1, 2, 4]")
    return tuple(sorted({int(r) for r in values}))


def craft(load: LoadMatrix, cluster: Cluster, capacity: Capacity, config: CraftConfig) -> Planned:
    """CRAFT with ``R * G`` extra replicas spread over layers by benefit (``--replicas-per-gpu R|auto``, or
    ``--slots-per-gpu S`` read as ``R = L * (S - E / G)``).

    ``allocation="uniform"`` skips Steps 1-3 and gives every layer the same number of replicas, placed with
    the same Steps 4-5.
    """
    L, G = load.num_layers, cluster.num_gpus
    R, used = capacity.replicas("craft", auto_ok=True)
    ladder = replica_ladder(G) if config.replica_counts is None else _check_ladder(config.replica_counts, G)
    params: dict[str, object] = {"objective": config.objective, "replica_counts": list(ladder),
                                 "allocation": config.allocation}
    if config.objective == "worst":
        return _craft_worst(load, cluster, R, ladder, config, params, used)
    if config.allocation == "uniform":
        if R is None:
            raise BudgetError("allocation 'uniform' has no benefit curve to choose R from; give a number")
        params["replicas_per_gpu"] = R
        return Planned(plan_with_allocation(load, cluster, uniform_allocation(L, R * G), params), capacity=used)
    table = benefit_table(load.counts, cluster, ladder)
    objective: Objective = "weighted" if config.objective == "weighted" else "gain"
    diagnostics = CraftDiagnostics()
    if R is None:
        R, curve = auto_replicas_per_gpu(table, G, objective=objective)
        params["replicas_per_gpu"] = "auto"
        diagnostics = CraftDiagnostics(chosen=R, auto_curve=[round(float(v), 6) for v in curve])
    else:
        params["replicas_per_gpu"] = R
    plan = plan_from_table(load, cluster, table, R, objective, params)
    return Planned(plan, diagnostics, used)


def _craft_worst(load: LoadMatrix, cluster: Cluster, R: int | None, ladder: tuple[int, ...], config: CraftConfig,
                 params: dict[str, object], used: Capacity | None) -> Planned:
    """Steps 1-5 for the worst workload (:mod:`moebalance.algorithms.robust`); under ``auto``, the knee of the
    per-layer worst gain's curve (Step 2 on the table of ``min_k`` gains)."""
    L, G = load.num_layers, cluster.num_gpus
    starts = workload_starts(config.workload_batches, load.num_batches)
    diagnostics = CraftDiagnostics()
    if config.allocation == "uniform":
        if R is None:
            raise BudgetError("allocation 'uniform' has no benefit curve to choose R from; give a number")
        x = uniform_allocation(L, R * G)
    else:
        table = worst_benefit_tables(load.counts, starts, ladder, cluster.gpus_per_node, G)
        if R is None:
            worst = BenefitTable(table.replica_counts, table.gain.min(axis=0), table.base.min(axis=0))
            R, curve = auto_replicas_per_gpu(worst, G)
            diagnostics = CraftDiagnostics(chosen=R, auto_curve=[round(float(v), 6) for v in curve])
        alloc = allocate_worst(table, R * G)
        x = alloc.layer_replicas
        params.update(predicted_worst_balancedness=round(float(alloc.predicted.min()), 6),
                      predicted_worst_bound=round(alloc.bound, 6))
    params["replicas_per_gpu"] = "auto" if diagnostics.chosen is not None else R
    w = normalise(workload_loads(load.counts, starts))
    reps, gpu, expert = plan_layers_worst(w, x, cluster.gpus_per_node, G)
    plan: Placement = placement_from_assignment(gpu, expert, cluster, load.num_experts, "craft",
                                                {**params, "layer_replicas": (reps.sum(axis=1) - load.num_experts)
                                                 .tolist()})
    return Planned(plan, diagnostics, used)


CRAFT = Policy("craft", CraftConfig, craft)
