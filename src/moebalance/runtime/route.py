"""The host side of routing a forward (docs/design.md, "Routers"): which GPU serves each pick, seen from one rank.

Legend: ``G`` ranks = GPUs, ``T`` tokens of all ranks, ``E`` logical experts, ``K`` picks per token.

Every rank of :class:`~moebalance.runtime.ep.ExpertParallelMoE` runs the plan's router on the whole gathered
batch (:func:`route_picks`, the same router code as the simulator, seeded identically everywhere), on the
layer's one-layer plan (:func:`layer_placement`), and finds its slot of each expert in :func:`slot_table`.
With a router in :data:`KEEPS_LOCAL` the picks served on their own GPU are known before it runs
(:func:`keeps_local`); :func:`check_kept_local` checks that the router kept them there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moebalance.core.errors import InputError, PlanError
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.routing import Router, get_router
from moebalance.routing.base import check_routes

__all__ = ["KEEPS_LOCAL", "check_kept_local", "keeps_local", "layer_placement", "route_picks", "slot_table"]

#: Routers that serve every kept pick whose expert has a copy on the token's own GPU on that GPU: with them the
#: local picks are known before the router runs (``EPConfig.router_thread``). ``minmax`` is not one:
#: lightening the busiest GPU may need some local picks elsewhere.
KEEPS_LOCAL = ("locality", "rebalance")


def layer_placement(plan: Placement, layer: int) -> Placement:
    """The one-layer plan of ``layer`` (with its routing weights): what the router sees for that layer."""
    if not 0 <= layer < plan.num_layers:
        raise PlanError(f"layer {layer} is outside the plan's {plan.num_layers} layers")
    weights = None if plan.weights is None else [plan.weights[layer]]
    return Placement([plan.gpu_experts[layer]], plan.num_experts, plan.cluster, policy=plan.policy,
                     weights=weights)


def slot_table(plan: Placement) -> np.ndarray:
    """``int64 [G, E]`` for a one-layer plan: GPU ``g``'s slot of expert ``e`` (its first copy), -1 if none."""
    G, E = plan.num_gpus, plan.num_experts
    table = np.full((G, E), -1, dtype=np.int64)
    for g, experts in enumerate(plan.gpu_experts[0]):
        for s in range(len(experts) - 1, -1, -1):  # backwards, so the first copy wins
            table[g, experts[s]] = s
    return table


def route_picks(plan: Placement, router: str | Router, ids_TK: np.ndarray, kept_TK: np.ndarray,
                tokens_per_rank: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """``int64 [T, K]``: the GPU serving each pick of a one-layer plan, ``-1`` where the pick was dropped.

    The tokens of rank ``r`` live on GPU ``r``; all form one batch. A router that balances load
    (``Router.assign_kept``) sees which picks were dropped, so they count nowhere; the others route every
    pick the gate chose (a trace has ``K`` distinct picks per token) and the dropped ones are masked afterwards.
    """
    T, K = ids_TK.shape
    if T == 0:
        return np.zeros((0, K), dtype=np.int64)
    src = np.repeat(np.arange(len(tokens_per_rank), dtype=np.int64), tokens_per_rank)
    trace = RoutingTrace(ids_TK[:, None, :], src, np.zeros(T, dtype=np.int64), num_experts=plan.num_experts)
    r = get_router(router)
    if r.assign_kept is not None:
        dest = np.asarray(r.assign_kept(plan, trace, kept_TK[:, None, :], rng))
    else:
        dest = np.asarray(r.assign_tokens(plan, trace, rng))
    if dest.ndim != 3 or dest.shape[1] != 1:
        raise InputError(f"router {r.name!r} returned GPUs of shape {dest.shape}; expected [T, 1, K] for one layer")
    if r.assign_kept is not None:
        check_routes(dest[:, 0, :], ids_TK, plan.copies[0], r.name, kept_TK)
        return dest[:, 0, :]
    check_routes(dest[:, 0, :], ids_TK, plan.copies[0], r.name)
    return np.where(kept_TK, dest[:, 0, :], -1)


def keeps_local(router: str | Router) -> bool:
    """Whether ``router`` keeps every kept pick whose expert has a copy on the token's own GPU there
    (:data:`KEEPS_LOCAL`), so that the local picks are known before it runs."""
    return get_router(router).name in KEEPS_LOCAL


def check_kept_local(dest_TK: np.ndarray, ids_TK: np.ndarray, kept_TK: np.ndarray, has_EG: np.ndarray,
                      tokens_per_rank: Sequence[int], name: str) -> None:
    """Raise (on every rank alike: the arrays are the same everywhere) if the router moved a local pick."""
    src = np.repeat(np.arange(len(tokens_per_rank), dtype=np.int64), tokens_per_rank)[:, None]
    bad = kept_TK & has_EG[ids_TK, src] & (dest_TK != src)
    if bad.any():
        t, k = (int(i) for i in np.argwhere(bad)[0])
        raise InputError(f"router {name!r} sent pick {k} of token {t} (expert {int(ids_TK[t, k])}) from its own GPU "
                         f"{int(src[t, 0])}, which holds a copy, to GPU {int(dest_TK[t, k])}; router_thread needs a "
                         f"router that keeps such picks local ({', '.join(KEEPS_LOCAL)}), so turn it off")
