"""Token dispatch for the expert-parallel layer: who sends which rows where, and the dispatchers that move them.

Legend: ``G`` ranks (rank ``g`` is GPU ``g`` of the plan), ``T`` tokens of all ranks, ``T_r`` tokens of
rank ``r``, ``K`` picks per token, ``N`` rows this rank sends, ``M`` rows it receives, ``P`` picks it
serves, ``S`` its physical expert slots, ``H`` hidden size.

Protocol (one forward of one layer), after every rank has gated its own tokens:

1. **Gather the routing.** Each rank's ``[T_r, K]`` expert ids (a dropped pick encoded as ``-1 - id``) and
   gate weights are all-gathered (:meth:`Dispatcher.gather_routing`), tokens in rank order. Every rank now
   holds the same ``[T, K]`` routing.
2. **Route.** Every rank runs the plan's router on the whole batch with the same seeded generator
   (:func:`moebalance.runtime.route.route_picks`), so all agree on the GPU of every pick without another
   message, and the result is exactly what the simulator computes for those tokens.
3. **Plan the exchange** (:func:`build_dispatch`, pure numpy). As in docs/design.md, "Metrics" and DeepEP, a token goes
   once to each distinct GPU serving any of its picks; rows to one destination are in token order.
   Because every rank knows every pick's GPU, receive counts and the picks behind each received row are
   computed locally: the only payload on the wire is hidden states, and no count exchange is needed.
4. **Dispatch** rows to the other ranks (:meth:`Dispatcher.dispatch`; a token served on its own GPU is
   not sent, whatever the phase order).
5. **Compute** on the receiving rank: for each local slot, its picks' rows through the expert FFN, scaled by
   the gate weight and summed per row (so several picks on one GPU come back as one row).
6. **Combine** (:meth:`Dispatcher.combine`): partial rows go back the way they came, and each token's output
   is the sum of its partial rows, added in ascending GPU order (deterministic, also on CUDA).

The layer's ``local_first`` flag (Libra Section 3.1) only moves *when* the local picks are computed
(before the remote exchange completes, overlapping it, instead of after it), never how, so results are
bit-identical either way.

A plan may hold two copies of one expert on one GPU (DeepSeek EPLB does): the router picks a GPU, so the
first copy on that GPU serves all of that GPU's picks of the expert and the second stays idle, exactly as
the simulator counts per GPU.

Dispatchers are chosen by name: ``all_to_all`` (the exchange over a process group, natively or
from point-to-point ops, see :mod:`moebalance.runtime.comm`) and ``local`` (no communication: one rank
that holds every expert, a no-op base).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moebalance.core.errors import InputError, PlanError
from moebalance.runtime.agree import RankCheck, agreed_gather
from moebalance.runtime.comm import A2AImpl, Pending, all_gather_v, all_to_all_v, over_budget, resolve_impl

__all__ = ["DISPATCHERS", "AllToAllDispatcher", "DispatchMeta", "Dispatcher", "ExpertWork", "LocalDispatcher",
           "build_dispatch", "build_local", "make_dispatcher"]


@dataclass(frozen=True, slots=True)
class ExpertWork:
    """The picks one rank serves from one batch of rows (its own tokens, or the rows it received).

    Example: rows ``[x_a, x_b]``, token ``a`` picked local slots 0 and 2 and token ``b`` slot 2::

        pick_row = [0, 0, 1], pick_slot = [0, 2, 2], pick_weight = [0.7, 0.3, 1.0]
    """

    #: ``int64 [P]``: the row of each pick.
    pick_row: torch.Tensor
    #: ``int64 [P]``: the local physical slot serving it.
    pick_slot: torch.Tensor
    #: ``float32 [P]``: its gate weight.
    pick_weight: torch.Tensor
    #: Rows in the batch.
    num_rows: int


@dataclass(frozen=True, slots=True)
class DispatchMeta:
    """What :func:`build_dispatch` decided for one rank, passed from dispatch to compute to combine.

    Example (2 ranks, rank 0 has tokens 0-1, token 1 picks an expert on rank 1 only)::

        send_token = [1], send_counts = (0, 1), local_token = [0] (if token 0 is served on rank 0)
    """

    rank: int
    #: ``int64 [N]``: the local token of each row sent, grouped by destination rank (ascending), then token.
    send_token: torch.Tensor
    #: ``[G]`` rows sent to each rank (0 for this rank: local picks are not sent).
    send_counts: tuple[int, ...]
    #: ``[G]`` rows received from each rank (0 for this rank).
    recv_counts: tuple[int, ...]
    #: ``int64 [N_local]``: this rank's tokens with at least one pick served here, ascending.
    local_token: torch.Tensor
    #: Picks of ``local_token`` rows served here.
    local: ExpertWork
    #: Picks of the received rows (rows in the order received: by source rank, then token).
    remote: ExpertWork

    def to(self, device: torch.device | str) -> DispatchMeta:
        """The same decisions with every tensor on ``device``."""
        def work(w: ExpertWork) -> ExpertWork:
            return ExpertWork(w.pick_row.to(device), w.pick_slot.to(device), w.pick_weight.to(device), w.num_rows)

        return DispatchMeta(self.rank, self.send_token.to(device), self.send_counts, self.recv_counts,
                            self.local_token.to(device), work(self.local), work(self.remote))

    @property
    def num_local_picks(self) -> int:
        return int(self.local.pick_row.numel())

    @property
    def num_remote_picks(self) -> int:
        return int(self.remote.pick_row.numel())


def build_dispatch(dest_TK: np.ndarray, ids_TK: np.ndarray, weights_TK: np.ndarray, tokens_per_rank: Sequence[int],
                   rank: int, slot_of_E: np.ndarray, device: torch.device | str = "cpu") -> DispatchMeta:
    """Rank ``rank``'s sends, receives and picks, from every token's routing.

    ``dest_TK`` is the GPU serving each pick of every token (ranks' tokens concatenated in rank order),
    ``-1`` for a dropped pick; ``ids_TK`` and ``weights_TK`` the experts and gate weights;
    ``slot_of_E [E]`` this rank's slot for each expert (``-1`` where it holds none). Routes that name a GPU
    outside ``-1..G-1``, or send a pick here for an expert this rank does not hold, are refused
    (:class:`InputError`); :func:`moebalance.routing.base.check_routes` checks every rank's picks at once and names the router.
    """
    G = len(tokens_per_rank)
    T = dest_TK.shape[0]
    offsets = np.concatenate(([0], np.cumsum(tokens_per_rank))).astype(np.int64)
    if offsets[-1] != T:
        raise InputError(f"tokens_per_rank {list(tokens_per_rank)} sums to {int(offsets[-1])}, but the routing has "
                         f"{T} tokens")
    if not 0 <= rank < G:
        raise InputError(f"rank {rank} is not one of the {G} ranks 0..{G - 1}")
    outside = (dest_TK < -1) | (dest_TK >= G)
    if outside.any():
        bad_t, bad_k = (int(i) for i in np.argwhere(outside)[0])
        raise InputError(f"pick {bad_k} of token {bad_t} is routed to GPU {int(dest_TK[bad_t, bad_k])}; valid GPUs "
                         f"are 0..{G - 1} "
                         f"(-1 for a dropped pick)")
    src_T = np.repeat(np.arange(G, dtype=np.int64), tokens_per_rank)
    lo, hi = int(offsets[rank]), int(offsets[rank + 1])

    # a token goes once to each distinct GPU serving any of its picks: no sort needed, boolean tables suffice
    here = dest_TK == rank
    here_T = here.any(axis=1)
    local_token = np.flatnonzero(here_T[lo:hi])
    here_T[lo:hi] = False
    recv_tok = np.flatnonzero(here_T)  # ascending token = by source rank, then token
    recv_counts = np.bincount(src_T[recv_tok], minlength=G)
    own = dest_TK[lo:hi]
    tok, k = np.nonzero(own >= 0)
    need_GT = np.zeros((G, hi - lo), dtype=bool)  # this rank's token t has a pick served on GPU g
    need_GT[own[tok, k], tok] = True
    need_GT[rank] = False  # served here: not sent
    send_dst, send_token = np.nonzero(need_GT)  # by destination rank, then token
    send_counts = np.bincount(send_dst, minlength=G)

    pick_tok, pick_k = np.nonzero(here)
    pick_slot = slot_of_E[ids_TK[pick_tok, pick_k]]
    if np.any(pick_slot < 0):
        i = int(np.flatnonzero(pick_slot < 0)[0])
        raise InputError(f"pick {int(pick_k[i])} of token {int(pick_tok[i])} (expert {int(ids_TK[pick_tok[i], pick_k[i]])}) "
                         f"is routed to rank {rank}, which holds no copy of it")
    pick_w = weights_TK[pick_tok, pick_k].astype(np.float32)
    is_local = (pick_tok >= lo) & (pick_tok < hi)
    # numpy int64 index arrays go to torch once, on the layer's device
    def work(rows: np.ndarray, keys: np.ndarray, sel: np.ndarray) -> ExpertWork:
        return ExpertWork(
            pick_row=torch.as_tensor(np.searchsorted(keys, rows[sel]), dtype=torch.long, device=device),
            pick_slot=torch.as_tensor(pick_slot[sel], dtype=torch.long, device=device),
            pick_weight=torch.as_tensor(pick_w[sel], device=device), num_rows=int(keys.size))

    return DispatchMeta(
        rank=rank,
        send_token=torch.as_tensor(send_token, dtype=torch.long, device=device),
        send_counts=tuple(int(c) for c in send_counts),
        recv_counts=tuple(int(c) for c in recv_counts),
        local_token=torch.as_tensor(local_token, dtype=torch.long, device=device),
        local=work(pick_tok - lo, local_token, is_local),
        remote=work(pick_tok, recv_tok, ~is_local),
    )


def build_local(here_TK: np.ndarray, ids_TK: np.ndarray, weights_TK: np.ndarray, slot_of_E: np.ndarray,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, ExpertWork]:
    """``(local_token [N_local], picks)``: the picks of this rank's own tokens served here, without the router.

    ``here_TK [T_r, K]`` marks them (kept picks whose expert has a copy on this GPU, for a router that keeps
    such picks local); ``ids_TK``, ``weights_TK`` are this rank's tokens' experts and gate weights. The result
    is what :func:`build_dispatch` puts in ``local_token`` and ``local`` when the router served exactly these
    picks here: the same rows, picks, order and values, so the two-stage path computes the same bits.
    """
    local_token = np.flatnonzero(here_TK.any(axis=1))
    tok, k = np.nonzero(here_TK)
    slot = slot_of_E[ids_TK[tok, k]]
    if np.any(slot < 0):
        i = int(np.flatnonzero(slot < 0)[0])
        raise InputError(f"pick {int(k[i])} of local token {int(tok[i])} (expert {int(ids_TK[tok[i], k[i]])}) is "
                         "marked local, but this rank holds no copy of it")
    work = ExpertWork(
        pick_row=torch.as_tensor(np.searchsorted(local_token, tok), dtype=torch.long, device=device),
        pick_slot=torch.as_tensor(slot, dtype=torch.long, device=device),
        pick_weight=torch.as_tensor(weights_TK[tok, k].astype(np.float32), device=device),
        num_rows=int(local_token.size))
    return torch.as_tensor(local_token, dtype=torch.long, device=device), work


class Dispatcher:
    """The interface: gather the routing, dispatch rows, combine results. This base is the local no-op."""

    name = "local"

    def __init__(self, group: Any = None, impl: A2AImpl = "auto") -> None:
        self.group = group
        self.impl = impl

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    def gather_routing(self, routing_TX: torch.Tensor, max_rows: int | None = None) -> list[torch.Tensor]:
        """Every rank's ``[T_r, X]`` routing rows, by rank (``max_rows``: a fixed per-rank bound, one collective)."""
        if max_rows is not None and routing_TX.shape[0] > max_rows:
            raise over_budget(0, routing_TX.shape[0], max_rows)
        return [routing_TX]

    def gather_agreed(self, routing_TX: torch.Tensor, check: RankCheck,
                      max_rows: int | None = None) -> list[torch.Tensor]:
        """:meth:`gather_routing` once every rank's ``check`` is clean (:mod:`moebalance.runtime.agree`): on one
        process, this rank's own error is raised as it is."""
        if check.error is not None:
            raise check.error
        return self.gather_routing(routing_TX, max_rows)

    def dispatch(self, x_TH: torch.Tensor, meta: DispatchMeta, *, async_op: bool = False) -> Pending:
        """The rows other ranks send here (``[M, H]``, by source rank then token); ``x`` rows go out."""
        if meta.send_token.numel() or sum(meta.recv_counts):
            raise PlanError(f"the local dispatcher has one rank and sends nothing, but this dispatch sends "
                            f"{int(meta.send_token.numel())} rows and receives {sum(meta.recv_counts)}; use a plan "
                            f"whose every expert is on GPU 0, or the all_to_all dispatcher")
        return Pending(x_TH.new_empty((0, x_TH.shape[1])))

    def combine(self, y_MH: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """The partial results for the rows this rank sent (``[N, H]``, aligned with ``meta.send_token``)."""
        return y_MH.new_empty((0, y_MH.shape[1]))


LocalDispatcher = Dispatcher


class AllToAllDispatcher(Dispatcher):
    """Dispatch and combine with a variable-size all-to-all over ``group`` (native or point-to-point)."""

    name = "all_to_all"

    def __init__(self, group: Any = None, impl: A2AImpl = "auto") -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise InputError("the all_to_all dispatcher needs an initialised torch.distributed process group "
                             "(torch.distributed.init_process_group); use dispatcher='local' on one process")
        super().__init__(group, impl)
        resolve_impl(impl, group, torch.device("cpu"))  # validates the name early

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def gather_routing(self, routing_TX: torch.Tensor, max_rows: int | None = None) -> list[torch.Tensor]:
        return all_gather_v(routing_TX, self.group, max_rows)

    def gather_agreed(self, routing_TX: torch.Tensor, check: RankCheck,
                      max_rows: int | None = None) -> list[torch.Tensor]:
        return agreed_gather(routing_TX, check, self.group, max_rows)

    def dispatch(self, x_TH: torch.Tensor, meta: DispatchMeta, *, async_op: bool = False) -> Pending:
        rows = x_TH.index_select(0, meta.send_token)
        return all_to_all_v(rows, meta.send_counts, meta.recv_counts, self.group, self.impl, async_op=async_op)

    def combine(self, y_MH: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        return all_to_all_v(y_MH, meta.recv_counts, meta.send_counts, self.group, self.impl).wait()


#: Dispatchers by name.
DISPATCHERS: dict[str, Callable[..., Dispatcher]] = {"all_to_all": AllToAllDispatcher, "local": LocalDispatcher}


def make_dispatcher(name: str, group: Any = None, impl: A2AImpl = "auto") -> Dispatcher:
    """The dispatcher called ``name`` over ``group``."""
    try:
        cls = DISPATCHERS[name]
    except KeyError:
        raise InputError(f"unknown dispatcher {name!r}; choose one of: {', '.join(sorted(DISPATCHERS))}") from None
    return cls(group, impl)
