"""The expert-parallel MoE layer: every rank holds its plan's experts, tokens go to the replica the router picks.

Legend: ``G`` ranks = GPUs (rank ``g`` is GPU ``g`` of ``plan.cluster``), ``T_r`` tokens of this rank, ``T``
tokens of all ranks, ``H`` hidden size, ``E`` logical experts, ``K`` picks per token, ``S`` physical slots
this rank holds in this layer (``plan.gpu_experts[layer][rank]``, in that order; with a per-batch plan, those
followed by this batch's ``n <= N`` extras, which live in the prefetch buffer).

Forward on each rank (inference only: nothing here is differentiable through the exchange):

1. check its input (and per-batch plan) and gate its own tokens (:func:`moebalance.runtime.gating.topk_gating`),
   with the replicated gate; a failure is not raised yet;
2. all-gather the routing with every rank's check (:mod:`moebalance.runtime.agree`: if any rank failed, all
   raise the same error here); with a per-batch plan, wait for this layer's extras in the prefetch buffer
   and post the next layer's copies (:mod:`moebalance.runtime.prefetch`); in exact mode
   (``EPConfig.exact``, :mod:`moebalance.runtime.exact`), plan this layer's extras and the rebalancer's routing
   from the gathered routing and post the extras' copies;
3. choose every pick's replica with the plan's router on every rank
   (:func:`~moebalance.runtime.route.route_picks`: docs/design.md, "Routers", the same router code as the
   simulator, seeded identically everywhere), on the per-batch layer plan when there is one (in exact mode
   the planner's routing, then wait for the copies);
4. dispatch, compute, combine (:mod:`moebalance.runtime.dispatch`).

Libra Section 3.1's two-stage execution is ``local_first=True``: the dispatch all-to-all is started
asynchronously, the picks whose replica is on the token's own rank (MoE_local) are computed while it is in
flight, then the received rows (MoE_remote). Libra overlaps MoE_local with its token sharding and dispatch;
here the router runs before both phases because it decides which picks are local (with the ``locality``
and ``rebalance`` routers every pick with a replica on its own GPU is local, as in Libra). Without the flag the local picks are
computed after the remote ones. Either way local picks are never sent, and the same rows meet the same
matmuls, so the outputs are bit-identical (the tests compare them with ``array_equal``).

``router_thread=True`` is Libra's order proper: with a router in :data:`KEEPS_LOCAL` the local picks are known
before routing (a kept pick whose expert has a copy on the token's own GPU), so the router and the dispatch
planning run in a CPU thread while MoE_local computes (:func:`~moebalance.runtime.dispatch.build_local`);
then the remote rows are dispatched and computed. Every rank checks that the router kept exactly those picks
local. Still bit-identical; :class:`EPStats` says whether the router finished inside the local phase.

Router randomness: ``np.random.default_rng((router_seed, layer, step))``, ``step`` counting forwards (or
given), so every rank draws the same numbers. Every rank routes the whole batch on the host: ``O(T * K)``
numpy work, the price of agreeing without a broadcast. It assumes the same numpy on every rank.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moebalance.core.errors import InputError, PlanError
from moebalance.core.plan import Placement
from moebalance.routing import Router, get_router
from moebalance.runtime.agree import RankCheck, plan_digest
from moebalance.runtime.comm import A2AImpl
from moebalance.runtime.dispatch import (
    DispatchMeta,
    ExpertWork,
    build_dispatch,
    build_local,
    make_dispatcher,
)
from moebalance.runtime.exact import ExactConfig, check_exact, exact_layer_plan, warm_up
from moebalance.runtime.experts import ExpertWeights, expert_ffn
from moebalance.runtime.gating import GateConfig, GateOutput, topk_gating
from moebalance.runtime.prefetch import ExpertPrefetcher, PrefetchResult, batch_extras
from moebalance.runtime.route import (
    KEEPS_LOCAL,
    check_kept_local,
    keeps_local,
    layer_placement,
    route_picks,
    slot_table,
)
from moebalance.runtime.stats import Clock, EPStats, ExactTiming, MoEOutput

#: Re-exported from :mod:`moebalance.runtime.route`: ``KEEPS_LOCAL``, ``keeps_local``, ``layer_placement``,
#: ``route_picks``, ``slot_table``; from :mod:`moebalance.runtime.stats`: ``EPStats``, ``MoEOutput``.
__all__ = ["KEEPS_LOCAL", "EPConfig", "EPStats", "ExpertParallelMoE", "MoEOutput", "keeps_local", "layer_placement",
           "route_picks", "slot_table"]

@dataclass(kw_only=True, frozen=True, slots=True)
class EPConfig:
    """How the layer routes and communicates.

    Example: ``EPConfig(router="locality", local_first=True)`` keeps picks on their own GPU where a replica is
    there, and computes them while the remote rows are in flight.
    """

    #: A name in :data:`moebalance.routing.ROUTERS` or a :class:`~moebalance.routing.Router`.
    router: str | Router = "uniform"
    router_seed: int = 0
    #: Libra's two-stage execution: compute local picks while the dispatch is in flight.
    local_first: bool = False
    #: ``all_to_all`` (a process group) or ``local`` (one process, no communication).
    dispatcher: str = "all_to_all"
    #: All-to-all implementation: ``auto``, ``native`` or ``p2p`` (see :mod:`moebalance.runtime.comm`).
    a2a_impl: A2AImpl = "auto"
    #: A bound on any rank's tokens per forward, the same on every rank: the routing is then gathered in one
    #: collective of fixed size instead of two (counts, then rows); ``None``: no bound, two collectives.
    max_tokens_per_rank: int | None = None
    #: Libra Section 3.1's two-stage execution with the router in a CPU thread: while the router runs, the
    #: picks served on their own rank are computed (they do not depend on it); then the remote picks are
    #: dispatched and computed. Only for routers that keep every pick with a copy on its own GPU there
    #: (:data:`KEEPS_LOCAL`); with the others the layer routes first, as without the flag.
    router_thread: bool = False
    #: Exact mode (:mod:`moebalance.runtime.exact`): each layer plans its extras and routing after its gate,
    #: from the batch's routing, and copies the extras into its prefetch buffer; ``None``: off.
    exact: ExactConfig | None = None

    def __post_init__(self) -> None:
        get_router(self.router)  # raises on an unknown name, listing the valid ones
        if self.exact is not None and not isinstance(self.exact, ExactConfig):
            raise InputError(f"exact ({type(self.exact).__name__}) must be a moebalance.runtime.ExactConfig or None")
        if self.exact is not None and self.router_thread:
            raise InputError("exact mode plans a layer's extras and routing before its experts compute, so the router "
                             "cannot run beside the local phase; turn router_thread off or exact mode off")
        if isinstance(self.router_seed, bool) or not isinstance(self.router_seed, int) or self.router_seed < 0:
            raise InputError(f"router_seed ({self.router_seed!r}) must be a non-negative integer")
        m = self.max_tokens_per_rank
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < 2**24):
            raise InputError(f"max_tokens_per_rank ({m!r}) must be an integer in [0, 2**24), or None for no bound")


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What a rank prepared for one forward before any collective (its checks passed)."""

    gate: GateOutput
    #: ``float32 [T_r, 2K]``: encoded expert ids (dropped: ``-1 - id``) and gate weights.
    routing: torch.Tensor
    #: The one-layer plan this forward routes on (the per-batch one when given) and this rank's slots in it.
    layer_plan: Placement
    slot_of: np.ndarray
    batch_plan: Placement | None
    digest: int


