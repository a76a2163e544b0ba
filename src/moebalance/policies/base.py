"""What every policy is: a frozen config, a planning function over a :class:`Capacity`, typed diagnostics.

A policy is registered as a :class:`Policy`: its name, its config class and a function
``plan(load, cluster, capacity, config) -> Planned`` (the placement, typed diagnostics, and the capacity the
plan must meet when the policy converted the budget, e.g. slots to replicas). :func:`make_plan` builds the config
once from keyword parameters (``--set key=value`` on the command line), resolves the budget once
(:func:`moebalance.core.budget.resolve_budget`), runs the policy, checks the plan's shape and memory, and
stores the budget, the config and the diagnostics in the plan's ``params`` (the plan file's JSON).

Callers may also pass any callable ``(*, load, cluster, budget, **params) -> Placement``: it is run as given
and its plan checked the same way.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from moebalance.core.budget import Budget, Capacity, resolve_budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.limits import check_alloc
from moebalance.core.load import LoadMatrix
from moebalance.core.options import Options
from moebalance.core.plan import Placement, with_dense_layers
from moebalance.core.trace import RoutingTrace

__all__ = [
    "Diagnostics",
    "NoConfig",
    "NoDiagnostics",
    "PlanResult",
    "Planned",
    "Policy",
    "PolicyConfig",
    "run_policy",
]


@dataclass(kw_only=True, frozen=True, slots=True)
class PolicyConfig(Options):
    """Base of every policy's options: frozen, keyword-only, validated in ``__post_init__``."""

    owner_kind: ClassVar[str] = "policy"
    option_word: ClassVar[str] = "parameter"


@dataclass(kw_only=True, frozen=True, slots=True)
class NoConfig(PolicyConfig):
    """A policy without options."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Diagnostics:
    """Base of what a policy reports about its plan (objectives, choices, notes); stored in the plan's params."""

    def as_params(self) -> dict[str, Any]:
        """The diagnostics as JSON values."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def chosen_replicas_per_gpu(self) -> int | None:
        """The ``R`` the policy chose under an ``auto`` budget (CRAFT Step 2); None for the rest."""
        return None


@dataclass(kw_only=True, frozen=True, slots=True)
class NoDiagnostics(Diagnostics):
    """A policy that reports nothing beyond its plan."""


C = TypeVar("C", bound=PolicyConfig)


@dataclass(frozen=True, slots=True)
class Planned:
    """What a policy's planning function returns."""

    placement: Placement
    diagnostics: Diagnostics = NoDiagnostics()
    #: The capacity the plan must meet: None for the one given, else the policy's conversion of it
    #: (:meth:`Capacity.replicas`, :meth:`Capacity.uniform_slots`), whose note the plan records.
    capacity: Capacity | None = None


@dataclass(frozen=True, slots=True)
class Policy(Generic[C]):
    """A registered policy."""

    name: str
    config: type[C]
    plan: Callable[[LoadMatrix, Cluster, Capacity, C], Planned]


@dataclass(frozen=True, slots=True)
class PlanResult:
    """A plan and how it was made."""

    placement: Placement
    config: PolicyConfig | None
    diagnostics: Diagnostics
    capacity: Capacity
    #: Wall-clock seconds of the policy itself.
    seconds: float


def _check_shape(name: str, plan: object, load: LoadMatrix, cluster: Cluster) -> Placement:
    if not isinstance(plan, Placement):
        raise PlanError(f"policy {name!r} returned {type(plan).__name__}, not a Placement")
    want = (load.num_layers, load.num_experts, cluster.num_gpus)
    got = (plan.num_layers, plan.num_experts, plan.num_gpus)
    if got != want:
        raise PlanError(f"policy {name!r} returned a plan of [layers, experts, GPUs] = {list(got)} for a load and "
                        f"cluster of {list(want)}")
    return plan


def _check_keywords(name: str, fn: Callable[..., Placement], params: Mapping[str, Any]) -> None:
    """A plain callable takes the keywords its signature names (any, with ``**kwargs``)."""
    sig = inspect.signature(fn)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    allowed = [p for p in sig.parameters if p not in ("load", "cluster", "budget")]
    for key in params:
        if key not in allowed:
            hint = f"its parameters: {', '.join(allowed)}" if allowed else "it takes none"
            raise InputError(f"policy {name!r} has no parameter {key!r}; {hint}")


