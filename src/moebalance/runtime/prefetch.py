"""Per-batch plans with a prefetch buffer: Libra's dynamic expert copies in the runtime (docs/design.md, "Runtime").

Legend: ``L`` layers, ``G`` ranks = GPUs, ``E`` logical experts, ``N`` buffer slots (the most extra experts a
GPU may add in one layer), ``S`` base slots of a rank in a layer, ``n <= N`` its extras in one batch, ``H``
hidden size, ``F`` expert FFN size, ``W`` numbers in one expert's weights (``2 H F`` for GELU, ``3 H F`` for SwiGLU).

Libra ("Libra: Effective yet Efficient Load Balancing for Large-Scale MoE Inference", Sections 3.2 and 4) keeps a
static *base* placement and, per batch and layer, copies up to ``N`` extra experts onto each GPU. Here:

- **Per-batch plan.** A :class:`~moebalance.core.plan.Placement` of the same shape as the base plan whose layer
  ``l``, GPU ``g`` list is the base plan's list (same order) followed by at most ``N`` extra expert ids, each
  one that GPU does not hold (:func:`batch_extras` checks it; a violation is a :class:`PlanError`). Rank ``g``'s
  local slots in that batch are its base slots ``0 .. S-1`` followed by the extras ``S .. S+n-1``; the router
  sees the whole per-batch layer plan, so load-aware routers use the extra copies.
- **Sources** (:func:`plan_fetches`, a pure function of the two plans, the same on every rank): each extra is
  copied from a GPU that holds the expert in the *base* plan, on the destination's node when one does, else
  any; within that tier the holder with the fewest sends so far in this layer, ties to the lowest id (the
  home, i.e. first, holder when nothing was sent yet), as :mod:`moebalance.runtime.rearrange` chooses.
- **Double buffer** (:class:`ExpertPrefetcher`, one per rank, shared by that rank's layers): two buffers of
  ``N`` slots; layer ``l`` computes from buffer ``l % 2``. Its copies are point-to-point messages (one per
  weight tensor of each extra, received in place, no packing) posted asynchronously with
  ``batch_isend_irecv``; when layer ``l`` starts computing, the copies for layer ``l + 1`` of the same
  per-batch plan are posted into the other buffer and overlap layer ``l``'s exchange and compute, and layer
  ``l + 1`` waits for them before it computes. Libra gathers base and extra experts into one buffer for a
  grouped GEMM; here the layer reads base slots from its own weights and extras from the buffer.

A buffer that already holds a layer's extras (the same layer and the same extras) is not filled again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from moebalance.core.errors import InputError, PlanError
from moebalance.core.plan import Placement
from moebalance.runtime.comm import global_rank, staged_through_host
from moebalance.runtime.experts import ExpertWeights

__all__ = ["ExpertPrefetcher", "Fetch", "PrefetchOwner", "PrefetchResult", "batch_extras", "plan_fetches"]

#: Point-to-point tag of buffer ``b``'s copies is ``PREFETCH_TAG + b`` (gloo matches by tag; NCCL by order).
PREFETCH_TAG = 7100

#: ``[L][G]`` the extra experts of each GPU in each layer.
Extras = tuple[tuple[tuple[int, ...], ...], ...]


@dataclass(frozen=True, slots=True)
class Fetch:
    """One extra expert copied into a buffer slot: ``Fetch(layer=1, expert=5, src=2, dst=0, slot=1)``."""

    layer: int
    expert: int
    src: int
    dst: int
    #: The buffer slot on ``dst`` (``0 .. N-1``): the extra's position after the base list.
    slot: int


class PrefetchOwner(Protocol):
    """What :class:`ExpertPrefetcher` reads from a layer it serves (one rank's
    :class:`~moebalance.runtime.ExpertParallelMoE` is one): the four members below, read only, nothing else."""

    @property
    def layer(self) -> int:
        """The layer's index in the plan: it fills buffer ``layer % 2``."""
        ...

    @property
    def rank(self) -> int:
        """This rank, i.e. GPU ``rank`` of the plan."""
        ...

    @property
    def plan(self) -> Placement:
        """The base plan: where each extra is copied from, and this rank's slot of each expert it sends."""
        ...

    @property
    def experts(self) -> ExpertWeights:
        """This rank's base experts of the layer (``S`` slots): the weights it sends, and the buffer's shapes."""
        ...


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """What one rank's buffer holds for one forward, and what filling it moved.

    Example: 2 extras received of 96 KiB each, none sent: ``received=2, bytes_received=196608, sent=0``. A buffer
    that already held the layer's extras reports zeros.
    """

    #: The buffer's ``N`` slots (the first ``n`` hold this rank's extras, in per-batch plan order); ``None``
    #: when the prefetcher has no slots.
    weights: ExpertWeights | None
    received: int
    bytes_received: int
    sent: int
    bytes_sent: int


