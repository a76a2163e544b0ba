"""Replay a trace batch by batch as a server would (``moebalance online``; docs/design.md, "Online replay and
prediction").

Legend: ``B`` batches, ``L`` layers, ``E`` experts, ``G`` GPUs, ``N`` extra experts per GPU and layer.

- A **static** policy plans once on the warm-up batches and serves every later batch with that plan; with
  ``replan_every = K`` (and ``window = W``) it plans again before every ``K``-th served batch on the ``W``
  batches just served (vLLM's EPLB ``step_interval`` and ``window_size``). Copies a new plan adds on a GPU
  count as experts moved.
- A **dynamic** policy (``libra``) plans its base on the warm-up batches once, then every served batch from its
  predictor: the prefetcher adds up to ``N`` experts per GPU and layer (:func:`moebalance.policies.libra.batch_plan`),
  all of which are loaded for that batch (experts moved). Layers the predictor cannot see (layer 0 for
  ``lookahead`` and ``path``; the first batch for ``history``) are planned from the previous batch's picks.
  On a load of counts only (no token sources), ``exact`` (alias ``oracle``) and ``history`` spread each expert's picks evenly
  over the GPUs, so every GPU seems to request every picked expert; phase 1 of the prefetcher then has
  little to go on.

Each served batch is scored with the router (``uniform`` for static policies and ``rebalance`` for ``libra``
unless one is given): per ``(batch, layer)`` the imbalance ratio ``max_g / mean_g`` of GPU load and the
balancedness ``mean_g / max_g`` (docs/design.md, "Metrics"); a batch's imbalance ratio is its mean over layers.

With ``pricing`` every served batch is also priced as a forward step, with what re-plans and prefetches expose
(:mod:`moebalance.pricing.step`): a re-plan's new plan then serves as its moves land (``sync``, ``async``, in
chunks of layers), not at once.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moebalance.algorithms.migration import align, lay_onto
from moebalance.algorithms.prefetch import prefetch_layers
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.core.tally import release
from moebalance.online.failure import (
    Failures,
    check_capacity,
    check_failures,
    failure_report,
    plan_on_survivors,
    recovery_cost,
    survivor_load,
)
from moebalance.online.rearrange import Rearranger, Replanning, time_summary
from moebalance.policies import DYNAMIC_POLICIES, POLICIES, make_plan
from moebalance.policies.libra import LibraConfig, batch_plan, buffer_slots
from moebalance.prediction.predictors import (
    AccuracyTally,
    HistoryPredictor,
    Predictor,
    PredictorInputs,
    make_predictor,
)
from moebalance.pricing.layer import price_layers
from moebalance.pricing.step import (
    RouterTimer,
    StepPricing,
    exposed_prefetch,
    exposed_router,
    local_seconds,
    step_time,
)
from moebalance.routing import Router, get_router
from moebalance.routing.simulate import check_compatible, layer_metrics, replay_loads

__all__ = ["OnlineResult", "moved_copies", "replay", "score_batch"]


@dataclass(frozen=True, slots=True)
class OnlineResult:
    """One policy replayed over the served batches."""

    policy: str
    router: str
    #: ``int64 [B']``: the served batches' ids in the load.
    batches: np.ndarray
    #: ``float64 [B']``: each served batch's imbalance ratio, the mean over its layers with load.
    per_batch_imbalance: np.ndarray
    #: ``float64 [B']``: each served batch's balancedness, the mean over its layers with load.
    per_batch_balancedness: np.ndarray
    #: ``float64 [B']``: expert copies loaded before each served batch (a replan's new copies, or the prefetches).
    per_batch_moved: np.ndarray
    #: Extra expert slots per GPU the policy holds: a static plan's extra replicas / G (over all layers), or the
    #: dynamic base's plus the prefetch buffer's ``2 N``.
    replica_slots_per_gpu: float
    #: Plans made after the first (static policies with ``replan_every``).
    replans: int
    #: ``float64 [L]``: the predictor's accuracy per layer (nan where it predicts nothing), or ``None``.
    per_layer_accuracy: np.ndarray | None
    params: dict[str, Any]
    #: Mean balancedness and imbalance ratio over every served ``(batch, layer)`` with load.
    balancedness: float
    mean_imbalance_ratio: float
    #: The served batches priced in time (:func:`moebalance.pricing.step.time_summary`), with ``pricing`` only.
    time: dict[str, Any] | None = None
    #: One object per ``--fail`` batch (:func:`moebalance.online.failure.failure_report`).
    failures: tuple[dict[str, Any], ...] = ()

    @property
    def experts_moved(self) -> float:
        """Expert copies loaded per served batch, on average."""
        return float(self.per_batch_moved.mean()) if self.per_batch_moved.size else 0.0

    @property
    def prediction_accuracy(self) -> float | None:
        a = self.per_layer_accuracy
        if a is None or not np.isfinite(a).any():
            return None
        return float(np.nanmean(a))

    def as_dict(self) -> dict[str, Any]:
        """The ``online --json`` object (docs/design.md, "Online replay and prediction")."""
        out: dict[str, Any] = {
            "policy": self.policy, "router": self.router,
            "balancedness": round(self.balancedness, 6),
            "mean_imbalance_ratio": round(self.mean_imbalance_ratio, 6),
            "max_imbalance_ratio": round(float(np.max(self.per_batch_imbalance)), 6),
            "per_batch_imbalance_ratio": [round(float(v), 6) for v in self.per_batch_imbalance],
            "experts_moved": round(self.experts_moved, 3),
            "replica_slots_per_gpu": round(self.replica_slots_per_gpu, 3),
            "replans": self.replans,
            "batches": f"{int(self.batches[0])}:{int(self.batches[-1]) + 1}",
            "params": self.params,
        }
        if self.per_layer_accuracy is not None:
            acc = self.prediction_accuracy
            out["prediction_accuracy"] = None if acc is None else round(acc, 6)
            out["per_layer_accuracy"] = [None if not np.isfinite(v) else round(float(v), 6)
                                         for v in self.per_layer_accuracy]
        if self.time is not None:
            out["time"] = self.time
        if self.failures:
            out["failures"] = list(self.failures)
        return out


def moved_copies(old: Placement, new: Placement) -> int:
    """Expert copies ``new`` holds that ``old`` does not, per (layer, GPU): what switching must load."""
    return int(np.maximum(new.copies - old.copies, 0).sum())


@dataclass
class _Clock:
    """The served batches' step seconds, what balancing exposed, and their tokens, filled batch by batch."""

    pricing: StepPricing | None
    served: int
    step: np.ndarray = dataclasses.field(init=False)
    exposed: np.ndarray = dataclasses.field(init=False)
    #: The router's share of ``exposed``.
    router: np.ndarray = dataclasses.field(init=False)
    #: Each batch's mean MoE layer (:attr:`moebalance.pricing.step.StepTime.moe_layer_seconds`).
    moe: np.ndarray = dataclasses.field(init=False)
    tokens: np.ndarray = dataclasses.field(init=False)
    #: Bytes moved besides a dynamic policy's prefetches (its base re-planned after a failure).
    moved_bytes: float = 0.0

    def __post_init__(self) -> None:
        self.step, self.exposed, self.tokens = np.zeros(self.served), np.zeros(self.served), np.zeros(self.served)
        self.router, self.moe = np.zeros(self.served), np.zeros(self.served)

    def summary(self, moved_bytes: float, rearrangements: int) -> dict[str, Any] | None:
        if self.pricing is None:
            return None
        return time_summary(self.step, self.exposed, self.tokens, moved_bytes, rearrangements, self.router, self.moe)


