"""A frozen copy of the per-layer planning as it was before :mod:`moebalance.algorithms.exact`: Libra's
prefetcher (Alg. 1, phases 1-2) and token rebalancer (Alg. 2) on one layer's counts.

Reference ONLY for the equality tests of the fast planner (tests/test_exact_planner.py): it must not change
when the library's kernels do. It is the library's own earlier code (moebalance.algorithms.prefetch,
moebalance.algorithms.rebalance and moebalance.algorithms.minmax_cut.host_lists), copied unchanged apart from
names; :func:`ref_plan_layer` composes the pieces as the libra policy and the ``rebalance`` router did.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_TOL = 1e-9


@njit(cache=True)
def ref_prefetch_kernel(demand: np.ndarray, hosted: np.ndarray, n: int, n_local: int,
                        extras: np.ndarray, load: np.ndarray) -> int:
    G, E = demand.shape
    has = hosted.copy()
    added = np.zeros(G, np.int64)
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
        x = min(share[src, e], load[src] - B, B - load[dst])
        if x > 0:
            share[src, e] -= x
            load[src] -= x
            share[dst, e] += x
            load[dst] += x
        moves += 1
    return moves


@njit(cache=True)
def ref_host_lists(has: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    E, G = has.shape
    hstart = np.zeros(E + 1, np.int64)
    for e in range(E):
        hstart[e + 1] = hstart[e]
        for g in range(G):
            if has[e, g]:
                hstart[e + 1] += 1
    hosts = np.empty(hstart[E], np.int64)
    k = 0
    for e in range(E):
        for g in range(G):
            if has[e, g]:
                hosts[k] = g
                k += 1
    return hstart, hosts


@njit(cache=True)
def ref_gpu_lists(hstart: np.ndarray, hosts: np.ndarray, G: int) -> tuple[np.ndarray, np.ndarray]:
    E = hstart.shape[0] - 1
    gstart = np.zeros(G + 1, np.int64)
    for e in range(E):
        if hstart[e + 1] - hstart[e] > 1:
            for j in range(hstart[e], hstart[e + 1]):
                gstart[hosts[j] + 1] += 1
    for g in range(G):
        gstart[g + 1] += gstart[g]
    pos = gstart[:G].copy()
    gexp = np.empty(gstart[G], np.int64)
    for e in range(E):
        if hstart[e + 1] - hstart[e] > 1:
            for j in range(hstart[e], hstart[e + 1]):
                g = hosts[j]
                gexp[pos[g]] = e
                pos[g] += 1
    return gstart, gexp


@njit(cache=True)
def _ref_reposition(by_load: np.ndarray, where: np.ndarray, loads: np.ndarray, g: int) -> None:
    p = where[g]
    while p > 0 and (loads[by_load[p - 1]] < loads[g] or (loads[by_load[p - 1]] == loads[g] and by_load[p - 1] > g)):
        by_load[p] = by_load[p - 1]
        where[by_load[p]] = p
        p -= 1
    n = by_load.shape[0]
    while p < n - 1 and (loads[by_load[p + 1]] > loads[g] or (loads[by_load[p + 1]] == loads[g] and by_load[p + 1] < g)):
        by_load[p] = by_load[p + 1]
        where[by_load[p]] = p
        p += 1
    by_load[p] = g
    where[g] = p


@njit(cache=True)
def ref_rebalance(local: np.ndarray, remote: np.ndarray, hstart: np.ndarray, hosts: np.ndarray, gstart: np.ndarray,
                  gexp: np.ndarray, target: float, eps: float, strict: bool) -> tuple[np.ndarray, int]:
    G, E = remote.shape
    loads = local.copy()
    for e in range(E):
        for j in range(hstart[e], hstart[e + 1]):
            loads[hosts[j]] += remote[hosts[j], e]
    order = np.empty(max(gexp.shape[0], 1), np.int64)
    by_load = np.argsort(-loads, kind="mergesort")
    where = np.empty(G, np.int64)
    for p in range(G):
        where[by_load[p]] = p
    moves = 0
    while True:
        if loads[by_load[0]] <= (1.0 + eps) * target:
            break
        moved = False
        for si in range(G):
            g_s = by_load[si]
            if loads[g_s] <= target:
                break
            n = 0
            for j in range(gstart[g_s], gstart[g_s + 1]):
                e = gexp[j]
                r = remote[g_s, e]
                if r <= 0:
                    continue
                i = n
                while i > 0 and (remote[g_s, order[i - 1]] < r
                                 or (remote[g_s, order[i - 1]] == r and order[i - 1] > e)):
                    order[i] = order[i - 1]
                    i -= 1
                order[i] = e
                n += 1
            for i in range(n):
                e = order[i]
                g_d = -1
                for j in range(hstart[e], hstart[e + 1]):
                    g = hosts[j]
                    if g != g_s and (g_d < 0 or loads[g] < loads[g_d]):
                        g_d = g
                cap = np.int64(np.floor(target - loads[g_d]))
                if cap < 1 and not strict:
                    cap = (loads[g_s] - loads[g_d]) // 2
                if cap < 1:
                    continue
                amount = min(remote[g_s, e], cap)
                remote[g_s, e] -= amount
                remote[g_d, e] += amount
                loads[g_s] -= amount
                loads[g_d] += amount
                _ref_reposition(by_load, where, loads, g_s)
                _ref_reposition(by_load, where, loads, g_d)
                moves += 1
                moved = True
                break
            if moved:
                break
        if not moved:
            break
    return loads, moves


@njit(cache=True)
def ref_start(n_remote: np.ndarray, copies: np.ndarray, hstart: np.ndarray, hosts: np.ndarray,
              remote: np.ndarray) -> None:
    for e in range(n_remote.shape[0]):
        n = n_remote[e]
        if n == 0:
            continue
        r = 0
        for j in range(hstart[e], hstart[e + 1]):
            r += copies[e, hosts[j]]
        c = 0
        for j in range(hstart[e], hstart[e + 1]):
            g = hosts[j]
            for _ in range(copies[e, g]):
                remote[g, e] += n // r + (1 if c < n % r else 0)
                c += 1


def ref_prefetch(demand: np.ndarray, hosted: np.ndarray, n: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """``(extras [G, N], expected load [G])`` as the earlier ``prefetch`` gave them (no input checks)."""
    d = np.ascontiguousarray(demand, dtype=np.float64)
    h = np.ascontiguousarray(hosted, dtype=np.bool_)
    n_local = int(np.floor(n * alpha + 1e-12))
    extras = np.full((d.shape[0], n), -1, dtype=np.int64)
    load = np.zeros(d.shape[0])
    ref_prefetch_kernel(d, h, n, n_local, extras, load)
    return extras, load


def ref_plan_layer(demand: np.ndarray, copies: np.ndarray, n: int, alpha: float, eps: float = 0.0,
                   strict: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """The earlier per-layer planning on counts ``demand int [G, E]`` (picks by source GPU and expert) over a
    base layer ``copies int [E, G]``: ``(extras [G, N], expected load [G], remote int64 [G, E], loads int64 [G],
    rebalancer moves)``.

    The prefetcher plans extras on ``copies > 0``; the per-batch layer is the base with one copy of every extra
    added; a pick whose expert has a copy on its GPU is local, the others start as the ``uniform`` router deals
    them and the rebalancer moves them (as the ``rebalance`` router does on one batch of tokens).
    """
    d = np.asarray(demand, dtype=np.int64)
    cp = np.array(copies, dtype=np.int64)
    G, E = d.shape
    extras, expected = ref_prefetch(d, (cp > 0).T, n, alpha)
    for g in range(G):
        for e in extras[g]:
            if e >= 0:
                cp[e, g] += 1
    has = cp > 0  # [E, G]
    local = (d * has.T).sum(axis=1).astype(np.int64)
    n_remote = (d * ~has.T).sum(axis=0).astype(np.int64)
    hstart, hosts = ref_host_lists(has)
    gstart, gexp = ref_gpu_lists(hstart, hosts, G)
    remote = np.zeros((G, E), np.int64)
    ref_start(n_remote, cp, hstart, hosts, remote)
    loads, moves = ref_rebalance(local, remote, hstart, hosts, gstart, gexp, float(d.sum()) / G, eps, strict)
    return extras, expected, remote, loads, moves
