"""Experts touched: how many distinct experts each GPU's picks reach per ``(batch, layer)``, the weights its
grouped GEMM reads (:func:`moebalance.cost.time.gemm_seconds`).

Legend: ``B`` batches, ``L`` layers, ``E`` experts, ``G`` GPUs, ``T`` tokens, ``K`` picks per token.

- From picks (token-level): exact, whatever the router (:func:`pick_tally`).
- From counts: a router that knows its split of each expert over GPUs says which experts each GPU touches
  (:class:`TouchingRouter`, ``split_touched``; ``metro`` does). For the others every copy of an expert with
  load counts as touched (:func:`hosted_touched`): exact for ``uniform``'s fractional split, which gives every
  copy a share, and an upper bound for a router that may leave a copy idle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moebalance.algorithms.split import apply_shares
from moebalance.core.tally import distinct_served
from moebalance.routing.base import Router

if TYPE_CHECKING:
    from moebalance.core.plan import Placement

__all__ = ["TouchingRouter", "hosted_touched", "pick_tally", "split_touched"]


@dataclass(frozen=True, slots=True)
class TouchingRouter(Router):
    """A router that also says, on counts, which experts each GPU's picks touch."""

    #: ``(plan, counts [B, L, E], rng) -> (picks float64 [B, L, G], touched float64 [B, L, G])``: the picks
    #: each GPU serves (what ``split_counts`` returns) and the distinct experts they belong to.
    split_touched: Callable[[Placement, np.ndarray, np.random.Generator], tuple[np.ndarray, np.ndarray]] | None = None


def hosted_touched(plan: Placement, counts: np.ndarray) -> np.ndarray:
    """``float64 [B, L, G]``: the experts with load in ``counts [B, L, E]`` that GPU ``g`` holds a copy of."""
    has = (plan.copies > 0).astype(np.float64)  # [L, E, G]
    return apply_shares((np.asarray(counts) > 0).astype(np.float64), has)


def split_touched(router: Router, plan: Placement, counts: np.ndarray,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(picks float64 [B, L, G], touched float64 [B, L, G])`` of ``router`` on ``counts [B, L, E]``: its own
    answer when it gives one (:class:`TouchingRouter`), else its loads and :func:`hosted_touched`."""
    touching = getattr(router, "split_touched", None)
    if touching is not None:
        picks, touched = touching(plan, counts, rng)
        return np.asarray(picks, dtype=np.float64), np.asarray(touched, dtype=np.float64)
    return router.split_counts(plan, counts, rng), hosted_touched(plan, counts)


def pick_tally(dest: np.ndarray, ids: np.ndarray | None, batch: np.ndarray, num_batches: int, num_experts: int,
               num_gpus: int) -> tuple[np.ndarray, np.ndarray | None]:
    """``(picks float64 [B, L, G], touched float64 [B, L, G] or None)`` of routed picks: ``dest int [T, L, K]``
    the GPU serving each pick (``-1``: dropped, counted nowhere), ``ids int [T, L, K]`` its expert (``None``:
    picks only), ``batch int [T]``."""
    L = dest.shape[1]
    B, E, G = num_batches, num_experts, num_gpus
    base = (np.asarray(batch, dtype=np.int64)[:, None, None] * L + np.arange(L)[None, :, None]) * G  # [T, L, 1]
    cell = base + dest  # (batch, layer, GPU) of each pick: one pick-sized temporary, as a plain bincount needs
    served = dest >= 0
    whole = bool(served.all())
    cells = cell.ravel() if whole else cell[served]
    picks = np.bincount(cells, minlength=B * L * G).reshape(B, L, G).astype(np.float64)
    if ids is None:
        return picks, None
    return picks, distinct_served(dest, ids, np.asarray(batch, dtype=np.int64), B, E, G)