def batch_extras(base: Placement, batch: Any, num_slots: int) -> Extras:
    """``[L][G]`` the extras of per-batch plan ``batch`` over ``base``, checked (module doc); a one-line error if not."""
    if not isinstance(batch, Placement):
        raise InputError(f"batch_plan must be a moebalance.core.plan.Placement, got {type(batch).__name__}")
    if (batch.num_layers, batch.num_experts, batch.num_gpus, batch.cluster.gpus_per_node) != \
            (base.num_layers, base.num_experts, base.num_gpus, base.cluster.gpus_per_node):
        raise PlanError(f"the per-batch plan has {batch.num_layers} layers x {batch.num_experts} experts on "
                        f"{batch.num_gpus} GPUs but the base plan {base.num_layers} x {base.num_experts} on "
                        f"{base.num_gpus}; derive it from the base plan (its lists, then the extras)")
    out = []
    for li, (bl, pl) in enumerate(zip(base.gpu_experts, batch.gpu_experts, strict=True)):
        row = []
        for g, (b, p) in enumerate(zip(bl, pl, strict=True)):
            if tuple(p[:len(b)]) != tuple(b):
                raise PlanError(f"the per-batch plan's layer {li}, GPU {g} lists {list(p)}, which does not start "
                                f"with the base plan's {list(b)}; list the base experts first, in their order, "
                                "then the extras")
            extra = tuple(p[len(b):])
            if len(extra) > num_slots and num_slots == 0:
                raise PlanError(f"the per-batch plan adds experts {list(extra)} to GPU {g} in layer {li} but the "
                                "layers have no prefetch buffer; build them with prefetcher=ExpertPrefetcher(N)")
            if len(extra) > num_slots:
                raise PlanError(f"the per-batch plan adds {len(extra)} experts {list(extra)} to GPU {g} in layer "
                                f"{li}; the prefetch buffer holds at most {num_slots} (ExpertPrefetcher num_slots)")
            seen = set(b)
            for e in extra:
                if e in seen:
                    raise PlanError(f"the per-batch plan adds expert {e} to GPU {g} in layer {li}, which already "
                                    "holds it; an extra must be an expert the GPU does not hold")
                seen.add(e)
            row.append(extra)
        out.append(tuple(row))
    return tuple(out)


def plan_fetches(base: Placement, layer: int, extras: Sequence[Sequence[int]]) -> tuple[Fetch, ...]:
    """The copies that fill layer ``layer``'s buffers with ``extras [G]``, by destination GPU then slot."""
    node = base.cluster.node_of()
    sends = np.zeros(base.num_gpus, dtype=np.int64)
    out = []
    for g, extra in enumerate(extras):
        for slot, e in enumerate(extra):
            holders = np.flatnonzero(base.copies[layer, e] > 0)
            near = holders[node[holders] == node[g]]
            tier = near if near.size else holders
            src = int(tier[np.argmin(sends[tier])])  # argmin: the lowest id among ties
            sends[src] += 1
            out.append(Fetch(layer, int(e), src, g, slot))
    return tuple(out)


