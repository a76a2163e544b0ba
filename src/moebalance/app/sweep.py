"""Budget sweeps: held-out balancedness against extra replicas per GPU (CRAFT Figures 1 and 8).

For each ``R`` in a list, plan on the planning batches and score on the held-out ones:

- ``craft``: CRAFT's benefit-driven allocation of ``R * G`` replicas (the benefit table is computed once,
  unless ``params`` give craft options: then each ``R`` is planned from scratch with them);
- ``craft-uniform``: the same number of replicas in every layer (CRAFT Figure 8's uniform replication), placed
  the same way, so the difference is the allocation alone (``uniform`` is accepted for it: an older name that
  is also a router's);
- ``eplb``: DeepSeek EPLB with ``floor(R / L)`` extra slots per GPU in every layer: placement only below
  ``R = L``, and EPLB's minimum uniform replication (one replica per layer per GPU) at ``R = L``, which
  the sweep always includes;
- ``greedy`` / ``contiguous``: placement only (the same at every ``R``).

A point a policy cannot plan (EPLB below its rounding minimum when ``G`` does not divide ``E``) is skipped
with its reason rather than ending the sweep. ``params`` gives each policy its options (``sweep --set``; for
``craft-uniform`` craft's, but ``allocation``). Plots put each point at the extra replicas per GPU its plan
actually uses (``extra_replicas / G``): CRAFT never gives a layer more than ``G`` replicas, so above
``R = L`` it spends less than ``R * G``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moebalance.algorithms.craft import benefit_table, plan_from_table, replica_ladder
from moebalance.app.options import policy_keys
from moebalance.core.cluster import Cluster
from moebalance.core.errors import BudgetError, InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.policies import Budget, make_plan
from moebalance.policies.craft import CraftConfig
from moebalance.pricing.goodput import PlanPrice
from moebalance.routing.simulate import evaluate

__all__ = ["SWEEP_ALIASES", "SWEEP_POLICIES", "SweepPoint", "SweepResult", "canonical", "sweep", "sweep_keys",
           "sweep_steps"]

SWEEP_POLICIES = ("craft", "craft-uniform", "eplb", "greedy", "contiguous")
#: Other names accepted for a sweep policy.
SWEEP_ALIASES = {"uniform": "craft-uniform"}


def canonical(policies: Sequence[str]) -> list[str]:
    """The sweep policies by their own names (aliases resolved, each once, in order), checked."""
    if not policies:
        raise InputError(f"no sweep policies given; choose from {', '.join(SWEEP_POLICIES)}, e.g. eplb,craft")
    out: list[str] = []
    for p in policies:
        name = SWEEP_ALIASES.get(p, p)
        if name not in SWEEP_POLICIES:
            raise InputError(f"sweep policy {p!r} is unknown; choose from {', '.join(SWEEP_POLICIES)}")
        if name not in out:
            out.append(name)
    return out


def sweep_keys(policy: str) -> tuple[str, ...]:
    """The options a sweep policy takes (``sweep --set``): its policy's, craft's for ``craft-uniform`` (whose
    allocation is fixed)."""
    if policy == "craft-uniform":
        return tuple(f.name for f in dataclasses.fields(CraftConfig) if f.name != "allocation")
    keys = policy_keys(policy)
    return () if keys is None else keys


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One (policy, R) point of a sweep, scored on held-out batches."""

    policy: str
    replicas_per_gpu: int
    extra_replicas: int
    balancedness: float
    imbalance_ratio: float
    #: Balancedness minus the placement-only (``greedy``) plan's, on the same held-out batches.
    gain: float
    #: With a cost model (``sweep --gpu``): KV cache per GPU (GiB) and modelled goodput (tokens/s).
    kv_cache_gb: float | None = None
    goodput: float | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {"policy": self.policy, "replicas_per_gpu": self.replicas_per_gpu,
               "extra_replicas": self.extra_replicas, "balancedness": round(self.balancedness, 6),
               "imbalance_ratio": round(self.imbalance_ratio, 6), "gain": round(self.gain, 6)}
        if self.goodput is not None and self.kv_cache_gb is not None:
            out.update(kv_cache_gb_per_gpu=round(self.kv_cache_gb, 4), modelled_goodput=round(self.goodput, 3))
        return out