def score_batch(plan: Placement, load: LoadMatrix, router: Router, seed: int, batch: int,
           pricing: StepPricing | None = None, lost: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray, Any]:
    """``(imbalance [L], balancedness [L], step or None)`` of one batch ``load`` (a single-batch load); with
    ``pricing`` also its :class:`~moebalance.pricing.step.StepTime` (the same routed picks). ``lost`` GPUs serve
    nothing: their tokens go to the survivors and balance is over the survivors
    (:mod:`moebalance.online.failure`)."""
    try:
        return _score_batch(plan, load, router, seed, batch, pricing, lost)
    finally:  # a memory-mapped trace's pages of the batch go back once it is scored
        release(None if load.trace is None else load.trace.topk_ids)


def _score_batch(plan: Placement, load: LoadMatrix, router: Router, seed: int, batch: int,
                 pricing: StepPricing | None, lost: Sequence[int]) -> tuple[np.ndarray, np.ndarray, Any]:
    G = plan.num_gpus
    load = survivor_load(load, lost, G, renumber=False)
    rng = np.random.default_rng((seed, batch))
    alive = np.setdiff1d(np.arange(G), np.asarray(lost, dtype=np.int64))
    if pricing is None:
        loads, _, _ = replay_loads(plan, load, router, rng)
        m = layer_metrics(loads[:, :, alive] if lost else loads, load.counts, plan.replica_counts())
        return m.imbalance[0], m.balancedness[0], None
    dep = pricing.deployment
    decides = router.assign_kept is not None  # a load-dependent router decides on the host after the gate
    timer = RouterTimer(router) if decides and pricing.router_ms is None else None
    priced = price_layers(plan, load, router if timer is None else timer.router, dep, rng, pricing.phase)
    loads = priced.loads
    m = layer_metrics(loads[:, :, alive] if lost else loads, load.counts, plan.replica_counts())
    trace = load.trace
    tokens = float(trace.topk_ids.shape[0] if trace is not None else load.counts[0].sum(axis=1).max() / dep.model.top_k)
    st = step_time(plan, priced, tokens, pricing, lost=len(lost))
    hidden_router = 0.0
    if decides and st.expert_gpu is not None:
        busy = max(int((load.counts[0].sum(axis=1) > 0).sum()), 1)
        per_layer = timer.seconds / busy if timer is not None else (pricing.router_ms or 0.0) * 1e-3
        hidden_router = exposed_router(per_layer, st.expert_gpu, local_seconds(plan, load, dep))
    return m.imbalance[0], m.balancedness[0], (st, tokens, hidden_router)