@dataclass(slots=True)
class _Forward:
    """One forward on this rank once every rank's routing is gathered: what the modes share and fill in.

    The routing (``tokens_per_rank``, ``allr``, ``ids``, ``kept``, ``layer_plan``, ``planned``) is the same on
    every rank, so every rank routes alike.
    """

    #: ``[T_r, H]``: this rank's tokens.
    x: torch.Tensor
    prep: _Prepared
    #: The router's step (see the module doc).
    step: int
    #: ``[G]`` tokens of each rank; ``T`` is their sum.
    tokens_per_rank: list[int]
    #: ``float32 [T, 2K]``: every rank's routing, by rank then token (encoded expert ids, then gate weights).
    allr: np.ndarray
    #: ``int64 [T, K]`` each pick's expert and ``bool [T, K]`` whether the gate's capacity kept it.
    ids: np.ndarray
    kept: np.ndarray
    gather_seconds: float
    #: The one-layer plan the picks are routed on and ``int64 [E]`` this rank's slot of each expert (-1: none);
    #: exact mode replaces both with its own plan.
    layer_plan: Placement
    slot_of: np.ndarray
    #: This rank's prefetch buffer for the forward (with a per-batch plan or in exact mode).
    pf: PrefetchResult
    #: Times the expert compute (:class:`~moebalance.runtime.stats.Clock`).
    clock: Clock
    #: Instants from the end of the gate to the first expert compute (exact mode reports them).
    mark: dict[str, float]
    #: ``int64 [T, K]``: exact mode's routing, each pick's GPU; ``None``: the router routes.
    planned: np.ndarray | None = None


