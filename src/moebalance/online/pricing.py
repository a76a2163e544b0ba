"""Served batches priced in time: each a forward step, with what balancing exposes (``moebalance online --gpu``;
docs/design.md, "Online replay and prediction" and "Cost model").

Legend: ``L`` MoE layers, ``G`` GPUs, ``C`` layers moved per step.

**A step.** Each served batch is one forward step of its tokens::

    step = sum_l (max_g t_expert[l, g] + a2a[l]) + rest + exposed

with the grouped GEMM's roofline :func:`moebalance.cost.time.expert_seconds` on each GPU's picks and the experts
they touch (hosted experts with load in the batch), the all-to-all of the replay's copies
(:func:`moebalance.routing.simulate.a2a_seconds` for a token-level load, :func:`moebalance.cost.goodput.a2a_estimate`
for counts), and the rest of the model (:func:`moebalance.cost.time.rest_seconds`) on each data-parallel rank's
share of the batch, read as a prefill: one next-token logit per prompt of ``prompt_tokens``, no KV cache read.

**A re-plan** (static policies with ``replan_every``) moves the experts each GPU must receive by a transfer schedule
(:func:`moebalance.cost.transfer.schedule_transfers`), layers in chunks of ``C`` (all at once by default), chunk
``k`` in the ``k``-th step after the re-plan; a layer serves the new plan from the step its chunk lands in.

- ``sync``: serving stops for each chunk's transfer; the first chunk also pays the host's fixed overhead (planning,
  metadata, synchronisation). A re-plan that moves nothing exposes nothing.
- ``async``: serving goes on with the old plan while the chunks move one after another in the background; a chunk's
  layers switch at the first step that starts after the steps served since the re-plan add up to the chunk's
  finish time (with one chunk: ``ceil(transfer / step)`` steps later). Nothing is exposed; the host's overhead is
  taken to run beside serving, and the transfer's share of the links beside the all-to-all's is not modelled.

A re-plan that arrives while an earlier one is still moving abandons the rest of it: the new moves start from what
the GPUs hold.

**Per-batch balancing** (``libra``): the extras of layer ``l`` are copied over the intra-node link during layer
``l - 1``'s expert phase (Libra's double buffer, Section 3.3): a GPU's copy of ``n`` experts takes
:func:`moebalance.cost.time.prefetch_seconds`, and the layer exposes ``max(0, max_g copy[l, g] - max_g
t_expert[l - 1, g])`` (the all-to-all shares the links, so it hides nothing). Layer 0's copies hide under the
previous step's last layer (nothing before the first served step). With the batch's true routing (the ``oracle``
predictor) the copies cannot start before the gate: every layer's copy is exposed in full.

**Router time.** A router whose choice depends on the batch's load (``rebalance``, ``minmax``: those that decide on
the host after the gate) costs its CPU time, measured on the replay's own routing of the batch (after one untimed
warm-up call, so compilation is not charged) and taken per MoE layer with load, or fixed with
``StepPricing.router_ms``. It runs beside each GPU's local phase (Libra's two-stage execution, Section 3: the picks
whose expert the token's own GPU holds are computed first, the rest wait for the router's decision), so a layer
exposes ``max_g(max(local[g], r) + remote[g]) - max_g(local[g] + remote[g])``, with ``local[g]`` the roofline of
GPU ``g``'s local picks and ``remote[g]`` the rest of its expert time. A router that ignores loads (``uniform``,
``random``) picks copies on the GPU as tokens are dispatched and exposes nothing.

The ``time`` summary counts as ``rearrangements`` the re-plans that moved experts (static policies) or the served
batches whose prefetch loaded any (``libra``), and as ``moved_gib`` the expert weights received over all GPUs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.cost.goodput import a2a_estimate
from moebalance.cost.hardware import GpuSpec
from moebalance.cost.memory import GIB, EngineMemory
from moebalance.cost.time import Calibration, expert_seconds, prefetch_seconds, rest_seconds
from moebalance.models import ModelSpec
from moebalance.routing.base import Router
from moebalance.routing.touched import hosted_touched

__all__ = ["DEFAULT_OVERHEAD_MS", "REARRANGE_MODES", "Rearranger", "RouterTimer", "StepPricing", "StepTime",
           "exposed_prefetch", "exposed_router", "hybrid", "local_seconds", "step_time", "time_summary"]

#: The host's fixed cost of one synchronous rearrangement, ms: SGLang's measured host time per rearrangement
#: (docs/design.md, "Online replay and prediction", gives the source and the numbers); the transfer is modelled on
#: its own, so only the host's time is charged here.
DEFAULT_OVERHEAD_MS = 1000.0
REARRANGE_MODES = ("sync", "async")


@dataclass(kw_only=True, frozen=True, slots=True)
class StepPricing:
    """What prices a served batch: the model, the GPU, the engine's bytes, and how re-plans move experts."""

    model: ModelSpec
    gpu: GpuSpec
    engine: EngineMemory = field(default_factory=EngineMemory)
    calibration: Calibration = field(default_factory=Calibration)
    #: ``sync`` or ``async`` (module docstring).
    rearrange: str = "sync"
    #: Host time a synchronous rearrangement exposes besides its transfer, ms.
    overhead_ms: float = DEFAULT_OVERHEAD_MS
    #: Layers a re-plan moves per step (``None``: all at once).
    layers_per_step: int | None = None
    #: Time a token-level load's all-to-all with one network copy per destination node.
    node_forwarding: bool = False
    #: Tokens per prompt: a step computes one next-token logit per prompt.
    prompt_tokens: int = 1000
    #: A load-dependent router's CPU time per MoE layer, ms (``None``: measured on the replay's routing).
    router_ms: float | None = None
    #: ``prefill`` (one logit per prompt, no KV cache read) or ``decode`` (a logit per token and each request's
    #: KV cache of ``prompt_tokens + output_tokens / 2`` tokens read).
    phase: str = "prefill"
    #: Tokens per answer (decode's mean context counts half of them).
    output_tokens: int = 0

    def __post_init__(self) -> None:
        if self.rearrange not in REARRANGE_MODES:
            raise InputError(f"rearrange mode {self.rearrange!r} is unknown; choose one of: {', '.join(REARRANGE_MODES)}")
        if not (math.isfinite(self.overhead_ms) and self.overhead_ms >= 0):
            raise InputError(f"the rearrangement overhead ({self.overhead_ms} ms) must be a finite number >= 0")
        if self.layers_per_step is not None and (isinstance(self.layers_per_step, bool) or self.layers_per_step < 1):
            raise InputError(f"layers per step ({self.layers_per_step!r}) must be a positive number of layers")
        if isinstance(self.prompt_tokens, bool) or self.prompt_tokens < 1:
            raise InputError(f"prompt tokens ({self.prompt_tokens!r}) must be a positive number")
        if self.phase not in ("prefill", "decode"):
            raise InputError(f"phase {self.phase!r} is unknown; choose one of: decode, prefill")
        if isinstance(self.output_tokens, bool) or self.output_tokens < 0:
            raise InputError(f"output tokens ({self.output_tokens!r}) must be a number >= 0")
        if self.router_ms is not None and not (math.isfinite(self.router_ms) and self.router_ms >= 0):
            raise InputError(f"the router time ({self.router_ms} ms per layer) must be a finite number >= 0")

    @property
    def bytes_per_expert(self) -> int:
        """One routed expert's weights: ``3 H F w``."""
        return self.model.expert_params() * self.engine.weight_bytes

    @property
    def bytes_per_copy(self) -> int:
        """One dispatched token copy: ``H a``."""
        return self.model.hidden_size * self.engine.weight_bytes

    def check(self, load: LoadMatrix) -> None:
        """Refuse a load of another model's shape (its MoE layers, or those with the dense ones)."""
        m = self.model
        if m.num_experts != load.num_experts or load.num_layers not in (m.num_layers, m.num_layers + m.num_dense_layers):
            raise InputError(f"{m.display_name} has {m.num_layers} MoE layers ({m.num_layers + m.num_dense_layers} with "
                             f"its dense ones) x {m.num_experts} experts but the load {load.num_layers} x "
                             f"{load.num_experts}; give the load's --model")


