"""Compare plans on one load: each scenario plans on the first batches and is scored on the held-out rest
(CRAFT Section 5.1's protocol).

A :class:`Scenario` is one row of a comparison: a label, a policy with its parameters, a budget and a router.
A :class:`Comparison` is a load, a cluster and its scenarios; ``moebalance compare`` builds one from its
arguments, and the demo is a list of them (:mod:`moebalance.app.demo`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moebalance.app.report import ComparisonRow
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.cost.goodput import PlanCost
from moebalance.policies import make_plan
from moebalance.routing import Router
from moebalance.routing.simulate import evaluate

__all__ = ["Comparison", "Scenario", "run_comparison"]


@dataclass(frozen=True, slots=True)
class Scenario:
    """One row: ``policy`` with ``params`` under ``budget``, scored with ``router``.

    ``label`` names the row (default: the policy); ``plan_name`` the plan file ``plan-<name>.json`` (default: the
    label); ``shown=False`` keeps the row out of the table, for numbers a note quotes.
    """

    policy: str
    budget: Budget
    params: Mapping[str, Any] = field(default_factory=dict)
    #: A router name or a :class:`~moebalance.routing.Router` (with its options).
    router: str | Router = "uniform"
    label: str | None = None
    plan_name: str | None = None
    shown: bool = True
    #: A plan made elsewhere (``compare --baseline``: what an engine runs today), scored as it is: no planning.
    fixed: Placement | None = None
    #: Seconds it took to make ``fixed``, if it was made for this comparison (``--auto-by goodput``).
    fixed_seconds: float = 0.0

    @property
    def name(self) -> str:
        return self.label or self.policy


@dataclass(frozen=True, slots=True)
class Comparison:
    """Scenarios on one load and cluster, planned on ``train_frac`` of the batches."""

    load: str
    cluster: Cluster
    scenarios: tuple[Scenario, ...]
    train_frac: float = 0.5
    seed: int = 0
    #: Notes printed under the table; each may quote rows by label (``rows[label].score.balancedness``).
    notes: Callable[[Mapping[str, ComparisonRow]], list[str]] = lambda rows: []


def run_comparison(load: LoadMatrix, cluster: Cluster, scenarios: Sequence[Scenario], *, train_frac: float = 0.5,
                   seed: int = 0, bytes_per_copy: int | None = None,
                   on_done: Callable[[str], None] | None = None,
                   cost: Callable[[Placement, LoadMatrix, str | Router], PlanCost] | None = None,
                   node_forwarding: bool = False) -> tuple[dict[str, ComparisonRow], dict[str, Placement]]:
    """Plan and score every scenario; rows by label (in order) and plans by plan name.

    Scenarios that differ only in their router share one plan (made once, its planning time on each row). With
    ``cost``, each row also carries ``cost(plan, held-out load, router)`` (``compare --gpu``).
    """
    train, test = load.split(train_frac)
    rows: dict[str, ComparisonRow] = {}
    plans: dict[str, Placement] = {}
    made: dict[str, tuple[Placement, float]] = {}
    for sc in scenarios:
        if sc.fixed is not None:
            plan, seconds = sc.fixed, sc.fixed_seconds
        else:
            key = repr((sc.policy, sorted(sc.params.items()), sc.budget))
            if key not in made:
                made[key] = make_plan(sc.policy, train, cluster, sc.budget, **dict(sc.params))
            plan, seconds = made[key]
        score = evaluate(plan, test, sc.router, seed=seed, bytes_per_copy=bytes_per_copy, routing_gap=True,
                         node_forwarding=node_forwarding)
        modelled = None if cost is None else cost(plan, test, sc.router)
        rows[sc.name] = ComparisonRow(sc.name, score, seconds, plan.warnings, modelled)
        if sc.shown:
            plans[sc.plan_name or sc.name] = plan
        if on_done is not None:
            on_done(sc.name)
    return rows, plans
