"""MoETuner's ILP 2 (Eq. 8-15) as one HiGHS MILP over all layers, optionally with Eq. 13.

The matching reformulation (binaries for "share a GPU" and "on node"; McCormick envelopes and RLT equalities
for the node products), used when a layer has too many node layouts for the DP; see
``docs/papers/moetuner.md``, "ILP 2 as we solve it" and "Eq. 13 enforcement". Legend: ``L`` layers, ``G``
GPUs, ``N`` nodes, ``M`` GPUs per node. Paper: arXiv 2502.06643.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from moebalance.algorithms.milp import Milp, MilpResult
from moebalance.algorithms.moetuner.deadline import Deadline
from moebalance.algorithms.moetuner.eq13 import Eq13Infeasible, balance_totals, meets_totals
from moebalance.algorithms.moetuner.ilp2_dp import greedy_assignment, ilp2_objective, link_weights
from moebalance.algorithms.moetuner.statistics import sizes_on_gpus
from moebalance.core.cluster import Cluster
from moebalance.core.errors import PlanError

__all__ = ["milp_start", "solve_milp"]


def solve_milp(C: np.ndarray, cluster: Cluster, deadline: Deadline, *, mip_gap: float, seed: int,
               sizes: np.ndarray | None = None, totals: tuple[int, int] | None = None, start: np.ndarray | None = None,
               lower_bound: float = 0.0) -> tuple[np.ndarray, MilpResult] | Eq13Infeasible:
    """ILP 2 as one MILP over all layers (the matching reformulation), solved by ``deadline``.

    With ``sizes int [L, G]`` and ``totals`` the program also has Eq. 13: the experts of the GPU that holds
    cluster ``c`` of layer ``l``, summed over layers ``0..l``, are carried along the matching chain,
    ``s[l + 1, c2] = sizes[l + 1, c2] + s[l, c1]`` where ``a[l, c1, c2] = 1`` (big-M rows, ``M`` the range
    ``s`` can span), and ``totals[0] <= s[L - 1, c] <= totals[1]``. ``start int [L, G]`` is a feasible GPU
    assignment to warm-start from (default: the greedy one, when it meets Eq. 13). ``lower_bound`` (in
    tokens / (GB/s)), a proven bound such as the optimum without Eq. 13, enters as the cut ``sum_l t_l >=
    lower_bound`` so that HiGHS stops as soon as its incumbent is within the gap of it.

    The model is built first; if the deadline has passed by then, the warm start is returned unsolved (time
    limit hit), else HiGHS gets the time left. Returns :class:`Eq13Infeasible` when Eq. 13 provably cannot
    hold or no assignment meeting it was found in time.
    """
    L, G = C.shape[0] + 1, cluster.num_gpus
    N, M = cluster.num_nodes, cluster.gpus_per_node
    w_n, w_x, use_nodes = link_weights(cluster)
    scale = max(w_n, w_x)  # solve in units of the slowest link, report in tokens / (GB/s)
    w_n, w_x = w_n / scale, w_x / scale
    chained = sizes is not None and totals is not None
    if start is None:
        start = greedy_assignment(C, cluster)
    if chained:
        assert sizes is not None and totals is not None  # for mypy: chained says so
        if not meets_totals(sizes, start, totals):
            start = balance_totals(sizes, start, totals)
    m = Milp()
    a = m.add_vars((L - 1, G, G))  # a[l, c1, c2]: c1 (layer l) and c2 (layer l + 1) share a GPU
    t = m.add_vars(L - 1, ub=np.inf, cost=1.0, integer=False)  # t_l: the tail of layer pair l (Eq. 8's max)
    m.add_rows(a, 1.0, lower=1.0, upper=1.0)  # Eq. 14-15: a GPU holds one cluster per layer, so a is a
    m.add_rows(a.transpose(0, 2, 1), 1.0, lower=1.0, upper=1.0)  # perfect matching between layers
    ls = np.broadcast_to(np.arange(L - 1)[:, None, None], a.shape)
    if lower_bound > 0:
        m.add_rows(t[None, :], 1.0, lower=lower_bound / scale * (1.0 - 1e-9))
    parts: dict[str, np.ndarray] = {}
    if use_nodes:
        Y = m.add_vars((L, G, N))  # Y[l, c, n]: cluster c of layer l is on node n
        m.add_rows(Y, 1.0, lower=1.0, upper=1.0)
        m.add_rows(Y.transpose(0, 2, 1), 1.0, lower=float(M), upper=float(M))
        m.add_rows(Y[0, 0, 0].reshape(1, 1), 1.0, lower=1.0)  # node labels are interchangeable
        b = m.add_vars((L - 1, G, G, N), integer=False)  # b[l, c1, c2, n] = Y[l, c1, n] * Y[l + 1, c2, n]
        Y1 = np.broadcast_to(Y[:-1, :, None, :], b.shape)
        Y2 = np.broadcast_to(Y[1:, None, :, :], b.shape)
        m.add_rows(np.stack([b, Y1], axis=-1), np.array([1.0, -1.0]), upper=0.0)  # McCormick upper envelopes
        m.add_rows(np.stack([b, Y2], axis=-1), np.array([1.0, -1.0]), upper=0.0)
        # RLT: c1 on node n shares it with exactly M clusters of the next layer (and the transpose)
        rows1 = np.concatenate([b.transpose(0, 1, 3, 2), Y[:-1, :, :, None]], axis=3)  # [L-1, G, N, G + 1]
        m.add_rows(rows1, np.concatenate([np.ones(G), [-float(M)]]), lower=0.0, upper=0.0)
        rows2 = np.concatenate([b.transpose(0, 2, 3, 1), Y[1:, :, :, None]], axis=3)
        m.add_rows(rows2, np.concatenate([np.ones(G), [-float(M)]]), lower=0.0, upper=0.0)
        # sharing a GPU means sharing a node
        m.add_rows(np.concatenate([a[..., None], b], axis=3), np.concatenate([[1.0], -np.ones(N)]), upper=0.0)
        # t_l >= C * (w_x - (w_x - w_n) * same_node - w_n * same_gpu)
        idx = np.concatenate([t[ls][..., None], a[..., None], b], axis=3)
        val = np.concatenate([np.ones_like(C)[..., None], (C * w_n)[..., None],
                              np.broadcast_to((C * (w_x - w_n))[..., None], b.shape)], axis=3)
        m.add_rows(idx, val, lower=C * w_x)
        parts["Y"], parts["b"] = Y, b
    else:
        w = w_x if N > 1 else w_n
        m.add_rows(np.stack([t[ls], a], axis=-1), np.stack([np.ones_like(C), C * w], axis=-1), lower=C * w)
    if chained:
        assert sizes is not None and totals is not None
        sz = sizes.astype(np.float64)
        # bounds on the running total s[l, c]: what the layers so far can add, and what Eq. 13 leaves room for
        lo = np.cumsum(sz.min(axis=1))
        hi = np.cumsum(sz.max(axis=1))
        rest_min = np.concatenate([np.cumsum(sz.min(axis=1)[::-1])[::-1][1:], [0.0]])
        rest_max = np.concatenate([np.cumsum(sz.max(axis=1)[::-1])[::-1][1:], [0.0]])
        lo = np.maximum(lo, totals[0] - rest_max)
        hi = np.minimum(hi, totals[1] - rest_min)
        if np.any(lo > hi) or np.any(sz[0] < lo[0]) or np.any(sz[0] > hi[0]):  # s[0] = sz[0] must fit too
            return Eq13Infeasible(f"Eq. 13 cannot hold: the clusters hold {int(sz.sum())} experts, which cannot "
                                  f"give every GPU {totals[0]} to {totals[1]}; use memory='layer'")
        lo_l = np.broadcast_to(lo[:, None], (L, G)).copy()
        hi_l = np.broadcast_to(hi[:, None], (L, G)).copy()
        lo_l[0] = hi_l[0] = sz[0]
        s_var = m.add_vars((L, G), lb=lo_l, ub=hi_l, integer=False)
        big = (hi[1:] - lo[:-1])[:, None, None] - sz[1:, None, :] + 1.0  # [L-1, 1, G]: s' - s - size <= big
        small = (hi[:-1] - lo[1:])[:, None, None] + sz[1:, None, :] + 1.0  # s + size - s' <= small
        nxt = np.broadcast_to(s_var[1:, None, :], a.shape)
        prv = np.broadcast_to(s_var[:-1, :, None], a.shape)
        big_b = np.broadcast_to(big, a.shape)
        small_b = np.broadcast_to(small, a.shape)
        size_b = np.broadcast_to(sz[1:, None, :], a.shape)
        # s' - s + big * a <= size + big, and s' - s - small * a >= size - small
        m.add_rows(np.stack([nxt, prv, a], axis=-1),
                   np.stack([np.ones(a.shape), -np.ones(a.shape), big_b], axis=-1), upper=size_b + big_b)
        m.add_rows(np.stack([nxt, prv, a], axis=-1),
                   np.stack([np.ones(a.shape), -np.ones(a.shape), -small_b], axis=-1), lower=size_b - small_b)
        parts["s"] = s_var
    x0 = None if start is None else milp_start(C, cluster, start, m.num_vars, a, t, parts, sizes, w_n, w_x)
    no_time = ("the time limit ran out before ILP 2 (with Eq. 13) found a feasible GPU assignment; "
               "raise time_limit or use memory='layer'")
    if deadline.too_short():  # building took the time left: keep the warm start, unsolved
        if x0 is None or start is None:
            return Eq13Infeasible(no_time)
        obj = m.objective(x0)
        return start, MilpResult(x=x0, objective=obj * scale, bound=max(lower_bound, 0.0), status="time_limit",
                                 seconds=0.0)
    result = m.solve(time_limit=deadline.left(), mip_gap=mip_gap, seed=seed, start=x0)
    if result.status == "infeasible":
        return Eq13Infeasible("Eq. 13 cannot hold for these clusters: no GPU assignment gives every GPU "
                              f"{totals[0] if totals else '?'} to {totals[1] if totals else '?'} experts over all "
                              "layers; use memory='layer'")
    if result.status == "no_solution":
        return Eq13Infeasible(no_time)
    partner = np.argmax(result.x[a].round(), axis=1)  # [L-1, G]: the layer-l cluster each c2 shares a GPU with
    gpu = np.empty((L, G), dtype=np.int64)
    if use_nodes:
        node0 = np.argmax(result.x[parts["Y"][0]].round(), axis=1)
        gpu[0, np.lexsort((np.arange(G), node0))] = np.arange(G)  # clusters of layer 0 by node, then id
    else:
        gpu[0] = np.arange(G)
    for layer in range(L - 1):
        gpu[layer + 1] = gpu[layer, partner[layer]]
    # a feasible point of the model is a permutation per layer, costs what the solver says and meets Eq. 13;
    # a solver fault (a point off its rows beyond tolerance) is reported, not trusted
    if not np.all(np.sort(gpu, axis=1) == np.arange(G)):
        raise PlanError("ILP 2's MILP solution is not one cluster per GPU in every layer (a solver fault)")
    if not math.isclose(ilp2_objective(C, gpu, cluster), result.objective * scale, rel_tol=1e-6,
                        abs_tol=1e-9 * max(1.0, float(C.max()) * scale)):
        raise PlanError("ILP 2's MILP objective disagrees with Eq. 8 at its own solution (a solver fault)")
    if chained:
        assert sizes is not None and totals is not None  # for mypy: chained says so
        if not meets_totals(sizes, gpu, totals):
            raise PlanError("ILP 2's MILP solution breaks Eq. 13, a row of its own model (a solver fault)")
    # t >= 0: a solve stopped before its root LP reports a bound of -inf, 0 is proven all the same
    return gpu, dataclasses.replace(result, objective=result.objective * scale, bound=max(result.bound, 0.0) * scale)


def milp_start(C: np.ndarray, cluster: Cluster, gpu: np.ndarray, num_vars: int, a: np.ndarray, t: np.ndarray,
                parts: dict[str, np.ndarray], sizes: np.ndarray | None, w_n: float, w_x: float) -> np.ndarray:
    """The MILP's variables at the GPU assignment ``gpu int [L, G]`` (a warm start)."""
    M, N = cluster.gpus_per_node, cluster.num_nodes
    same_gpu = gpu[:-1, :, None] == gpu[1:, None, :]  # [L-1, G, G]
    x0 = np.zeros(num_vars)
    x0[a] = same_gpu
    if "Y" in parts:
        node = gpu // M
        node = (node - node[0, 0]) % N  # relabel nodes so that cluster 0 of layer 0 is on node 0
        y0 = (node[..., None] == np.arange(N)).astype(np.float64)  # [L, G, N]
        b0 = y0[:-1, :, None, :] * y0[1:, None, :, :]
        same_node = b0.sum(axis=3) > 0
        x0[t] = (C * np.where(same_gpu, 0.0, np.where(same_node, w_n, w_x))).max(axis=(1, 2))
        x0[parts["Y"]] = y0
        x0[parts["b"]] = b0
    else:
        x0[t] = (C * np.where(same_gpu, 0.0, w_x if N > 1 else w_n)).max(axis=(1, 2))
    if "s" in parts:
        assert sizes is not None
        running = np.cumsum(sizes_on_gpus(sizes, gpu), axis=0)  # [L, G]: a GPU's experts in layers 0..l
        x0[parts["s"]] = np.take_along_axis(running, gpu, axis=1)
    return x0
