"""The expert-parallel MoE layer: every rank holds its plan's experts, tokens go to the replica the router picks.

Legend: ``G`` ranks = GPUs (rank ``g`` is GPU ``g`` of ``plan.cluster``), ``T_r`` tokens of this rank, ``T``
tokens of all ranks, ``H`` hidden size, ``E`` logical experts, ``K`` picks per token, ``S`` physical slots
this rank holds in this layer (``plan.gpu_experts[layer][rank]``, in that order).

Forward on each rank (inference only: nothing here is differentiable through the exchange):

1. gate its own tokens (:func:`moebalance.runtime.gating.topk_gating`), with the replicated gate;
2. all-gather the routing and choose every pick's replica with the plan's router on every rank
   (:func:`route_picks`: docs/design.md, "Routers", the same router code as the simulator, seeded identically everywhere);
3. dispatch, compute, combine (:mod:`moebalance.runtime.dispatch`).

Libra Section 3.1's two-stage execution is ``local_first=True``: the dispatch all-to-all is started
asynchronously, the picks whose replica is on the token's own rank (MoE_local) are computed while it is in
flight, then the received rows (MoE_remote). Libra overlaps MoE_local with its token sharding and dispatch;
here the router runs before both phases because it decides which picks are local (with the ``locality``
and ``rebalance`` routers every pick with a replica on its own GPU is local, as in Libra). Without the flag the local picks are
computed after the remote ones. Either way local picks are never sent, and the same rows meet the same
matmuls, so the outputs are bit-identical (the tests compare them with ``array_equal``).

Router randomness: ``np.random.default_rng((router_seed, layer, step))``, ``step`` counting forwards (or
given), so every rank draws the same numbers. Every rank routes the whole batch on the host: ``O(T * K)``
numpy work, the price of agreeing without a broadcast. It assumes the same numpy on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moebalance.core.errors import InputError, PlanError
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.routing import Router, get_router
from moebalance.routing.base import check_routes
from moebalance.runtime.comm import A2AImpl
from moebalance.runtime.dispatch import (
    DispatchMeta,
    ExpertWork,
    build_dispatch,
    make_dispatcher,
)
from moebalance.runtime.experts import ExpertWeights, expert_ffn
from moebalance.runtime.gating import GateConfig, GateOutput, topk_gating

__all__ = ["EPConfig", "EPStats", "ExpertParallelMoE", "MoEOutput", "layer_placement", "route_picks", "slot_table"]


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

    def __post_init__(self) -> None:
        get_router(self.router)  # raises on an unknown name, listing the valid ones
        if isinstance(self.router_seed, bool) or not isinstance(self.router_seed, int) or self.router_seed < 0:
            raise InputError(f"router_seed ({self.router_seed!r}) must be a non-negative integer")
        m = self.max_tokens_per_rank
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < 2**24):
            raise InputError(f"max_tokens_per_rank ({m!r}) must be an integer in [0, 2**24), or None for no bound")


@dataclass(frozen=True, slots=True)
class EPStats:
    """One rank's account of one forward.

    Example: on 2 GPUs of one node, rank 0 computing 5 picks on its 2 slots and sending 3 rows of 4 KiB::

        tokens_per_slot = [3, 2], send_rows = [2, 3], recv_rows = [0, 1], link_kind = [0, 1]

    (``send_rows[rank]`` counts this rank's tokens served locally: copies that cost nothing.)
    """

    rank: int
    #: ``int64 [S]``: picks computed by each local physical slot (a second copy of an expert on one GPU: 0).
    tokens_per_slot: np.ndarray
    #: ``int64 [G]``: dispatch rows to each rank; at ``rank``, the own tokens served here (not sent).
    send_rows: np.ndarray
    #: ``int64 [G]``: dispatch rows from each rank; at ``rank``, the same local count.
    recv_rows: np.ndarray
    #: ``int8 [G]``: 0 this rank, 1 same node, 2 another node (``plan.cluster``).
    link_kind: np.ndarray
    #: Bytes of one hidden-state row (``H * dtype size``); combine rows are the same size.
    bytes_per_row: int
    #: This rank's picks dropped by the capacity.
    dropped_picks: int
    #: Seconds gathering the routing (including waiting for the slowest rank to reach the gather) and
    #: running the router and :func:`~moebalance.runtime.dispatch.build_dispatch` on the host.
    routing_seconds: float
    #: Seconds of expert FFN compute, local and remote picks (CUDA events on GPU, wall time on CPU).
    expert_seconds: float

    @property
    def tokens_computed(self) -> int:
        """Picks this GPU served: what the simulator calls its load."""
        return int(self.tokens_per_slot.sum())

    def bytes(self) -> dict[str, int]:
        """Bytes moved by this rank, by direction and link; combine is dispatch reversed."""
        out: dict[str, int] = {}
        for kind, name in ((1, "intra_node"), (2, "inter_node")):
            sent = int(self.send_rows[self.link_kind == kind].sum()) * self.bytes_per_row
            recv = int(self.recv_rows[self.link_kind == kind].sum()) * self.bytes_per_row
            out[f"dispatch_sent_{name}"] = out[f"combine_received_{name}"] = sent
            out[f"dispatch_received_{name}"] = out[f"combine_sent_{name}"] = recv
        return out


@dataclass(frozen=True, slots=True)
class MoEOutput:
    """A forward's result on one rank."""

    #: ``[T_r, H]`` the MoE output of this rank's tokens (dtype of the input).
    out: torch.Tensor
    gate: GateOutput
    stats: EPStats
    #: ``int64 [T, K]``: the GPU of every pick of every rank's token (-1 dropped), identical on all ranks.
    dest: np.ndarray


def layer_placement(plan: Placement, layer: int) -> Placement:
    """The one-layer plan of ``layer`` (with its routing weights): what the router sees for that layer."""
    if not 0 <= layer < plan.num_layers:
        raise PlanError(f"layer {layer} is outside the plan's {plan.num_layers} layers")
    weights = None if plan.weights is None else [plan.weights[layer]]
    return Placement([plan.gpu_experts[layer]], plan.num_experts, plan.cluster, policy=plan.policy,
                     weights=weights)


def slot_table(plan: Placement) -> np.ndarray:
    """``int64 [G, E]`` for a one-layer plan: GPU ``g``'s slot of expert ``e`` (its first copy), -1 if none."""
    G, E = plan.num_gpus, plan.num_experts
    table = np.full((G, E), -1, dtype=np.int64)
    for g, experts in enumerate(plan.gpu_experts[0]):
        for s in range(len(experts) - 1, -1, -1):  # backwards, so the first copy wins
            table[g, experts[s]] = s
    return table


def route_picks(plan: Placement, router: str | Router, ids_TK: np.ndarray, kept_TK: np.ndarray,
                tokens_per_rank: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """``int64 [T, K]``: the GPU serving each pick of a one-layer plan, ``-1`` where the pick was dropped.

    The tokens of rank ``r`` live on GPU ``r``; all form one batch. A router that balances load
    (``Router.assign_kept``) sees which picks were dropped, so they count nowhere; the others route every
    pick the gate chose (a trace has ``K`` distinct picks per token) and the dropped ones are masked afterwards.
    """
    T, K = ids_TK.shape
    if T == 0:
        return np.zeros((0, K), dtype=np.int64)
    src = np.repeat(np.arange(len(tokens_per_rank), dtype=np.int64), tokens_per_rank)
    trace = RoutingTrace(ids_TK[:, None, :], src, np.zeros(T, dtype=np.int64), num_experts=plan.num_experts)
    r = get_router(router)
    if r.assign_kept is not None:
        dest = np.asarray(r.assign_kept(plan, trace, kept_TK[:, None, :], rng))
    else:
        dest = np.asarray(r.assign_tokens(plan, trace, rng))
    if dest.ndim != 3 or dest.shape[1] != 1:
        raise InputError(f"router {r.name!r} returned GPUs of shape {dest.shape}; expected [T, 1, K] for one layer")
    if r.assign_kept is not None:
        check_routes(dest[:, 0, :], ids_TK, plan.copies[0], r.name, kept_TK)
        return dest[:, 0, :]
    check_routes(dest[:, 0, :], ids_TK, plan.copies[0], r.name)
    return np.where(kept_TK, dest[:, 0, :], -1)


class _Clock:
    """Sums compute spans: CUDA events on the current stream (no device-wide sync that would wait for the
    all-to-all in flight and spoil the overlap), wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list[Any] = []

    def start(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start: Any) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.spans.append((start, ev))
        else:
            self.spans.append(time.perf_counter() - start)

    def seconds(self) -> float:
        if not self.cuda:
            return float(sum(self.spans))
        if self.spans:
            self.spans[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self.spans) / 1e3


class ExpertParallelMoE:
    """One MoE layer of ``plan`` on this rank. Build with :meth:`from_full` or give this rank's slots."""

    def __init__(self, plan: Placement, layer: int, gate_HE: torch.Tensor, experts: ExpertWeights,
                 gate_config: GateConfig, config: EPConfig | None = None, *, group: Any = None,
                 selection_bias_E: torch.Tensor | None = None) -> None:
        self.config = config or EPConfig()
        self.gate_config = gate_config
        self.layer = layer
        self.gate_HE = gate_HE
        self.selection_bias_E = selection_bias_E
        self.dispatcher = make_dispatcher(self.config.dispatcher, group, self.config.a2a_impl)
        self.rank = self.dispatcher.rank
        if gate_HE.shape[1] != plan.num_experts:
            raise InputError(f"the gate has {gate_HE.shape[1]} experts but the plan {plan.num_experts}")
        if plan.num_experts > 2**24:
            raise InputError(f"the plan has {plan.num_experts} experts; the routing is gathered as float32, exact "
                             "for expert ids below 2**24, so use at most 2**24 experts per layer")
        self._step = 0
        self.set_plan(plan, experts)

    @classmethod
    def from_full(cls, plan: Placement, layer: int, gate_HE: torch.Tensor, full: ExpertWeights,
                  gate_config: GateConfig, config: EPConfig | None = None, *, group: Any = None,
                  selection_bias_E: torch.Tensor | None = None) -> ExpertParallelMoE:
        """Keep only this rank's physical experts of ``full`` (all ``E`` logical experts)."""
        rank = make_dispatcher((config or EPConfig()).dispatcher, group, "auto").rank
        if not 0 <= layer < plan.num_layers:
            raise PlanError(f"layer {layer} is outside the plan's {plan.num_layers} layers")
        local = full.select(plan.gpu_experts[layer][rank])
        return cls(plan, layer, gate_HE, local, gate_config, config, group=group, selection_bias_E=selection_bias_E)

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

    def _compute(self, rows_RH: torch.Tensor, work: ExpertWork) -> torch.Tensor:
        """``float32 [R, H]``: per row, the gate-weighted sum of its picks' expert outputs, slots ascending."""
        out = torch.zeros((work.num_rows, rows_RH.shape[1]), dtype=torch.float32, device=rows_RH.device)
        if work.pick_slot.numel() == 0:
            return out
        for s in torch.unique(work.pick_slot).tolist():
            sel = work.pick_slot == s
            r = work.pick_row[sel]
            y = expert_ffn(rows_RH.index_select(0, r), self.experts, int(s)).float()
            out.index_add_(0, r, y * work.pick_weight[sel, None])
        return out

    def forward(self, x_TH: torch.Tensor, *, step: int | None = None) -> MoEOutput:
        """This rank's MoE output for its tokens ``x [T_r, H]``; every rank must call it (a collective)."""
        if x_TH.ndim != 2 or x_TH.shape[1] != self.gate_HE.shape[0]:
            raise InputError(f"x must be [T, {self.gate_HE.shape[0]}], got {tuple(x_TH.shape)}")
        step = self._step if step is None else step
        self._step = step + 1
        gate = topk_gating(x_TH @ self.gate_HE, self.gate_config, selection_bias_E=self.selection_bias_E)

        t0 = time.perf_counter()
        # float32 carries the ids exactly (below 2**24) and the weights as the experts use them (float32)
        encoded = torch.where(gate.kept, gate.topk_ids, -1 - gate.topk_ids).float()
        routing = torch.cat([encoded, gate.topk_weights.float()], dim=1)
        parts = [p.cpu().numpy() for p in self.dispatcher.gather_routing(routing, self.config.max_tokens_per_rank)]
        tokens_per_rank = [p.shape[0] for p in parts]
        allr = np.concatenate(parts) if parts else np.zeros((0, 2 * self.gate_config.top_k))
        K = self.gate_config.top_k
        enc = allr[:, :K].astype(np.int64)
        kept = enc >= 0
        ids = np.where(kept, enc, -1 - enc)
        rng = np.random.default_rng((self.config.router_seed, self.layer, step))
        dest = route_picks(self.layer_plan, self.config.router, ids, kept, tokens_per_rank, rng)
        meta = build_dispatch(dest, ids, allr[:, K:], tokens_per_rank, self.rank, self.slot_of, x_TH.device)
        routing_seconds = time.perf_counter() - t0

        clock = _Clock(x_TH.device)
        pending = self.dispatcher.dispatch(x_TH, meta, async_op=self.config.local_first)
        local_out = None
        if self.config.local_first:  # Libra 3.1: MoE_local while the dispatch is in flight
            t = clock.start()
            local_out = self._compute(x_TH.index_select(0, meta.local_token), meta.local)
            clock.stop(t)
        received = pending.wait()
        t = clock.start()
        remote_out = self._compute(received, meta.remote)
        if local_out is None:
            local_out = self._compute(x_TH.index_select(0, meta.local_token), meta.local)
        clock.stop(t)
        back = self.dispatcher.combine(remote_out.to(x_TH.dtype), meta)
        out = self._merge(x_TH, local_out, back, meta)
        stats = self._stats(meta, gate, x_TH, routing_seconds, clock.seconds())
        return MoEOutput(out=out, gate=gate, dest=dest, stats=stats)

    __call__ = forward

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
               compute: float) -> EPStats:
        slots = torch.cat([meta.local.pick_slot, meta.remote.pick_slot]).cpu().numpy()
        send = np.asarray(meta.send_counts, dtype=np.int64)
        recv = np.asarray(meta.recv_counts, dtype=np.int64)
        send[self.rank] = recv[self.rank] = int(meta.local_token.numel())
        return EPStats(rank=self.rank, tokens_per_slot=np.bincount(slots, minlength=len(self.local_experts)),
                       send_rows=send, recv_rows=recv, link_kind=self.link_kind,
                       bytes_per_row=int(x.shape[1] * x.element_size()), dropped_picks=gate.num_dropped,
                       routing_seconds=routing_seconds, expert_seconds=compute)
