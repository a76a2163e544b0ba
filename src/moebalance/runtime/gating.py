"""Top-k gating with an optional expert capacity (background in docs/papers/routing.md).

Legend: ``T`` tokens, ``E`` experts, ``K`` picks per token (top-k), ``H`` hidden size.

Gating, as vLLM's ``select_experts`` with ``renormalize=True``:

1. affinity ``scores[t, e]``: softmax over *all* ``E`` logits (or an elementwise sigmoid, as DeepSeek-V3),
   computed in float32;
2. keep the ``K`` highest scores per token; equal scores are broken by the lowest expert index (a stable
   descending sort's ``argsort(-gates, kind="stable")``);
3. renormalise the ``K`` kept gates to sum to 1 (``renormalize=False`` keeps the raw affinities, whose sum
   is then below 1 for softmax).

An optional ``selection_bias [E]`` is added to the scores for choosing the experts only, never to the mixing
weights (DeepSeek-V3's auxiliary-loss-free balancing bias).

Capacity (Switch Transformer, GShard): with ``capacity_factor`` set, each expert takes at most
``capacity = ceil(capacity_factor * T * K / E)`` picks of the ``T`` tokens gated together. The usual textbook
formula rounds down (``floor``); we round up, so that ``capacity_factor = 1`` on a load that does not divide evenly
still fits the average, and we round the product to 9 decimals first so that ``1.1 * 10 / 11`` is 1, not 2.
Picks claim capacity in **token order, and within a token by gate rank** (pick 0 first), i.e. row-major over
``topk_ids [T, K]``, as Switch Transformer keeps the first ``cap`` tokens that arrive. A pick that finds its expert
full is

- ``drop``: dropped. The token keeps its other picks; the dropped pick's weight becomes 0, so its share of
  the gate mass goes to the residual stream (contributes nothing to the MoE output). The kept weights are
  *not* renormalised again.
- ``spill``: moved to the token's next-best expert (by score; ties lowest index) that is not already one of
  its picks and still has room; its weight is that expert's own score (divided by the same top-k sum as
  the other picks when renormalising). If every other expert is full the pick is dropped as above.

Raising the factor never drops more picks under ``drop`` (a larger capacity keeps a superset). ``spill``
never drops more than ``drop`` at the same capacity: an expert that ends below capacity never overflowed,
so it kept all ``n_e`` of its original picks, and the kept total is at least
``capacity * |full| + sum over the others of n_e``, leaving at most ``sum over full experts of
(n_e - capacity)`` dropped, which is what ``drop`` loses on them. So ``spill`` drops nothing once
``capacity >= T`` (at most ``T`` picks per expert), and nothing once ``(E - K + 1) * capacity >= T * K``
(a drop needs every expert outside the token's ``K`` picks full). That ``spill`` drops are also monotone in
the factor held in 10^5 randomised checks and is tested as a property, but we have no proof of it.

In the expert-parallel layer every rank gates its own tokens, so a rank's tokens form one capacity group
(GShard's "group"); the dense reference takes the same groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from moebalance.core.errors import InputError

__all__ = ["GateConfig", "GateOutput", "Overflow", "ScoreFn", "apply_capacity", "expert_capacity", "topk_gating"]

ScoreFn = Literal["softmax", "sigmoid"]
Overflow = Literal["drop", "spill"]


@dataclass(kw_only=True, frozen=True, slots=True)
class GateConfig:
    """How tokens pick experts.

    Example: ``GateConfig(top_k=2, capacity_factor=1.25)`` is softmax top-2, renormalised, with a capacity of
    ``ceil(1.25 * T * 2 / E)`` picks per expert and overflowing picks dropped.
    """

    top_k: int
    score_fn: ScoreFn = "softmax"
    renormalize: bool = True
    #: ``None`` disables the capacity (no pick is ever dropped).
    capacity_factor: float | None = None
    overflow: Overflow = "drop"

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise InputError(f"top_k ({self.top_k!r}) must be a positive integer")
        if self.score_fn not in ("softmax", "sigmoid"):
            raise InputError(f"score_fn ({self.score_fn!r}) must be 'softmax' or 'sigmoid'")
        if self.overflow not in ("drop", "spill"):
            raise InputError(f"overflow ({self.overflow!r}) must be 'drop' or 'spill'")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, int | float) or not math.isfinite(cf)
                               or cf < 0):
            raise InputError(f"capacity_factor ({cf!r}) must be a finite number >= 0, or None for no capacity")

    def capacity(self, num_tokens: int, num_experts: int) -> int | None:
        """Picks each expert may take from ``num_tokens`` tokens, or ``None`` without a capacity."""
        if self.capacity_factor is None:
            return None
        return expert_capacity(num_tokens, self.top_k, num_experts, self.capacity_factor)


@dataclass(frozen=True, slots=True)
class GateOutput:
    """The gate's decision for ``T`` tokens.

    Example: two tokens, ``E = 4``, top-2, the second token's pick 1 dropped by the capacity::

        topk_ids = [[2, 0], [2, 3]], topk_weights = [[0.6, 0.4], [0.7, 0.0]], kept = [[T, T], [T, F]]
    """

    #: ``int64 [T, K]``: the expert of each pick after capacity (a spilled pick names its new expert; a
    #: dropped pick keeps the expert it overflowed). Distinct within a token.
    topk_ids: torch.Tensor
    #: ``float32 [T, K]``: mixing weight of each pick; 0 where dropped.
    topk_weights: torch.Tensor
    #: ``bool [T, K]``: False where the pick was dropped.
    kept: torch.Tensor
    #: ``float32 [T, E]``: the affinities (softmax or sigmoid), before any selection bias.
    scores: torch.Tensor

    @property
    def num_dropped(self) -> int:
        return int((~self.kept).sum().item())


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor * T * K / E)`` (rounded to 9 decimals before the ceiling).

    Example: ``expert_capacity(1024, 2, 8, 1.25) == 320`` (the classic example, where floor agrees).
    """
    if num_experts < 1:
        raise InputError(f"num_experts ({num_experts}) must be positive")
    return math.ceil(round(capacity_factor * num_tokens * top_k / num_experts, 9))


