"""Token-level routing traces and the statistics derived from them.

Legend: ``T`` tokens, ``L`` MoE layers, ``K`` experts picked per token (top-k), ``E`` experts per layer,
``B`` batches, ``G`` GPUs.

A :class:`RoutingTrace` records, for every token, the experts it picked in every layer (``topk_ids_TLK``),
the data-parallel rank it lives on (``src_gpu_T``) and its batch (``batch_T``, non-decreasing). From it we
derive the load matrix ``counts [B, L, E]``, the co-activation (affinity) matrices ``[L, E, E]`` used by
GRACE, the cross-layer transition counts ``[L-1, E, E]`` used by MoETuner, and the per-source demand
``[L, G, E]`` used by locality-aware routers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from moebalance.core import tally
from moebalance.core.errors import InputError
from moebalance.core.limits import check_alloc

__all__ = ["RoutingTrace"]


def _int_array(value: object, name: str, ndim: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool):
        raise InputError(f"{name} has dtype {arr.dtype}; it must hold integers (expert ids, ranks, batch ids)")
    if arr.ndim != ndim:
        raise InputError(f"{name} has shape {arr.shape}; expected {ndim} dimensions")
    return arr


@dataclass(frozen=True, slots=True)
class RoutingTrace:
    """Which experts each token picked, per layer, with the token's GPU and batch.

    Example: two tokens, one layer, top-2, 4 experts, both on GPU 0 in batch 0::

        RoutingTrace(topk_ids=[[[0, 3]], [[3, 1]]], src_gpu=[0, 0], batch=[0, 0], num_experts=4)

    has ``counts() == [[[1, 1, 0, 2]]]``.

    Expert ids are held compactly (``int16`` up to 32,767 experts, else ``int32``: a quarter or half of
    ``int64``), and every statistic below is counted in one pass over the picks with no trace-sized
    temporary (:mod:`moebalance.core.tally`), so memory grows with the trace only by the ids themselves.
    """

    #: ``int16 | int32 [T, L, K]``: the experts token ``t`` picked in layer ``l`` (distinct within a token); the
    #: dtype is :func:`moebalance.core.tally.id_dtype` of ``num_experts``, whatever integer type was given.
    topk_ids: np.ndarray
    #: ``int64 [T]``: the GPU (data-parallel rank) token ``t`` lives on.
    src_gpu: np.ndarray
    #: ``int64 [T]``: the batch of token ``t``; non-decreasing, in ``[0, num_batches)``.
    batch: np.ndarray
    #: ``E``, experts per layer.
    num_experts: int
    #: ``B``; defaults to ``batch.max() + 1``.
    num_batches: int = -1

    def __post_init__(self) -> None:
        topk = _int_array(self.topk_ids, "topk_ids", 3)
        src = np.ascontiguousarray(_int_array(self.src_gpu, "src_gpu", 1), dtype=np.int64)
        batch = np.ascontiguousarray(_int_array(self.batch, "batch", 1), dtype=np.int64)
        num_tokens = topk.shape[0]
        if src.shape[0] != num_tokens or batch.shape[0] != num_tokens:
            raise InputError(
                f"topk_ids has {num_tokens} tokens but src_gpu has {src.shape[0]} and batch has "
                f"{batch.shape[0]}; all three must have one entry per token"
            )
        if topk.shape[1] == 0 or topk.shape[2] == 0:
            raise InputError(f"topk_ids has shape {topk.shape}; it needs at least one layer and one pick")
        num_experts = int(self.num_experts)
        if num_experts < 1:
            raise InputError(f"num_experts ({num_experts}) must be positive")
        if num_tokens:
            if int(src.min()) < 0:
                raise InputError(f"src_gpu holds rank {int(src.min())}; ranks must be >= 0")
            if int(batch.min()) < 0:
                raise InputError(f"batch holds id {int(batch.min())}; batch ids must be >= 0")
            if np.any(np.diff(batch) < 0):
                first = int(np.argmax(np.diff(batch) < 0)) + 1
                raise InputError(f"batch must be non-decreasing, but token {first} goes back to an earlier batch")
        max_batch = int(batch[-1]) + 1 if num_tokens else 0
        num_batches = max_batch if self.num_batches < 0 else int(self.num_batches)
        if num_batches < max_batch:
            raise InputError(f"batch holds id {max_batch - 1} but there are only {num_batches} batches")
        # every trace has counts [B, L, E] (and the pick check an [E] array): refuse ids that make them absurd
        check_alloc((num_batches, topk.shape[1], num_experts), 8, "the counts [B, L, E] of this trace",
                    "expert ids must lie below the model's expert count and batch ids below the number of batches "
                    "(is the file damaged?)")
        topk = tally.as_ids(topk.astype(np.int8) if topk.dtype == bool else topk, num_experts)
        if num_tokens:
            tally.check_picks(topk, num_experts)
        object.__setattr__(self, "topk_ids", topk)
        object.__setattr__(self, "src_gpu", src)
        object.__setattr__(self, "batch", batch)
        object.__setattr__(self, "num_experts", num_experts)
        object.__setattr__(self, "num_batches", num_batches)

    @classmethod
    def _checked(cls, topk_ids: np.ndarray, src_gpu: np.ndarray, batch: np.ndarray, num_experts: int,
                 num_batches: int) -> RoutingTrace:
        """A trace from arrays already validated in these dtypes (a slice of a trace): no second check."""
        trace = object.__new__(cls)
        for name, value in (("topk_ids", topk_ids), ("src_gpu", src_gpu), ("batch", batch),
                            ("num_experts", num_experts), ("num_batches", num_batches)):
            object.__setattr__(trace, name, value)
        return trace

    @property
    def num_tokens(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.topk_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[2])

    def counts(self) -> np.ndarray:
        """``int64 [B, L, E]``: tokens routed to each expert of each layer in each batch."""
        return tally.count_picks(self.topk_ids, self.batch, self.num_batches, self.num_experts)

    def coactivation(self) -> np.ndarray:
        """``int64 [L, E, E]``: ``A[l, i, j]`` tokens that picked both ``i`` and ``j`` in layer ``l``.

        The diagonal ``A[l, i, i]`` is expert ``i``'s load (GRACE Section 4.1's affinity before normalising).
        """
        return tally.pair_counts(self.topk_ids, self.num_experts)

    def transitions(self) -> np.ndarray:
        """``int64 [L-1, E, E]``: ``R[l, i, j]`` (token, pick) pairs going from ``i`` in ``l`` to ``j`` in ``l+1``.

        A token that picked ``i`` in layer ``l`` and ``j`` in layer ``l + 1`` adds one to ``R[l, i, j]``
        (MoETuner Section 3's cross-layer routing dependency); each token adds ``K * K`` pairs per layer pair.
        """
        return tally.transition_counts(self.topk_ids, self.num_experts)

    def demand(self, num_gpus: int) -> np.ndarray:
        """``int64 [L, G, E]``: tokens living on GPU ``g`` that picked expert ``e`` in layer ``l``."""
        self.check_gpus(num_gpus)
        return tally.demand_counts(self.topk_ids, self.src_gpu, num_gpus, self.num_experts)

    def check_gpus(self, num_gpus: int) -> None:
        """Raise if a token lives on a rank the cluster does not have."""
        if self.num_tokens and int(self.src_gpu.max()) >= num_gpus:
            raise InputError(
                f"src_gpu holds rank {int(self.src_gpu.max())} but the cluster has {num_gpus} GPUs; "
                "record the trace with as many data-parallel ranks as GPUs, or use a larger cluster"
            )

    def select_batches(self, start: int, stop: int) -> RoutingTrace:
        """The tokens of batches ``start <= b < stop``, renumbered from 0 (views of the ids: no copy)."""
        lo, hi = np.searchsorted(self.batch, [start, stop], side="left")
        return RoutingTrace._checked(self.topk_ids[lo:hi], self.src_gpu[lo:hi], self.batch[lo:hi] - start,
                                     self.num_experts, stop - start)

    def batch_chunks(self, max_picks: int = 1 << 24) -> Iterator[tuple[int, int]]:
        """Consecutive batch ranges ``(start, stop)`` covering every batch, each of at most ``max_picks`` picks
        (``T * L * K`` of its tokens) unless one batch alone holds more.

        Replaying a trace one such chunk at a time bounds the per-pick temporaries (a router's destination
        GPUs, ``int64``) by the chunk, not by the trace; a trace of at most ``max_picks`` picks is one chunk.
        """
        per_token = self.num_layers * self.top_k
        bounds = np.searchsorted(self.batch, np.arange(self.num_batches + 1), side="left")
        start = 0
        while start < self.num_batches:
            stop = start + 1
            while stop < self.num_batches and (int(bounds[stop + 1]) - int(bounds[start])) * per_token <= max_picks:
                stop += 1
            yield start, stop
            start = stop