def replay(load: LoadMatrix, cluster: Cluster, budget: Budget, policy: str | Placement,
           params: Mapping[str, Any] | None = None, *, warmup: tuple[int, int], batches: tuple[int, int] | None = None,
           router: str | Router | None = None, seed: int = 0, replanning: Replanning | None = None,
           inputs: PredictorInputs | None = None, failures: Failures | None = None,
           pricing: StepPricing | None = None, progress: Callable[[int], None] | None = None) -> OnlineResult:
    """Replay ``load``'s batches ``batches`` (default: all after the warm-up) through ``policy``: a policy's name,
    or a plan that serves unchanged (one no registered policy makes, such as CRAFT padded to equal slots).

    ``replanning`` says when a static policy plans again and how its moves land
    (:class:`~moebalance.online.rearrange.Replanning`); ``inputs`` what the predictor of a dynamic policy may need
    (:class:`~moebalance.prediction.predictors.PredictorInputs`); ``failures`` the GPUs lost while serving
    (:class:`~moebalance.online.failure.Failures`). ``pricing`` prices every served batch in time (the result's
    ``time``). ``progress(1)`` is called after each served batch. ``None``: plan once, no predictor inputs, no
    failures.
    """
    replanning = Replanning() if replanning is None else replanning
    inputs = PredictorInputs() if inputs is None else inputs
    failures = Failures() if failures is None else failures
    params = dict(params or {})
    B = load.num_batches
    a, b = warmup
    if not 0 <= a < b <= B:
        raise InputError(f"warm-up batches {a}:{b} must be a non-empty range within the load's {B} batches")
    c, d = (b, B) if batches is None else batches
    if not b <= c < d <= B:
        raise InputError(f"served batches {c}:{d} must be a non-empty range after the warm-up ({a}:{b}) and "
                         f"within the load's {B} batches; give a later --batches or a shorter --warmup")
    if load.trace is not None:
        load.trace.check_gpus(cluster.num_gpus)
    fixed = policy if isinstance(policy, Placement) else None
    name = policy.policy if isinstance(policy, Placement) else policy
    if fixed is not None:
        if replanning.periodic or failures.events:
            raise InputError("a given plan serves unchanged: re-planning (replan_every, failures) needs a policy's "
                             "name to plan again")
        check_compatible(fixed, load)
        if fixed.num_gpus != cluster.num_gpus:
            raise InputError(f"the given plan is for {fixed.num_gpus} GPUs but the cluster has {cluster.num_gpus}")
    dynamic = None if fixed is not None else DYNAMIC_POLICIES.get(name)
    if dynamic is None and fixed is None and name not in POLICIES:
        names = [*POLICIES, *DYNAMIC_POLICIES]
        raise InputError(f"unknown policy {name!r}; choose one of: {', '.join(names)}")
    if dynamic is not None and replanning.periodic:
        raise InputError(f"{name} replans every batch from its predictor; --replan-every and --window apply to "
                         "static policies")
    if pricing is not None:
        pricing.deployment.check_load(load)
    if replanning.migration != "fresh" and (dynamic is not None or not replanning.periodic):
        raise InputError(f"migration {replanning.migration} lays periodic re-plans onto the plan in service; it needs "
                         "a static policy with --replan-every K")
    how = _Moves(replanning, check_failures(failures.events, cluster.num_gpus, (c, d)), failures.reload_gbps)
    warm = load.select_batches(a, b)
    clock = _Clock(pricing, d - c)
    if dynamic is None:
        return _replay_static(load, warm, cluster, budget, name, params, (c, d), get_router(router or "uniform"),
                              seed, progress, clock, how, fixed)
    config = LibraConfig.from_params(name, params)
    if not isinstance(config, LibraConfig):  # from_params builds the policy's own config
        raise RuntimeError(f"{name}'s options are not a LibraConfig")
    build = inputs.build if inputs.build is not None else warm
    return _replay_dynamic(load, warm, cluster, budget, config, (c, d), get_router(router or "rebalance"), seed,
                           dataclasses.replace(inputs, build=build), progress, clock, how)


