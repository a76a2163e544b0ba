"""MoETuner's ILP 2 (Eq. 8-15), the exact combinatorial part: Eq. 8's cost and a dynamic program over node layouts.

A layer pair's tail depends only on which clusters share a GPU (a perfect matching) and which share a node;
given the node layouts, the best matchings are bottleneck matchings, and a DP over the layouts of every layer
is exact (``docs/papers/moetuner.md``, "ILP 2 as we solve it"). Legend: ``L`` layers, ``G`` GPUs, ``N``
nodes, ``M`` GPUs per node. Paper: "MoETuner: Optimized Mixture of Expert Serving with Balanced Expert
Placement and Token Routing" (arXiv 2502.06643).
"""

from __future__ import annotations

import math

import numpy as np

from moebalance.algorithms.moetuner.statistics import inverse_bandwidth
from moebalance.core.cluster import Cluster

__all__ = [
    "bottleneck_matching",
    "bottleneck_value",
    "greedy_assignment",
    "ilp2_objective",
    "link_weights",
    "node_layouts",
    "num_layouts",
    "pair_costs",
    "realise_layouts",
    "solve_dp",
]


def ilp2_objective(traffic: np.ndarray, gpu_of_cluster: np.ndarray, cluster: Cluster) -> float:
    """Eq. 8 evaluated GPU by GPU: ``sum_l max_{g1, g2} C[l, c1, c2] / B[g1, g2]`` for the clusters on them.

    ``traffic [L-1, G, G]`` (:func:`cluster_traffic`), ``gpu_of_cluster int [L, G]``. In tokens / (GB/s).
    """
    if traffic.shape[0] == 0:
        return 0.0
    inv = inverse_bandwidth(cluster)
    w = inv[gpu_of_cluster[:-1, :, None], gpu_of_cluster[1:, None, :]]  # [L-1, G, G] cost per cluster pair
    return float((traffic * w).max(axis=(1, 2)).sum())


def link_weights(cluster: Cluster) -> tuple[float, float, bool]:
    """``(w_n, w_x, two_level)``: cost per token to another GPU of the node and to another node (1 / GB/s),
    and whether the two differ in a way placement can use (more than one node of more than one GPU)."""
    N, M = cluster.num_nodes, cluster.gpus_per_node
    w_n, w_x = 1.0 / cluster.intra_node_bandwidth, 1.0 / cluster.inter_node_bandwidth
    if N == 1:
        w_x = w_n  # there is no other node
    if M == 1:
        w_n = w_x  # another GPU is another node
    return w_n, w_x, N > 1 and M > 1 and w_n != w_x


def bottleneck_value(sub: np.ndarray) -> np.ndarray:
    """``min over perfect matchings p of max_{j != p(i)} sub[..., i, j]``, for ``sub [..., M, M] >= 0``.

    A value ``v`` is reachable iff the entries above ``v`` share no row or column (then a matching covers
    them all, and a partial matching of a complete bipartite graph always extends to a perfect one). So the
    optimum is the first entry, in descending order, that shares a row or column with a larger one.
    """
    M = sub.shape[-1]
    flat = sub.reshape(*sub.shape[:-2], M * M)
    order = np.argsort(-flat, axis=-1, kind="stable")
    vals = np.take_along_axis(flat, order, axis=-1)
    rows, cols = order // M, order % M
    lead = sub.shape[:-2]
    row_used = np.zeros((*lead, M), dtype=bool)
    col_used = np.zeros((*lead, M), dtype=bool)
    value = np.zeros(lead)
    found = np.zeros(lead, dtype=bool)
    for k in range(M * M):
        r, c = rows[..., k:k + 1], cols[..., k:k + 1]
        conflict = (np.take_along_axis(row_used, r, axis=-1) | np.take_along_axis(col_used, c, axis=-1))[..., 0]
        new = conflict & ~found
        value = np.where(new, vals[..., k], value)
        found |= conflict
        np.put_along_axis(row_used, r, True, axis=-1)
        np.put_along_axis(col_used, c, True, axis=-1)
    return value


def bottleneck_matching(sub: np.ndarray) -> np.ndarray:
    """``int64 [M]``: a perfect matching (column of each row) reaching :func:`bottleneck_value` of ``sub [M, M]``."""
    M = sub.shape[0]
    v = float(bottleneck_value(sub))
    match = np.full(M, -1, dtype=np.int64)
    for i, j in np.argwhere(sub > v):  # the entries that must be matched: a partial matching
        match[i] = j
    free_cols = [j for j in range(M) if j not in set(match.tolist())]
    for i in np.flatnonzero(match < 0):
        match[i] = free_cols.pop(0)
    return match


