"""GRACE-MoE's routers (Section 4.3 and Appendix A.3; see docs/papers/grace.md): ``wrr`` and ``locality``.

``wrr`` -- weighted round-robin with load prediction (Alg. 3). Each token goes to one replica of its expert,
drawn at random with probability proportional to the replica's weight. The weights come from the plan's
optional ``weights`` (docs/design.md, "Data formats"): GRACE's policy sets them inversely proportional to the predicted GPU loads
of Eq. 3; a plan without weights routes with equal weights, i.e. like ``random``. Alg. 3 names the rule
"round-robin" but draws with ``WeightedRandomChoice``; we follow the pseudocode (a random draw).

``locality`` -- topology-aware routing with locality preference (Alg. 4): a replica on the token's own GPU
if there is one; else a replica on another GPU of the token's node, drawn by the weights restricted to that
node; else any replica, drawn by all the weights. It needs to know where each token lives (``src_gpu``), so
it routes token-level traces only; on bare counts it raises :class:`InputError`.

On counts, ``wrr`` samples each expert's tokens over its replicas (a multinomial drawn as a chain of
binomials), as ``random`` does with equal probabilities.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moebalance.core.errors import InputError
from moebalance.routing.base import Router
from moebalance.routing.basic import apply_shares, tokens_to_gpus

if TYPE_CHECKING:
    from moebalance.core.plan import Placement
    from moebalance.core.trace import RoutingTrace

__all__ = ["LOCALITY", "WRR", "replica_weights", "weighted_index"]


def replica_weights(plan: Placement) -> np.ndarray:
    """``float64 [L, E, R]``: routing probability of each replica, aligned with ``plan.replica_gpus()``.

    From ``plan.weights`` when given (two copies of one expert on one GPU share that GPU's weight equally),
    else equal; each expert's probabilities sum to 1, padding is 0. An expert whose weights are all 0 on
    the GPUs of one tier is routed by equal weights within that tier (see :data:`LOCALITY`).
    """
    L, E, G = plan.copies.shape
    gpus = plan.replica_gpus()
    valid = gpus >= 0
    if plan.weights is None:
        w = valid.astype(np.float64)
    else:
        per_gpu = np.zeros((L, E, G))
        for layer, (wl, pl) in enumerate(zip(plan.weights, plan.gpu_experts, strict=True)):
            for g, (wg, pg) in enumerate(zip(wl, pl, strict=True)):
                np.add.at(per_gpu[layer, :, g], np.asarray(pg, dtype=np.int64), np.asarray(wg, dtype=np.float64))
        per_copy = per_gpu / np.maximum(plan.copies, 1)
        lidx = np.arange(L)[:, None, None]
        eidx = np.arange(E)[None, :, None]
        w = np.where(valid, per_copy[lidx, eidx, np.maximum(gpus, 0)], 0.0)
    return w / w.sum(axis=2, keepdims=True)


def weighted_index(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``int64 [...]``: the column of ``weights [..., R]`` (rows with a positive sum) picked by ``u [...]`` in [0, 1].

    The inverse of the cumulative weights: column ``j`` is picked for ``u * total`` in
    ``[cum_{j-1}, cum_j)``, so with ``u`` uniform it is drawn with probability ``w_j / total``; a zero-weight
    column is never picked. ``u * total`` can round up to ``total`` (``u`` just below 1, probability about
    ``2^-53``), which no interval holds: that goes to the last column of positive weight, not to the last column,
    which may be padding or outside the locality tier. Example: ``weights [1, 3, 0]``: ``u = 0.2`` -> 0,
    ``u = 0.5`` -> 1, ``u = 1.0`` -> 1.
    """
    cum, last_positive = _draw_table(np.asarray(weights, dtype=np.float64))
    return _draw(cum, last_positive, np.asarray(u, dtype=np.float64))


def _wrr_counts(plan: Placement, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    reps = plan.replica_counts()
    single = (reps == 1).astype(np.float64)
    out = apply_shares(counts, (plan.copies > 0) * single[:, :, None])
    layer_idx, exp_idx = np.nonzero(reps > 1)
    if layer_idx.size == 0:
        return out
    B, L, G = out.shape
    gpus = plan.replica_gpus()[layer_idx, exp_idx]  # [M, R]
    prob = replica_weights(plan)[layer_idx, exp_idx]  # [M, R]
    tail = np.cumsum(prob[:, ::-1], axis=1)[:, ::-1]  # probability mass of replicas j, j+1, ...
    remaining = counts[:, layer_idx, exp_idx].astype(np.int64)  # [B, M]
    base = np.arange(B)[:, None] * L * G + layer_idx[None, :] * G
    for j in range(gpus.shape[1]):
        live = np.flatnonzero(gpus[:, j] >= 0)
        is_last = (gpus[live, j + 1] < 0) if j + 1 < gpus.shape[1] else np.ones(live.size, dtype=bool)
        draw, last = live[~is_last], live[is_last]
        # multinomial as a chain: replica j takes Binomial(left, p_j / (p_j + p_{j+1} + ...))
        p = np.where(tail[draw, j] > 0, prob[draw, j] / np.maximum(tail[draw, j], 1e-300), 0.0)
        take = np.zeros_like(remaining)
        take[:, draw] = rng.binomial(remaining[:, draw], np.clip(p, 0.0, 1.0))
        take[:, last] = remaining[:, last]  # the last replica takes what is left
        remaining -= take
        flat = base[:, live] + gpus[live, j][None, :]
        out += np.bincount(flat.ravel(), weights=take[:, live].ravel().astype(np.float64),
                           minlength=B * L * G).reshape(B, L, G)
    return out


def _draw_table(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For :func:`_draw`: the cumulative weights ``[..., R]`` and each row's last positive column ``[...]``.

    Computed once per (GPU,) expert instead of once per token; the same numbers as :func:`weighted_index`.
    """
    R = weights.shape[-1]
    return np.cumsum(weights, axis=-1), R - 1 - np.argmax((weights > 0)[..., ::-1], axis=-1)


def _draw(cum: np.ndarray, last_positive: np.ndarray, u: np.ndarray) -> np.ndarray:
    """:func:`weighted_index` of the rows whose :func:`_draw_table` is ``cum, last_positive``, picked by ``u``."""
    picked = (cum <= u[..., None] * cum[..., -1:]).sum(axis=-1)
    return np.minimum(picked, last_positive)


def _wrr_tokens(plan: Placement, trace: RoutingTrace, rng: np.random.Generator) -> np.ndarray:
    cum, last_positive = _draw_table(replica_weights(plan))  # [L, E, R], [L, E]
    return tokens_to_gpus(plan, trace, lambda layer, ids, r: _draw(cum[layer, ids], last_positive[layer, ids],
                                                                    rng.random(ids.shape)))


def _locality_counts(plan: Placement, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    raise InputError("the locality router needs to know which GPU each token lives on; give a token-level "
                     "trace (topk_ids, src_gpu, batch) or use the wrr router on bare counts")


def _locality_tokens(plan: Placement, trace: RoutingTrace, rng: np.random.Generator) -> np.ndarray:
    gpn = plan.cluster.gpus_per_node
    prob = replica_weights(plan)
    replica_gpus = plan.replica_gpus()
    trace.check_gpus(plan.num_gpus)  # the tables below are indexed by the token's GPU
    src = trace.src_gpu[:, None]  # [T, 1]
    here = np.arange(plan.num_gpus)[:, None, None]  # the token's GPU, [G, 1, 1]

    def pick(layer: int, ids: np.ndarray, reps: np.ndarray) -> np.ndarray:
        # the choice depends on the token only through (its GPU, its expert): tables [G, E, R] first
        gpus = replica_gpus[layer][None]  # [1, E, R]
        valid = gpus >= 0
        same_gpu = gpus == here
        same_node = valid & (gpus // gpn == here // gpn)
        w = prob[layer][None]
        tier = np.where(same_node.any(axis=-1, keepdims=True), same_node, valid)
        tw = np.where(tier, w, 0.0)
        # a tier whose weights are all zero falls back to equal weights within the tier
        tw = np.where(tw.sum(axis=-1, keepdims=True) > 0, tw, tier.astype(np.float64))
        cum, last_positive = _draw_table(tw)
        choice = _draw(cum[src, ids], last_positive[src, ids], rng.random(ids.shape))
        own = same_gpu.any(axis=-1)[src, ids]
        return np.where(own, np.argmax(same_gpu, axis=-1)[src, ids], choice)

    return tokens_to_gpus(plan, trace, pick)


WRR = Router("wrr", _wrr_counts, _wrr_tokens, "GRACE Alg. 3: replica drawn by the plan's weights (Eq. 3 predicted loads)")
LOCALITY = Router("locality", _locality_counts, _locality_tokens,
                  "GRACE Alg. 4: own GPU, else own node, else remote; wrr within a tier (token-level traces)")