@dataclass(frozen=True, slots=True)
class StepTime:
    """One served batch's modelled step, seconds."""

    #: ``float64 [L]``: the slowest GPU's grouped GEMM per layer.
    expert: np.ndarray
    #: ``float64 [L]``: the all-to-all per layer (dispatch and combine).
    a2a: np.ndarray
    rest: float
    #: ``float64 [L, G]``: each GPU's grouped GEMM per layer.
    expert_gpu: np.ndarray | None = None

    @property
    def seconds(self) -> float:
        """The step without what balancing exposes."""
        return float(self.expert.sum() + self.a2a.sum()) + self.rest

    @property
    def moe_layer_seconds(self) -> float:
        """The mean MoE layer over the layers with load (0 without any)."""
        busy = self.expert > 0
        return float((self.expert + self.a2a)[busy].mean()) if busy.any() else 0.0


def step_time(plan: Placement, batch: LoadMatrix, loads: np.ndarray, a2a: np.ndarray | None, tokens: float,
              pricing: StepPricing, *, lost: int = 0, touched: np.ndarray | None = None) -> StepTime:
    """The step of one served batch (a one-batch ``batch``) through ``plan``: ``loads [1, L, G]`` the router's
    picks per GPU, ``a2a [1, L]`` the token-level replay's all-to-all seconds (``None`` for counts: estimated),
    ``touched [1, L, G]`` the experts each GPU's picks read (``None``: every hosted copy of an expert with load);
    ``lost`` failed GPUs leave their data-parallel share to the survivors' ranks. In ``decode`` the rest of the
    step computes a logit per token and reads each request's KV cache."""
    cluster = plan.cluster
    touched = hosted_touched(plan, batch.counts)[0] if touched is None else \
        np.asarray(touched, dtype=np.float64).reshape(loads.shape[1:])
    engine = pricing.engine
    per_gpu = np.asarray(expert_seconds(loads[0], touched, pricing.model, pricing.gpu, pricing.calibration,
                                        weight_bytes=engine.weight_bytes), dtype=np.float64)
    expert = per_gpu.max(axis=1)
    comm = a2a[0] if a2a is not None else a2a_estimate(loads[0], cluster, pricing.bytes_per_copy)
    ranks = (cluster.num_gpus - lost) // engine.attention_group(cluster.gpus_per_node)
    per_rank = tokens / max(ranks, 1)
    if pricing.phase == "decode":  # one token of each running request: its logit, and its context's KV cache
        context = pricing.prompt_tokens + pricing.output_tokens / 2
        rest = rest_seconds(per_rank, pricing.model, pricing.gpu, engine, cluster.gpus_per_node,
                            kv_tokens_per_rank=per_rank * context, calibration=pricing.calibration)
    else:
        rest = rest_seconds(per_rank, pricing.model, pricing.gpu, engine, cluster.gpus_per_node,
                            logits_per_rank=per_rank / pricing.prompt_tokens, calibration=pricing.calibration)
    return StepTime(expert=np.asarray(expert, dtype=np.float64), a2a=np.asarray(comm, dtype=np.float64), rest=rest,
                    expert_gpu=per_gpu)


