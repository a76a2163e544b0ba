"""MoETuner's ILP 1 (Eq. 1-7): load-balanced expert clustering, one layer at a time.

Per layer, split the ``E`` experts into ``G`` clusters minimising ``O1 = sum_c |T_c - S / G|``. The model,
its symmetry breaking, the hot-expert cut, the warm start and the gap measured against a GPU's mean load are
explained in ``docs/papers/moetuner.md``. Paper: "MoETuner: Optimized Mixture of Expert Serving with
Balanced Expert Placement and Token Routing" (arXiv 2502.06643).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from moebalance.algorithms.milp import Milp, MilpResult
from moebalance.algorithms.moetuner.deadline import DEFAULT_MIP_GAP, MIN_SOLVE_SECONDS, Deadline
from moebalance.algorithms.moetuner.statistics import cluster_sizes
from moebalance.core.errors import InputError, PlanError

__all__ = [
    "balanced_start",
    "canonical_clusters",
    "cluster_experts",
    "cluster_layers",
    "ilp1_gap",
    "ilp1_lower_bound",
    "ilp1_objective",
    "improve_clustering",
]


def ilp1_objective(weight: np.ndarray, cluster_of_expert: np.ndarray, num_gpus: int) -> float:
    """Eq. 1 for one layer: ``sum_c |T_c - S / G|`` for ``weight [E]`` and ``cluster_of_expert [E]``."""
    T = np.bincount(cluster_of_expert, weights=weight.astype(np.float64), minlength=num_gpus)
    return float(np.abs(T - weight.sum() / num_gpus).sum())


def canonical_clusters(cluster_of_expert: np.ndarray, num_gpus: int) -> np.ndarray:
    """Relabel clusters by their smallest expert id (empty clusters last): ILP 1's symmetry-free form."""
    E = cluster_of_expert.shape[0]
    first = np.full(num_gpus, E, dtype=np.int64)
    np.minimum.at(first, cluster_of_expert, np.arange(E))
    rank = np.empty(num_gpus, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(num_gpus)
    return rank[cluster_of_expert]


def balanced_start(weight: np.ndarray, num_gpus: int, lo: int, hi: int) -> np.ndarray:
    """A feasible ILP 1 point: heaviest expert to the lightest cluster with room (ties: fewer experts,
    then lower index), keeping room for the clusters that still need experts to reach ``lo``."""
    E, G = weight.shape[0], num_gpus
    load = np.zeros(G)
    size = np.zeros(G, dtype=np.int64)
    out = np.empty(E, dtype=np.int64)
    for left, e in enumerate(np.argsort(-weight, kind="stable")):
        room = size < hi
        short = size < lo
        if int(np.maximum(lo - size, 0).sum()) >= E - left:
            room &= short
        key = np.lexsort((np.arange(G), size, np.where(room, load, np.inf)))
        c = int(key[0])
        out[e] = c
        load[c] += weight[e]
        size[c] += 1
    return canonical_clusters(improve_clustering(weight, out, G, lo, hi), G)


def improve_clustering(weight: np.ndarray, cluster_of: np.ndarray, num_gpus: int, lo: int, hi: int,
             max_rounds: int = 10_000) -> np.ndarray:
    """Best-improvement local search on Eq. 1: swap two experts of different clusters, or move one expert
    where the sizes allow, until no move lowers ``sum_c |G * T_c - S|``. Deterministic (ties: lowest ids)."""
    G = num_gpus
    w = weight.astype(np.float64)
    S = w.sum()
    out = cluster_of.copy()
    dev = G * np.bincount(out, weights=w, minlength=G) - S  # [G] G * T_c - S
    size = np.bincount(out, minlength=G)
    for _ in range(max_rounds):
        c = out
        # swap e (in c[e]) with f (in c[f]): c[e] gains G * (w_f - w_e), c[f] loses it
        delta = G * (w[None, :] - w[:, None])  # [E(e), E(f)]
        gain = (np.abs(dev[c])[:, None] + np.abs(dev[c])[None, :]
                - np.abs(dev[c][:, None] + delta) - np.abs(dev[c][None, :] - delta))
        gain[c[:, None] == c[None, :]] = 0.0
        best_swap = np.unravel_index(int(np.argmax(gain)), gain.shape)
        # move e to cluster k: c[e] loses G * w_e, k gains it
        mv = (np.abs(dev[c])[:, None] + np.abs(dev)[None, :]
              - np.abs(dev[c] - G * w)[:, None] - np.abs(dev[None, :] + G * w[:, None]))  # [E, G]
        ok = (size[c] > lo)[:, None] & (size < hi)[None, :] & (c[:, None] != np.arange(G)[None, :])
        mv = np.where(ok, mv, 0.0)
        best_move = np.unravel_index(int(np.argmax(mv)), mv.shape)
        g_swap, g_move = gain[best_swap], mv[best_move]
        if max(g_swap, g_move) <= 1e-9 * max(S, 1.0):
            break
        if g_swap >= g_move:
            e, f = (int(i) for i in best_swap)
            ce, cf = int(c[e]), int(c[f])
            d = G * (w[f] - w[e])
            dev[ce] += d
            dev[cf] -= d
            out[e], out[f] = cf, ce
        else:
            e, k = (int(i) for i in best_move)
            ce = int(c[e])
            dev[ce] -= G * w[e]
            dev[k] += G * w[e]
            size[ce] -= 1
            size[k] += 1
            out[e] = k
    return out


def ilp1_lower_bound(weight: np.ndarray, num_gpus: int, lo: int) -> float:
    """A lower bound on ``sum_c |G * T_c - S|`` that every integer point meets (a valid cut for ILP 1).

    The positive and negative deviations cancel, so the sum is twice the positive part, which is at least
    (a) ``r (G - r)`` with ``r = S mod G`` (``T_c`` are integers: the best split puts ``r`` clusters at
    ``ceil(S / G)``), and (b) for the ``h`` heaviest experts, spread over some ``m`` clusters (``h / lo <= m
    <= min(h, G)``) that also hold at least ``m * lo - h`` other experts:
    ``min_m G * (W_h + lightest(m * lo - h)) - m * S``. Hot experts bound the imbalance from below.
    """
    G = num_gpus
    S = int(weight.sum())
    r = S % G
    best = r * (G - r)
    desc = np.sort(weight)[::-1].astype(np.int64)
    E = len(desc)
    top = np.concatenate([[0], np.cumsum(desc)])  # top[h]: the h heaviest
    light = np.concatenate([[0], np.cumsum(desc[::-1])])  # light[n]: the n lightest
    for h in range(1, E + 1):
        if h > G * max(lo, 1):  # more heavy experts than G clusters of lo can hold: done
            break
        ms = np.arange(max(1, math.ceil(h / max(lo, 1))), min(h, G) + 1)
        fill = np.clip(ms * lo - h, 0, E - h)
        best = max(best, int((G * (top[h] + light[fill]) - ms * S).min()))
    return float(2 * best)


def ilp1_gap(result: MilpResult, layer_load: float) -> float:
    """ILP 1's proven gap for one layer: ``(O1 - bound) / max(O1, T_mean)``, ``T_mean = S / G``.

    Gurobi's and HiGHS's relative gap ``(O1 - bound) / O1`` cannot close when the optimum is near 0 (a
    near-perfect split, the common case with many experts: no bound short of finding the perfect split
    proves it), so the gap is measured against the mean cluster load when ``O1`` is below it: a gap of
    0.025 then means the split is proven within 2.5% of a GPU's mean load of the best one. Where
    ``O1 >= T_mean`` (skewed layers) it is the usual relative gap. :func:`cluster_experts` stops at this gap.
    """
    scale = max(result.objective, layer_load)  # the solve's units are G * tokens: O1 * G and S = T_mean * G
    return 0.0 if scale <= 0 else max(result.objective - result.bound, 0.0) / scale


def cluster_experts(weight: np.ndarray, num_gpus: int, *, time_limit: float | None = None,
                    mip_gap: float = DEFAULT_MIP_GAP, seed: int = 0, start: np.ndarray | None = None,
                    sizes: tuple[int, int] | None = None) -> tuple[np.ndarray, MilpResult | None]:
    """ILP 1 (Eq. 1-7) for one layer: ``int64 [E]`` cluster of each expert, and the solve (``None`` if trivial).

    ``weight int64 [E]`` is the layer's ``P[:, l]``. Clusters are numbered by their smallest expert id and
    hold ``sizes = (lo, hi)`` experts each (default :func:`cluster_sizes` with ``memory="layer"``).
    The solve is warm-started from ``start [E]`` (a feasible clustering) or else from a greedy split
    improved by local search. It stops at :func:`ilp1_gap` ``<= mip_gap`` or at ``time_limit``.
    Example: loads ``[4, 1, 1, 4]`` on 2 GPUs give clusters ``[0, 0, 1, 1]`` (5 tokens each, ``O1 = 0``).
    """
    E, G = int(weight.shape[0]), int(num_gpus)
    lo, hi = cluster_sizes(E, G) if sizes is None else sizes
    if not lo * G <= E <= hi * G:
        raise InputError(f"{E} experts do not fit {G} clusters of {lo} to {hi} experts")
    start = balanced_start(weight, G, lo, hi) if start is None else canonical_clusters(np.asarray(start), G)
    if G == 1 or hi == 1:  # one cluster, or one expert per cluster: nothing to choose up to relabelling
        return start, None
    w = weight.astype(np.float64)
    S = float(w.sum())
    lower = ilp1_lower_bound(weight, G, lo)
    T0 = np.bincount(start, weights=w, minlength=G)
    if time_limit is not None and time_limit < MIN_SOLVE_SECONDS:  # no time to build and solve: the warm start
        return start, MilpResult(x=np.zeros(0), objective=float(np.abs(G * T0 - S).sum()), bound=lower,
                                 status="time_limit", seconds=0.0)
    m = Milp()
    # x[c, e] = 0 for e < c: cluster c's smallest expert is at least c (symmetry breaking)
    x = m.add_vars((G, E), ub=(np.arange(E)[None, :] >= np.arange(G)[:, None]).astype(np.float64))
    d = m.add_vars(G, ub=np.inf, cost=1.0, integer=False)  # d_c >= |G * T_c - S|
    m.add_rows(x.T, 1.0, lower=1.0, upper=1.0)  # each expert in one cluster
    m.add_rows(x, 1.0, lower=float(lo), upper=float(hi))  # Eq. 7 and the per-layer memory side of Eq. 13
    row = np.concatenate([x, d[:, None]], axis=1)  # [G, E + 1]
    m.add_rows(row, np.concatenate([G * w, [-1.0]]), upper=S)  # G * T_c - d_c <= S   (Eq. 5-6)
    m.add_rows(row, np.concatenate([G * w, [1.0]]), lower=S)  # G * T_c + d_c >= S
    m.add_rows(d[None, :], 1.0, lower=lower)
    # cluster c >= 1 may hold e only if cluster c - 1 holds an expert below e (clusters ordered by min id),
    # through prefix counts z[c, e] = sum_{e' < e} x[c, e'] (O(G E) non-zeros instead of O(G E^2))
    z = m.add_vars((G - 1, E + 1), ub=float(E), integer=False)
    m.add_rows(z[:, :1], 1.0, upper=0.0)  # z[c, 0] = 0 (z >= 0)
    m.add_rows(np.stack([z[:, 1:], z[:, :-1], x[:-1]], axis=-1), np.array([1.0, -1.0, -1.0]), lower=0.0, upper=0.0)
    m.add_rows(np.stack([x[1:], z[:, :E]], axis=-1), np.array([1.0, -1.0]), upper=0.0)
    x0 = np.zeros((G, E))
    x0[start, np.arange(E)] = 1.0
    x_start = np.concatenate([x0.ravel(), np.abs(G * T0 - S),
                              np.concatenate([np.zeros((G - 1, 1)), np.cumsum(x0[:-1], axis=1)], axis=1).ravel()])
    result = m.solve(time_limit=time_limit, mip_gap=mip_gap, abs_gap=mip_gap * S, seed=seed, start=x_start)
    result = dataclasses.replace(result, bound=max(result.bound, lower))  # the cut is proven even if HiGHS stopped early
    sol = result.x[x].round().astype(np.int64)
    cluster_of = np.argmax(sol, axis=0)
    if not np.all(sol.sum(axis=0) == 1):  # a row of the model; only a solver fault breaks it
        raise PlanError("ILP 1's solution does not put every expert in exactly one cluster")
    return cluster_of, result


def cluster_layers(P: np.ndarray, num_gpus: int, deadline: Deadline, *, mip_gap: float, seed: int,
                   sizes: tuple[int, int]) -> tuple[np.ndarray, list[MilpResult | None]]:
    """ILP 1 for every layer of ``P int64 [E, L]``: ``int64 [L, E]`` clusters and each layer's solve.

    A first pass gives each layer an equal share, half of what ``deadline`` leaves split over the layers; the
    layers that hit their share are then solved again, warm-started, sharing what the easy layers left. A
    layer's bound is the better of its two solves' (a stopped solve still proves its bound).
    """
    E, L = P.shape
    cluster_of = np.empty((L, E), dtype=np.int64)
    results: list[MilpResult | None] = []
    budget = deadline.left()
    share = None if budget is None else budget / (2 * L)
    for layer in range(L):
        limit = None if share is None else min(share, deadline.left(L - layer) or 0.0)
        cluster_of[layer], res = cluster_experts(P[:, layer], num_gpus, time_limit=limit, mip_gap=mip_gap, seed=seed,
                                                 sizes=sizes)
        results.append(res)
    again = [layer for layer, res in enumerate(results) if res is not None and res.time_limit_hit]
    for i, layer in enumerate(again):
        first = results[layer]
        cluster_of[layer], res = cluster_experts(P[:, layer], num_gpus, time_limit=deadline.left(len(again) - i),
                                                 mip_gap=mip_gap, seed=seed, start=cluster_of[layer], sizes=sizes)
        if res is not None and first is not None:
            res = dataclasses.replace(res, bound=max(res.bound, first.bound))
        results[layer] = res
    return cluster_of, results