@dataclass(frozen=True, slots=True)
class _Moves:
    """How re-plans are made and laid on, and the failures ``{batch: GPUs}``."""

    replanning: Replanning
    fails: dict[int, tuple[int, ...]]
    reload_gbps: float

    def check_capacity(self, plan: Placement) -> None:
        """Refuse failures after which the survivors cannot hold every expert in ``plan``'s slots per GPU."""
        lost: set[int] = set()
        for bt, gpus in self.fails.items():
            lost.update(gpus)
            check_capacity(plan.max_slots_per_gpu, plan.num_gpus - len(lost), plan.num_experts,
                           f"--fail {','.join(f'{g}@{bt}' for g in gpus)}")

    def recover(self, serving: Placement, new: Placement, lost: tuple[int, ...], pricing: StepPricing | None,
                event: dict[str, Any]) -> tuple[float, int]:
        """``(seconds, bytes)`` of a failure's moves; ``event`` gains the reloaded experts."""
        bpe = pricing.deployment.bytes_per_expert if pricing is not None else 0
        seconds, moved, event["reloaded"] = recovery_cost(serving, new, lost, bpe, self.reload_gbps)
        return seconds, moved


def _replay_static(load: LoadMatrix, warm: LoadMatrix, cluster: Cluster, budget: Budget, policy: str,
                   params: dict[str, Any], served: tuple[int, int], router: Router, seed: int,
                   progress: Callable[[int], None] | None, clock: _Clock, how: _Moves,
                   fixed: Placement | None = None) -> OnlineResult:
    """A static policy's replay; ``fixed``: the plan that serves, instead of ``policy``'s plan on the warm-up."""
    c, d = served
    every, window = how.replanning.every, how.replanning.window_batches
    plan = fixed if fixed is not None else make_plan(policy, warm, cluster, budget, **params)[0]
    how.check_capacity(plan)
    slots = plan.max_slots_per_gpu
    L = load.num_layers
    imb = np.full((d - c, L), np.nan)
    bal = np.full((d - c, L), np.nan)
    moved = np.zeros(d - c)
    replans = 0
    extra = plan.extra_replicas
    moves = Rearranger(plan, how.replanning,
                       None if clock.pricing is None else clock.pricing.deployment.bytes_per_expert)
    lost: tuple[int, ...] = ()
    events: list[dict[str, Any]] = []
    for i, bt in enumerate(range(c, d)):
        periodic = every is not None and i > 0 and i % every == 0
        if window is None and periodic:  # unreachable: replay defaults the window to the interval
            raise InputError("a periodic re-plan needs a window")
        recent = load.select_batches(max(0, bt - window), bt) if window is not None and (
            periodic or bt in how.fails) else warm
        event: dict[str, Any] | None = None
        if bt in how.fails:  # serving stops: the survivors' plan, aligned, with the lost GPUs' only copies reloaded
            lost = tuple(sorted({*lost, *how.fails[bt]}))
            new = align(moves.serving, plan_on_survivors(policy, recent, cluster, lost, slots, params))
            event = {"batch": bt, "gpus": how.fails[bt], "stall_s": None}
            moves.recover(new, *how.recover(moves.serving, new, lost, clock.pricing, event))
            events.append(event)
            replans += 1
        elif periodic:
            fresh = (plan_on_survivors(policy, recent, cluster, lost, slots, params) if lost
                     else make_plan(policy, recent, cluster, budget, **params)[0])
            if how.replanning.migration != "fresh":
                fresh = lay_onto(moves.serving, fresh, how.replanning.migration, max_moves=how.replanning.max_moves,
                                 load=recent)
            moves.replan(fresh)
            replans += 1
        serving, exposed = moves.before_step()
        if event is not None and clock.pricing is not None:
            event["stall_s"] = exposed
        moved[i] = moved_copies(plan, serving)
        plan = serving
        extra = max(extra, plan.extra_replicas)
        imb[i], bal[i], priced = score_batch(plan, load.select_batches(bt, bt + 1), router, seed, bt, clock.pricing,
                                             lost)
        if priced is not None:
            st, clock.tokens[i], clock.router[i] = priced
            clock.moe[i] = st.moe_layer_seconds
            exposed += clock.router[i]
            clock.step[i], clock.exposed[i] = st.seconds + exposed, exposed
            moves.after_step(clock.step[i])
        if progress is not None:
            progress(1)
    params = {**params, **({"replan_every": every, "window": window} if every else {}),
              **({"migration": how.replanning.migration} if how.replanning.migration != "fresh" else {}),
              **({"max_moves": how.replanning.max_moves} if how.replanning.max_moves is not None else {})}
    return _result(policy, router, served, imb, bal, moved, extra / cluster.num_gpus, replans, None, params,
                   clock.summary(moves.moved_bytes, moves.rearrangements), events)


