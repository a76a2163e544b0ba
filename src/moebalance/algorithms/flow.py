"""Network flow kernels (numba): Dinic's maximum flow and a primal-dual minimum-cost flow.

Arrays in, arrays out, integer capacities and costs (exact). A network of ``n`` nodes is a list of edges;
:func:`build` turns it into arcs in pairs -- arc ``2 i`` is edge ``i`` (``tail -> head``, its capacity and
cost), arc ``2 i + 1`` its reverse (capacity 0, cost negated) -- and a CSR index of the arcs leaving each node.
``res`` holds the residual capacities; the flow on edge ``i`` is ``res[2 i + 1]``.

Legend: ``n`` nodes, ``m`` edges, ``2 m`` arcs.

- :func:`max_flow`: Dinic's algorithm (level graph by BFS, blocking flow by an iterative DFS with
  current-arc pointers), over the arcs an ``ok`` mask admits.
- :func:`min_cost_flow`: the primal-dual method: Dijkstra on reduced costs (potentials keep them
  non-negative), then a maximum flow over the arcs of reduced cost zero -- all shortest paths at once --
  until the demand is met or the sink is cut off. With costs in ``{0, 1, 2}`` the shortest-path length takes
  few values, so there are few phases.
- :func:`reach_from`, :func:`reaches`: the nodes reachable from a node, or that reach it, in the residual
  network (a minimum cut, a tight set).

They serve the ``minmax`` router (:mod:`moebalance.algorithms.minmax`); the routing problems are small
(nodes: experts with a choice plus GPUs) but solved once per batch and layer, hence compiled code.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["build", "build_into", "max_flow", "min_cost_flow", "reach_from", "reaches", "scratch"]

INF = np.int64(1) << np.int64(62)


@njit(cache=True)
def build_into(n: int, m: int, tail: np.ndarray, head: np.ndarray, cap: np.ndarray, cost: np.ndarray,
               arc_head: np.ndarray, arc_cost: np.ndarray, res: np.ndarray, start: np.ndarray, adj: np.ndarray,
               pos: np.ndarray) -> None:
    """:func:`build` of the first ``m`` edges into given arrays (``[>= 2m]``, ``start [>= n + 1]``,
    ``pos [>= n]``), for callers that solve many small networks without allocating."""
    start[:n + 1] = 0
    for i in range(m):
        arc_head[2 * i] = head[i]
        arc_head[2 * i + 1] = tail[i]
        arc_cost[2 * i] = cost[i]
        arc_cost[2 * i + 1] = -cost[i]
        res[2 * i] = cap[i]
        res[2 * i + 1] = 0
        start[tail[i] + 1] += 1
        start[head[i] + 1] += 1
    for v in range(n):
        start[v + 1] += start[v]
        pos[v] = start[v]
    for i in range(m):
        adj[pos[tail[i]]] = 2 * i
        pos[tail[i]] += 1
        adj[pos[head[i]]] = 2 * i + 1
        pos[head[i]] += 1


@njit(cache=True)
def build(n: int, tail: np.ndarray, head: np.ndarray, cap: np.ndarray, cost: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Arcs in pairs and the CSR index: ``(arc_head [2m], arc_cost [2m], res [2m], start [n + 1], adj [2m])``.

    The arcs leaving node ``v`` are ``adj[start[v]:start[v + 1]]``, in edge order (forward and reverse arcs
    interleaved as they occur).
    """
    m = tail.shape[0]
    arc_head = np.empty(2 * m, np.int64)
    arc_cost = np.empty(2 * m, np.int64)
    res = np.empty(2 * m, np.int64)
    start = np.empty(n + 1, np.int64)
    adj = np.empty(2 * m, np.int64)
    build_into(n, m, tail, head, cap, cost, arc_head, arc_cost, res, start, adj, np.empty(n, np.int64))
    return arc_head, arc_cost, res, start, adj


