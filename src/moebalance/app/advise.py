"""``moebalance advise``: every expert-parallel configuration an engine can run, priced in tokens per second on
held-out batches, and the one to run (docs/design.md, "Advice").

Legend: ``E`` experts per layer, ``G`` GPUs (the EP size), ``L`` MoE layers, ``S`` slots per GPU and layer,
``r = G S - E`` redundant experts, ``N`` tokens in a step.

**Held out.** A load of several batches is split: the first ``train_frac`` plan, the rest are priced. A load of one
batch (engine statistics) plans and prices on that batch (its steps are drawn from it several times). Several loads:
their planning batches and their priced batches are each concatenated in order; plans use their sum. Other
workloads given to price on (``advise --price-load``): every load is planned on whole and those are priced
(:attr:`Setup.cross` says which is which).

**Steps.** Every priced batch is drawn again as one step of the phase (:mod:`moebalance.pricing.phase`; decode by
default): in decode ``N`` is the concurrency the KV cache left by the candidate's experts per GPU allows, so a
replica's memory costs tokens per step; in prefill ``N`` is a prompt chunk per data-parallel rank. Each candidate is
replayed through :func:`moebalance.online.replay.replay` priced in time (:mod:`moebalance.pricing.step`), planning
on the planning batches as recorded; its tokens per second are the served tokens over the summed step time.

**Candidates** (:func:`candidates`): EPLB off (contiguous blocks, no replicas); EPLB with each valid number of
redundant experts (``E + r`` divisible by ``G``: a few values from the smallest, while the KV cache stays positive),
hierarchical (where ``num_nodes > 1`` divides the model's expert groups) and global; CRAFT's allocation padded to
equal slots (:func:`moebalance.engines.slots.pad_plan`) where the engine loads a placement file; periodic
re-planning with a few ``(step_interval, window)`` pairs in steps, moved as the engine moves experts; the engine's
routers. Each engine's rule (:class:`moebalance.engines.base.EngineRule`) says what it runs.

**Recommendation** (:func:`recommend`): the most tokens per second, unless it beats EPLB off by no more than the
margin (the model's stated uncertainty), in which case EPLB stays off. Where the experts do not divide over the GPUs
and the engine then cannot run EPLB off (its rule), EPLB off is priced as the reference only and the
fastest configuration the engine runs is recommended, whatever the margin; a note names the GPU counts that divide
the experts, and another says so where there are more GPUs than experts.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix, concatenate_loads
from moebalance.core.plan import Placement
from moebalance.cost.memory import MemoryReport, memory_per_gpu
from moebalance.engines.registry import ENGINES as REGISTRY
from moebalance.engines.registry import get_engine, refusal
from moebalance.engines.slots import pad_plan
from moebalance.online.rearrange import Replanning
from moebalance.online.replay import replay
from moebalance.policies import make_plan
from moebalance.pricing.phase import PhaseModel, phase_steps
from moebalance.pricing.step import StepPricing

__all__ = [
    "DEFAULT_MARGIN",
    "ENGINES",
    "STATISTICS_STEPS",
    "Advice",
    "Candidate",
    "Priced",
    "Setup",
    "candidates",
    "clears",
    "concatenate",
    "dividing_gpu_counts",
    "margin_of",
    "price",
    "recommend",
    "redundant_values",
]

#: The share of tokens/s a configuration must gain over EPLB off (advise) or a re-plan over keeping the placement
#: (watch) to be chosen: the model's uncertainty where no calibration says more.
DEFAULT_MARGIN = 0.05

#: The engines advised on (``--engine``).
ENGINES = tuple(REGISTRY)
#: Steps drawn from a load of one batch (statistics), so that one draw does not decide.
STATISTICS_STEPS = 4
#: Values of ``r`` tried at most, and the periodic ``(step_interval, window)`` pairs kept at most.
MAX_REDUNDANT_VALUES = 4
MAX_PERIODS = 2


@dataclass(frozen=True, slots=True)
class Candidate:
    """One configuration to price. ``plan`` is set for a plan made before pricing (CRAFT padded), else the replay
    plans ``policy`` with ``params`` under ``slots_per_gpu``."""

    label: str
    policy: str
    params: dict[str, Any]
    slots_per_gpu: int
    redundant_experts: int
    router: str
    #: EPLB's expert groups (``None`` for the other policies) and its mode, ``"hierarchical"`` or ``"global"``.
    num_groups: int | None = None
    mode: str | None = None
    #: ``(step_interval, window)`` in steps, or ``None`` for a static plan.
    rebalance: tuple[int, int] | None = None
    migration: str = "fresh"
    rearrange: str = "sync"
    layers_per_step: int | None = None
    #: The plug-in variant the engine needs (vLLM's ``move-aware``), or ``None``.
    plugin: str | None = None
    plan: Placement | None = None
    #: Why the engine cannot run it (EPLB off where the experts do not divide over the GPUs): priced as the
    #: reference the others are measured against, never recommended; ``None`` for a configuration it runs.
    reference_only: str | None = None

    @property
    def off(self) -> bool:
        return self.policy == "contiguous"


@dataclass(frozen=True, slots=True)
class Setup:
    """What every candidate is priced with: the deployment, the model, the planning and priced batches."""

    cluster: Cluster
    phase: PhaseModel
    pricing: StepPricing
    #: The planning batches (every load's, in order) and the batches priced (drawn again as steps).
    train: LoadMatrix
    test: LoadMatrix
    #: Each load's planning batches (several loads: the worst-of plans' workloads).
    workload_batches: tuple[int, ...]
    seed: int = 0
    notes: tuple[str, ...] = ()
    #: Where the priced batches are another workload than the plans saw (``advise --price-load``): which is which.
    cross: str | None = None
    _steps: dict[int, LoadMatrix] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_moe_layers(self) -> int:
        return self.phase.model.num_layers

    def memory(self, experts_per_gpu: int) -> MemoryReport:
        """Memory per GPU with ``experts_per_gpu`` experts hosted over the MoE layers."""
        d, c = self.phase.deployment, self.cluster
        return memory_per_gpu(d.model, d.gpu, num_gpus=c.num_gpus, gpus_per_node=c.gpus_per_node,
                              experts_per_gpu=experts_per_gpu, engine=d.engine,
                              context_tokens=d.workload.context_tokens)

    def fits(self, experts_per_gpu: int) -> bool:
        """Whether the KV cache left holds one request (decode) or anything (prefill)."""
        m = self.memory(experts_per_gpu)
        return m.max_concurrency >= 1 if self.phase.phase == "decode" else m.kv_cache_gb_per_gpu > 0

    def steps(self, tokens: int) -> LoadMatrix:
        """The planning batches followed by the priced batches drawn again as steps of ``tokens`` (cached). The
        steps of every size share their draws (:func:`~moebalance.pricing.phase.phase_steps`'s ``shared``: the largest
        step, EPLB off's), so candidates whose KV cache allows different sizes are priced on the same tokens."""
        if tokens not in self._steps:
            E, G = self.phase.model.num_experts, self.cluster.num_gpus
            largest = self.phase.step_tokens(self.cluster, -(-E // G) * self.num_moe_layers)  # no replicas
            drawn = phase_steps(self.test, tokens, self.phase.model.top_k, self.seed, shared=max(largest, tokens))
            self._steps[tokens] = concatenate([self.train, drawn])
        return self._steps[tokens]


def concatenate(parts: Sequence[LoadMatrix]) -> LoadMatrix:
    """``parts``' batches one after another (a token-level trace where all have one)."""
    return parts[0] if len(parts) == 1 else concatenate_loads(list(parts))


def dividing_gpu_counts(num_experts: int, num_gpus: int) -> list[int]:
    """The GPU counts nearest ``num_gpus`` that divide ``num_experts``: the largest below it and the smallest above
    it (the experts' count alone where ``num_gpus`` exceeds it)."""
    divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
    below, above = [d for d in divisors if d < num_gpus], [d for d in divisors if d > num_gpus]
    return below[-1:] + above[:1]


def redundant_values(num_experts: int, num_gpus: int) -> list[int]:
    """The redundant-expert counts to try: ``E + r`` divisible by ``G``, from the smallest upward in steps of ``G``,
    up to ``E / 2`` but at least two values and at most :data:`MAX_REDUNDANT_VALUES`."""
    r0 = (-num_experts) % num_gpus
    values = [r0 + k * num_gpus for k in range(MAX_REDUNDANT_VALUES)]
    return [r for i, r in enumerate(values) if i < 2 or r <= num_experts // 2]


def _router_suffix(engine: str, router: str) -> str:
    """``", LP dispatch"``: the engine's name of ``router`` where the engine has several."""
    rule = REGISTRY[engine].rule
    name = rule.routers[router]
    return f", {name.upper() if len(name) <= 2 else name} dispatch" if len(rule.routers) > 1 else ""


def candidates(setup: Setup, engine: str, *,
               periods: Sequence[tuple[int, int]] = ()) -> tuple[list[Candidate], list[str]]:
    """The configurations ``engine`` can run on ``setup`` (module docstring), and notes on what was left out.
    ``periods``: the ``(step_interval, window)`` pairs of periodic re-planning (none for statistics)."""
    rule = get_engine(engine).rule
    why = refusal(engine, setup.phase.deployment)
    if why is not None:
        raise InputError(why)
    spec, cluster = setup.phase.model, setup.cluster
    E, G, L = spec.num_experts, cluster.num_gpus, setup.num_moe_layers
    base = math.ceil(E / G)
    if not setup.fits(base * L):
        raise InputError(f"{spec.display_name} on {cluster.num_nodes} x {cluster.gpus_per_node} "
                         f"{setup.phase.deployment.gpu.display_name} leaves no KV cache for one request of "
                         f"{setup.phase.deployment.workload.context_tokens} tokens even without replicas, so no configuration "
                         "fits; give more GPUs, a larger --memory-fraction or shorter requests")
    notes: list[str] = []
    fitting = []
    for r in redundant_values(E, G):
        if setup.fits((E + r) // G * L):
            fitting.append(r)
        else:
            notes.append(f"{r} redundant experts ({(E + r) // G} per GPU and layer) leave no KV cache for a request: "
                         "not listed")
    routers = list(rule.routers)
    first = routers[0]
    reference = None
    if E % G and not rule.uneven_off:
        counts = " or ".join(map(str, dividing_gpu_counts(E, G)))
        reference = f"{E} experts do not divide over {G:,} GPUs ({counts} GPUs would divide them)"
        notes.append(f"{engine} cannot run EPLB off here: {reference}, and its EP size must divide the experts plus the "
                     "redundant ones; EPLB off is priced only as the reference, and a configuration with redundant "
                     "experts is recommended")
    if G > E:
        notes.append(f"{G:,} GPUs for {E} experts: more GPUs than experts, so EPLB off leaves {G - E:,} GPUs without "
                     f"experts and the other configurations fill them with copies; an EP size that divides {E} (at "
                     f"most {E} GPUs) needs no copies")
    out = [Candidate("off (contiguous, no EPLB" + (f"; reference only, {engine} cannot run it)" if reference else ")"),
                     "contiguous", {}, base, 0, first, reference_only=reference)]
    hierarchical = cluster.num_nodes > 1 and spec.num_groups % cluster.num_nodes == 0
    default_mode = "hierarchical" if hierarchical else "global"
    modes = ["hierarchical", "global"] if hierarchical and rule.placement_file else [default_mode]

    def eplb(r: int, mode: str, **extra: Any) -> Candidate:
        groups = spec.num_groups if mode == "hierarchical" else 1
        label = f"EPLB {mode}, {r} redundant"
        return Candidate(label, "eplb", {"num_groups": groups}, (E + r) // G, r, first, groups, mode, **extra)

    for r in fitting:
        for mode in modes:
            c = eplb(r, mode)
            for router in routers if r > 0 else [first]:
                out.append(dataclasses.replace(c, label=f"{c.label}, static plan{_router_suffix(engine, router)}",
                                               router=router))
    if len(setup.workload_batches) > 1 and rule.placement_file:  # plans for the worst workload, not the sum
        for r, mode in ((r, mode) for r in fitting for mode in modes):
            c = eplb(r, mode)
            params = {**c.params, "objective": "worst", "workload_batches": list(setup.workload_batches)}
            out.append(dataclasses.replace(c, label=f"EPLB {mode} worst of {len(setup.workload_batches)} workloads, "
                                                    f"{r} redundant, static plan{_router_suffix(engine, first)}",
                                           params=params))
    if rule.placement_file:
        out += _craft(setup, engine, fitting, notes)
    else:
        what = "CRAFT and worst-of plans are" if len(setup.workload_batches) > 1 else "CRAFT is"
        notes.append(f"{engine} loads no placement file and plans with its own EPLB ({default_mode} here): {what} not "
                     "listed (the moebalance plug-in has no CRAFT variant)")
    for r in fitting:
        for K, W in periods:
            c = eplb(r, default_mode, rebalance=(K, W), rearrange=rule.rearrange)
            if rule.layers_per_step == "spread":
                C = math.ceil(L / K)
                out.append(dataclasses.replace(c, label=f"{c.label}, online every {K} on {W}, {C} layers per step "
                                                        f"({rule.rearrange})", layers_per_step=C))
                continue
            out.append(dataclasses.replace(c, label=f"{c.label}, every {K} on {W} ({rule.rearrange})"))
            if rule.move_aware is not None:
                out.append(dataclasses.replace(c, label=f"{c.label}, every {K} on {W} ({rule.rearrange}), "
                                                        f"{rule.move_aware} plug-in", migration="aligned",
                                               plugin=rule.move_aware))
    return out, notes


def _craft(setup: Setup, engine: str, fitting: Sequence[int], notes: list[str]) -> list[Candidate]:
    """CRAFT under each budget of ``fitting``, padded to equal slots; one candidate per distinct padded plan."""
    spec, cluster = setup.phase.model, setup.cluster
    E, G, L = spec.num_experts, cluster.num_gpus, setup.num_moe_layers
    out: list[Candidate] = []
    seen: set[int] = set()
    routers = list(REGISTRY[engine].rule.routers)
    for r in fitting:
        if r == 0:
            continue
        plan = make_plan("craft", setup.train, cluster, Budget(slots_per_gpu=(E + r) // G))[0]
        padded = pad_plan(plan, setup.train.counts).plan
        S = padded.max_slots_per_gpu
        r_padded = G * S - E
        if r_padded in seen:
            continue
        seen.add(r_padded)
        if not setup.fits(S * L):
            notes.append(f"CRAFT padded to {S} slots per GPU ({r_padded} redundant) leaves no KV cache: not listed")
            continue
        for router in routers:
            out.append(Candidate(f"CRAFT padded, {r_padded} redundant, static plan{_router_suffix(engine, router)}",
                                 "craft", {}, S, r_padded, router, plan=padded))
    return out


@dataclass(frozen=True, slots=True)
class Priced:
    """A candidate priced: tokens per second, memory per GPU, balance, and the replay's ``time`` object."""

    candidate: Candidate
    tokens_per_s: float
    kv_cache_gib: float
    weights_gib: float
    balancedness: float
    step_tokens: int
    time: dict[str, Any]
    #: The plan that serves first (made on the planning batches).
    plan: Placement

    def as_dict(self) -> dict[str, Any]:
        """One entry of ``candidates`` in ``advise --json``."""
        c, t = self.candidate, self.time
        return {"label": c.label, "tokens_per_s": round(self.tokens_per_s, 3),
                "kv_cache_gib": round(self.kv_cache_gib, 4), "balancedness": round(self.balancedness, 6),
                "redundant_experts": c.redundant_experts, "policy": c.policy, "router": c.router,
                "step_tokens": self.step_tokens, "weights_gib": round(self.weights_gib, 4),
                "step_ms_mean": t["step_ms_mean"], "exposed_balancing_ms": t["exposed_balancing_ms"],
                "moved_gib": t["moved_gib"]}


def price(setup: Setup, candidate: Candidate) -> Priced:
    """``candidate`` replayed over the priced batches as steps of its own size (module docstring); a plan made
    before pricing (CRAFT padded) serves unchanged."""
    c = candidate
    L = setup.num_moe_layers
    hosted = c.slots_per_gpu * L
    tokens = setup.phase.step_tokens(setup.cluster, hosted)
    load = setup.steps(tokens)
    warm = (0, setup.train.num_batches)
    served = (warm[1], load.num_batches)
    budget = Budget(slots_per_gpu=c.slots_per_gpu)
    K, W = c.rebalance if c.rebalance is not None else (None, None)
    replanning = Replanning(every=K, window=W, migration=c.migration, rearrange=c.rearrange,
                            layers_per_step=c.layers_per_step)
    result = replay(load, setup.cluster, budget, c.plan if c.plan is not None else c.policy, c.params, warmup=warm,
                    batches=served, router=c.router, seed=setup.seed, replanning=replanning, pricing=setup.pricing)
    if result.time is None:  # replay prices when given pricing
        raise RuntimeError("the replay was not priced")
    balance, time = result.balancedness, result.time
    plan = c.plan if c.plan is not None else make_plan(c.policy, setup.train, setup.cluster, budget, **c.params)[0]
    memory = setup.memory(hosted)
    return Priced(c, float(time["tokens_per_s"]), memory.kv_cache_gb_per_gpu, memory.weights_gb_per_gpu, balance,
                  tokens, time, plan)


@dataclass(frozen=True, slots=True)
class Advice:
    """Every candidate priced (best first), the one to run, and the margin it had to clear."""

    engine: str
    ranked: tuple[Priced, ...]
    off: Priced
    recommended: Priced
    margin: float

    @property
    def gain_vs_off(self) -> float:
        return self.recommended.tokens_per_s / self.off.tokens_per_s - 1.0 if self.off.tokens_per_s > 0 else 0.0

    @property
    def leave_off(self) -> bool:
        return self.recommended is self.off

    def recommendation(self) -> dict[str, Any]:
        """The ``recommendation`` object of ``advise --json``."""
        c = self.recommended.candidate
        return {"label": c.label, "engine": self.engine, "policy": c.policy,
                "redundant_experts": c.redundant_experts, "num_groups": c.num_groups, "router": c.router,
                "rebalance": None if c.rebalance is None else {"step_interval": c.rebalance[0],
                                                               "window_size": c.rebalance[1]},
                "tokens_per_s": round(self.recommended.tokens_per_s, 3), "gain_vs_off": round(self.gain_vs_off, 6)}

    def as_dict(self, engine_files: Sequence[str | os.PathLike[str]] = ()) -> dict[str, Any]:
        """``advise --json``: exactly ``recommendation``, ``candidates`` and ``engine_files``."""
        return {"recommendation": self.recommendation(), "candidates": [p.as_dict() for p in self.ranked],
                "engine_files": [str(f) for f in engine_files]}


def margin_of(given: float | None, fit_error: float | None) -> float:
    """The margin a modelled gain must clear, as a fraction: ``given`` (else :data:`DEFAULT_MARGIN`), or the
    calibration's fit error where that is larger (``exp(error) - 1``: a mean absolute log error as a ratio). One rule
    for ``advise`` and ``compare``'s recommendation."""
    margin = DEFAULT_MARGIN if given is None else float(given)
    return margin if fit_error is None else max(margin, math.expm1(fit_error))


def clears(value: float, base: float, margin: float) -> bool:
    """Whether a modelled ``value`` (tokens per second) beats ``base`` by more than ``margin`` (a fraction)."""
    return value > base * (1.0 + margin)


def recommend(priced: Sequence[Priced], engine: str, margin: float) -> Advice:
    """The fastest candidate, or EPLB off when the fastest beats it by ``margin`` (a fraction) or less; where the
    engine cannot run EPLB off (``reference_only``), the fastest candidate it runs, whatever the margin."""
    if not (math.isfinite(margin) and margin >= 0):
        raise InputError(f"the margin ({margin}) must be a finite fraction >= 0, like 0.05")
    offs = [p for p in priced if p.candidate.off]
    if not offs:
        raise InputError("the candidates hold no EPLB-off configuration to compare with")
    off = offs[0]
    order = sorted(range(len(priced)), key=lambda i: (-priced[i].tokens_per_s, i))  # ties: the simpler, listed first
    runs = [i for i in order if priced[i].candidate.reference_only is None]
    if not runs:
        raise InputError(f"{engine} can run none of the configurations: {off.candidate.reference_only}; give a GPU "
                         "count it runs")
    best = priced[runs[0]]
    if off.candidate.reference_only is not None:  # EPLB off cannot run: the fastest configuration that does
        chosen = best
    else:
        chosen = best if clears(best.tokens_per_s, off.tokens_per_s, margin) else off
    return Advice(engine, tuple(priced[i] for i in order), off, chosen, margin)