def _replay_dynamic(load: LoadMatrix, warm: LoadMatrix, cluster: Cluster, budget: Budget, config: LibraConfig,
                    served: tuple[int, int], router: Router, seed: int, inputs: PredictorInputs,
                    progress: Callable[[int], None] | None, clock: _Clock, how: _Moves) -> OnlineResult:
    c, d = served
    base = make_plan(config.base, warm, cluster, budget)[0]  # the base policy's defaults, under the budget
    how.check_capacity(base)
    base_slots = base.max_slots_per_gpu
    lost: tuple[int, ...] = ()
    events: list[dict[str, Any]] = []
    whole = load
    trace = load.trace
    G, L = cluster.num_gpus, load.num_layers
    predictor: Predictor | None = None
    if trace is None:
        if not (config.exact or config.predictor == "history"):
            raise InputError(f"the {config.predictor} predictor needs a token-level trace (topk_ids, src_gpu); this "
                             "load has counts only: use --set predictor=history or predictor=exact")
    else:
        build = inputs.build.trace if inputs.build is not None else None
        if build is None and config.predictor == "path":
            raise InputError("the path predictor needs a token-level build split")
        predictor = make_predictor(config.predictor, build=[build] if build is not None else [], hidden=inputs.hidden,
                                   model=inputs.model, depth=config.depth, window=config.window, progress=inputs.progress)
    fallback = HistoryPredictor(1)
    imb = np.full((d - c, L), np.nan)
    bal = np.full((d - c, L), np.nan)
    moved = np.zeros(d - c)
    tally = AccuracyTally(L)
    last = 0.0  # the previous step's last expert phase, which hides layer 0's prefetch
    for i, bt in enumerate(range(c, d)):
        stall = 0.0
        if bt in how.fails:  # the base re-planned on the survivors, aligned; the lost tokens go to the survivors
            lost = tuple(sorted({*lost, *how.fails[bt]}))
            new = align(base, plan_on_survivors(config.base, warm, cluster, lost, base_slots, {}))
            event: dict[str, Any] = {"batch": bt, "gpus": how.fails[bt], "stall_s": None}
            seconds, nbytes = how.recover(base, new, lost, clock.pricing, event)
            if clock.pricing is not None:
                stall = event["stall_s"] = seconds + how.replanning.overhead_ms * 1e-3
                clock.moved_bytes += nbytes
            events.append(event)
            base = new
            load = survivor_load(whole, lost, G, renumber=False)
            trace = load.trace
        if trace is not None and predictor is not None:
            pred = predictor.predict(trace, bt, G)
            demand = pred.demand
            if not pred.layers.all():
                prev = fallback.predict(trace, bt, G)
                demand = np.where(pred.layers[:, None, None], demand, prev.demand)
            lo, hi = (int(x) for x in np.searchsorted(trace.batch, [bt, bt + 1], side="left"))
            tally.add(pred, trace.topk_ids[lo:hi])
        elif config.exact:
            demand = np.repeat(load.counts[bt][:, None, :] / G, G, axis=1).astype(float)
        else:
            got = HistoryPredictor(config.window).predict_counts(load.counts, bt, G)
            demand = np.zeros((L, G, load.num_experts)) if got is None else got
        if lost:  # the lost GPUs ask for nothing and take no extras
            demand = _spread(demand, lost, trace is None)
        plan, extras = batch_plan(base, demand, config) if not lost else _survivors_batch_plan(base, demand, config,
                                                                                                   lost)
        moved[i] = int((extras >= 0).sum())
        imb[i], bal[i], priced = score_batch(plan, load.select_batches(bt, bt + 1), router, seed, bt, clock.pricing,
                                             lost)
        if priced is not None and clock.pricing is not None:
            st, clock.tokens[i], clock.router[i] = priced
            clock.moe[i] = st.moe_layer_seconds
            dep = clock.pricing.deployment
            copy = exposed_prefetch((extras >= 0).sum(axis=2), st.expert, last, dep.model,
                                    cluster.intra_node_bandwidth, oracle=config.exact,
                                    weight_bytes=dep.engine.expert_bytes_per_weight)
            clock.exposed[i] = clock.router[i] + copy
            clock.exposed[i] += stall
            clock.step[i] = st.seconds + clock.exposed[i]
            last = float(st.expert[st.expert > 0][-1]) if (st.expert > 0).any() else last
        if progress is not None:
            progress(1)
    per_layer_acc = tally.per_layer()
    slots = base.extra_replicas / G + buffer_slots(config)
    params = {**dataclasses.asdict(config), "phase1": config.phase1, "buffer_slots_per_gpu": buffer_slots(config),
              "base_extra_replicas": base.extra_replicas}
    # without tokens there is no per-token accuracy: nan per layer (null in JSON), the predictor still named
    bpe = clock.pricing.deployment.bytes_per_expert if clock.pricing is not None else 0
    return _result("libra", router, served, imb, bal, moved, slots, len(events),
                   per_layer_acc if trace is not None else np.full(L, np.nan), params,
                   clock.summary(float(moved.sum()) * bpe + clock.moved_bytes, int((moved > 0).sum()) + len(events)),
                   events)


