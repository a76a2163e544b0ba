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

from dataclasses import dataclass

import numpy as np

from moebalance.core.errors import InputError

__all__ = ["RoutingTrace"]


def _int_array(value: object, name: str, ndim: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool):
        raise InputError(f"{name} has dtype {arr.dtype}; it must hold integers (expert ids, ranks, batch ids)")
    if arr.ndim != ndim:
        raise InputError(f"{name} has shape {arr.shape}; expected {ndim} dimensions")
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True, slots=True)
class RoutingTrace:
    """Which experts each token picked, per layer, with the token's GPU and batch.

    Example: two tokens, one layer, top-2, 4 experts, both on GPU 0 in batch 0::

        RoutingTrace(topk_ids=[[[0, 3]], [[3, 1]]], src_gpu=[0, 0], batch=[0, 0], num_experts=4)

    has ``counts() == [[[1, 1, 0, 2]]]``.
    """

    #: ``int64 [T, L, K]``: the experts token ``t`` picked in layer ``l`` (distinct within a token).
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
        src = _int_array(self.src_gpu, "src_gpu", 1)
        batch = _int_array(self.batch, "batch", 1)
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
            lo, hi = int(topk.min()), int(topk.max())
            if lo < 0 or hi >= num_experts:
                bad = lo if lo < 0 else hi
                raise InputError(f"topk_ids holds expert id {bad}; ids must lie in [0, {num_experts})")
            if int(src.min()) < 0:
                raise InputError(f"src_gpu holds rank {int(src.min())}; ranks must be >= 0")
            if int(batch.min()) < 0:
                raise InputError(f"batch holds id {int(batch.min())}; batch ids must be >= 0")
            if np.any(np.diff(batch) < 0):
                first = int(np.argmax(np.diff(batch) < 0)) + 1
                raise InputError(f"batch must be non-decreasing, but token {first} goes back to an earlier batch")
            if topk.shape[2] > 1:
                srt = np.sort(topk, axis=2)
                dup = np.any(srt[:, :, 1:] == srt[:, :, :-1], axis=2)
                if dup.any():
                    t, layer = (int(i) for i in np.argwhere(dup)[0])
                    raise InputError(f"token {t} picks the same expert twice in layer {layer}; top-k picks are distinct")
        max_batch = int(batch.max()) + 1 if num_tokens else 0
        num_batches = max_batch if self.num_batches < 0 else int(self.num_batches)
        if num_batches < max_batch:
            raise InputError(f"batch holds id {max_batch - 1} but there are only {num_batches} batches")
        object.__setattr__(self, "topk_ids", topk)
        object.__setattr__(self, "src_gpu", src)
        object.__setattr__(self, "batch", batch)
        object.__setattr__(self, "num_experts", num_experts)
        object.__setattr__(self, "num_batches", num_batches)

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
        B, L, E = self.num_batches, self.num_layers, self.num_experts
        layer = np.arange(L, dtype=np.int64)[None, :, None]
        flat = (self.batch[:, None, None] * L + layer) * E + self.topk_ids
        return np.bincount(flat.ravel(), minlength=B * L * E).reshape(B, L, E)

    def coactivation(self) -> np.ndarray:
        """``int64 [L, E, E]``: ``A[l, i, j]`` tokens that picked both ``i`` and ``j`` in layer ``l``.

        The diagonal ``A[l, i, i]`` is expert ``i``'s load (GRACE Section 4.1's affinity before normalising).
        """
        L, E = self.num_layers, self.num_experts
        ids = self.topk_ids
        layer = np.arange(L, dtype=np.int64)[None, :, None, None]
        flat = (layer * E + ids[:, :, :, None]) * E + ids[:, :, None, :]
        return np.bincount(flat.ravel(), minlength=L * E * E).reshape(L, E, E)

    def transitions(self) -> np.ndarray:
        """``int64 [L-1, E, E]``: ``R[l, i, j]`` (token, pick) pairs going from ``i`` in ``l`` to ``j`` in ``l+1``.

        A token that picked ``i`` in layer ``l`` and ``j`` in layer ``l + 1`` adds one to ``R[l, i, j]``
        (MoETuner Section 3's cross-layer routing dependency); each token adds ``K * K`` pairs per layer pair.
        """
        L, E = self.num_layers, self.num_experts
        if L < 2:
            return np.zeros((0, E, E), dtype=np.int64)
        ids = self.topk_ids
        layer = np.arange(L - 1, dtype=np.int64)[None, :, None, None]
        flat = (layer * E + ids[:, :-1, :, None]) * E + ids[:, 1:, None, :]
        return np.bincount(flat.ravel(), minlength=(L - 1) * E * E).reshape(L - 1, E, E)

    def demand(self, num_gpus: int) -> np.ndarray:
        """``int64 [L, G, E]``: tokens living on GPU ``g`` that picked expert ``e`` in layer ``l``."""
        self.check_gpus(num_gpus)
        L, E = self.num_layers, self.num_experts
        layer = np.arange(L, dtype=np.int64)[None, :, None]
        flat = (layer * num_gpus + self.src_gpu[:, None, None]) * E + self.topk_ids
        return np.bincount(flat.ravel(), minlength=L * num_gpus * E).reshape(L, num_gpus, E)

    def check_gpus(self, num_gpus: int) -> None:
        """Raise if a token lives on a rank the cluster does not have."""
        if self.num_tokens and int(self.src_gpu.max()) >= num_gpus:
            raise InputError(
                f"src_gpu holds rank {int(self.src_gpu.max())} but the cluster has {num_gpus} GPUs; "
                "record the trace with as many data-parallel ranks as GPUs, or use a larger cluster"
            )

    def select_batches(self, start: int, stop: int) -> RoutingTrace:
        """The tokens of batches ``start <= b < stop``, renumbered from 0."""
        lo, hi = np.searchsorted(self.batch, [start, stop], side="left")
        return RoutingTrace(
            topk_ids=self.topk_ids[lo:hi],
            src_gpu=self.src_gpu[lo:hi],
            batch=self.batch[lo:hi] - start,
            num_experts=self.num_experts,
            num_batches=stop - start,
        )