def _stable_order(values_TE: torch.Tensor) -> torch.Tensor:
    """``int64 [T, E]``: experts by descending value, equal values by ascending index."""
    return torch.sort(values_TE, dim=-1, descending=True, stable=True).indices


def topk_gating(logits_TE: torch.Tensor, config: GateConfig, *,
                selection_bias_E: torch.Tensor | None = None) -> GateOutput:
    """Gate ``logits [T, E]`` (any float dtype, any device) into top-k picks, weights and the capacity mask."""
    if logits_TE.ndim != 2:
        raise InputError(f"logits must be [T, E], got shape {tuple(logits_TE.shape)}")
    T, E = logits_TE.shape
    K = config.top_k
    if K > E:
        raise InputError(f"top_k ({K}) must not exceed the number of experts ({E})")
    logits = logits_TE.float()
    scores_TE = torch.softmax(logits, dim=-1) if config.score_fn == "softmax" else torch.sigmoid(logits)
    select_TE = scores_TE if selection_bias_E is None else scores_TE + selection_bias_E.float()
    order_TE = _stable_order(select_TE)
    topk_ids_TK = order_TE[:, :K]
    raw_TK = torch.gather(scores_TE, 1, topk_ids_TK)
    denom_T1 = raw_TK.sum(dim=-1, keepdim=True) if config.renormalize else torch.ones_like(raw_TK[:, :1])
    cap = config.capacity(T, E)
    if cap is None:
        kept_TK = torch.ones_like(topk_ids_TK, dtype=torch.bool)
    else:
        topk_ids_TK, kept_TK = apply_capacity(topk_ids_TK, order_TE, E, cap, config.overflow)
    weights_TK = torch.gather(scores_TE, 1, topk_ids_TK) / denom_T1
    weights_TK = torch.where(kept_TK, weights_TK, torch.zeros_like(weights_TK))
    return GateOutput(topk_ids=topk_ids_TK, topk_weights=weights_TK, kept=kept_TK, scores=scores_TE)


def apply_capacity(topk_ids_TK: torch.Tensor, order_TE: torch.Tensor, num_experts: int, capacity: int,
                   overflow: Overflow) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids, kept)`` after giving each expert at most ``capacity`` picks, in row-major pick order.

    ``order_TE`` lists each token's experts by preference (best first); ``spill`` walks it past the top-k.
    ``drop`` is vectorised (a stable sort gives each pick its arrival position at its expert); ``spill`` is
    sequential by nature (each spilled pick changes the room left) and runs a loop over the picks on the
    CPU: fine for a layer's tokens, not for millions.
    """
    T, K = topk_ids_TK.shape
    if overflow == "drop":
        flat = topk_ids_TK.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        sorted_ids = flat[order]
        n = flat.numel()
        idx = torch.arange(n, device=flat.device)
        is_start = torch.ones(n, dtype=torch.bool, device=flat.device)
        if n > 1:
            is_start[1:] = sorted_ids[1:] != sorted_ids[:-1]
        start = torch.cummax(torch.where(is_start, idx, torch.zeros_like(idx)), dim=0).values if n else idx
        arrival = torch.empty_like(idx)
        arrival[order] = idx - start
        return topk_ids_TK, (arrival < capacity).reshape(T, K)
    ids = topk_ids_TK.cpu().numpy().copy()
    pref = order_TE.cpu().numpy()
    kept = np.ones((T, K), dtype=bool)
    load = np.zeros(num_experts, dtype=np.int64)
    member = np.zeros(num_experts, dtype=bool)
    for t in range(T):
        member[ids[t]] = True
        for j in range(K):
            e = ids[t, j]
            if load[e] < capacity:
                load[e] += 1
                continue
            room = (load[pref[t]] < capacity) & ~member[pref[t]]
            if room.any():
                new = pref[t, int(np.argmax(room))]
                ids[t, j] = new
                member[new] = True
                load[new] += 1
            else:
                kept[t, j] = False
        member[pref[t]] = False
    dev = topk_ids_TK.device
    return torch.from_numpy(ids).to(dev), torch.from_numpy(kept).to(dev)
