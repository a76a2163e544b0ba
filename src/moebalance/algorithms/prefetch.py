"""Libra's Hierarchical Expert Prefetcher (Libra Appendix B, Alg. 1; our readings in docs/papers/libra.md).

Legend: ``G`` GPUs, ``E`` experts, ``N`` extra experts a GPU may take for one layer (its prefetch buffer),
``L = floor(N * alpha)`` of them chosen for locality in phase 1.

Input of one ``(batch, layer)``: ``demand [G, E]``, the predicted picks of expert ``e`` by tokens living on
GPU ``g`` (from a predictor), and ``hosted [G, E]``, the base placement's copies. Output: up to ``N`` extra
experts per GPU for this layer, and the loads the planner expects.

The load model (line 7 of Alg. 1, and what "update GPU loads" means in line 17). A pick whose expert has a copy
on the token's own GPU is served there (MoE_local; it never moves). The other picks of expert ``e``,
``R_e = sum of demand[g, e] over GPUs g without a copy``, are remote; they start evenly split over the
copies of ``e`` (``S[g, e] = R_e / copies_e``), as the token rebalancer starts them. So::

    load[g] = sum_e demand[g, e] * hosted[g, e] + sum_e S[g, e],     B = sum(demand) / G

Phase 1: every GPU takes its ``L`` most requested experts that it does not hold (only experts its own tokens
request; ties to the lower id). Phase 2, at most ``(N - L) * G`` times: ``g_src`` is the most loaded GPU (stop
when it is at or below ``B``); ``e`` the expert with the most remote load on it (``argmax_e S[g_src, e]``);
``g_dst`` the least loaded GPU without ``e`` and with fewer than ``N`` extras. Duplicating ``e`` there first
localises ``g_dst``'s own picks of ``e`` (``own = demand[g_dst, e]``, taken from ``e``'s copies in proportion
to what they serve), then hands ``g_dst`` the share of ``g_src``'s remote picks of ``e`` that the rebalancer
would move, ``min(S[g_src, e], load[g_src] - B, B - load[g_dst])``. The duplication is made only if
``load[g_dst] + own <= B`` (line 15), so no duplication lifts a GPU above ``B``. When no expert, no
destination or no room is found, the state is unchanged and every later pass of the loop would find the same:
we stop there, which gives the printed algorithm's result without its idle passes. Ties go to the lower GPU or
expert id.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moebalance.core.errors import InputError

__all__ = ["phase1_count", "prefetch", "prefetch_layers"]

#: Loads within this many tokens of ``B`` count as balanced, and loads or shares this close count as tied (so ties
#: go to the lower id, not to rounding noise): the loads are sums of float shares.
_TOL = 1e-9


def phase1_count(n: int, alpha: float) -> int:
    """``L = floor(N * alpha)``: the phase-1 (locality) share of the ``N`` buffer slots.

    Example: ``phase1_count(8, 0.5) == 4`` (the paper's deployment); ``phase1_count(3, 0.5) == 1``.
    """
    return int(np.floor(n * alpha + 1e-12))


@njit(cache=True)
def _prefetch(demand: np.ndarray, hosted: np.ndarray, n: int, n_local: int,
              extras: np.ndarray, load: np.ndarray) -> int:
    """Alg. 1 on one layer; fills ``extras [G, N]`` (-1 padded, in the order added) and ``load [G]``; returns the
    number of phase-2 duplications."""
    G, E = demand.shape
    has = hosted.copy()
    added = np.zeros(G, np.int64)
    # phase 1: each GPU's L most requested experts it does not hold
    for g in range(G):
        for _ in range(n_local):
            best, bv = -1, 0.0
            for e in range(E):
                if not has[g, e] and demand[g, e] > bv:
                    best, bv = e, demand[g, e]
            if best < 0:
                break
            has[g, best] = True
            extras[g, added[g]] = best
            added[g] += 1
    # loads: local picks stay; remote picks split evenly over the copies
    share = np.zeros((G, E))
    total = 0.0
    for g in range(G):
        load[g] = 0.0
    for e in range(E):
        remote, copies = 0.0, 0
        for g in range(G):
            total += demand[g, e]
            if has[g, e]:
                load[g] += demand[g, e]
                copies += 1
            else:
                remote += demand[g, e]
        if copies > 0 and remote > 0:
            for g in range(G):
                if has[g, e]:
                    share[g, e] = remote / copies
                    load[g] += remote / copies
    B = total / G
    moves = 0
    for _ in range((n - n_local) * G):
        src = 0
        for g in range(1, G):
            if load[g] > load[src] + _TOL:
                src = g
        if load[src] <= B + _TOL:
            break
        e, ev = -1, 0.0
        for x in range(E):
            if share[src, x] > ev + _TOL:
                e, ev = x, share[src, x]
        if e < 0:
            break
        dst = -1
        for g in range(G):
            if not has[g, e] and added[g] < n and (dst < 0 or load[g] < load[dst] - _TOL):
                dst = g
        if dst < 0:
            break
        own = demand[dst, e]
        if load[dst] + own > B + _TOL:
            break
        # localise dst's own picks of e, taken from e's copies in proportion to what they serve
        remote = 0.0
        for g in range(G):
            remote += share[g, e]
        if own > 0 and remote > 0:
            keep = max(remote - own, 0.0) / remote
            for g in range(G):
                if has[g, e]:
                    cut = share[g, e] * (1.0 - keep)
                    share[g, e] -= cut
                    load[g] -= cut
        has[dst, e] = True
        extras[dst, added[dst]] = e
        added[dst] += 1
        load[dst] += own
        # the rebalancer's transfer of src's remote picks of e, never past B on either side
        x = min(share[src, e], load[src] - B, B - load[dst])
        if x > 0:
            share[src, e] -= x
            load[src] -= x
            share[dst, e] += x
            load[dst] += x
        moves += 1
    return moves


def prefetch(demand: np.ndarray, hosted: np.ndarray, n: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Libra's Alg. 1 for one layer: ``(extras [G, N], expected load [G])``.

    ``demand [G, E]`` (non-negative, any real) and ``hosted [G, E]`` (bool; every expert somewhere).
    ``extras[g]`` lists the experts GPU ``g`` prefetches, phase 1 first, padded with -1.

    Example: 2 GPUs, experts ``{0, 1}`` on GPU 0 and ``{2, 3}`` on GPU 1, GPU 0's tokens want expert 2 most,
    ``N = 2, alpha = 0.5``: phase 1 gives GPU 0 expert 2 (and GPU 1 its own favourite remote expert).
    """
    d, h = _arrays(demand, hosted, 2)
    n_local = _check(n, alpha, d.shape[1])
    extras = np.full((d.shape[0], n), -1, dtype=np.int64)
    load = np.zeros(d.shape[0])
    _prefetch(d, h, n, n_local, extras, load)
    return extras, load


def prefetch_layers(demand: np.ndarray, hosted: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """``extras [L, G, N]``: :func:`prefetch` on every layer of ``demand [L, G, E]`` and ``hosted [L, G, E]``."""
    d, h = _arrays(demand, hosted, 3)
    n_local = _check(n, alpha, d.shape[2])
    L, G, _ = d.shape
    extras = np.full((L, G, n), -1, dtype=np.int64)
    load = np.zeros(G)
    for layer in range(L):
        _prefetch(d[layer], h[layer], n, n_local, extras[layer], load)
    return extras


def _arrays(demand: np.ndarray, hosted: np.ndarray, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    d = np.ascontiguousarray(demand, dtype=np.float64)
    h = np.ascontiguousarray(hosted, dtype=np.bool_)
    if d.ndim != ndim or h.shape != d.shape:
        shape = "[G, E]" if ndim == 2 else "[L, G, E]"
        raise InputError(f"demand {d.shape} and hosted {h.shape} must both be {shape}")
    if not np.all(np.isfinite(d)) or (d < 0).any():
        raise InputError("demand must be finite and non-negative (predicted picks per GPU and expert)")
    somewhere = h.any(axis=-2)
    if not somewhere.all():
        where = np.argwhere(~somewhere)[0]
        raise InputError(f"expert {int(where[-1])} has no copy in the base placement"
                         + (f" of layer {int(where[0])}" if ndim == 3 else "") + "; every expert needs a home")
    return d, h


def _check(n: int, alpha: float, num_experts: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise InputError(f"n ({n!r}) must be a non-negative integer (extra experts per GPU and layer)")
    if n > num_experts:
        raise InputError(f"n ({n}) exceeds the {num_experts} experts of a layer: a GPU cannot take more extra experts "
                         "than there are; give a smaller n")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0:
        raise InputError(f"alpha ({alpha!r}) must be a number in [0, 1] (the locality share of n)")
    return phase1_count(int(n), float(alpha))
