"""Exact per-layer planning: Libra's prefetcher and rebalancer on the batch's own routing, in one call.

Legend: ``G`` GPUs, ``E`` experts, ``N`` extra experts a GPU may take for one layer, ``T`` tokens, ``K`` picks
per token.

``libra`` with ``predictor=exact`` plans each layer after its gate, from the picks the gate just made (Libra,
"Libra: Effective yet Efficient Load Balancing for Large-Scale MoE Inference", Alg. 1 and Alg. 2; our readings
in docs/papers/libra.md). :func:`plan_layer` takes that layer's picks counted by source GPU and expert,
``demand [G, E]``, and the base placement's copies ``[E, G]``, and gives:

- the prefetcher's extras (Alg. 1, phases 1 and 2: :func:`moebalance.algorithms.prefetch.prefetch`), and
- the rebalancer's routing split on the base copies plus the extras (Alg. 2: what the ``rebalance`` router
  computes on that batch): each GPU serves its own tokens' picks of the experts it holds (``local``), and
  ``remote[g, e]`` of the other picks of expert ``e``.

The result is exactly what the two steps give one after the other (:func:`moebalance.algorithms.prefetch.prefetch`,
then :func:`moebalance.algorithms.rebalance.route_tokens` on the per-batch layer), computed in one compiled
call without building the per-batch plan. :func:`assign` hands the split out to tokens as the router does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from moebalance.algorithms.minmax import host_lists
from moebalance.algorithms.prefetch import check_options, hosting_lists, plan_extras
from moebalance.algorithms.rebalance import hand_out, rebalance, start_split
from moebalance.core.errors import InputError

__all__ = ["MAX_PICKS", "BaseLayer", "LayerPlan", "assign", "base_layer", "plan_layer", "plan_layer_kernel"]

#: Picks of one layer above this cannot be summed exactly in float64 (the loads the prefetcher compares).
MAX_PICKS = 1 << 52


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """One layer's exact plan.

    Example: 2 GPUs, experts ``{0, 1}`` on GPU 0 and ``{2, 3}`` on GPU 1, GPU 0's tokens want expert 2 most:
    with ``n = 1, alpha = 1`` GPU 0 takes expert 2 (``extras[0] == [2]``) and serves its own picks of it.
    """

    #: ``int64 [G, N]``: each GPU's extras in the order added (phase 1 first), padded with -1.
    extras: np.ndarray
    #: ``float64 [G]``: the loads the prefetcher expects (its even split of remote picks).
    expected: np.ndarray
    #: ``int64 [G, E]``: remote picks of expert ``e`` that GPU ``g`` serves after the rebalancer.
    remote: np.ndarray
    #: ``int64 [G]``: picks each GPU serves, its own tokens' local picks plus ``remote[g].sum()``.
    loads: np.ndarray
    #: The rebalancer's moves.
    moves: int


@dataclass(frozen=True, slots=True)
class BaseLayer:
    """One layer of the base placement, prepared once for many :func:`plan_layer` calls (its host lists).

    Example: ``base = base_layer(plan.copies[layer])``, then ``plan_layer(demand, base, n, alpha)`` per batch.
    """

    #: ``int64 [E, G]``: copies of each expert on each GPU.
    copies: np.ndarray
    #: ``int64 [G, S]``: ``glist[g, :gcount[g]]`` the experts GPU ``g`` holds, ascending.
    glist: np.ndarray
    gcount: np.ndarray
    #: ``int64 [E, G]``: ``hlist[e, :hcount[e]]`` the GPUs holding expert ``e``, ascending.
    hlist: np.ndarray
    hcount: np.ndarray


def base_layer(copies: np.ndarray) -> BaseLayer:
    """:class:`BaseLayer` of ``copies [E, G]`` (whole, non-negative, every expert at least once)."""
    cp = np.asarray(copies)
    if cp.ndim != 2 or cp.dtype.kind not in "biu":
        raise InputError(f"copies must be whole numbers [E, G] (copies of each expert on each GPU), got "
                         f"{cp.dtype} {cp.shape}")
    cp = np.ascontiguousarray(cp, dtype=np.int64)
    if (cp < 0).any():
        e, g = np.argwhere(cp < 0)[0]
        raise InputError(f"copies[{e}, {g}] is negative; give copy counts >= 0")
    homeless = ~(cp > 0).any(axis=1)
    if homeless.any():
        raise InputError(f"expert {int(np.flatnonzero(homeless)[0])} has no copy in the base placement; every "
                         "expert needs a home")
    glist, gcount, hlist, hcount = hosting_lists(cp, 0)
    return BaseLayer(cp, glist, gcount, hlist, hcount)


@njit(cache=True, nogil=True)
def plan_layer_kernel(demand: np.ndarray, copies: np.ndarray, glist0: np.ndarray, gcount0: np.ndarray,
                      hlist0: np.ndarray, hcount0: np.ndarray, n: int, n_local: int, eps: float, strict: bool
                      ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """``(status, extras [G, N], expected [G], remote [G, E], loads [G], moves)`` of ``demand int64 [G, E]``
    on a :class:`BaseLayer`'s arrays (left unchanged). ``status``: 0 planned; ``-1 - i`` the flat index ``i``
    of a negative demand; ``-2 - G * E`` more than :data:`MAX_PICKS` picks."""
    G, E = demand.shape
    extras = np.full((G, n), -1, np.int64)
    expected = np.zeros(G)
    remote = np.zeros((G, E), np.int64)
    low, high = np.int64(0), np.int64(0)
    for g in range(G):
        for e in range(E):
            low = min(low, demand[g, e])
            high = max(high, demand[g, e])
    if low < 0:
        return -1 - int(np.argmin(demand)), extras, expected, remote, np.zeros(G, np.int64), 0
    if high > 0 and (high >= MAX_PICKS // (G * E) and demand.astype(np.float64).sum() >= MAX_PICKS):
        return -2 - G * E, extras, expected, remote, np.zeros(G, np.int64), 0
    # the base lists, with room for the extras (only the used part is copied)
    width = glist0.shape[1] + n
    glist = np.empty((G, max(width, 1)), np.int64)
    gcount = gcount0.copy()
    for g in range(G):
        for j in range(gcount[g]):
            glist[g, j] = glist0[g, j]
    hlist = np.empty((E, G), np.int64)
    hcount = hcount0.copy()
    for e in range(E):
        for j in range(hcount[e]):
            hlist[e, j] = hlist0[e, j]
    column = np.empty(E, np.int64)
    plan_extras(demand, glist, gcount, hlist, hcount, n, n_local, True, extras, expected, column)
    # the per-batch layer as host lists: base copies plus one copy of every extra
    hstart = np.zeros(E + 1, np.int64)
    for e in range(E):
        hstart[e + 1] = hstart[e] + hcount[e]
    hosts = np.empty(hstart[E], np.int64)
    mult = np.empty(hstart[E], np.int64)
    n_remote = np.empty(E, np.int64)
    total = 0
    for e in range(E):
        rest = column[e]
        total += column[e]
        for j in range(hcount[e]):
            g = hlist[e, j]
            hosts[hstart[e] + j] = g
            mult[hstart[e] + j] = max(copies[e, g], 1)
            rest -= demand[g, e]
        n_remote[e] = rest
    gstart = np.zeros(G + 1, np.int64)
    local = np.zeros(G, np.int64)
    for g in range(G):
        k = 0
        for j in range(gcount[g]):
            e = glist[g, j]
            local[g] += demand[g, e]
            k += hcount[e] > 1
        gstart[g + 1] = gstart[g] + k
    gexp = np.empty(gstart[G], np.int64)
    for g in range(G):
        k = gstart[g]
        for j in range(gcount[g]):
            e = glist[g, j]
            if hcount[e] > 1:
                gexp[k] = e
                k += 1
    start_split(n_remote, mult, hstart, hosts, remote)
    loads, moves = rebalance(local, remote, hstart, hosts, gstart, gexp, total / G, eps, strict)
    return 0, extras, expected, remote, loads, moves


def plan_layer(demand: np.ndarray, base: BaseLayer | np.ndarray, n: int, alpha: float, *, eps: float = 0.0,
               strict: bool = False) -> LayerPlan:
    """The exact plan of one layer (module docstring).

    ``demand [G, E]``: the layer's picks by source GPU and expert (whole, non-negative; any integer dtype, or
    floats with whole values). ``base``: the base placement's layer, a :class:`BaseLayer` (prepared once) or its
    copies ``[E, G]`` (a placement's ``copies[layer]``; every expert at least once). ``n``, ``alpha``: the
    prefetcher's buffer and locality share; ``eps``, ``strict``: the rebalancer's options (the ``rebalance``
    router's).
    """
    b = base if isinstance(base, BaseLayer) else base_layer(base)
    d = _counts(demand)
    E, G = b.copies.shape
    if d.shape != (G, E):
        raise InputError(f"demand {d.shape} must be [G, E] = [{G}, {E}] for a base layer of copies [E, G] = "
                         f"[{E}, {G}]")
    n_local = check_options(n, alpha, E)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0.0 <= eps < 1.0:
        raise InputError(f"eps ({eps!r}) must be a number in [0, 1), the rebalancer's tolerance over the mean load")
    status, extras, expected, remote, loads, moves = plan_layer_kernel(
        d, b.copies, b.glist, b.gcount, b.hlist, b.hcount, int(n), n_local, float(eps), bool(strict))
    if status == -2 - G * E:
        raise InputError(f"the layer has {float(d.sum(dtype=np.float64)):.3g} picks, more than {MAX_PICKS:.3g}; "
                         "give one layer of one batch")
    if status < 0:
        where = -1 - status
        raise InputError(f"demand[{where // E}, {where % E}] is negative; give picks counted per GPU and expert")
    return LayerPlan(extras, expected, remote, loads, int(moves))


def _counts(demand: np.ndarray) -> np.ndarray:
    """``int64`` C-contiguous counts of ``demand``; floats must be finite and whole."""
    d = np.asarray(demand)
    if d.dtype.kind in "iub":
        return np.ascontiguousarray(d, dtype=np.int64)
    if d.dtype.kind != "f":
        raise InputError(f"demand must hold numbers (picks per GPU and expert), got dtype {d.dtype}")
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(d).all() and bool((d == np.floor(d)).all()) and (d.size == 0 or float(d.max()) < MAX_PICKS)
    if not ok:
        raise InputError("demand must hold whole, finite pick counts (exact mode plans from the batch's routing)")
    return np.ascontiguousarray(d, dtype=np.int64)


@njit(cache=True, nogil=True)
def _assign(ids: np.ndarray, src: np.ndarray, kept: np.ndarray, has: np.ndarray, remote: np.ndarray,
            gpus_per_node: int) -> np.ndarray:
    T, K = ids.shape
    hstart, hosts = host_lists(has)
    dest = np.full((T, K), -1, np.int64)
    for i in range(T):
        for k in range(K):
            if kept[i, k] and has[ids[i, k], src[i]]:
                dest[i, k] = src[i]
    hand_out(ids, src, 0, T, kept, hstart, hosts, remote, gpus_per_node, dest)
    return dest


def assign(plan: LayerPlan, base: BaseLayer | np.ndarray, ids_TK: np.ndarray, src_T: np.ndarray, kept_TK: np.ndarray,
           gpus_per_node: int) -> np.ndarray:
    """``int64 [T, K]``: each kept pick's GPU under ``plan`` (-1 where not kept), as the ``rebalance`` router
    routes the batch on the per-batch layer: a pick stays on its token's GPU when that GPU holds the expert
    (base copy or extra), the others take ``plan.remote``'s shares in token order, the token's node first.

    ``base`` the base layer the plan was made on (or its copies ``[E, G]``); ``ids_TK``, ``src_T`` (each token's GPU) and
    ``kept_TK`` the picks ``plan`` was counted from.
    """
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int | np.integer) or gpus_per_node < 1:
        raise InputError(f"gpus_per_node ({gpus_per_node!r}) must be a positive integer")
    has = np.ascontiguousarray(np.asarray(base.copies if isinstance(base, BaseLayer) else base) > 0)
    if has.ndim != 2 or has.shape[::-1] != plan.remote.shape:
        raise InputError(f"the base layer's copies have shape {list(has.shape)} but the plan is for [E, G] = "
                         f"{list(plan.remote.shape[::-1])}; give the base the plan was made on")
    E, G = has.shape
    ids, src, kept = np.asarray(ids_TK), np.asarray(src_T), np.asarray(kept_TK)
    if ids.ndim != 2 or src.shape != ids.shape[:1] or kept.shape != ids.shape:
        raise InputError(f"ids {list(ids.shape)}, src {list(src.shape)} and kept {list(kept.shape)} must be [T, K], "
                         "[T] and [T, K]: the picks the plan was counted from")
    for name, a, bound in (("ids", ids, E), ("src", src, G)):
        if a.size and (a.dtype.kind not in "iu" or int(a.min()) < 0 or int(a.max()) >= bound):
            raise InputError(f"{name} must be whole numbers in [0, {bound}) (the layer's "
                             f"{'experts' if name == 'ids' else 'GPUs'}); got {a.dtype} in "
                             f"[{a.min()}, {a.max()}]")
    g, slot = np.nonzero(plan.extras >= 0)
    has[plan.extras[g, slot], g] = True
    return _assign(np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(src, dtype=np.int64),
                   np.ascontiguousarray(kept, dtype=np.bool_), has, plan.remote.copy(), int(gpus_per_node))
