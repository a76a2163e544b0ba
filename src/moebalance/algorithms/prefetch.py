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

__all__ = ["TOL", "check_options", "hosting_lists", "phase1_count", "plan_extras", "prefetch", "prefetch_layers"]

#: Loads within this many tokens of ``B`` count as balanced, and loads or shares this close count as tied (so ties
#: go to the lower id, not to rounding noise): the loads are sums of float shares.
TOL = 1e-9


def phase1_count(n: int, alpha: float) -> int:
    """``L = floor(N * alpha)``: the phase-1 (locality) share of the ``N`` buffer slots.

    Example: ``phase1_count(8, 0.5) == 4`` (the paper's deployment); ``phase1_count(3, 0.5) == 1``.
    """
    return int(np.floor(n * alpha + 1e-12))


@njit(cache=True, nogil=True)
def hosting_lists(has_EG: np.ndarray, room: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(glist [G, S], gcount [G], hlist [E, G], hcount [E])`` of ``has_EG [E, G]`` (non-zero: a copy; any layout).

    ``glist[g, :gcount[g]]`` are the experts GPU ``g`` holds and ``hlist[e, :hcount[e]]`` the GPUs holding ``e``,
    both ascending; ``S`` leaves ``room`` more slots per GPU (for the extras).
    """
    E, G = has_EG.shape
    gcount = np.zeros(G, np.int64)
    hcount = np.zeros(E, np.int64)
    for e in range(E):
        for g in range(G):
            if has_EG[e, g] != 0:
                gcount[g] += 1
    width = room + (gcount.max() if G > 0 else 0)
    glist = np.empty((G, max(width, 1)), np.int64)
    hlist = np.empty((E, max(G, 1)), np.int64)
    gcount[:] = 0
    for e in range(E):
        for g in range(G):
            if has_EG[e, g] != 0:
                glist[g, gcount[g]] = e
                gcount[g] += 1
                hlist[e, hcount[e]] = g
                hcount[e] += 1
    return glist, gcount, hlist, hcount


@njit(cache=True, nogil=True, inline="always")
def _insert(rows: np.ndarray, count: np.ndarray, i: int, value: int) -> int:
    """Insert ``value`` into the ascending ``rows[i, :count[i]]``; returns its position."""
    p = count[i]
    while p > 0 and rows[i, p - 1] > value:
        rows[i, p] = rows[i, p - 1]
        p -= 1
    rows[i, p] = value
    count[i] += 1
    return p


@njit(cache=True, nogil=True)
def _phase1_row(row: np.ndarray, held: np.ndarray, n_held: int, n_local: int, top_v: np.ndarray,
                top_e: np.ndarray) -> int:
    """The ``n_local`` largest positive entries of ``row [E]`` outside the ascending ``held[:n_held]``, largest
    first, ties to the lower id, into ``top_v``, ``top_e``; returns how many. Blocks of 8 whose largest entry
    cannot enter are skipped whole."""
    E = row.shape[0]
    k, p = 0, 0
    floor = row[0] * 0  # an entry must exceed it: 0 until the list is full, then its last value
    lo = 0
    while lo < E:
        hi = lo + 8
        if hi <= E:
            m = row[lo]
            for i in range(1, 8):
                m = max(m, row[lo + i])
        else:
            hi = E
            m = row[lo]
            for e in range(lo + 1, hi):
                m = max(m, row[e])
        if m > floor:
            for e in range(lo, hi):
                v = row[e]
                if v <= floor:
                    continue
                while p < n_held and held[p] < e:
                    p += 1
                if p < n_held and held[p] == e:
                    continue
                i = k if k < n_local else n_local - 1
                while i > 0 and top_v[i - 1] < v:
                    top_v[i] = top_v[i - 1]
                    top_e[i] = top_e[i - 1]
                    i -= 1
                top_v[i] = v
                top_e[i] = e
                if k < n_local:
                    k += 1
                if k == n_local:
                    floor = top_v[n_local - 1]
        lo = hi
    return k


@njit(cache=True, nogil=True)
def _most_loaded(load: np.ndarray) -> int:
    """The printed scan ``src = 0; src = g where load[g] > load[src] + tol``. Its result is within ``tol`` of the
    maximum (``load[src] + tol >= max``): when one GPU alone is, that is it, found without the scan."""
    G = load.shape[0]
    top = load[0]
    for g in range(1, G):
        top = max(top, load[g])
    near = 0
    for g in range(G):
        near += load[g] + TOL >= top
    src = 0
    if near == 1:
        while load[src] + TOL < top:
            src += 1
        return src
    for g in range(1, G):
        if load[g] > load[src] + TOL:
            src = g
    return src


@njit(cache=True, nogil=True)
def _least_loaded(load: np.ndarray, open_: np.ndarray) -> int:
    """The printed scan for the least loaded GPU among ``open_ [G]`` (-1 if none), as :func:`_most_loaded`."""
    G = load.shape[0]
    low = np.inf
    for g in range(G):
        low = min(low, load[g] if open_[g] else np.inf)
    if low == np.inf:
        return -1
    near = 0
    for g in range(G):
        near += open_[g] and load[g] - TOL <= low
    dst = -1
    if near == 1:
        dst = 0
        while not (open_[dst] and load[dst] - TOL <= low):
            dst += 1
        return dst
    for g in range(G):
        if open_[g] and (dst < 0 or load[g] < load[dst] - TOL):
            dst = g
    return dst


@njit(cache=True, nogil=True)
def plan_extras(demand: np.ndarray, glist: np.ndarray, gcount: np.ndarray, hlist: np.ndarray, hcount: np.ndarray,
                n: int, n_local: int, integral: bool, extras: np.ndarray, load: np.ndarray,
                column: np.ndarray) -> int:
    """Alg. 1 on one layer (the module docstring), on :func:`hosting_lists`, which it updates with the extras.

    ``demand [G, E]`` (int64 counts with ``integral``, else float64), ``extras [G, N]`` (-1 filled; gets the
    extras in the order added), ``load [G]`` (gets the expected loads), ``column [E]`` (gets the picks of each
    expert, with ``integral`` only). Returns the phase-2 duplications.

    The result is the printed loop's, computed with less work: phase 1 keeps each GPU's ``L`` best in one
    pass; phase 2 looks only at the experts a GPU holds (the others have no remote share) and at the holders
    of an expert, and finds the most and least loaded GPU with vectorised passes, falling back to the printed
    scan when two loads are within the tolerance of the extreme. Every float is computed by the same
    operations in the same order as the plain loop (loads summed expert by expert, shares summed GPU by GPU),
    so ties within the tolerance fall alike. With ``integral`` the column sums are exact in any order (the
    caller keeps them under 2**52).
    """
    G, E = demand.shape
    added = np.zeros(G, np.int64)
    top_v = np.empty(max(n_local, 1), demand.dtype)
    top_e = np.empty(max(n_local, 1), np.int64)
    total = 0.0
    if integral:
        column[:] = 0
        for g in range(G):
            for e in range(E):
                column[e] += demand[g, e]
    # phase 1: each GPU's L most requested experts it does not hold (ties to the lower id)
    if n_local > 0:
        for g in range(G):
            k = _phase1_row(demand[g], glist[g], gcount[g], n_local, top_v, top_e)
            for i in range(k):
                e = top_e[i]
                _insert(glist, gcount, g, e)
                _insert(hlist, hcount, e, g)
                extras[g, added[g]] = e
                added[g] += 1
    # expert e's remote picks (by GPUs without a copy), and the total
    remote_e = np.empty(E)
    if integral:
        whole = 0
        for e in range(E):
            whole += column[e]
            rest = column[e]
            for j in range(hcount[e]):
                rest -= demand[hlist[e, j], e]
            remote_e[e] = rest
        total = float(whole)
    else:
        for e in range(E):
            r, p = 0.0, 0
            for g in range(G):
                total += demand[g, e]
                if p < hcount[e] and hlist[e, p] == g:
                    p += 1
                else:
                    r += demand[g, e]
            remote_e[e] = r
    # loads: local picks stay; remote picks split evenly over the copies
    share = np.empty((G, E))
    for g in range(G):
        x = 0.0
        for j in range(gcount[g]):
            e = glist[g, j]
            x += demand[g, e]
            if remote_e[e] > 0:
                share[g, e] = remote_e[e] / hcount[e]
                x += remote_e[e] / hcount[e]
            else:
                share[g, e] = 0.0
        load[g] = x
    B = total / G
    open_ = added < n  # GPUs that may take another extra (the holders of the expert at hand are closed)
    moves = 0
    for _ in range((n - n_local) * G):
        src = _most_loaded(load)
        if load[src] <= B + TOL:
            break
        e, ev = -1, 0.0
        for j in range(gcount[src]):  # the experts src does not hold have no share there
            x = glist[src, j]
            if share[src, x] > ev + TOL:
                e, ev = x, share[src, x]
        if e < 0:
            break
        for j in range(hcount[e]):
            open_[hlist[e, j]] = False
        dst = _least_loaded(load, open_)
        for j in range(hcount[e]):
            g = hlist[e, j]
            open_[g] = added[g] < n
        if dst < 0:
            break
        own = demand[dst, e]
        if load[dst] + own > B + TOL:
            break
        # localise dst's own picks of e, taken from e's copies in proportion to what they serve
        remote = 0.0
        for j in range(hcount[e]):
            remote += share[hlist[e, j], e]
        if own > 0 and remote > 0:
            keep = max(remote - own, 0.0) / remote
            for j in range(hcount[e]):
                g = hlist[e, j]
                cut = share[g, e] * (1.0 - keep)
                share[g, e] -= cut
                load[g] -= cut
        _insert(glist, gcount, dst, e)
        _insert(hlist, hcount, e, dst)
        share[dst, e] = 0.0
        extras[dst, added[dst]] = e
        added[dst] += 1
        open_[dst] = added[dst] < n
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
    n_local = check_options(n, alpha, d.shape[1])
    extras = np.full((d.shape[0], n), -1, dtype=np.int64)
    load = np.zeros(d.shape[0])
    _layer(d, h, n, n_local, extras, load)
    return extras, load


def prefetch_layers(demand: np.ndarray, hosted: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """``extras [L, G, N]``: :func:`prefetch` on every layer of ``demand [L, G, E]`` and ``hosted [L, G, E]``."""
    d, h = _arrays(demand, hosted, 3)
    n_local = check_options(n, alpha, d.shape[2])
    L, G, _ = d.shape
    extras = np.full((L, G, n), -1, dtype=np.int64)
    load = np.zeros(G)
    for layer in range(L):
        _layer(d[layer], h[layer], n, n_local, extras[layer], load)
    return extras


def _layer(d: np.ndarray, h: np.ndarray, n: int, n_local: int, extras: np.ndarray, load: np.ndarray) -> None:
    """:func:`plan_extras` on float ``demand d [G, E]`` and ``hosted h [G, E]``."""
    glist, gcount, hlist, hcount = hosting_lists(h.T, n)
    plan_extras(d, glist, gcount, hlist, hcount, n, n_local, False, extras, load, np.empty(0))


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


def check_options(n: int, alpha: float, num_experts: int) -> int:
    """``L = floor(n * alpha)`` after checking ``n`` (0 .. ``num_experts``) and ``alpha`` (in [0, 1]); one-line errors."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise InputError(f"n ({n!r}) must be a non-negative integer (extra experts per GPU and layer)")
    if n > num_experts:
        raise InputError(f"n ({n}) exceeds the {num_experts} experts of a layer: a GPU cannot take more extra experts "
                         "than there are; give a smaller n")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0:
        raise InputError(f"alpha ({alpha!r}) must be a number in [0, 1] (the locality share of n)")
    return phase1_count(int(n), float(alpha))