@dataclass(frozen=True, slots=True)
class SweepResult:
    """The scored points of a sweep, and the ``(policy, R)`` points skipped with the reason."""

    points: list[SweepPoint]
    #: ``"eplb at R = 0: ..."``: points no plan could be made for.
    skipped: list[str] = field(default_factory=list)


def _check(load: LoadMatrix, cluster: Cluster, replicas: Sequence[int]) -> None:
    if not replicas or any(r < 0 for r in replicas):
        raise InputError(f"replicas per GPU ({list(replicas)}) must be a non-empty list of integers >= 0")
    L, E, G = load.num_layers, load.num_experts, cluster.num_gpus
    # with every expert of every layer on every GPU, no replica can be added
    most = math.ceil(L * E * (G - 1) / G)
    if max(replicas) > max(most, L):
        raise InputError(f"replicas per GPU {max(replicas)} exceeds {max(most, L)}, where every GPU already "
                         f"holds every expert of all {L} layers; sweep smaller values")


def _rs(policy: str, replicas: Sequence[int], num_layers: int) -> list[int]:
    return sorted(set(replicas) | ({num_layers} if policy == "eplb" else set()))


def _uses_table(policies: Sequence[str], params: Mapping[str, Mapping[str, Any]] | None) -> bool:
    return "craft" in policies and not (params or {}).get("craft")


def sweep_steps(load: LoadMatrix, cluster: Cluster, policies: Sequence[str], replicas: Sequence[int],
                params: Mapping[str, Mapping[str, Any]] | None = None) -> int:
    """How many times :func:`sweep` calls ``on_step`` (for a progress bar's total)."""
    names = canonical(policies)
    table = len(replica_ladder(cluster.num_gpus)) + 1 if _uses_table(names, params) else 0
    return table + sum(len(_rs(p, replicas, load.num_layers)) for p in names)


def sweep(load: LoadMatrix, cluster: Cluster, policies: Sequence[str], replicas: Sequence[int], *,
          train_frac: float = 0.5, num_groups: int | None = None,
          params: Mapping[str, Mapping[str, Any]] | None = None,
          on_step: Callable[[], None] | None = None,
          price: Callable[[Placement, LoadMatrix], PlanPrice] | None = None) -> SweepResult:
    """Score every policy at every ``R`` in ``replicas`` (plus ``R = L`` for eplb); with ``price``, also model each
    plan's KV cache and goodput on the held-out batches. ``params[policy]`` are a policy's options;
    ``num_groups`` is eplb's (``params`` win)."""
    names = canonical(policies)
    _check(load, cluster, replicas)
    options = {p: dict((params or {}).get(p, {})) for p in names}
    if num_groups is not None and "eplb" in options:
        options["eplb"] = {"num_groups": num_groups, **options["eplb"]}
    train, test = load.split(train_frac)
    L = load.num_layers
    base_plan, _ = make_plan("greedy", train, cluster, Budget(replicas_per_gpu=0))
    base = evaluate(base_plan, test).balancedness
    table = benefit_table(train.counts, cluster, on_step=on_step) if _uses_table(names, params) else None
    result = SweepResult([])
    for policy in names:
        for R in _rs(policy, replicas, L):
            budget = Budget(replicas_per_gpu=R)
            try:
                if table is not None and policy == "craft":
                    plan = plan_from_table(train, cluster, table, R)
                elif policy == "craft-uniform":
                    plan, _ = make_plan("craft", train, cluster, budget, **{**options[policy], "allocation": "uniform"})
                else:
                    plan, _ = make_plan(policy, train, cluster, budget, **options[policy])
            except BudgetError as exc:
                result.skipped.append(f"{policy} at R = {R}: {exc}")
            else:
                score = evaluate(plan, test)
                modelled = None if price is None else price(plan, test)
                result.points.append(SweepPoint(
                    policy, R, plan.extra_replicas, score.balancedness, score.imbalance_ratio, score.balancedness - base,
                    None if modelled is None else modelled.memory.kv_cache_gb_per_gpu,
                    None if modelled is None else modelled.modelled_goodput))
            if on_step is not None:
                on_step()
    return result