def node_layouts(num_nodes: int, gpus_per_node: int) -> np.ndarray:
    """``int64 [K, G]``: every way to put ``G`` clusters on ``N`` nodes, ``M`` each (node of each cluster)."""
    G = num_nodes * gpus_per_node
    out: list[list[int]] = []

    def rec(layout: list[int], left: list[int]) -> None:
        if len(layout) == G:
            out.append(layout)
            return
        for n in range(num_nodes):
            if left[n]:
                left[n] -= 1
                rec([*layout, n], left)
                left[n] += 1

    rec([], [gpus_per_node] * num_nodes)
    return np.array(out, dtype=np.int64).reshape(-1, G)


def num_layouts(num_nodes: int, gpus_per_node: int) -> int:
    return math.factorial(num_nodes * gpus_per_node) // math.factorial(gpus_per_node) ** num_nodes


def pair_costs(C: np.ndarray, layouts: np.ndarray, num_nodes: int, w_n: float, w_x: float) -> np.ndarray:
    """``[K, K]``: the tail ``t_l`` between layouts ``s`` (layer ``l``) and ``s'`` (``l + 1``), matchings optimal.

    ``t = max(w_x * max of C over cluster pairs on different nodes, w_n * max over nodes of the node's
    bottleneck matching value)``: within a node, the clusters sharing a GPU form a perfect matching.
    """
    K, G = layouts.shape
    M = G // num_nodes
    cross = layouts[:, None, :, None] != layouts[None, :, None, :]  # [K, K, G, G]
    cost = w_x * np.where(cross, C, 0.0).max(axis=(2, 3))
    members = np.argsort(layouts, axis=1, kind="stable").reshape(K, num_nodes, M)  # clusters per node
    for n in range(num_nodes):
        mem = members[:, n]
        sub = C[mem[:, None, :, None], mem[None, :, None, :]]  # [K, K, M, M]
        cost = np.maximum(cost, w_n * bottleneck_value(sub))
    return cost


def realise_layouts(C: np.ndarray, layouts: np.ndarray, num_nodes: int) -> np.ndarray:
    """``int64 [L, G]`` GPUs from per-layer layouts ``[L, G]`` (node of each cluster), optimal matchings."""
    L, G = layouts.shape
    gpu = np.empty((L, G), dtype=np.int64)
    order = np.lexsort((np.arange(G), layouts[0]))  # layer 0: node by node, clusters in id order
    gpu[0, order] = np.arange(G)
    for layer in range(L - 1):
        for n in range(num_nodes):
            src = np.flatnonzero(layouts[layer] == n)
            dst = np.flatnonzero(layouts[layer + 1] == n)
            match = bottleneck_matching(C[layer][np.ix_(src, dst)])
            gpu[layer + 1, dst[match]] = gpu[layer, src]
    return gpu


def solve_dp(C: np.ndarray, cluster: Cluster) -> np.ndarray:
    """Exact ILP 2 by dynamic programming over node layouts (``docs/papers/moetuner.md``, "ILP 2 as we solve it")."""
    w_n, w_x, two_level = link_weights(cluster)
    N = cluster.num_nodes if two_level else 1
    G = cluster.num_gpus
    layouts = node_layouts(N, G // N)
    L = C.shape[0] + 1
    value = np.zeros(len(layouts))
    back = np.empty((L - 1, len(layouts)), dtype=np.int64)
    for layer in range(L - 1):
        total = value[:, None] + pair_costs(C[layer], layouts, N, w_n, w_x if two_level else w_n)
        back[layer] = np.argmin(total, axis=0)  # ties: the lowest layout index
        value = total[back[layer], np.arange(len(layouts))]
    path = np.empty(L, dtype=np.int64)
    path[-1] = int(np.argmin(value))
    for layer in range(L - 2, -1, -1):
        path[layer] = back[layer, path[layer + 1]]
    return realise_layouts(C, layouts[path], N)


def greedy_assignment(C: np.ndarray, cluster: Cluster) -> np.ndarray:
    """A quick feasible ILP 2 point for the MILP's warm start: layer ``l + 1``'s clusters join, heaviest
    transition first, the node of their source cluster while it has room; matchings as in the DP."""
    L, G = C.shape[0] + 1, cluster.num_gpus
    N, M = cluster.num_nodes, cluster.gpus_per_node
    layouts = np.empty((L, G), dtype=np.int64)
    layouts[0] = np.arange(G) // M
    for layer in range(L - 1):
        node = np.full(G, -1, dtype=np.int64)
        room = np.full(N, M)
        for flat in np.argsort(-C[layer], axis=None, kind="stable"):
            c1, c2 = divmod(int(flat), G)
            n = layouts[layer, c1]
            if node[c2] < 0 and room[n] > 0:
                node[c2] = n
                room[n] -= 1
        layouts[layer + 1] = node
    return realise_layouts(C, layouts, N)