def local_seconds(plan: Placement, batch: LoadMatrix, pricing: StepPricing) -> np.ndarray:
    """``float64 [L, G]``: the roofline of each GPU's local picks in a one-batch ``batch`` (picks whose expert the
    token's own GPU holds; for counts, each GPU's even share of every expert it holds)."""
    has = plan.copies > 0  # [L, E, G]
    L, E, G = has.shape
    trace = batch.trace
    if trace is not None:  # layer by layer: [T, K] at a time, not [T, L, K]
        src = trace.src_gpu[:, None]
        picks, touched = np.zeros((L, G)), np.zeros((L, G))
        for li in range(L):
            ids = trace.topk_ids[:, li, :]
            local = has[li, ids, src]
            hits = np.bincount((src * E + ids)[local], minlength=G * E).reshape(G, E)
            picks[li], touched[li] = hits.sum(axis=1), (hits > 0).sum(axis=1)
    else:
        share = batch.counts[0].astype(np.float64) / G  # [L, E]: each GPU's even share
        picks = np.einsum("le,leg->lg", share, has.astype(np.float64))
        touched = np.einsum("le,leg->lg", (share > 0).astype(np.float64), has.astype(np.float64))
    return np.asarray(expert_seconds(picks, touched, pricing.model, pricing.gpu, pricing.calibration,
                                     weight_bytes=pricing.engine.weight_bytes), dtype=np.float64)


