"""Route picks to copies so that the slowest GPU's grouped GEMM is shortest, not its token count (METRO,
arXiv 2512.09277: balance the experts each GPU activates in decode).

Legend: ``B`` batches, ``L`` layers, ``E`` experts, ``G`` GPUs, ``T`` tokens, ``K`` picks per token, ``P`` host
entries of one layer (an expert and a GPU holding a copy; two copies on one GPU are one entry).

One ``(batch, layer)``: expert loads ``W [E]`` and the GPUs holding each expert,
``hosts[hstart[e]:hstart[e + 1]]`` (:func:`moebalance.algorithms.minmax.host_lists`). A split ``take [P]`` sends
``take[j]`` of the picks of entry ``j``'s expert to its GPU, ``sum`` over an expert's entries ``= W[e]``. GPU
``g`` then serves ``n_g`` picks and touches ``u_g`` experts (its entries with ``take > 0``). Its grouped GEMM
takes the cost model's roofline (:func:`moebalance.cost.time.gemm_seconds`), and receiving its picks' tokens
takes about ``kappa`` per pick (the all-to-all's busiest link when tokens come from every GPU alike,
:func:`moebalance.cost.a2a.a2a_estimate`); the local search below balances their sum::

    t(n, u) = max(alpha * n, beta * u + gamma * n) + kappa * n + launch        (0 when n = 0)

``cost = [alpha, beta, gamma, launch, kappa]``: seconds of compute per pick, to read one expert's weights, to
read and write one pick's activations, per grouped GEMM, and of all-to-all per pick. Decode (few picks per
expert) is bound by ``beta * u``: an expert's few picks belong on few of its copies, and the experts touched
spread over the GPUs. Prefill is bound by ``alpha * n``: the picks spread, as a token balancer spreads them.
(The layer waits for the slowest grouped GEMM and then for the all-to-all's busiest link, a sum of two maxima;
balancing each GPU's sum is the surrogate, and the router scores its answer by the cost model itself.)

The split minimises the layer's time as the cost model adds it, ``max_g t_expert + kappa * max_g n_g``, heuristically
(the problem holds makespan scheduling on restricted machines, NP-hard). Two starts, both of whole experts
taken in one order (fewest copies first, then the most loaded, then the lower id):

1. greedily, each expert to the copy whose GPU's time after taking it is least;
2. with the least possible ``max_g u_g``: each expert to the copy whose GPU touches fewest experts, then
   cost-reducing paths until none is left (:func:`moebalance.algorithms.metro_starts.fewest_touched`), which
   the greedy start may miss.

Each start is kept as it is and also improved twice, by local search on ``t`` and on the expert time alone
(``kappa = 0``), each search followed by levelling the picks; the best of the six is returned. (Splitting an
expert's picks evenly over its copies, the balance of tokens, is left to the router, which also prices
``uniform``'s and ``rebalance``'s splits and keeps the fastest.)

- Local search, repeated while it helps: on the slowest GPU ``s``, move all or part of one expert's picks to
  another copy's GPU, and, when no single move helps, a chain of two whole moves (``s`` gives an expert to
  ``h``, ``h`` gives another to a third GPU or back to ``s``). A move is taken when the GPUs it changes all end
  below ``t_s``; the best such move (least new maximum among them) is applied. Each move lowers the sorted vector of GPU times
  lexicographically, so the search ends.
- Levelling: while it lowers the most picks on a GPU, move picks from that GPU to another copy's GPU without any
  grouped GEMM growing past the slowest one.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moebalance.algorithms import metro_starts as starts
from moebalance.algorithms import minmax

__all__ = ["expert_time", "gpu_time", "layer_time", "route_tokens", "split_counts", "split_layer"]


@njit(cache=True, nogil=True)
def expert_time(n: float, u: float, cost: np.ndarray) -> float:
    """Seconds of one GPU's grouped GEMM over ``n`` picks touching ``u`` experts (module docstring)."""
    if n <= 0:
        return 0.0
    return max(cost[0] * n, cost[1] * u + cost[2] * n) + cost[3]


