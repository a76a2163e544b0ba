"""The exact min-max split of expert load over replicas (docs/papers/routing.md, "The min-max split").

Legend: ``B`` batches, ``E`` experts, ``G`` GPUs, ``T`` tokens, ``K`` picks per token; ``has [E, G]`` says
which GPUs hold a copy of which expert (one layer).

Given expert loads ``W [E]`` and where the copies are, a split sends ``x[e, g] >= 0`` of expert ``e``'s
tokens to each GPU ``g`` holding it, ``sum_g x[e, g] = W[e]``. The least possible straggler load is::

    t* = max over GPU sets S of  W(experts whose copies all lie in S) / |S|

(the max-flow min-cut theorem on the network source -> expert -> GPU -> sink with GPU capacities ``t``),
found exactly, by minimum cuts, in :mod:`moebalance.algorithms.minmax_cut`, whose kernels this module
re-exports (:func:`host_lists`, :func:`workspace`, :func:`lex_loads`, :func:`minmax_value`).

- **Counts** (fractional tokens): :func:`lex_loads` returns the lexicographically smallest load vector:
  the largest set of GPUs that must carry ``t*`` (those that cannot reach the sink in the residual network)
  takes exactly ``t*``; the experts whose copies all lie in it are settled, the others lose those copies,
  and the rest is solved again. The maximum is ``t*`` (the LP optimum) and no other split has a smaller
  sorted load vector, so the spread of load (standard deviation, idle time) is the least possible too.
- **Tokens** (each pick goes to one GPU): with integer capacities ``U`` a fractional split exists iff an
  integral one does, so the integral optimum is ``ceil(t*)``. :func:`route_tokens` finds, among the splits
  whose GPUs all stay within ``ceil(t*)``, one of least traffic cost -- a pick served on its own GPU costs
  0, on another GPU of its node 1, on another node 2 -- as a minimum-cost flow from (source GPU, expert)
  classes to GPUs, then hands each class's tokens to GPUs in token order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moebalance.algorithms.flow import build, min_cost_flow
from moebalance.algorithms.minmax_cut import (
    host_lists,
    lex_loads,
    minmax_value,
    solve_loads,
    solve_value,
    workspace,
)

__all__ = ["host_lists", "lex_loads", "max_loads", "minmax_value", "route_tokens", "split_counts", "workspace"]


@njit(cache=True)
def split_counts(counts: np.ndarray, has: np.ndarray) -> np.ndarray:
    """``float64 [B, L, G]``: :func:`lex_loads` of every ``(b, l)`` of ``counts int64 [B, L, E]``,
    ``has bool [L, E, G]``."""
    B, L, _E = counts.shape
    G = has.shape[2]
    out = np.zeros((B, L, G), np.float64)
    for layer in range(L):
        hstart, hosts = host_lists(has[layer])
        ints, io, bools, bo = workspace(_E, G, hosts.shape[0])
        for b in range(B):
            num, den = solve_loads(counts[b, layer], hstart, hosts, G, True, ints, io, bools, bo)
            for g in range(G):
                out[b, layer, g] = num[g] / den[g]
    return out


@njit(cache=True)
def max_loads(counts: np.ndarray, has: np.ndarray, integral: bool) -> np.ndarray:
    """``float64 [B, L]``: the least straggler load of every ``(b, l)``: ``t*``, or ``ceil(t*)`` if integral."""
    B, L, _E = counts.shape
    G = has.shape[2]
    out = np.zeros((B, L), np.float64)
    for layer in range(L):
        hstart, hosts = host_lists(has[layer])
        ints, io, bools, bo = workspace(_E, G, hosts.shape[0])
        for b in range(B):
            p, q = solve_value(counts[b, layer], hstart, hosts, G, ints, io, bools, bo)
            out[b, layer] = (p + q - 1) // q if integral else p / q
    return out


@njit(cache=True)
def route_tokens(ids: np.ndarray, src: np.ndarray, batch_start: np.ndarray, has: np.ndarray,
                 gpus_per_node: int, kept: np.ndarray) -> np.ndarray:
    """``int64 [T, K]``: a GPU for every kept pick of one layer, batch by batch (module docstring, "Tokens").

    ``ids int64 [T, K]`` the picks (distinct within a token), ``src int64 [T]`` each token's GPU, tokens of
    batch ``b`` at ``batch_start[b]:batch_start[b + 1]``; ``has bool [E, G]``; ``kept bool [T, K]``: the
    picks to serve (a dropped pick's GPU is -1 and it counts nowhere).
    """
    T, K = ids.shape
    E, G = has.shape
    dest = np.full((T, K), -1, np.int64)
    n_hosts = np.zeros(E, np.int64)
    only = np.full(E, -1, np.int64)
    for e in range(E):
        for g in range(G):
            if has[e, g]:
                n_hosts[e] += 1
                only[e] = g
    multi = np.empty(E, np.int64)  # position of each multi-copy expert among them, -1 for the others
    M = 0
    for e in range(E):
        if n_hosts[e] > 1:
            multi[e] = M
            M += 1
        else:
            multi[e] = -1
    mexp = np.empty(M, np.int64)
    for e in range(E):
        if multi[e] >= 0:
            mexp[multi[e]] = e
    cls_count = np.zeros(G * M, np.int64)
    cls_node = np.full(G * M, -1, np.int64)
    W = np.zeros(E, np.int64)
    base = np.zeros(G, np.int64)
    hstart, hosts = host_lists(has)
    ints, io, bools, bo = workspace(E, G, hosts.shape[0])
    for b in range(batch_start.shape[0] - 1):
        lo, hi = batch_start[b], batch_start[b + 1]
        if hi == lo:
            continue
        W[:] = 0
        base[:] = 0
        cls_count[:] = 0
        for i in range(lo, hi):
            for k in range(K):
                if not kept[i, k]:
                    continue
                e = ids[i, k]
                W[e] += 1
                if multi[e] < 0:
                    base[only[e]] += 1
                else:
                    cls_count[src[i] * M + multi[e]] += 1
        p, q = solve_value(W, hstart, hosts, G, ints, io, bools, bo)
        U = (p + q - 1) // q
        # network: source 0, classes 1..C, GPUs C+1..C+G, sink C+G+1
        C = 0
        n_arcs = 0
        for c in range(G * M):
            if cls_count[c] > 0:
                cls_node[c] = 1 + C
                C += 1
                n_arcs += 1 + n_hosts[mexp[c % M]]
            else:
                cls_node[c] = -1
        n = C + G + 2
        s, t = 0, C + G + 1
        m = n_arcs + G
        tail = np.empty(m, np.int64)
        head = np.empty(m, np.int64)
        cap = np.empty(m, np.int64)
        cost = np.zeros(m, np.int64)
        first_edge = np.empty(G * M, np.int64)  # each class's first class -> GPU edge
        k = 0
        for c in range(G * M):
            if cls_node[c] < 0:
                continue
            sg, e = c // M, mexp[c % M]
            tail[k], head[k], cap[k] = s, cls_node[c], cls_count[c]
            k += 1
            first_edge[c] = k
            for g in range(G):
                if has[e, g]:
                    tail[k], head[k], cap[k] = cls_node[c], 1 + C + g, cls_count[c]
                    if g != sg:
                        cost[k] = 1 if g // gpus_per_node == sg // gpus_per_node else 2
                    k += 1
        demand = np.int64(0)
        for c in range(G * M):
            demand += cls_count[c]
        for g in range(G):
            tail[k], head[k], cap[k] = 1 + C + g, t, U - base[g]
            k += 1
        arc_head, arc_cost, res, start, adj = build(n, tail, head, cap, cost)
        sent = min_cost_flow(n, arc_head, arc_cost, res, start, adj, s, t, demand)
        if sent != demand:
            raise RuntimeError("minmax: the integral split at ceil(t*) was infeasible (a bug)")
        # hand each class's tokens to its GPUs in token order; the flow on edge j is res[2 j + 1]
        for i in range(lo, hi):
            for kk in range(K):
                if not kept[i, kk]:
                    continue
                e = ids[i, kk]
                if multi[e] < 0:
                    dest[i, kk] = only[e]
                    continue
                c = src[i] * M + multi[e]
                j = first_edge[c]
                while res[2 * j + 1] == 0:
                    j += 1
                res[2 * j + 1] -= 1
                dest[i, kk] = arc_head[2 * j] - 1 - C
    return dest