def exposed_router(router_s: float, expert: np.ndarray, local: np.ndarray) -> float:
    """Seconds a router's ``router_s`` per layer exposes beside the local phase, summed over the layers with load:
    ``expert, local [L, G]`` each GPU's expert time and its local picks' share (module docstring)."""
    local = np.minimum(local, expert)
    remote = expert - local
    busy = expert.max(axis=1) > 0
    after = (np.maximum(local, router_s) + remote).max(axis=1)
    before = expert.max(axis=1)
    return float(np.where(busy, after - before, 0.0).sum())


class RouterTimer:
    """``router`` with its host time measured: :attr:`router` calls the same functions and adds their seconds to
    :attr:`seconds`. The first call of each of a router's functions in a process runs once untimed first (numba
    compiles then)."""

    _warm: ClassVar[set[str]] = set()

    def __init__(self, router: Router) -> None:
        self.seconds = 0.0
        timed: dict[str, Any] = {}
        for name in ("split_counts", "assign_tokens", "assign_kept", "split_touched"):  # the last two optional
            fn = getattr(router, name, None)
            if fn is not None:  # each function warms up on its own: each compiles its own kernels
                timed[name] = self._timed(f"{router.name}.{name}", fn)
        self.router = dataclasses.replace(router, **timed)

    def _timed(self, name: str, fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        def call(*args: Any) -> np.ndarray:
            if name not in RouterTimer._warm:  # compile outside the clock, on a throw-away generator
                fn(*args[:-1], np.random.default_rng(0))
                RouterTimer._warm.add(name)
            t0 = time.perf_counter()
            out = fn(*args)
            self.seconds += time.perf_counter() - t0
            return out
        return call


def exposed_prefetch(copies: np.ndarray, expert: np.ndarray, previous_last: float, model: ModelSpec,
                     bandwidth: float, *, oracle: bool, weight_bytes: int = 2) -> float:
    """Seconds a step's prefetch exposes: ``copies [L, G]`` experts each GPU loads per layer over ``bandwidth`` GB/s,
    hidden under the expert phase ``expert [L]`` of the last layer with load before it (``previous_last``, the
    previous step's last, before the first) where it fits; all of it with ``oracle`` (module docstring)."""
    copy = prefetch_seconds(copies, model, bandwidth, weight_bytes=weight_bytes).max(axis=1)  # [L]
    if oracle:
        return float(copy.sum())
    L = expert.shape[0]
    last = np.maximum.accumulate(np.where(expert > 0, np.arange(L), -1))  # the last layer with load up to l
    before = np.concatenate([[-1], last[:-1]])
    window = np.where(before >= 0, expert[np.maximum(before, 0)], previous_last)
    return float(np.maximum(copy - window, 0.0).sum())


def hybrid(old: Placement, new: Placement, layers: Sequence[int]) -> Placement:
    """``old`` with ``layers`` taken from ``new`` (a re-plan's chunks landed so far)."""
    take = set(layers)
    lists = [new.gpu_experts[li] if li in take else old.gpu_experts[li] for li in range(old.num_layers)]
    weights = None
    if old.weights is not None and new.weights is not None:
        weights = [new.weights[li] if li in take else old.weights[li] for li in range(old.num_layers)]
    return Placement(gpu_experts=lists, num_experts=old.num_experts, cluster=old.cluster, policy=new.policy,
                     params=new.params, weights=weights)


@dataclass
class _Move:
    """A re-plan in flight: the target plan, its chunks' layers and seconds, the chunks landed."""

    target: Placement
    chunks: list[list[int]]
    seconds: list[float]
    bytes: list[int]
    landed: int = 0
    elapsed: float = 0.0


class Rearranger:
    """Which plan serves each step while re-plans move experts, and what that exposes (module docstring).

    Per served step: :meth:`replan` when a new plan is made, then :meth:`before_step` (the serving plan and the
    seconds exposed before the step), then :meth:`after_step` with the step's seconds. Without ``pricing`` a new plan
    serves at once and exposes nothing (the replay's imbalance-only mode).
    """

    def __init__(self, plan: Placement, pricing: StepPricing | None) -> None:
        self.serving = plan
        self.pricing = pricing
        self.rearrangements = 0
        self.moved_bytes = 0
        self._move: _Move | None = None
        self._pending = 0.0

    def recover(self, new: Placement, seconds: float = 0.0, moved_bytes: int = 0) -> None:
        """GPUs were lost: ``new`` serves the next step, which waits ``seconds`` (the moves and reloads,
        :func:`moebalance.online.failure.recovery_cost`) and the host's overhead; a re-plan in flight is abandoned."""
        self.serving, self._move = new, None
        if self.pricing is not None:
            self._pending = seconds + self.pricing.overhead_ms * 1e-3
            self.moved_bytes += moved_bytes
            self.rearrangements += 1

    def replan(self, new: Placement) -> None:
        p = self.pricing
        if p is None:
            self.serving, self._move = new, None
            return
        from moebalance.cost.transfer import schedule_transfers

        L = new.num_layers
        C = p.layers_per_step or L
        chunks = [list(range(lo, min(lo + C, L))) for lo in range(0, L, C)]
        plans = [schedule_transfers(self.serving, new, p.bytes_per_expert, new.cluster, layers=c) for c in chunks]
        if sum(s.moved_experts for s in plans) == 0:  # nothing to move: the new plan serves at once, for free
            self.serving, self._move = new, None
            return
        self._move = _Move(new, chunks, [s.seconds for s in plans], [s.moved_bytes for s in plans])

    def before_step(self) -> tuple[Placement, float]:
        """``(plan serving the next step, seconds exposed before it)``."""
        m = self._move
        if self._pending:
            pending, self._pending = self._pending, 0.0
            return self.serving, pending
        if m is None or self.pricing is None:
            return self.serving, 0.0
        exposed, before = 0.0, m.landed
        if self.pricing.rearrange == "sync":  # this step's chunk moves while serving waits
            exposed = m.seconds[before] + (self.pricing.overhead_ms * 1e-3 if before == 0 else 0.0)
            m.landed += 1
        else:  # the chunks that finished during the steps served since the re-plan
            finish = np.cumsum(m.seconds)
            while m.landed < len(m.chunks) and finish[m.landed] <= m.elapsed * (1 + 1e-12):
                m.landed += 1
        self.moved_bytes += sum(m.bytes[before:m.landed])
        if before == 0 and m.landed > 0:  # a rearrangement counts once its first chunk lands (not if abandoned)
            self.rearrangements += 1
        landed = [li for c in m.chunks[:m.landed] for li in c]
        if m.landed == len(m.chunks):
            self.serving, self._move = m.target, None
        elif landed:
            self.serving = hybrid(self.serving, m.target, landed)
        return self.serving, exposed

    def after_step(self, seconds: float) -> None:
        if self._move is not None:
            self._move.elapsed += seconds


def time_summary(step_s: np.ndarray, exposed_s: np.ndarray, tokens: np.ndarray, moved_bytes: float,
                 rearrangements: int, router_s: np.ndarray | None = None,
                 moe_layer_s: np.ndarray | None = None) -> dict[str, Any]:
    """The ``time`` object of ``online --json``: ``step_s``, ``exposed_s`` and ``tokens`` per served batch ``[B']``;
    ``router_s [B']``, the router's share of ``exposed_s``, is also given on its own (``exposed_router_ms``), and
    ``moe_layer_s [B']``, each batch's mean MoE layer (slowest GPU's experts and the all-to-all, over the layers
    with load), as their mean (``moe_layer_ms_mean``)."""
    ms = step_s * 1e3
    total = float(step_s.sum())
    return {"step_ms_mean": round(float(ms.mean()), 6), "step_ms_p50": round(float(np.percentile(ms, 50)), 6),
            "step_ms_p99": round(float(np.percentile(ms, 99)), 6),
            "tokens_per_s": round(float(tokens.sum()) / total, 3) if total > 0 else 0.0,
            "exposed_balancing_ms": round(float(exposed_s.sum()) * 1e3, 6),
            "exposed_router_ms": round(float(router_s.sum()) * 1e3 if router_s is not None else 0.0, 6),
            "moe_layer_ms_mean": round(float(moe_layer_s.mean()) * 1e3 if moe_layer_s is not None and
                                       moe_layer_s.size else 0.0, 6),
            "moved_gib": round(moved_bytes / GIB, 6), "rearrangements": int(rearrangements),
            "per_batch_step_ms": [round(float(v), 6) for v in ms]}