@dataclass(slots=True)
class _Buffer:
    """One of the two buffers: ``flat [N, W]`` and the fill it holds or is receiving."""

    flat: torch.Tensor
    key: tuple[Any, ...] | None = None
    works: list[Any] = field(default_factory=list)
    #: ``(device slice, host staging tensor)`` to copy back after the wait (gloo with CUDA tensors).
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    #: Keeps staged send tensors alive until the wait.
    keep: list[torch.Tensor] = field(default_factory=list)
    counts: tuple[int, int] = (0, 0)  # (received, sent) by the current fill
    reported: bool = True

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        for dst, host in self.copy_back:
            dst.copy_(host)
        self.works, self.copy_back, self.keep = [], [], []


class ExpertPrefetcher:
    """One rank's double buffer of ``num_slots`` extra experts per layer, shared by its layers (module doc).

    Example::

        pf = ExpertPrefetcher(num_slots=2)
        layers = [ExpertParallelMoE.from_full(base, l, gate[l], full[l], gcfg, cfg, prefetcher=pf) for l in range(L)]
        for step, batch_plan in enumerate(plans):   # every rank, the same plans
            for l in range(L):
                h = layers[l](h, step=step, batch_plan=batch_plan).out

    All layers registered must have experts of the same shape, dtype and device. Every rank must build its
    layers with its own prefetcher and run the same per-batch plans in the same order (the copies are
    point-to-point messages matched in posting order).
    """

    def __init__(self, num_slots: int, *, group: Any = None) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise InputError(f"num_slots ({num_slots!r}) must be a non-negative integer (Libra's N)")
        self.num_slots = num_slots
        self.group = group
        self._layers: dict[int, PrefetchOwner] = {}
        self._buffers: list[_Buffer] = []
        self._shapes: tuple[tuple[int, ...], ...] = ()
        self._checked: tuple[Placement, Placement, Extras] | None = None

    # ----- registration and checks --------------------------------------------------------------------------
    def register(self, layer: PrefetchOwner) -> None:
        """Serve ``layer`` (called by :class:`~moebalance.runtime.ExpertParallelMoE`; a layer index registered
        again replaces the old one)."""
        tensors = layer.experts.tensors()
        shapes = tuple(tuple(t.shape[1:]) for t in tensors)
        like = tensors[0]
        if not self._buffers:
            self._shapes = shapes
            W = sum(math.prod(s) for s in shapes)
            self._buffers = [_Buffer(like.new_zeros((self.num_slots, W))) for _ in range(2)]
        elif shapes != self._shapes or like.dtype != self._buffers[0].flat.dtype \
                or like.device != self._buffers[0].flat.device:
            raise InputError(f"layer {layer.layer}'s experts have shapes {list(shapes)} ({like.dtype}, {like.device}) "
                             f"but the prefetcher's buffers hold {list(self._shapes)} "
                             f"({self._buffers[0].flat.dtype}, {self._buffers[0].flat.device}); use one prefetcher "
                             "per kind of layer")
        self._layers[layer.layer] = layer

    def extras(self, base: Placement, batch: Any) -> Extras:
        """:func:`batch_extras` of ``batch`` over ``base`` with this buffer's slots (the last answer is cached)."""
        c = self._checked
        if c is not None and c[0] is base and c[1] is batch:
            return c[2]
        out = batch_extras(base, batch, self.num_slots)
        self._checked = (base, batch, out)
        return out

    def views(self, buffer: int) -> ExpertWeights:
        """The ``N`` slots of buffer ``buffer`` as expert weights (views, no copy)."""
        flat = self._buffers[buffer].flat
        parts, lo = [], 0
        for s in self._shapes:
            n = math.prod(s)
            parts.append(flat[:, lo:lo + n].view(self.num_slots, *s))
            lo += n
        return ExpertWeights(parts[0], parts[1], parts[2] if len(parts) > 2 else None)

    # ----- copies ---------------------------------------------------------------------------------------------
    def start(self, batch_plan: Placement, layer: int) -> bool:
        """Post the copies of ``layer``'s extras under ``batch_plan`` into buffer ``layer % 2``, without waiting.

        A collective in spirit: every rank must call it at the same point. Returns False (and does nothing) when
        this rank has no such layer or the buffer already holds or receives that fill. An unchecked plan is
        checked first (a one-line :class:`PlanError`), on every rank alike when the plans agree.
        """
        owner = self._layers.get(layer)
        if owner is None or not self._buffers:
            return False
        return self.post(owner, self.extras(owner.plan, batch_plan)[layer])

    def post(self, owner: PrefetchOwner, extras: Sequence[Sequence[int]]) -> bool:
        """Post the copies that fill buffer ``owner.layer % 2`` with ``extras [G]`` (each GPU's extras of that layer,
        checked by the caller: at most ``N``, none hosted there), without waiting; exact mode plans them after the
        gate. A collective in spirit, as :meth:`start`; False when the buffer already holds or receives that fill."""
        layer = owner.layer
        if not self._buffers:
            return False
        extras = tuple(tuple(int(e) for e in row) for row in extras)
        buf = self._buffers[layer % 2]
        key = (layer, extras)
        if buf.key == key:
            return False
        buf.wait()  # an earlier fill still in flight completes first: messages match in posting order
        base = owner.plan
        rank = owner.rank
        fetches = plan_fetches(base, layer, extras)
        staged = staged_through_host(self.group, buf.flat.device)
        ops: list[Any] = []
        tag = PREFETCH_TAG + layer % 2
        sent = 0
        for f in fetches:
            if f.src == rank and f.dst != rank:
                slot = base.gpu_experts[layer][rank].index(f.expert)
                for t in owner.experts.tensors():
                    part = t[slot].contiguous()
                    if staged:
                        part = part.cpu()
                    buf.keep.append(part)
                    ops.append(dist.P2POp(dist.isend, part, global_rank(self.group, f.dst), self.group, tag))
                sent += 1
        received = 0
        for f in fetches:
            if f.dst == rank:
                lo = 0
                for s in self._shapes:
                    n = math.prod(s)
                    dst = buf.flat[f.slot, lo:lo + n]
                    if staged:
                        host = torch.empty(n, dtype=dst.dtype)
                        buf.copy_back.append((dst, host))
                        dst = host
                    ops.append(dist.P2POp(dist.irecv, dst, global_rank(self.group, f.src), self.group, tag))
                    lo += n
                received += 1
        buf.works = list(dist.batch_isend_irecv(ops)) if ops else []
        buf.key, buf.counts, buf.reported = key, (received, sent), False
        return True

    def acquire(self, layer: PrefetchOwner, batch_plan: Placement) -> PrefetchResult:
        """Buffer ``layer.layer % 2`` filled with the layer's extras under ``batch_plan`` (started now if it was
        not), then the copies for the next layer posted into the other buffer. Every rank calls it alike."""
        if not self._buffers:
            return PrefetchResult(None, 0, 0, 0, 0)
        self.start(batch_plan, layer.layer)
        result = self.ready(layer)
        self.start(batch_plan, layer.layer + 1)  # Libra Section 4: the next layer's copies overlap this layer
        return result

    def ready(self, layer: PrefetchOwner) -> PrefetchResult:
        """Buffer ``layer.layer % 2`` once the copies posted into it have landed (what they moved is reported by
        the first forward that waits for them; later ones report zeros)."""
        if not self._buffers:
            return PrefetchResult(None, 0, 0, 0, 0)
        bpe = layer.experts.bytes_per_expert()
        buf = self._buffers[layer.layer % 2]
        buf.wait()
        received, sent = (0, 0) if buf.reported else buf.counts
        buf.reported = True
        return PrefetchResult(self.views(layer.layer % 2), received, received * bpe, sent, sent * bpe)

    def drain(self) -> None:
        """Wait for every copy still in flight (before tearing the process group down)."""
        for buf in self._buffers:
            buf.wait()