def run_policy(policy: Policy[Any] | Callable[..., Placement], load: LoadMatrix, cluster: Cluster, budget: Budget,
               params: Mapping[str, Any], dense_layers: Sequence[int] | None = None) -> PlanResult:
    """Run a registered policy (config from ``params``) or a plain callable (``params`` passed as keywords).

    Layers without load (an engine's dense layers, kept as zero rows in its numbering) are not planned: the policy
    sees the MoE layers only, so its budget goes where tokens are, and each dense layer gets contiguous blocks (no
    copies, no memory beyond one slot per expert); the plan records them as ``params["dense_layers"]``.
    ``dense_layers`` names them instead (a layer idle in a planning window may carry load later: the CLI passes
    the layers without load in the whole file).
    """
    # a load that records the model's layer ids has left its dense layers out already: every row is an MoE layer
    has_load = load.counts.sum(axis=(0, 2)) > 0 if load.layer_ids is None else np.ones(load.num_layers, dtype=bool)
    if dense_layers is not None:
        listed = np.asarray(list(dense_layers), dtype=np.int64)
        if listed.size and (listed.min() < 0 or listed.max() >= load.num_layers):
            raise InputError(f"dense_layers {listed.tolist()} must lie in 0..{load.num_layers - 1}")
        has_load = np.ones(load.num_layers, dtype=bool)
        has_load[listed] = False
    moe = np.flatnonzero(has_load)
    if moe.size == load.num_layers:
        return _run_policy(policy, load, cluster, budget, params)
    if moe.size == 0:  # nothing to plan around: every layer dense, in contiguous blocks (the policy still checks
        result = _run_policy(policy, load, cluster, budget, params)  # its options and the budget)
        return dataclasses.replace(result, placement=with_dense_layers(result.placement, range(load.num_layers)))
    sub = LoadMatrix(load.counts[:, moe], None if load.trace is None else _trace_layers(load.trace, moe), load.preset,
                     None if load.layer_ids is None else load.layer_ids[moe])
    result = _run_policy(policy, sub, cluster, budget, params)
    plan = result.placement
    rows: list[Any] = [plan.gpu_experts[0]] * load.num_layers  # dense rows are replaced below
    weights: list[Any] | None = None if plan.weights is None else [plan.weights[0]] * load.num_layers
    for i, layer in enumerate(moe):
        rows[layer] = plan.gpu_experts[i]
        if weights is not None and plan.weights is not None:
            weights[layer] = plan.weights[i]
    # per-layer diagnostics in the policy's params (GRACE's skew, replicas, ...) list the planned layers only
    params_out = {**plan.params, "planned_layers": [int(x) for x in moe]}
    if load.layer_ids is not None:
        params_out["layer_ids"] = [int(x) for x in load.layer_ids]
    full = Placement(rows, load.num_experts, plan.cluster, policy=plan.policy, params=params_out, weights=weights)
    full = with_dense_layers(full, np.flatnonzero(~has_load).tolist())
    # the capacity of the whole model: dense layers add at most ceil(E / G) slots per GPU each, and no copies
    used = result.capacity
    extra_slots = (load.num_layers - moe.size) * used.placement_slots
    used = dataclasses.replace(used, num_layers=load.num_layers, max_slots_total=None if used.max_slots_total is None
                               else used.max_slots_total + extra_slots)
    used.check(full, chosen_replicas_per_gpu=result.diagnostics.chosen_replicas_per_gpu)
    return PlanResult(full, result.config, result.diagnostics, used, result.seconds)


def _trace_layers(trace: RoutingTrace, layers: np.ndarray) -> RoutingTrace:
    """The trace's MoE layers alone: a copy of their picks, which must fit in memory (a trace that records no dense
    layers, or whose load names its layer ids, is planned on as it is, mapped from its file)."""
    check_alloc((trace.num_tokens, layers.size, trace.top_k), trace.topk_ids.itemsize,
                "the MoE layers' picks of this trace [T, L, K]", "plan on a trace of the MoE layers alone (record "
                "the model's layer ids, or leave dense layers out of the trace)")
    return RoutingTrace(trace.topk_ids[:, layers], trace.src_gpu, trace.batch, trace.num_experts, trace.num_batches)


def _run_policy(policy: Policy[Any] | Callable[..., Placement], load: LoadMatrix, cluster: Cluster, budget: Budget,
                params: Mapping[str, Any]) -> PlanResult:
    capacity = resolve_budget(budget, load.num_experts, cluster.num_gpus, load.num_layers)
    if not isinstance(policy, Policy):
        name = getattr(policy, "__name__", "custom")
        _check_keywords(name, policy, params)
        t0 = time.perf_counter()
        plan = policy(load=load, cluster=cluster, budget=budget, **params)
        seconds = time.perf_counter() - t0
        plan = _check_shape(name, plan, load, cluster)
        # a plain callable has no typed diagnostics: under auto it records the R it chose in its params
        capacity.check(plan, chosen_replicas_per_gpu=plan.params.get("chosen_replicas_per_gpu"))
        return PlanResult(plan, None, NoDiagnostics(), capacity, seconds)
    config = policy.config.from_params(policy.name, params)
    t0 = time.perf_counter()
    out = policy.plan(load, cluster, capacity, config)
    seconds = time.perf_counter() - t0
    plan = _check_shape(policy.name, out.placement, load, cluster)
    diagnostics = out.diagnostics
    used = capacity if out.capacity is None else out.capacity
    used.check(plan, chosen_replicas_per_gpu=diagnostics.chosen_replicas_per_gpu)
    params_out = {**budget.as_params(), **config.as_params(), **diagnostics.as_params(), **dict(plan.params)}
    if used.note is not None:
        params_out["budget_note"] = used.note
    if load.layer_ids is not None:  # the model's layer index of each plan layer (engine exports line up with it)
        params_out["layer_ids"] = [int(x) for x in load.layer_ids]
    return PlanResult(plan.with_params(params_out, policy=policy.name), config, diagnostics, used, seconds)