def _spread(demand: np.ndarray, lost: Sequence[int], counts_only: bool) -> np.ndarray:
    """``demand [L, G, E]`` with nothing on the ``lost`` GPUs; for counts (every GPU's share alike) their share
    spread over the survivors."""
    out = np.array(demand, dtype=np.float64)
    G = out.shape[1]
    alive = np.setdiff1d(np.arange(G), np.asarray(lost, dtype=np.int64))
    if counts_only:
        out[:, alive, :] = out.sum(axis=1, keepdims=True) / alive.size
    out[:, list(lost), :] = 0.0
    return out


def _survivors_batch_plan(base: Placement, demand: np.ndarray, config: LibraConfig,
                          lost: Sequence[int]) -> tuple[Placement, np.ndarray]:
    """:func:`~moebalance.policies.libra.batch_plan` on the survivors alone: the prefetcher never sees the ``lost``
    GPUs (idle, they would draw phase 2's copies, which then go nowhere); ``extras [L, G, N]`` is ``-1`` there."""
    G = base.num_gpus
    alive = np.setdiff1d(np.arange(G), np.asarray(lost, dtype=np.int64))
    hosted = base.copies.transpose(0, 2, 1) > 0  # [L, G, E]
    extras = np.full((base.num_layers, G, config.n), -1, dtype=np.int64)
    extras[:, alive] = prefetch_layers(demand[:, alive], hosted[:, alive], config.n, config.alpha)
    rows = [[list(base.gpu_experts[li][g]) + [int(e) for e in extras[li, g] if e >= 0] for g in range(G)]
            for li in range(base.num_layers)]
    plan = Placement(rows, base.num_experts, base.cluster, policy="libra",
                     params={"base": base.policy, "n": config.n, "alpha": config.alpha})
    return plan, extras


def _result(policy: str, router: Router, served: tuple[int, int], imb: np.ndarray, bal: np.ndarray, moved: np.ndarray,
            slots: float, replans: int, acc: np.ndarray | None, params: dict[str, Any],
            time: dict[str, Any] | None = None, events: Sequence[dict[str, Any]] = ()) -> OnlineResult:
    if not np.isfinite(imb).any():
        raise InputError("the served batches carry no load in any layer; there is nothing to score")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a batch whose layers all had no load: nan
        per_imb = np.nanmean(imb, axis=1)
        per_bal = np.nanmean(bal, axis=1)
    return OnlineResult(policy=policy, router=router.label, batches=np.arange(*served), per_batch_imbalance=per_imb,
                        per_batch_balancedness=per_bal, per_batch_moved=moved, replica_slots_per_gpu=float(slots),
                        replans=replans, per_layer_accuracy=acc, params=params,
                        balancedness=float(np.nanmean(bal)), mean_imbalance_ratio=float(np.nanmean(imb)), time=time,
                        failures=tuple(failure_report(events, per_imb, per_bal, served[0])))

