"""Compare policies on one trace: plan on the first batches, score on the held-out rest (CRAFT 5.1)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from moebalance.app.report import ComparisonRow
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.policies import Budget, make_plan
from moebalance.routing.simulate import evaluate

__all__ = ["compare_policies"]


def compare_policies(load: LoadMatrix, policies: Sequence[str], cluster: Cluster, budget: Budget, *,
                     train_frac: float = 0.5, router: str = "uniform", seed: int = 0,
                     params: Mapping[str, Mapping[str, Any]] | None = None, bytes_per_copy: int | None = None,
                     on_done: Callable[[str], None] | None = None) -> tuple[list[ComparisonRow], dict[str, Placement]]:
    """Plan each policy on the planning batches and score it on the held-out batches.

    ``params[policy]`` holds extra keyword parameters for that policy. ``on_done(policy)`` is called after
    each policy (for a progress bar). Returns the rows, in the given order, and the plans by policy.
    """
    train, test = load.split(train_frac)
    rows: list[ComparisonRow] = []
    plans: dict[str, Placement] = {}
    for name in policies:
        plan, seconds = make_plan(name, train, cluster, budget, **dict((params or {}).get(name, {})))
        score = evaluate(plan, test, router, seed=seed, bytes_per_copy=bytes_per_copy)
        rows.append(ComparisonRow(name, score, seconds, plan.warnings))
        plans[name] = plan
        if on_done is not None:
            on_done(name)
    return rows, plans
