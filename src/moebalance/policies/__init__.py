"""Placement policies, registered by name: thin adapters from a load, a cluster and a budget to the paper
algorithms in :mod:`moebalance.algorithms`.

Each policy has a frozen config dataclass (its ``--set`` options) and returns typed diagnostics
(:mod:`moebalance.policies.base`). Callers pass a registered name or any callable
``(*, load, cluster, budget, **params) -> Placement``. The names are part of the command-line contract
(``docs/design.md``, "Policies"); an import-time check keeps the registry within them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from moebalance.core.budget import Budget, Capacity, resolve_budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.policies.base import PlanResult, Policy, PolicyConfig, run_policy
from moebalance.policies.contiguous import CONTIGUOUS
from moebalance.policies.craft import CRAFT
from moebalance.policies.eplb import EPLB
from moebalance.policies.grace import GRACE
from moebalance.policies.greedy import GREEDY
from moebalance.policies.libra import LIBRA, DynamicPolicy
from moebalance.policies.moetuner import MOETUNER

__all__ = [
    "DYNAMIC_POLICIES",
    "POLICIES",
    "Budget",
    "Capacity",
    "PlanResult",
    "Policy",
    "PolicyConfig",
    "PolicyFn",
    "get_policy",
    "make_plan",
    "plan_with",
    "resolve_budget",
]

PolicyFn = Callable[..., Placement]

POLICIES: dict[str, Policy[Any] | PolicyFn] = {
    "contiguous": CONTIGUOUS,
    "greedy": GREEDY,
    "eplb": EPLB,
    "craft": CRAFT,
    "grace": GRACE,
    "moetuner": MOETUNER,
}

#: Policies that plan every batch from a prediction (``moebalance online``), so have no single plan.
DYNAMIC_POLICIES: dict[str, DynamicPolicy] = {"libra": LIBRA}


def get_policy(policy: str | Policy[Any] | PolicyFn) -> tuple[str, Policy[Any] | PolicyFn]:
    """``(name, policy)`` for a registered name, a :class:`Policy` or a callable."""
    if isinstance(policy, Policy):
        return policy.name, policy
    if callable(policy):
        return getattr(policy, "__name__", "custom"), policy
    if isinstance(policy, str) and policy in DYNAMIC_POLICIES:
        raise InputError(f"policy {policy!r} is dynamic: it plans every batch from a prediction, so it has no single "
                         f"plan to write or score; replay it with moebalance online --policy {policy}")
    try:
        return policy, POLICIES[policy]
    except (KeyError, TypeError):
        raise InputError(f"unknown policy {policy!r}; choose one of: {', '.join(POLICIES)}") from None


def plan_with(policy: str | Policy[Any] | PolicyFn, load: LoadMatrix, cluster: Cluster, budget: Budget, *,
              dense_layers: Sequence[int] | None = None, **params: Any) -> PlanResult:
    """Run ``policy`` with ``params`` (its config's fields) under ``budget``: the plan, its config, typed
    diagnostics, the capacity it was checked against, and the seconds it took.

    Layers without load, or ``dense_layers`` when given, are an engine's dense layers: not planned, placed in
    contiguous blocks without copies (:func:`moebalance.policies.base.run_policy`).
    """
    _, fn = get_policy(policy)
    return run_policy(fn, load, cluster, budget, params, dense_layers)


def make_plan(policy: str | Policy[Any] | PolicyFn, load: LoadMatrix, cluster: Cluster, budget: Budget, *,
              dense_layers: Sequence[int] | None = None, **params: Any) -> tuple[Placement, float]:
    """Run ``policy`` and check its plan against the budget; returns ``(plan, seconds)``."""
    result = plan_with(policy, load, cluster, budget, dense_layers=dense_layers, **params)
    return result.placement, result.seconds
