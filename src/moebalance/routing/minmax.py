"""The ``minmax`` router: the split of each expert's tokens over its copies that minimises the busiest GPU.

Beyond the papers: it is the bound every other router is measured against (``routing_gap`` in
:func:`moebalance.routing.simulate.evaluate`). The algorithm and why it is exact:
:mod:`moebalance.algorithms.minmax` and docs/papers/routing.md, "The min-max split".

- On counts the split is fractional and equals the LP optimum; of all optimal splits it takes the one with the
  most even GPU loads (lexicographically smallest), so idle time and load deviation are least too.
- On tokens every pick goes to one GPU and the straggler carries ``ceil(t*)`` picks, the integral optimum;
  among such splits it keeps picks on their own GPU, then their own node (a minimum-cost flow).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moebalance.algorithms import minmax as kernel
from moebalance.routing.base import Router

if TYPE_CHECKING:
    from moebalance.core.plan import Placement
    from moebalance.core.trace import RoutingTrace

__all__ = ["MINMAX", "batch_starts", "least_max_load"]


def batch_starts(trace: RoutingTrace) -> np.ndarray:
    """``int64 [B + 1]``: batch ``b``'s tokens are ``batch_starts[b]:batch_starts[b + 1]`` (batches are sorted)."""
    return np.searchsorted(trace.batch, np.arange(trace.num_batches + 1)).astype(np.int64)


def least_max_load(plan: Placement, counts: np.ndarray, *, integral: bool) -> np.ndarray:
    """``float64 [B, L]``: the least straggler load any split of ``counts [B, L, E]`` over ``plan`` allows:
    ``t*`` (fractional tokens) or ``ceil(t*)`` (whole tokens)."""
    return kernel.max_loads(np.ascontiguousarray(counts, dtype=np.int64), plan.copies > 0, integral)


def _counts(plan: Placement, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return kernel.split_counts(np.ascontiguousarray(counts, dtype=np.int64), plan.copies > 0)


def _kept(plan: Placement, trace: RoutingTrace, kept: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    trace.check_gpus(plan.num_gpus)  # the flow's classes are (the token's GPU, its expert)
    starts = batch_starts(trace)
    has = plan.copies > 0
    dest = np.empty(trace.topk_ids.shape, dtype=np.int64)
    for layer in range(trace.num_layers):
        ids = np.ascontiguousarray(trace.topk_ids[:, layer, :], dtype=np.int64)
        dest[:, layer, :] = kernel.route_tokens(ids, trace.src_gpu,
                                                starts, has[layer], plan.cluster.gpus_per_node,
                                                np.ascontiguousarray(kept[:, layer, :]))
    return dest


def _tokens(plan: Placement, trace: RoutingTrace, rng: np.random.Generator) -> np.ndarray:
    return _kept(plan, trace, np.ones(trace.topk_ids.shape, dtype=bool), rng)


MINMAX = Router("minmax", _counts, _tokens,
                "the split minimising the busiest GPU (LP optimum on counts, ceil of it on tokens; then least traffic)",
                assign_kept=_kept)
