"""Placement policies: plain functions ``(*, load, cluster, budget, **params) -> Placement`` in a registry.

Callers pass a registered name or any callable with that signature (STYLE 3). Names are a contract
(DESIGN §4); an import-time check keeps the registry within the documented names.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.policies.contiguous import contiguous
from moebalance.policies.craft import craft
from moebalance.policies.eplb import eplb
from moebalance.policies.grace import grace
from moebalance.policies.greedy import greedy
from moebalance.policies.moetuner import moetuner

__all__ = ["DOCUMENTED_POLICIES", "POLICIES", "Budget", "PolicyFn", "get_policy", "make_plan"]

PolicyFn = Callable[..., Placement]

#: Policy names documented in DESIGN §4 (contract).
DOCUMENTED_POLICIES = ("contiguous", "greedy", "eplb", "craft", "grace", "moetuner", "libra")

POLICIES: dict[str, PolicyFn] = {
    "contiguous": contiguous,
    "greedy": greedy,
    "eplb": eplb,
    "craft": craft,
    "grace": grace,
    "moetuner": moetuner,
}

_unknown = set(POLICIES) - set(DOCUMENTED_POLICIES)
if _unknown:
    raise RuntimeError(f"policies {sorted(_unknown)} are registered but not documented in DOCUMENTED_POLICIES")


def get_policy(policy: str | PolicyFn) -> tuple[str, PolicyFn]:
    """``(name, function)`` for a registered name or a callable."""
    if callable(policy):
        return getattr(policy, "__name__", "custom"), policy
    try:
        return policy, POLICIES[policy]
    except KeyError:
        raise InputError(f"unknown policy {policy!r}; choose one of: {', '.join(POLICIES)}") from None


def _check_params(name: str, fn: PolicyFn, params: dict[str, Any]) -> None:
    sig = inspect.signature(fn)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    allowed = [p for p in sig.parameters if p not in ("load", "cluster", "budget")]
    for key in params:
        if key not in allowed:
            hint = f"its parameters: {', '.join(allowed)}" if allowed else "it takes none"
            raise InputError(f"policy {name!r} has no parameter {key!r}; {hint}")


def make_plan(policy: str | PolicyFn, load: LoadMatrix, cluster: Cluster, budget: Budget,
              **params: Any) -> tuple[Placement, float]:
    """Run ``policy`` and check its plan against the budget; returns ``(plan, seconds)``."""
    name, fn = get_policy(policy)
    _check_params(name, fn, params)
    t0 = time.perf_counter()
    plan = fn(load=load, cluster=cluster, budget=budget, **params)
    seconds = time.perf_counter() - t0
    if (plan.num_layers, plan.num_experts, plan.num_gpus) != (load.num_layers, load.num_experts, cluster.num_gpus):
        raise AssertionError(f"policy {name!r} returned a plan of the wrong shape")
    budget.check(plan)
    return plan, seconds
