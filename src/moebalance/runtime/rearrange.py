"""Changing the plan at run time: move expert weights so every rank ends with the new plan's experts (docs/design.md, "Runtime").

Legend: ``L`` layers, ``E`` logical experts, ``G`` ranks = GPUs, ``S`` slots of one rank in one layer.

Schedule (:func:`plan_transfers`, a pure function of the two plans, so every rank computes the same one):

- A rank that holds a copy of expert ``e`` in layer ``l`` in the old plan keeps it: nothing moves.
- Each ``(l, g, e)`` that is new (``g`` hosts ``e`` in the new plan and held no copy in the old one) is one
  transfer, from a GPU that held ``e`` in the old plan: one on ``g``'s node if there is one, else any; within
  that tier the holder with the fewest sends so far (over all layers; ties: lowest id), to spread the load.
- A second copy of ``e`` on the same GPU (EPLB plans can have them) is cloned locally, never sent.

So the transfers number exactly the new ``(layer, GPU, expert)`` triples. Execution (:func:`rearrange`) moves
one layer at a time with point-to-point sends (``isend``/``irecv`` in one batch per layer, see
:func:`moebalance.runtime.comm.p2p_exchange`): an expert's tensors are packed into one flat buffer, so a
transfer is one message; peak extra memory is one layer's incoming experts. Old experts the new plan does not
keep on a rank are dropped from that rank.

Libra and vLLM's EPLB move weights the same way (rearrange after a rebalance step); neither is needed here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moebalance.core.errors import PlanError
from moebalance.core.plan import Placement
from moebalance.runtime.comm import p2p_exchange
from moebalance.runtime.experts import ExpertWeights

__all__ = ["RearrangeReport", "Transfer", "plan_transfers", "rearrange"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One expert copy sent: ``Transfer(layer=3, expert=17, src=0, dst=5)``."""

    layer: int
    expert: int
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class RearrangeReport:
    """What a plan change moved (the schedule is the same on every rank; bytes are this rank's).

    Example: 2 transfers of 1 MiB experts, one of them from this rank: ``num_moved == 2``,
    ``bytes_sent == 1048576``.
    """

    rank: int
    #: The whole schedule, by layer, then destination GPU, then expert.
    transfers: tuple[Transfer, ...]
    bytes_per_expert: int
    #: Transfers between GPUs of one node / of different nodes, over all ranks.
    intra_node: int
    inter_node: int
    bytes_sent: int
    bytes_received: int

    @property
    def num_moved(self) -> int:
        return len(self.transfers)

    @property
    def bytes_moved(self) -> int:
        """Bytes sent by all ranks together."""
        return self.num_moved * self.bytes_per_expert


def _check_same_shape(old: Placement, new: Placement) -> None:
    if (old.num_layers, old.num_experts, old.num_gpus) != (new.num_layers, new.num_experts, new.num_gpus):
        raise PlanError(f"cannot rearrange a plan of {old.num_layers} layers x {old.num_experts} experts on "
                        f"{old.num_gpus} GPUs into one of {new.num_layers} x {new.num_experts} on {new.num_gpus}; "
                        "both plans must be for the same model and cluster")


def plan_transfers(old: Placement, new: Placement) -> tuple[Transfer, ...]:
    """The transfers that turn ``old`` into ``new``: one per new ``(layer, GPU, expert)``."""
    _check_same_shape(old, new)
    node = new.cluster.node_of()
    fresh = (new.copies > 0) & (old.copies == 0)  # [L, E, G]
    sends = np.zeros(new.num_gpus, dtype=np.int64)
    out = []
    for layer, e, g in sorted(zip(*np.nonzero(fresh), strict=True), key=lambda t: (t[0], t[2], t[1])):
        holders = np.flatnonzero(old.copies[layer, e] > 0)
        near = holders[node[holders] == node[g]]
        tier = near if near.size else holders
        src = int(tier[np.argmin(sends[tier])])  # argmin takes the lowest id among ties
        sends[src] += 1
        out.append(Transfer(int(layer), int(e), src, int(g)))
    return tuple(out)


def _pack(experts: ExpertWeights, slot: int) -> torch.Tensor:
    return torch.cat([t[slot].reshape(-1) for t in experts.tensors()])


def _unpack(flat: torch.Tensor, like: ExpertWeights) -> tuple[torch.Tensor, ...]:
    parts, lo = [], 0
    for t in like.tensors():
        n = math.prod(t.shape[1:])
        parts.append(flat[lo:lo + n].view(t.shape[1:]))
        lo += n
    return tuple(parts)


def rearrange(old: Placement, new: Placement, shards: Sequence[ExpertWeights], group: Any = None,
              ) -> tuple[list[ExpertWeights], RearrangeReport]:
    """Move weights so this rank holds ``new``'s experts: ``(new shards per layer, report)``.

    ``shards[l]`` is this rank's experts of layer ``l`` under ``old`` (``old.gpu_experts[l][rank]`` order).
    A collective: every rank of ``group`` must call it with the same plans.
    """
    _check_same_shape(old, new)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if len(shards) != old.num_layers:
        raise PlanError(f"got {len(shards)} layers of expert weights for a plan of {old.num_layers} layers")
    transfers = plan_transfers(old, new)
    kinds = new.cluster.link_kind()
    bpe = shards[0].bytes_per_expert() if shards else 0
    new_shards = []
    for layer, shard in enumerate(shards):
        have = old.gpu_experts[layer][rank]
        if shard.num_experts != len(have):
            raise PlanError(f"rank {rank} holds {len(have)} experts in layer {layer} of the old plan but was "
                            f"given {shard.num_experts}")
        moves = [t for t in transfers if t.layer == layer]
        sends = [(t.dst, _pack(shard, have.index(t.expert))) for t in moves if t.src == rank]
        incoming = [t for t in moves if t.dst == rank]
        numel = sum(math.prod(t.shape[1:]) for t in shard.tensors())
        recvs = [(t.src, shard.w1_SHF.new_empty(numel)) for t in incoming]
        p2p_exchange(sends, recvs, group)
        got = {t.expert: _unpack(buf, shard) for t, (_, buf) in zip(incoming, recvs, strict=True)}
        new_shards.append(_assemble(new.gpu_experts[layer][rank], have, shard, got))
    return new_shards, RearrangeReport(
        rank=rank, transfers=transfers, bytes_per_expert=bpe,
        intra_node=sum(1 for t in transfers if kinds[t.src, t.dst] == 1),
        inter_node=sum(1 for t in transfers if kinds[t.src, t.dst] == 2),
        bytes_sent=bpe * sum(1 for t in transfers if t.src == rank),
        bytes_received=bpe * sum(1 for t in transfers if t.dst == rank))


def _assemble(want: Sequence[int], have: Sequence[int], shard: ExpertWeights,
              got: dict[int, tuple[torch.Tensor, ...]]) -> ExpertWeights:
    """This rank's new slots ``want``, from its old slots ``have`` and the experts received ``got``."""
    tensors = shard.tensors()
    cols: list[list[torch.Tensor]] = [[] for _ in tensors]
    for e in want:
        parts = tuple(t[have.index(e)] for t in tensors) if e in have else got[e]
        for c, p in zip(cols, parts, strict=True):
            c.append(p)
    stacked = [torch.stack(c) if c else t[:0].clone() for c, t in zip(cols, tensors, strict=True)]
    return ExpertWeights(stacked[0], stacked[1], stacked[2] if len(stacked) > 2 else None)