@njit(cache=True)
def scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Work arrays for :func:`max_flow` on up to ``n`` nodes (reused across calls: no allocation per flow)."""
    return np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)


@njit(cache=True)
def max_flow(n: int, arc_head: np.ndarray, res: np.ndarray, start: np.ndarray, adj: np.ndarray, ok: np.ndarray,
             s: int, t: int, work: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> int:
    """Push a maximum flow from ``s`` to ``t`` over the arcs with ``ok[a]`` (Dinic); ``res`` is updated.

    Returns the flow added. Reverse arcs of admitted arcs must be admitted too (they carry the undo).
    ``work`` is :func:`scratch` of at least ``n`` nodes.
    """
    total = 0
    level, ptr, queue, path = work  # path: the arcs of the current DFS path
    while True:
        level[:n] = -1
        level[s] = 0
        qh, qt = 0, 1
        queue[0] = s
        while qh < qt:
            u = queue[qh]
            qh += 1
            for i in range(start[u], start[u + 1]):
                a = adj[i]
                v = arc_head[a]
                if res[a] > 0 and ok[a] and level[v] < 0:
                    level[v] = level[u] + 1
                    queue[qt] = v
                    qt += 1
        if level[t] < 0:
            return total
        for v in range(n):
            ptr[v] = start[v]
        depth = 0
        u = s
        while True:
            if u == t:
                f = res[path[0]]
                for j in range(1, depth):
                    f = min(f, res[path[j]])
                cut = -1
                for j in range(depth):
                    a = path[j]
                    res[a] -= f
                    res[a ^ 1] += f
                    if cut < 0 and res[a] == 0:
                        cut = j
                total += f
                depth = cut  # resume from the tail of the first saturated arc
                u = arc_head[path[cut] ^ 1]
                continue
            advanced = False
            while ptr[u] < start[u + 1]:
                a = adj[ptr[u]]
                v = arc_head[a]
                if res[a] > 0 and ok[a] and level[v] == level[u] + 1:
                    path[depth] = a
                    depth += 1
                    u = v
                    advanced = True
                    break
                ptr[u] += 1
            if not advanced:
                if u == s:
                    break
                level[u] = -1  # a dead end for the rest of this phase
                depth -= 1
                u = arc_head[path[depth] ^ 1]
                ptr[u] += 1


@njit(cache=True)
def _search(n: int, arc_head: np.ndarray, res: np.ndarray, start: np.ndarray, adj: np.ndarray, root: int,
            backwards: bool, seen: np.ndarray, queue: np.ndarray) -> None:
    """Breadth-first search over arcs with residual capacity from ``root`` (``backwards``: towards ``root``)."""
    seen[:n] = False
    seen[root] = True
    queue[0] = root
    qh, qt = 0, 1
    while qh < qt:
        u = queue[qh]
        qh += 1
        for i in range(start[u], start[u + 1]):
            a = adj[i]  # a leaves u for arc_head[a]; a ^ 1 enters u from it
            v = arc_head[a]
            if res[a ^ 1 if backwards else a] > 0 and not seen[v]:
                seen[v] = True
                queue[qt] = v
                qt += 1


@njit(cache=True)
def reach_from(n: int, arc_head: np.ndarray, res: np.ndarray, start: np.ndarray, adj: np.ndarray,
               s: int, seen: np.ndarray, queue: np.ndarray) -> None:
    """Set ``seen[v]`` for the nodes reachable from ``s`` over arcs with residual capacity (a minimum cut's
    side); ``seen bool [>= n]``, ``queue int64 [>= n]`` are work arrays."""
    _search(n, arc_head, res, start, adj, s, False, seen, queue)


@njit(cache=True)
def reaches(n: int, arc_head: np.ndarray, res: np.ndarray, start: np.ndarray, adj: np.ndarray,
            t: int, seen: np.ndarray, queue: np.ndarray) -> None:
    """Set ``seen[v]`` for the nodes from which ``t`` is reachable over arcs with residual capacity."""
    _search(n, arc_head, res, start, adj, t, True, seen, queue)


@njit(cache=True)
def _dijkstra(n: int, arc_head: np.ndarray, arc_cost: np.ndarray, res: np.ndarray, start: np.ndarray,
              adj: np.ndarray, pi: np.ndarray, s: int) -> np.ndarray:
    """Shortest distances from ``s`` under reduced costs ``cost + pi[u] - pi[v]`` (non-negative); INF if none."""
    dist = np.full(n, INF, np.int64)
    done = np.zeros(n, np.bool_)
    # binary heap of (distance, node) with lazy deletion; at most one entry per relaxation
    cap_heap = 2 * adj.shape[0] + 2
    hkey = np.empty(cap_heap, np.int64)
    hval = np.empty(cap_heap, np.int64)
    size = 0
    dist[s] = 0
    hkey[0] = 0
    hval[0] = s
    size = 1
    while size > 0:
        d, u = hkey[0], hval[0]
        size -= 1
        if size > 0:  # sift the last entry down from the root
            k, v = hkey[size], hval[size]
            i = 0
            while True:
                c = 2 * i + 1
                if c >= size:
                    break
                if c + 1 < size and hkey[c + 1] < hkey[c]:
                    c += 1
                if hkey[c] >= k:
                    break
                hkey[i], hval[i] = hkey[c], hval[c]
                i = c
            hkey[i], hval[i] = k, v
        if done[u] or d > dist[u]:
            continue
        done[u] = True
        for j in range(start[u], start[u + 1]):
            a = adj[j]
            if res[a] <= 0:
                continue
            v = arc_head[a]
            nd = d + arc_cost[a] + pi[u] - pi[v]
            if nd < dist[v]:
                dist[v] = nd
                i = size  # sift up
                size += 1
                while i > 0:
                    p = (i - 1) // 2
                    if hkey[p] <= nd:
                        break
                    hkey[i], hval[i] = hkey[p], hval[p]
                    i = p
                hkey[i], hval[i] = nd, v
    return dist


@njit(cache=True)
def min_cost_flow(n: int, arc_head: np.ndarray, arc_cost: np.ndarray, res: np.ndarray, start: np.ndarray,
                  adj: np.ndarray, s: int, t: int, demand: int | np.integer) -> int:
    """Send up to ``demand`` units from ``s`` to ``t`` at least total cost (costs >= 0 on forward arcs).

    Primal-dual: each phase finds shortest distances on reduced costs, raises the potentials by them, and
    pushes a maximum flow over the arcs whose reduced cost is now zero. Every flow it holds is a cheapest
    flow of its value. The maximum flow of a phase may exceed what is still demanded only if the caller's
    network can carry more than ``demand`` (callers size the source arcs so that it cannot). Returns the
    flow sent.
    """
    m2 = adj.shape[0]
    pi = np.zeros(n, np.int64)
    ok = np.empty(m2, np.bool_)
    work = scratch(n)
    flow = 0
    while flow < demand:
        dist = _dijkstra(n, arc_head, arc_cost, res, start, adj, pi, s)
        if dist[t] >= INF:
            break
        dt = dist[t]
        for v in range(n):
            pi[v] += dist[v] if dist[v] < dt else dt
        for a in range(m2):
            u = arc_head[a ^ 1]
            ok[a] = arc_cost[a] + pi[u] - pi[arc_head[a]] == 0
        pushed = max_flow(n, arc_head, res, start, adj, ok, s, t, work)
        if pushed == 0:
            break
        flow += pushed
    return flow