@njit(cache=True, nogil=True)
def gpu_time(n: float, u: float, cost: np.ndarray) -> float:
    """:func:`expert_time` with the picks' all-to-all, ``kappa * n``: what the local search balances."""
    if n <= 0:
        return 0.0
    return expert_time(n, u, cost) + cost[4] * n


@njit(cache=True, nogil=True)
def _entries(hstart: np.ndarray, hosts: np.ndarray, G: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(expert [P], gstart [G + 1], gent [P])``: each entry's expert, and the entries on GPU ``g``,
    ``gent[gstart[g]:gstart[g + 1]]``."""
    P = hosts.shape[0]
    expert = np.empty(P, np.int64)
    for e in range(hstart.shape[0] - 1):
        for j in range(hstart[e], hstart[e + 1]):
            expert[j] = e
    gstart = np.zeros(G + 1, np.int64)
    for j in range(P):
        gstart[hosts[j] + 1] += 1
    for g in range(G):
        gstart[g + 1] += gstart[g]
    pos = gstart[:G].copy()
    gent = np.empty(P, np.int64)
    for j in range(P):
        g = hosts[j]
        gent[pos[g]] = j
        pos[g] += 1
    return expert, gstart, gent


@njit(cache=True, nogil=True)
def _tally(take: np.ndarray, hosts: np.ndarray, n: np.ndarray, u: np.ndarray) -> None:
    """``n [G]`` picks and ``u [G]`` experts touched per GPU under ``take [P]``."""
    n[:] = 0
    u[:] = 0
    for j in range(take.shape[0]):
        if take[j] > 0:
            n[hosts[j]] += take[j]
            u[hosts[j]] += 1


@njit(cache=True, nogil=True)
def _peak(n: np.ndarray, u: np.ndarray, cost: np.ndarray) -> tuple[int, float]:
    """``(GPU, seconds)`` of the slowest GPU (the lowest id among equals)."""
    best, where = -1.0, -1
    for g in range(n.shape[0]):
        t = gpu_time(n[g], u[g], cost)
        if t > best:
            best, where = t, g
    return where, best


@njit(cache=True, nogil=True)
def _layer(n: np.ndarray, u: np.ndarray, cost: np.ndarray) -> float:
    """The layer's seconds as the cost model adds them: the slowest grouped GEMM plus the all-to-all's busiest
    GPU (``kappa * max_g n_g``)."""
    slowest, most = 0.0, 0
    for g in range(n.shape[0]):
        slowest = max(slowest, expert_time(n[g], u[g], cost))
        most = max(most, n[g])
    return slowest + cost[4] * most


@njit(cache=True, nogil=True)
def layer_time(take: np.ndarray, hosts: np.ndarray, G: int, cost: np.ndarray) -> float:
    """The layer's seconds (:func:`_layer`) of a split ``take [P]`` over the host entries ``hosts [P]``."""
    n = np.zeros(G, np.int64)
    u = np.zeros(G, np.int64)
    _tally(take, hosts, n, u)
    return _layer(n, u, cost)


@njit(cache=True, nogil=True)
def _greedy(W: np.ndarray, order: np.ndarray, hstart: np.ndarray, hosts: np.ndarray, cost: np.ndarray,
            take: np.ndarray, n: np.ndarray, u: np.ndarray) -> None:
    """Start 1: whole experts in ``order`` (:func:`moebalance.algorithms.metro_starts.order`), each to the copy
    whose GPU's time after taking it is least (then the GPU's time before it, then the first such copy)."""
    take[:] = 0
    n[:] = 0
    u[:] = 0
    for i in range(order.shape[0]):
        e = order[i]
        w = W[e]
        pick, best, now = -1, np.inf, np.inf
        for j in range(hstart[e], hstart[e + 1]):
            g = hosts[j]
            t = gpu_time(n[g] + w, u[g] + 1, cost)
            t0 = gpu_time(n[g], u[g], cost)
            if t < best or (t == best and t0 < now):
                pick, best, now = j, t, t0
        take[pick] = w
        n[hosts[pick]] += w
        u[hosts[pick]] += 1


@njit(cache=True, nogil=True)
def _level(n1: int, u1: int, n2: int, u2: int, most: int, cost: np.ndarray) -> int:
    """The ``m`` in ``[1, most]`` that minimises ``max(t(n1 - m, u1), t(n2 + m, u2))``: the first is
    non-increasing in ``m``, the second non-decreasing, so the best is next to where they cross."""
    lo, hi = 1, most
    while lo < hi:  # the least m with t(n2 + m) >= t(n1 - m), or most
        mid = (lo + hi) // 2
        if gpu_time(n2 + mid, u2, cost) >= gpu_time(n1 - mid, u1, cost):
            hi = mid
        else:
            lo = mid + 1
    best_m = lo
    best = max(gpu_time(n1 - lo, u1, cost), gpu_time(n2 + lo, u2, cost))
    if lo > 1:
        m = lo - 1
        v = max(gpu_time(n1 - m, u1, cost), gpu_time(n2 + m, u2, cost))
        if v < best:
            best_m = m
    return best_m


@njit(cache=True, nogil=True)
def _shift(take: np.ndarray, hosts: np.ndarray, n: np.ndarray, u: np.ndarray, j: int, j2: int, m: int) -> None:
    """Move ``m`` picks from entry ``j`` to entry ``j2`` (same expert), updating ``n`` and ``u``."""
    g, g2 = hosts[j], hosts[j2]
    if take[j2] == 0:
        u[g2] += 1
    take[j] -= m
    take[j2] += m
    n[g] -= m
    n[g2] += m
    if take[j] == 0:
        u[g] -= 1


@njit(cache=True, nogil=True)
def _improve(take: np.ndarray, n: np.ndarray, u: np.ndarray, hstart: np.ndarray, hosts: np.ndarray,
             expert: np.ndarray, gstart: np.ndarray, gent: np.ndarray, cost: np.ndarray, max_moves: int) -> None:
    """The local search of the module docstring, in place on ``take``, ``n`` and ``u``."""
    for _ in range(max_moves):
        s, ts = _peak(n, u, cost)
        if ts <= 0.0:
            return
        best = ts * (1.0 - 1e-12)
        mj, mj2, mm = -1, -1, 0
        for p in range(gstart[s], gstart[s + 1]):
            j = gent[p]
            x = take[j]
            if x == 0:
                continue
            e = expert[j]
            for j2 in range(hstart[e], hstart[e + 1]):
                g2 = hosts[j2]
                if g2 == s:
                    continue
                u2 = u[g2] + (1 if take[j2] == 0 else 0)
                v = max(gpu_time(n[s] - x, u[s] - 1, cost), gpu_time(n[g2] + x, u2, cost))
                if v < best:
                    best, mj, mj2, mm = v, j, j2, x
                if x >= 2:
                    m = _level(n[s], u[s], n[g2], u2, x - 1, cost)
                    v = max(gpu_time(n[s] - m, u[s], cost), gpu_time(n[g2] + m, u2, cost))
                    if v < best:
                        best, mj, mj2, mm = v, j, j2, m
        if mj >= 0:
            _shift(take, hosts, n, u, mj, mj2, mm)
            continue
        # a chain of two whole moves: s -> h (expert e), then h -> k (another expert f)
        cj, cj2, cj3, cj4 = -1, -1, -1, -1
        for p in range(gstart[s], gstart[s + 1]):
            j = gent[p]
            x = take[j]
            if x == 0:
                continue
            e = expert[j]
            t1 = gpu_time(n[s] - x, u[s] - 1, cost)
            if t1 >= best:
                continue
            for j2 in range(hstart[e], hstart[e + 1]):
                h = hosts[j2]
                if h == s:
                    continue
                nh, uh = n[h] + x, u[h] + (1 if take[j2] == 0 else 0)
                for q in range(gstart[h], gstart[h + 1]):
                    j3 = gent[q]
                    y = take[j3]
                    if j3 == j2 or y == 0:
                        continue
                    th = gpu_time(nh - y, uh - 1, cost)
                    if th >= best:
                        continue
                    f = expert[j3]
                    for j4 in range(hstart[f], hstart[f + 1]):
                        k = hosts[j4]
                        if k == h:
                            continue
                        if k == s:  # a swap: s takes f back
                            v = max(th, gpu_time(n[s] - x + y, u[s] - 1 + (1 if take[j4] == 0 else 0), cost))
                        else:
                            tk = gpu_time(n[k] + y, u[k] + (1 if take[j4] == 0 else 0), cost)
                            v = max(t1, max(th, tk))
                        if v < best:
                            best, cj, cj2, cj3, cj4 = v, j, j2, j3, j4
        if cj < 0:
            return
        y = take[cj3]
        _shift(take, hosts, n, u, cj, cj2, take[cj])
        _shift(take, hosts, n, u, cj3, cj4, y)


@njit(cache=True, nogil=True)
def _level_picks(take: np.ndarray, n: np.ndarray, u: np.ndarray, hstart: np.ndarray, hosts: np.ndarray,
                 expert: np.ndarray, gstart: np.ndarray, gent: np.ndarray, cost: np.ndarray, max_moves: int) -> None:
    """Lower the most picks on a GPU (the all-to-all's busiest link) while no GPU's grouped GEMM exceeds the
    slowest one's: move all or part of an expert's picks from the GPU with the most picks to another copy's
    GPU, the move that leaves the pair's larger count least; in place."""
    cap = 0.0
    for g in range(n.shape[0]):
        cap = max(cap, expert_time(n[g], u[g], cost))
    for _ in range(max_moves):
        s = int(np.argmax(n))
        ns = n[s]
        best, mj, mj2, mm = ns, -1, -1, 0
        for p in range(gstart[s], gstart[s + 1]):
            j = gent[p]
            x = take[j]
            if x == 0:
                continue
            e = expert[j]
            for j2 in range(hstart[e], hstart[e + 1]):
                g2 = hosts[j2]
                if g2 == s or n[g2] + 1 >= ns:
                    continue
                u2 = u[g2] + (1 if take[j2] == 0 else 0)
                m = min(x, (ns - n[g2]) // 2)  # the even split, at most the expert's picks there
                lo, hi = 0, m  # the most picks g2 can take within the cap (its time grows with them)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if expert_time(n[g2] + mid, u2, cost) <= cap:
                        lo = mid
                    else:
                        hi = mid - 1
                if lo >= 1 and max(ns - lo, n[g2] + lo) < best:
                    best, mj, mj2, mm = max(ns - lo, n[g2] + lo), j, j2, lo
        if mj < 0:
            return
        _shift(take, hosts, n, u, mj, mj2, mm)


@njit(cache=True, nogil=True)
def _search(W: np.ndarray, hstart: np.ndarray, hosts: np.ndarray, expert: np.ndarray, gstart: np.ndarray,
            gent: np.ndarray, cost: np.ndarray, best_take: np.ndarray) -> None:
    """The best of the two starts, each as it is and improved twice (module docstring), into ``best_take [P]``;
    ``expert, gstart, gent``: :func:`_entries` of the host lists."""
    G = gstart.shape[0] - 1
    P = hosts.shape[0]
    max_moves = 8 * (P + G)
    best = np.inf
    take = np.zeros(P, np.int64)
    start_take = np.zeros(P, np.int64)
    n = np.zeros(G, np.int64)
    u = np.zeros(G, np.int64)
    no_a2a = cost.copy()
    no_a2a[4] = 0.0
    order = starts.order(W, hstart, starts.fits_key(W, G))
    for start in range(2):
        if start == 0:
            _greedy(W, order, hstart, hosts, cost, take, n, u)
        else:
            starts.fewest_touched(W, order, hstart, hosts, expert, gstart, gent, take, n, u)
        start_take[:] = take
        for improve in range(3):  # as started; improved on the per-GPU sum; improved on expert time alone
            if improve > 0:
                take[:] = start_take
                _tally(take, hosts, n, u)
                _improve(take, n, u, hstart, hosts, expert, gstart, gent, cost if improve == 1 else no_a2a,
                         max_moves)
                _level_picks(take, n, u, hstart, hosts, expert, gstart, gent, cost, max_moves)
            t = _layer(n, u, cost)
            if t < best:
                best = t
                best_take[:] = take


@njit(cache=True, nogil=True)
def split_layer(W: np.ndarray, hstart: np.ndarray, hosts: np.ndarray, G: int, cost: np.ndarray) -> np.ndarray:
    """``int64 [P]``: the split of one ``(batch, layer)``'s loads ``W int64 [E]`` over the host entries
    ``hstart, hosts`` (:func:`~moebalance.algorithms.minmax.host_lists` of the layer's ``has bool [E, G]``) with
    ``cost float64 [5]``: the search of the module docstring."""
    expert, gstart, gent = _entries(hstart, hosts, G)
    take = np.zeros(hosts.shape[0], np.int64)
    if W.sum() > 0:
        _search(W, hstart, hosts, expert, gstart, gent, cost, take)
    return take


@njit(cache=True, nogil=True)
def split_counts(counts: np.ndarray, has: np.ndarray, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(picks float64 [B, L, G], touched float64 [B, L, G])``: every ``(b, l)`` of ``counts int64 [B, L, E]``
    split by :func:`split_layer` over ``has bool [L, E, G]``; whole picks, the experts each GPU touches."""
    B, L, _E = counts.shape
    G = has.shape[2]
    picks = np.zeros((B, L, G), np.float64)
    touched = np.zeros((B, L, G), np.float64)
    for layer in range(L):
        hstart, hosts = minmax.host_lists(has[layer])
        expert, gstart, gent = _entries(hstart, hosts, G)
        take = np.zeros(hosts.shape[0], np.int64)
        for b in range(B):
            if counts[b, layer].sum() == 0:
                continue
            _search(counts[b, layer], hstart, hosts, expert, gstart, gent, cost, take)
            for j in range(take.shape[0]):
                if take[j] > 0:
                    picks[b, layer, hosts[j]] += take[j]
                    touched[b, layer, hosts[j]] += 1.0
    return picks, touched


@njit(cache=True, nogil=True)
def route_tokens(ids: np.ndarray, src: np.ndarray, batch_start: np.ndarray, has: np.ndarray, gpus_per_node: int,
                 kept: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """``int64 [T, K]``: a GPU for every kept pick of one layer (the others -1), batch by batch.

    ``ids int64 [T, K]``, ``src int64 [T]`` each token's GPU, batch ``b``'s tokens at ``batch_start[b]:
    batch_start[b + 1]``, ``has bool [E, G]``, ``kept bool [T, K]``. Each batch's kept loads are split by
    :func:`split_layer`; each GPU's share of an expert then goes to picks from that GPU first, then from its
    node, then to any (less traffic, the same split).
    """
    T, K = ids.shape
    E = has.shape[0]
    G = has.shape[1]
    hstart, hosts = minmax.host_lists(has)
    expert, gstart, gent = _entries(hstart, hosts, G)
    left = np.zeros(hosts.shape[0], np.int64)
    dest = np.full((T, K), -1, np.int64)
    W = np.zeros(E, np.int64)
    for b in range(batch_start.shape[0] - 1):
        lo, hi = batch_start[b], batch_start[b + 1]
        W[:] = 0
        for i in range(lo, hi):
            for k in range(K):
                if kept[i, k]:
                    W[ids[i, k]] += 1
        if W.sum() == 0:
            continue
        _search(W, hstart, hosts, expert, gstart, gent, cost, left)
        for pass_ in range(3):  # 0: the token's own GPU; 1: its node; 2: any copy with picks left
            for i in range(lo, hi):
                own = src[i]
                node = own // gpus_per_node
                for k in range(K):
                    if dest[i, k] >= 0 or not kept[i, k]:
                        continue
                    e = ids[i, k]
                    for j in range(hstart[e], hstart[e + 1]):
                        g = hosts[j]
                        if left[j] > 0 and (pass_ == 2 or g == own or (pass_ == 1 and g // gpus_per_node == node)):
                            left[j] -= 1
                            dest[i, k] = g
                            break
    return dest
