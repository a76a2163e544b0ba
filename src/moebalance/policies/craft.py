"""``craft``: CRAFT as a policy, a thin adapter over :mod:`moebalance.algorithms.craft`.

After "CRAFT: Cost-Aware Expert Replica Allocation with Fine-Grained Layerwise Estimations" (our readings of
its open points: ``docs/papers/craft.md``). EPLB gives every layer the same number of replicas; CRAFT gives
``R * G`` extra replicas to the layers where they buy the most balancedness: benefit table (Alg. 1), ``R``
chosen at the knee under ``auto`` (Step 2), allocation DP (Alg. 2), interleaved capacities (Alg. 3) and
capacity-aware greedy placement (Section 4.2.2 step 5).

Budgets: ``replicas_per_gpu R`` (or ``auto``) as CRAFT plans; ``slots_per_gpu S`` is read as the same
replica memory, ``R = L * (S - E / G)`` (:meth:`~moebalance.core.budget.Capacity.replicas`, with a note in the
plan), so that CRAFT and EPLB compare under one budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from moebalance.algorithms.craft import (
    Objective,
    auto_replicas_per_gpu,
    benefit_table,
    plan_from_table,
    plan_with_allocation,
    replica_ladder,
    uniform_allocation,
)
from moebalance.core.budget import Capacity
from moebalance.core.cluster import Cluster
from moebalance.core.errors import BudgetError
from moebalance.core.load import LoadMatrix
from moebalance.core.options import check_choice
from moebalance.policies.base import Diagnostics, Planned, Policy, PolicyConfig

__all__ = ["CRAFT", "CraftConfig", "CraftDiagnostics", "craft"]

Allocation = Literal["benefit", "uniform"]


@dataclass(kw_only=True, frozen=True, slots=True)
class CraftConfig(PolicyConfig):
    """``objective``: Alg. 2's ``"gain"`` (sum of gains) or the printed ``"weighted"`` (``r * T``).
    ``replica_counts``: the positive replica counts a layer may take (None: ``1, 2, 4, ..., G``; checked
    against ``G`` when planning). ``allocation``: ``"benefit"`` (Alg. 1-2) or ``"uniform"`` (the same
    replicas in every layer, the baseline CRAFT compares against)."""

    objective: Objective = "gain"
    replica_counts: list[int] | None = None
    allocation: Allocation = "benefit"

    def __post_init__(self) -> None:
        check_choice("objective", self.objective, ("gain", "weighted"), BudgetError)
        check_choice("allocation", self.allocation, ("benefit", "uniform"), BudgetError)


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
    if config.allocation == "uniform":
        if R is None:
            raise BudgetError("allocation 'uniform' has no benefit curve to choose R from; give a number")
        params["replicas_per_gpu"] = R
        return Planned(plan_with_allocation(load, cluster, uniform_allocation(L, R * G), params), capacity=used)
    table = benefit_table(load.counts, cluster, ladder)
    diagnostics = CraftDiagnostics()
    if R is None:
        R, curve = auto_replicas_per_gpu(table, G, objective=config.objective)
        params["replicas_per_gpu"] = "auto"
        diagnostics = CraftDiagnostics(chosen=R, auto_curve=[round(float(v), 6) for v in curve])
    else:
        params["replicas_per_gpu"] = R
    plan = plan_from_table(load, cluster, table, R, config.objective, params)
    return Planned(plan, diagnostics, used)


CRAFT = Policy("craft", CraftConfig, craft)
