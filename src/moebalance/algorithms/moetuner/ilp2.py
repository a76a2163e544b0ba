"""MoETuner's ILP 2 (Eq. 8-15): communication-aware cluster-to-GPU assignment over all layers.

One cluster per GPU in every layer, minimising ``O2 = sum_l max_{g1, g2} C[l, c1, c2] / B[g1, g2]``. Two exact
solvers of the matching reformulation: a dynamic program over node layouts (:mod:`.ilp2_dp`) and a HiGHS
MILP (:mod:`.ilp2_milp`). This module chooses between them and handles Eq. 13: first relaxed, then repaired
(:mod:`.eq13`) or enforced in the MILP.
Legend: ``L`` layers, ``G`` GPUs, ``N`` nodes, ``M`` GPUs per node. The reformulation and why it is exact are
in ``docs/papers/moetuner.md``; paper: "MoETuner: Optimized Mixture of Expert Serving with Balanced Expert
Placement and Token Routing" (arXiv 2502.06643).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.algorithms.moetuner.deadline import DEFAULT_MIP_GAP, Deadline
from moebalance.algorithms.moetuner.eq13 import Eq13Infeasible, balance_totals, lpt_totals, meets_totals
from moebalance.algorithms.moetuner.ilp2_dp import (
    greedy_assignment,
    ilp2_objective,
    link_weights,
    num_layouts,
    solve_dp,
)
from moebalance.algorithms.moetuner.ilp2_milp import solve_milp
from moebalance.algorithms.moetuner.statistics import gpu_totals, relative_gap
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError

__all__ = ["MAX_DP_LAYOUTS", "Ilp2Solution", "assign_clusters", "ilp2_method", "solve_ilp2"]


#: ILP 2 is solved by dynamic programming over node layouts when a layer has at most this many of them.
MAX_DP_LAYOUTS = 256


@dataclass(frozen=True, slots=True)
class Ilp2Solution:
    """How ILP 2 was solved. Example: on one node ``method == "dp"`` and ``gap == 0.0``."""

    #: ``int64 [L, G]``: GPU of cluster ``c`` in layer ``l``.
    gpu_of_cluster: np.ndarray
    #: ``O2`` of Eq. 8, tokens / (GB/s).
    objective: float
    #: Proven relative gap ``(objective - bound) / objective`` (0 for the exact DP).
    gap: float
    #: ``"dp"``, ``"milp"`` or ``"trivial"`` (no traffic between GPUs to weigh); ``"<that>+swaps"`` when
    #: :func:`balance_totals` then met Eq. 13 within the gap.
    method: str
    time_limit_hit: bool = False
    #: Proven lower bound on ``objective``.
    bound: float = 0.0
    #: Eq. 13: ``"not asked"``, ``"held"`` (the optimum without it meets it) or ``"enforced"`` (a MILP with it).
    eq13: str = "not asked"


def ilp2_method(cluster: Cluster) -> str:
    """``"dp"`` when a layer has at most :data:`MAX_DP_LAYOUTS` node layouts, else ``"milp"``."""
    _, _, two_level = link_weights(cluster)
    layouts = num_layouts(cluster.num_nodes, cluster.gpus_per_node) if two_level else 1
    return "dp" if layouts <= MAX_DP_LAYOUTS else "milp"


def assign_clusters(traffic: np.ndarray, cluster: Cluster, *, time_limit: float | None = None,
                    mip_gap: float = DEFAULT_MIP_GAP, seed: int = 0, method: str = "auto",
                    sizes: np.ndarray | None = None, totals: tuple[int, int] | None = None) -> Ilp2Solution:
    """ILP 2 (Eq. 8-15): the GPU of every cluster in every layer (:class:`Ilp2Solution`).

    ``traffic float [L-1, G, G]`` is ``C`` of Eq. 9
    (:func:`~moebalance.algorithms.moetuner.statistics.cluster_traffic`).
    ``method``: ``"dp"`` (exact dynamic programming over node layouts), ``"milp"`` (HiGHS on the matching
    reformulation), or ``"auto"``: the DP when a layer has at most :data:`MAX_DP_LAYOUTS` node layouts, else
    the MILP. ``time_limit``: seconds for the whole of ILP 2 (``None``: no limit).

    Eq. 13: with ``sizes int [L, G]`` (experts of each cluster) and ``totals = (lo, hi)``, every GPU must hold
    ``lo`` to ``hi`` experts over all layers (see :func:`solve_ilp2`). Raises :class:`PlanError` if no
    assignment meeting Eq. 13 is found.
    """
    sol = solve_ilp2(traffic, cluster, Deadline.after(time_limit), mip_gap=mip_gap, seed=seed, method=method,
                     sizes=sizes, totals=totals)
    if isinstance(sol, Eq13Infeasible):
        raise PlanError(sol.reason)
    return sol


def solve_ilp2(traffic: np.ndarray, cluster: Cluster, deadline: Deadline, *, mip_gap: float = DEFAULT_MIP_GAP,
               seed: int = 0, method: str = "auto", sizes: np.ndarray | None = None,
               totals: tuple[int, int] | None = None) -> Ilp2Solution | Eq13Infeasible:
    """:func:`assign_clusters` by ``deadline``, returning :class:`Eq13Infeasible` where that raises.

    The program is first solved without Eq. 13; if that optimum meets it, it is optimal with it too. Else the
    assignment is repaired by swaps (:func:`~moebalance.algorithms.moetuner.eq13.balance_totals`, for half the
    time left) and kept if within ``mip_gap`` of the first optimum (a proven lower bound); else the MILP is
    solved with Eq. 13, warm-started from the repair.
    """
    L, G = traffic.shape[0] + 1, cluster.num_gpus
    C = np.asarray(traffic, dtype=np.float64)
    if method not in ("auto", "dp", "milp"):
        raise InputError(f"method ({method!r}) must be 'auto', 'dp' or 'milp'")
    if (sizes is None) != (totals is None):
        raise InputError("give both sizes and totals for Eq. 13, or neither")
    _, _, two_level = link_weights(cluster)
    hit = False
    if G == 1 or L == 1 or not np.any(C > 0):
        gpu = np.tile(np.arange(G, dtype=np.int64), (L, 1))
        kind, bound = "trivial", ilp2_objective(C, gpu, cluster)
    else:
        layouts = num_layouts(cluster.num_nodes, cluster.gpus_per_node) if two_level else 1
        kind = ilp2_method(cluster) if method == "auto" else method
        if kind == "dp":
            if layouts > 16 * MAX_DP_LAYOUTS:
                raise InputError(f"{layouts} node layouts are too many for the exact DP; use method='milp'")
            gpu = solve_dp(C, cluster)
            bound = ilp2_objective(C, gpu, cluster)
        elif deadline.too_short():
            gpu, bound, hit = greedy_assignment(C, cluster), 0.0, True
        else:
            solved = solve_milp(C, cluster, deadline, mip_gap=mip_gap, seed=seed)
            if isinstance(solved, Eq13Infeasible):  # cannot happen without Eq. 13: the greedy start is feasible
                return solved
            gpu, res = solved
            bound, hit = res.bound, res.time_limit_hit
    objective = ilp2_objective(C, gpu, cluster)
    gap = relative_gap(objective, bound)
    if sizes is None or totals is None:
        return Ilp2Solution(gpu, objective, gap, kind, hit, bound)
    if meets_totals(sizes, gpu, totals):
        return Ilp2Solution(gpu, objective, gap, kind, hit, bound, "held")
    if L == 1 or G == 1:
        held = sorted(gpu_totals(sizes, gpu).tolist())
        return Eq13Infeasible(f"Eq. 13 cannot hold: one layer's clusters hold {held} experts but every GPU "
                              f"needs {totals[0]} to {totals[1]}; use memory='layer'")
    # (without traffic every assignment costs 0, so the first repair that meets Eq. 13 is optimal below)
    exact_bound = bound  # the optimum without Eq. 13, or a proven bound on it, bounds the one with it
    repaired = balance_totals(sizes, gpu, totals, C, cluster, deadline=deadline.share(0.5))
    if repaired is None:  # start again from the most balanced greedy layout (no traffic weighed)
        repaired = balance_totals(sizes, lpt_totals(sizes), totals)
    if repaired is not None:
        obj = ilp2_objective(C, repaired, cluster)
        if relative_gap(obj, exact_bound) <= mip_gap:  # proven within the gap by the bound: no MILP needed
            return Ilp2Solution(repaired, obj, relative_gap(obj, exact_bound), f"{kind}+swaps", hit, exact_bound,
                                "enforced")
    if deadline.too_short():
        if repaired is None:
            return Eq13Infeasible("the time limit ran out before ILP 2 with Eq. 13 could be solved, and no quick GPU "
                                  "assignment meets Eq. 13; raise time_limit or use memory='layer'")
        obj = ilp2_objective(C, repaired, cluster)
        return Ilp2Solution(repaired, obj, relative_gap(obj, exact_bound), f"{kind}+swaps", True, exact_bound,
                            "enforced")
    solved = solve_milp(C, cluster, deadline, mip_gap=mip_gap, seed=seed, sizes=sizes, totals=totals,
                        start=repaired, lower_bound=exact_bound)
    if isinstance(solved, Eq13Infeasible):
        return solved
    gpu2, res = solved
    obj = ilp2_objective(C, gpu2, cluster)
    bound2 = max(res.bound, exact_bound)
    return Ilp2Solution(gpu2, obj, relative_gap(obj, bound2), "milp", hit or res.time_limit_hit, bound2, "enforced")
