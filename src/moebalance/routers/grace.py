"""GRACE-MoE's routers (paper 001, Section 4.3 and Appendix A.3): ``wrr`` and ``locality``.

``wrr`` -- weighted round-robin with load prediction (Alg. 3). Each token goes to one replica of its expert,
drawn at random with probability proportional to the replica's weight. The weights come from the plan's
optional ``weights`` (DESIGN §2): GRACE's policy sets them inversely proportional to the predicted GPU loads
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

from moebalance.errors import InputError
from moebalance.routers.base import Router
from moebalance.routers.basic import apply_shares, tokens_to_gpus

if TYPE_CHECKING:
    from moebalance.plan import Placement
    from moebalance.trace import RoutingTrace

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
    w = np.asarray(weights, dtype=np.float64)
    R = w.shape[-1]
    cum = np.cumsum(w, axis=-1)
    picked = (cum <= np.asarray(u, dtype=np.float64)[..., None] * cum[..., -1:]).sum(axis=-1)
    last_positive = R - 1 - np.argmax((w > 0)[..., ::-1], axis=-1)
    return np.minimum(picked, last_positive)


def _weighted_choice(weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Index along the last axis drawn with probability proportional to ``weights [..., R]`` (rows > 0)."""
    return weighted_index(weights, rng.random(weights.shape[:-1]))


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


def _wrr_tokens(plan: Placement, trace: RoutingTrace, rng: np.random.Generator) -> np.ndarray:
    prob = replica_weights(plan)
    return tokens_to_gpus(plan, trace, lambda layer, ids, r: _weighted_choice(prob[layer, ids], rng))


def _locality_counts(plan: Placement, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    raise InputError("the locality router needs to know which GPU each token lives on; give a token-level "
                     "trace (topk_ids, src_gpu, batch) or use the wrr router on bare counts")


def _locality_tokens(plan: Placement, trace: RoutingTrace, rng: np.random.Generator) -> np.ndarray:
    gpn = plan.cluster.gpus_per_node
    prob = replica_weights(plan)
    src = trace.src_gpu[:, None, None]

    replica_gpus = plan.replica_gpus()

    def pick(layer: int, ids: np.ndarray, reps: np.ndarray) -> np.ndarray:
        gpus = replica_gpus[layer, ids]  # [T, K, R]
        valid = gpus >= 0
        same_gpu = gpus == src
        same_node = valid & (gpus // gpn == src // gpn)
        w = prob[layer, ids]
        tier = np.where(same_node.any(axis=-1, keepdims=True), same_node, valid)
        tw = np.where(tier, w, 0.0)
        # a tier whose weights are all zero falls back to equal weights within the tier
        tw = np.where(tw.sum(axis=-1, keepdims=True) > 0, tw, tier.astype(np.float64))
        choice = _weighted_choice(tw, rng)
        own = same_gpu.any(axis=-1)
        return np.where(own, np.argmax(same_gpu, axis=-1), choice)

    return tokens_to_gpus(plan, trace, pick)


WRR = Router("wrr", _wrr_counts, _wrr_tokens, "GRACE Alg. 3: replica drawn by the plan's weights (Eq. 3 predicted loads)")
LOCALITY = Router("locality", _locality_counts, _locality_tokens,
                  "GRACE Alg. 4: own GPU, else own node, else remote; wrr within a tier (token-level traces)")