_POOL: ThreadPoolExecutor | None = None


def _router_pool() -> ThreadPoolExecutor:
    """The one CPU thread the two-stage path runs routers in (created on first use, in each process)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moebalance-router")
    return _POOL


class ExpertParallelMoE:
    """One MoE layer of ``plan`` on this rank. Build with :meth:`from_full` or give this rank's slots.

    ``prefetcher``: this rank's :class:`~moebalance.runtime.prefetch.ExpertPrefetcher`, shared by its layers,
    for per-batch plans with extra experts (``forward(..., batch_plan=...)``).
    """

    def __init__(self, plan: Placement, layer: int, gate_HE: torch.Tensor, experts: ExpertWeights,
                 gate_config: GateConfig, config: EPConfig | None = None, *, group: Any = None,
                 selection_bias_E: torch.Tensor | None = None, prefetcher: ExpertPrefetcher | None = None) -> None:
        self.config = config or EPConfig()
        self.gate_config = gate_config
        self.layer = layer
        self.gate_HE = gate_HE
        self.selection_bias_E = selection_bias_E
        self.prefetcher = prefetcher
        self.dispatcher = make_dispatcher(self.config.dispatcher, group, self.config.a2a_impl)
        self.rank = self.dispatcher.rank
        if gate_HE.shape[1] != plan.num_experts:
            raise InputError(f"the gate has {gate_HE.shape[1]} experts but the plan {plan.num_experts}")
        if plan.num_experts > 2**24:
            raise InputError(f"the plan has {plan.num_experts} experts; the routing is gathered as float32, exact "
                             "for expert ids below 2**24, so use at most 2**24 experts per layer")
        self._step = 0
        check_exact(self.config.exact, plan.num_experts, prefetcher)
        if self.config.exact is not None:
            warm_up()  # the planner's kernels loaded now, not in the first forward's timing
        self.set_plan(plan, experts)

    @classmethod
    def from_full(cls, plan: Placement, layer: int, gate_HE: torch.Tensor, full: ExpertWeights,
                  gate_config: GateConfig, config: EPConfig | None = None, *, group: Any = None,
                  selection_bias_E: torch.Tensor | None = None,
                  prefetcher: ExpertPrefetcher | None = None) -> ExpertParallelMoE:
        """Keep only this rank's physical experts of ``full`` (all ``E`` logical experts)."""
        rank = make_dispatcher((config or EPConfig()).dispatcher, group, "auto").rank
        if not 0 <= layer < plan.num_layers:
            raise PlanError(f"layer {layer} is outside the plan's {plan.num_layers} layers")
        local = full.select(plan.gpu_experts[layer][rank])
        return cls(plan, layer, gate_HE, local, gate_config, config, group=group, selection_bias_E=selection_bias_E,
                   prefetcher=prefetcher)

    def set_plan(self, plan: Placement, experts: ExpertWeights) -> None:
        """Switch to ``plan``, with this rank's new slots (e.g. from :func:`~moebalance.runtime.rearrange`)."""
        if self.dispatcher.world_size != plan.num_gpus:
            raise PlanError(f"the plan is for {plan.num_gpus} GPUs but the process group has "
                            f"{self.dispatcher.world_size} ranks; run one rank per GPU of the plan")
        if plan.num_experts != self.gate_HE.shape[1]:
            raise PlanError(f"the plan has {plan.num_experts} experts but the gate {self.gate_HE.shape[1]}")
        self.plan = plan
        self.layer_plan = layer_placement(plan, self.layer)
        self.local_experts: tuple[int, ...] = tuple(self.layer_plan.gpu_experts[0][self.rank])
        if experts.num_experts != len(self.local_experts):
            raise PlanError(f"rank {self.rank} holds {len(self.local_experts)} experts in layer {self.layer} of "
                            f"the plan but was given {experts.num_experts}")
        self.experts = experts
        self.slot_of = slot_table(self.layer_plan)[self.rank]
        self.link_kind = plan.cluster.link_kind()[self.rank]
        if self.prefetcher is not None:
            self.prefetcher.register(self)

    def _compute(self, rows_RH: torch.Tensor, work: ExpertWork, buffer: ExpertWeights | None) -> torch.Tensor:
        """``float32 [R, H]``: per row, the gate-weighted sum of its picks' expert outputs, slots ascending.

        Slots ``0 .. S-1`` are this rank's base experts, ``S ..`` the prefetch ``buffer``'s slots.
        """
        out = torch.zeros((work.num_rows, rows_RH.shape[1]), dtype=torch.float32, device=rows_RH.device)
        if work.pick_slot.numel() == 0:
            return out
        S = len(self.local_experts)
        for s in torch.unique(work.pick_slot).tolist():
            sel = work.pick_slot == s
            r = work.pick_row[sel]
            experts, slot = (self.experts, int(s)) if s < S or buffer is None else (buffer, int(s) - S)
            y = expert_ffn(rows_RH.index_select(0, r), experts, slot).float()
            out.index_add_(0, r, y * work.pick_weight[sel, None])
        return out

    def _prepare(self, x_TH: Any, step: Any, batch_plan: Any) -> _Prepared:
        """This rank's checks and gating, before any collective (a failure here is agreed on: see forward)."""
        H = self.gate_HE.shape[0]
        if not isinstance(x_TH, torch.Tensor) or x_TH.ndim != 2 or x_TH.shape[1] != H:
            got = tuple(x_TH.shape) if isinstance(x_TH, torch.Tensor) else type(x_TH).__name__
            raise InputError(f"x must be [T, {H}], got {got}")
        if not x_TH.dtype.is_floating_point:
            raise InputError(f"x has dtype {x_TH.dtype}; give floating-point hidden states")
        if x_TH.device != self.gate_HE.device:
            raise InputError(f"x is on {x_TH.device} but the layer's weights on {self.gate_HE.device}; move x there")
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or not 0 <= step < 2**62:
            raise InputError(f"step ({step!r}) must be a non-negative integer")
        layer_plan, slot_of = self.layer_plan, self.slot_of
        if batch_plan is not None and self.config.exact is not None:
            raise InputError("this layer runs exact mode, which plans each batch's extras after the gate; pass no "
                             "batch_plan, or build the layer without EPConfig(exact=...)")
        if batch_plan is not None:
            if self.prefetcher is not None:
                self.prefetcher.extras(self.plan, batch_plan)
            else:
                batch_extras(self.plan, batch_plan, 0)
            layer_plan = layer_placement(batch_plan, self.layer)
            slot_of = slot_table(layer_plan)[self.rank]
        gate = topk_gating(x_TH @ self.gate_HE, self.gate_config, selection_bias_E=self.selection_bias_E)
        # float32 carries the ids exactly (below 2**24) and the weights as the experts use them (float32)
        encoded = torch.where(gate.kept, gate.topk_ids, -1 - gate.topk_ids).float()
        routing = torch.cat([encoded, gate.topk_weights.float()], dim=1)
        # the next layer's lists too: this forward posts their copies, so the ranks must agree on them first
        nxt = (batch_plan.gpu_experts[self.layer + 1]
               if batch_plan is not None and self.layer + 1 < batch_plan.num_layers else ())
        digest = plan_digest(self.layer, self.gate_config.top_k, layer_plan.gpu_experts[0], nxt)
        return _Prepared(gate, routing, layer_plan, slot_of, batch_plan, digest)

    def forward(self, x_TH: torch.Tensor, *, step: int | None = None,
                batch_plan: Placement | None = None) -> MoEOutput:
        """This rank's MoE output for its tokens ``x [T_r, H]``; every rank must call it (a collective).

        ``batch_plan``: this batch's per-batch plan (:mod:`moebalance.runtime.prefetch`: the base plan's lists,
        then at most ``N`` extra experts per GPU), the same on every rank; its extras are copied into this
        rank's prefetch buffer before the layer computes. A bad input or plan on any rank makes every rank raise
        the same one-line error (:mod:`moebalance.runtime.agree`).

        Every rank takes the same path, so the collectives meet in the same order: the routing gather
        (:meth:`_gather`), with a per-batch plan the prefetch copies, then one mode, each ending in the combine:
        :meth:`_forward_exact` (``EPConfig.exact``), :meth:`_forward_two_stage` (``router_thread`` with a router
        in :data:`KEEPS_LOCAL`) or :meth:`_forward_routed` (any other: the base plan or the per-batch one).
        """
        step = self._step if step is None else (int(step) if isinstance(step, np.integer) else step)
        fw = self._gather(x_TH, step, batch_plan)
        if fw.prep.batch_plan is not None and self.prefetcher is not None:
            # Libra's prefetch: wait for this layer's extras, post the next layer's copies
            fw.pf = self.prefetcher.acquire(self, fw.prep.batch_plan)
        if self.config.exact is not None:
            return self._forward_exact(fw, self.config.exact)
        if self.config.router_thread and keeps_local(self.config.router):
            return self._forward_two_stage(fw)
        return self._forward_routed(fw)

    __call__ = forward

    def _gather(self, x_TH: torch.Tensor, step: int, batch_plan: Placement | None) -> _Forward:
        """Prepare this forward (:meth:`_prepare`), then gather every rank's routing ``[T, 2K]`` with its check:
        the forward's first collective, where a failure on any rank raises the same error on every rank."""
        K = self.gate_config.top_k
        prep: _Prepared | None = None
        error: Exception | None = None
        try:
            prep = self._prepare(x_TH, step, batch_plan)
        except Exception as exc:  # agreed on with the other ranks before anyone raises
            error = exc
        device = self.gate_HE.device
        routing = prep.routing if prep is not None else torch.zeros((0, 2 * K), device=device)
        digest = prep.digest if prep is not None else plan_digest(self.layer, K, self.layer_plan.gpu_experts[0])
        check = RankCheck(error, step if error is None else -1, digest)

        t0 = time.perf_counter()
        gathered = self.dispatcher.gather_agreed(routing, check, self.config.max_tokens_per_rank)
        assert prep is not None  # gather_agreed raised on every rank otherwise
        self._step = step + 1
        parts = [p.cpu().numpy() for p in gathered]
        allr = np.concatenate(parts) if parts else np.zeros((0, 2 * K))
        enc = allr[:, :K].astype(np.int64)
        kept = enc >= 0
        return _Forward(x=x_TH, prep=prep, step=step, tokens_per_rank=[p.shape[0] for p in parts], allr=allr,
                        ids=np.where(kept, enc, -1 - enc), kept=kept, gather_seconds=time.perf_counter() - t0,
                        layer_plan=prep.layer_plan, slot_of=prep.slot_of, pf=PrefetchResult(None, 0, 0, 0, 0),
                        clock=Clock(x_TH.device), mark={"gate": t0})

    def _route(self, fw: _Forward, device: torch.device) -> tuple[np.ndarray, DispatchMeta, float, float]:
        """``(dest [T, K], this rank's dispatch plan on device, seconds, end instant)``: every pick's GPU (exact
        mode's planned routing, else the router's on ``fw.layer_plan``, its randomness seeded by
        ``(router_seed, layer, step)`` so every rank draws alike), then the dispatch built from it. Host work only
        (with ``device`` the CPU), so the two-stage mode runs it in the router thread."""
        K = self.gate_config.top_k
        rng = np.random.default_rng((self.config.router_seed, self.layer, fw.step))
        t = time.perf_counter()
        dest = fw.planned if fw.planned is not None else \
            route_picks(fw.layer_plan, self.config.router, fw.ids, fw.kept, fw.tokens_per_rank, rng)
        meta = build_dispatch(dest, fw.ids, fw.allr[:, K:], fw.tokens_per_rank, self.rank, fw.slot_of, device)
        end = time.perf_counter()
        return dest, meta, end - t, end

    def _forward_routed(self, fw: _Forward) -> MoEOutput:
        """Route on the base plan (or the per-batch plan, its extras already in ``fw.pf``), then dispatch, compute
        and combine (:meth:`_exchange`)."""
        dest, meta, router_seconds, _ = self._route(fw, fw.x.device)
        local_out, remote_out = self._exchange(fw, meta)
        return self._finish(fw, dest, meta, local_out, remote_out, router_seconds)

    def _forward_exact(self, fw: _Forward, exact: ExactConfig) -> MoEOutput:
        """Exact mode (:mod:`moebalance.runtime.exact`): plan this layer's extras and routing from the gathered
        routing, post the extras' copies, build the dispatch while they fly, wait for them, then dispatch,
        compute and combine as :meth:`_forward_routed`; reports the gate -> first expert time as ExactTiming."""
        m = fw.mark
        m["gathered"] = time.perf_counter()
        xp = exact_layer_plan(fw.layer_plan, fw.ids, fw.kept, fw.tokens_per_rank, exact, self.config.router)
        m["planned"] = time.perf_counter()
        fw.layer_plan, fw.planned = xp.layer_plan, xp.dest
        fw.slot_of = slot_table(xp.layer_plan)[self.rank]
        if self.prefetcher is not None:
            self.prefetcher.post(self, xp.extras)
        dest, meta, router_seconds, m["routed"] = self._route(fw, fw.x.device)
        if self.prefetcher is not None:
            fw.pf = self.prefetcher.ready(self)  # this layer's extras, posted before the dispatch was planned
        m["copied"] = time.perf_counter()
        local_out, remote_out = self._exchange(fw, meta)
        # the three parts add up to the gate's end -> the first expert compute
        timing = ExactTiming(plan_seconds=m["planned"] - m["gathered"], copy_seconds=m["copied"] - m["routed"],
                             route_seconds=(m["gathered"] - m["gate"]) + (m["routed"] - m["planned"])
                             + (m["expert"] - m["copied"]))
        return self._finish(fw, dest, meta, local_out, remote_out, router_seconds, timing=timing)

    def _forward_two_stage(self, fw: _Forward) -> MoEOutput:
        """Libra Section 3.1 (``router_thread``): MoE_local needs no routing decision (a kept pick whose expert has
        a copy on the token's own GPU stays there), so the router runs in a CPU thread while the local picks
        compute; then every rank checks the router kept exactly those local, and the remote rows go."""
        x, K, clock, weights = fw.x, self.gate_config.top_k, fw.clock, fw.pf.weights
        lo = sum(fw.tokens_per_rank[:self.rank])
        hi = lo + fw.tokens_per_rank[self.rank]
        has_EG = fw.layer_plan.copies[0] > 0
        # the thread stays on the host: a copy to the GPU there would queue behind the local kernels
        future = _router_pool().submit(self._route, fw, torch.device("cpu"))
        t_local = time.perf_counter()
        here = fw.kept[lo:hi] & has_EG[fw.ids[lo:hi], self.rank]
        local_token, local_work = build_local(here, fw.ids[lo:hi], fw.allr[lo:hi, K:], fw.slot_of, x.device)
        t = clock.start()
        local_out = self._compute(x.index_select(0, local_token), local_work, weights)
        clock.stop(t)
        local_end = time.perf_counter()
        dest, meta, router_seconds, router_end = future.result()
        hidden = clock.busy() if clock.cuda else router_end <= local_end
        meta = meta.to(x.device)
        check_kept_local(dest, fw.ids, fw.kept, has_EG, fw.tokens_per_rank, get_router(self.config.router).name)
        assert torch.equal(meta.local_token, local_token)  # follows from the check just made
        received = self.dispatcher.dispatch(x, meta).wait()
        t = clock.start()
        remote_out = self._compute(received, meta.remote, weights)
        clock.stop(t)
        return self._finish(fw, dest, meta, local_out, remote_out, router_seconds, local_seconds=local_end - t_local,
                            hidden=hidden)

    def _exchange(self, fw: _Forward, meta: DispatchMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """Dispatch and compute: ``(local_out [T_l, H], remote_out [M, H])`` float32, for this rank's local picks
        and the rows it received. With ``local_first`` the local picks compute while the dispatch is in flight
        (Libra's MoE_local), else after the remote rows; ``fw.mark["expert"]``: when the experts may start."""
        x, clock, weights = fw.x, fw.clock, fw.pf.weights
        pending = self.dispatcher.dispatch(x, meta, async_op=self.config.local_first)
        # the experts start now with local_first (MoE_local while the dispatch is in flight), else once it landed
        landed = None if self.config.local_first else pending.wait()
        fw.mark["expert"] = time.perf_counter()
        first = None
        if landed is None:
            t = clock.start()
            first = self._compute(x.index_select(0, meta.local_token), meta.local, weights)
            clock.stop(t)
        received = pending.wait() if landed is None else landed
        t = clock.start()
        remote_out = self._compute(received, meta.remote, weights)
        local_out = first if first is not None else \
            self._compute(x.index_select(0, meta.local_token), meta.local, weights)
        clock.stop(t)
        return local_out, remote_out

    def _finish(self, fw: _Forward, dest: np.ndarray, meta: DispatchMeta, local_out: torch.Tensor,
                remote_out: torch.Tensor, router_seconds: float, *, local_seconds: float | None = None,
                hidden: bool | None = None, timing: ExactTiming | None = None) -> MoEOutput:
        """Combine (the forward's last collective: the remote partial rows come back), sum each token's rows into
        ``out [T_r, H]`` and account for the forward."""
        x = fw.x
        back = self.dispatcher.combine(remote_out.to(x.dtype), meta)
        out = self._merge(x, local_out, back, meta)
        slots = len(fw.layer_plan.gpu_experts[0][self.rank])
        stats = self._stats(meta, fw.prep.gate, x, fw.gather_seconds + router_seconds, fw.clock.seconds(), slots,
                            fw.pf, router_seconds, local_seconds, hidden, timing)
        return MoEOutput(out=out, gate=fw.prep.gate, dest=dest, stats=stats)

    def _merge(self, x_TH: torch.Tensor, local_out: torch.Tensor, back: torch.Tensor,
               meta: DispatchMeta) -> torch.Tensor:
        """Sum each token's partial rows in ascending GPU order (no duplicate index per ``index_add_``)."""
        out = torch.zeros(x_TH.shape, dtype=torch.float32, device=x_TH.device)
        lo = 0
        for g, n in enumerate(meta.send_counts):
            if g == meta.rank:
                out.index_add_(0, meta.local_token, local_out)
            elif n:
                out.index_add_(0, meta.send_token[lo:lo + n], back[lo:lo + n].float())
            lo += n
        return out.to(x_TH.dtype)

    def _stats(self, meta: DispatchMeta, gate: GateOutput, x: torch.Tensor, routing_seconds: float,
               compute: float, num_slots: int, pf: PrefetchResult, router_seconds: float,
               local_seconds: float | None, hidden: bool | None, exact: ExactTiming | None) -> EPStats:
        slots = torch.cat([meta.local.pick_slot, meta.remote.pick_slot]).cpu().numpy()
        send = np.asarray(meta.send_counts, dtype=np.int64)
        recv = np.asarray(meta.recv_counts, dtype=np.int64)
        send[self.rank] = recv[self.rank] = int(meta.local_token.numel())
        return EPStats(rank=self.rank, tokens_per_slot=np.bincount(slots, minlength=num_slots),
                       send_rows=send, recv_rows=recv, link_kind=self.link_kind,
                       bytes_per_row=int(x.shape[1] * x.element_size()), dropped_picks=gate.num_dropped,
                       routing_seconds=routing_seconds, expert_seconds=compute,
                       prefetch_received=pf.received, prefetch_bytes_received=pf.bytes_received,
                       prefetch_sent=pf.sent, prefetch_bytes_sent=pf.bytes_sent, router_seconds=router_seconds,
                       local_seconds=local_seconds, rebalancer_hidden=hidden, exact=exact)
