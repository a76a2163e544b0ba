"""The two baseline routers: ``uniform`` (equal split) and ``random`` (uniformly random replica).

``uniform`` splits each expert's load equally over its replicas, in fractional tokens; it is the default for
scoring placements (CRAFT Alg. 1: ``G[g] += W[b][l][e] / r_el``). On tokens it is realised as round-robin:
the ``i``-th token of batch ``b`` routed to expert ``e`` goes to replica ``i mod r_e`` (replicas in GPU
order), so per-replica counts differ by at most one from the equal split.

``random`` sends each token to a uniformly random replica, as vLLM and SGLang dispatch with EPLB. On counts
it samples ``multinomial(W[b, l, e], 1 / r_e)`` per expert, drawn as a chain of binomials.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from moebalance.algorithms.split import apply_shares, round_robin_gpus
from moebalance.core.errors import PlanError
from moebalance.routing.base import Router

if TYPE_CHECKING:
    from moebalance.core.plan import Placement
    from moebalance.core.trace import RoutingTrace

__all__ = ["RANDOM", "UNIFORM", "apply_shares", "share_matrix", "tokens_to_gpus"]

def share_matrix(plan: Placement) -> np.ndarray:
    """``float64 [L, E, G]``: the fraction of expert ``e``'s tokens that GPU ``g`` serves, equal split."""
    copies = plan.copies.astype(np.float64)
    return copies / copies.sum(axis=2, keepdims=True)


def _uniform_counts(plan: Placement, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return apply_shares(counts, share_matrix(plan))


def tokens_to_gpus(plan: Placement, trace: RoutingTrace,
                   replica_index: Callable[[int, np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """``int64 [T, L, K]`` GPUs from a rule ``(layer, ids [T, K], reps [T, K]) -> replica index [T, K]``."""
    replica_gpus = plan.replica_gpus()
    reps = plan.replica_counts()
    dest = np.empty(trace.topk_ids.shape, dtype=np.int64)
    for layer in range(trace.num_layers):
        ids = trace.topk_ids[:, layer, :]
        dest[:, layer, :] = replica_gpus[layer, ids, replica_index(layer, ids, reps[layer, ids])]
    return dest


def _uniform_tokens(plan: Placement, trace: RoutingTrace, rng: np.random.Generator) -> np.ndarray:
    if (trace.num_layers, trace.num_experts) != (plan.num_layers, plan.num_experts):  # the kernel indexes unchecked
        raise PlanError(f"the plan has {plan.num_layers} layers x {plan.num_experts} experts but the trace "
                        f"{trace.num_layers} x {trace.num_experts}; route a trace of the plan's model")
    return round_robin_gpus(np.ascontiguousarray(trace.topk_ids), trace.batch, plan.replica_gpus(),
                            plan.replica_counts())


def _random_counts(plan: Placement, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    reps = plan.replica_counts()
    single = (reps == 1).astype(np.float64)
    out = apply_shares(counts, share_matrix(plan) * single[:, :, None])
    layer_idx, exp_idx = np.nonzero(reps > 1)
    if layer_idx.size == 0:
        return out
    B, L, G = out.shape
    replica_gpus = plan.replica_gpus()[layer_idx, exp_idx]  # [M, R]
    r = reps[layer_idx, exp_idx]  # [M]
    remaining = counts[:, layer_idx, exp_idx].astype(np.int64)  # [B, M]
    base = np.arange(B)[:, None] * L * G + layer_idx[None, :] * G  # [B, M]
    for j in range(replica_gpus.shape[1]):
        # multinomial(n, 1/r) drawn as a chain of binomials: replica j takes Binomial(left, 1 / (r - j)),
        # the last replica takes what is left; only columns with two or more replicas left need a draw
        draw = np.flatnonzero(r - j >= 2)
        last = np.flatnonzero(r - j == 1)
        take = np.zeros_like(remaining)
        take[:, draw] = rng.binomial(remaining[:, draw], 1.0 / (r[draw] - j))
        take[:, last] = remaining[:, last]
        remaining -= take
        cols = np.concatenate([draw, last])
        flat = base[:, cols] + replica_gpus[cols, j][None, :]
        out += np.bincount(flat.ravel(), weights=take[:, cols].ravel().astype(np.float64),
                           minlength=B * L * G).reshape(B, L, G)
    return out


def _random_tokens(plan: Placement, trace: RoutingTrace, rng: np.random.Generator) -> np.ndarray:
    return tokens_to_gpus(plan, trace, lambda layer, ids, r: (rng.random(ids.shape) * r).astype(np.int64))


UNIFORM = Router("uniform", _uniform_counts, _uniform_tokens, "equal split over replicas (round-robin on tokens)")
RANDOM = Router("random", _random_counts, _random_tokens, "each token to a uniformly random replica (vLLM/SGLang)")
