"""MoETuner: expert placement by two integer programs, ILP 1 (balanced clusters per layer) then ILP 2 (clusters
to GPUs over all layers, weighing cross-layer traffic by bandwidth).

From "MoETuner: Optimized Mixture of Expert Serving with Balanced Expert Placement and Token Routing"
(arXiv 2502.06643). What we solve exactly, and the readings where the paper is ambiguous, are in
``docs/papers/moetuner.md``. The policy adapter is :mod:`moebalance.policies.moetuner`.
"""

from __future__ import annotations

from moebalance.algorithms.moetuner.deadline import (
    DEFAULT_MIP_GAP,
    DEFAULT_TIME_LIMIT,
    MIN_SOLVE_SECONDS,
    Deadline,
)
from moebalance.algorithms.moetuner.eq13 import Eq13Infeasible, balance_totals, lpt_totals, narrow_sizes
from moebalance.algorithms.moetuner.ilp1 import cluster_experts, cluster_layers, ilp1_gap, ilp1_objective
from moebalance.algorithms.moetuner.ilp2 import (
    MAX_DP_LAYOUTS,
    Ilp2Solution,
    assign_clusters,
    ilp2_method,
    ilp2_objective,
    solve_ilp2,
)
from moebalance.algorithms.moetuner.statistics import (
    cluster_sizes,
    cluster_traffic,
    gpu_totals,
    memory_totals,
    relative_gap,
    routing_statistics,
)

__all__ = [
    "DEFAULT_MIP_GAP",
    "DEFAULT_TIME_LIMIT",
    "MAX_DP_LAYOUTS",
    "MIN_SOLVE_SECONDS",
    "Deadline",
    "Eq13Infeasible",
    "Ilp2Solution",
    "assign_clusters",
    "balance_totals",
    "cluster_experts",
    "cluster_layers",
    "cluster_sizes",
    "cluster_traffic",
    "gpu_totals",
    "ilp1_gap",
    "ilp1_objective",
    "ilp2_method",
    "ilp2_objective",
    "lpt_totals",
    "memory_totals",
    "narrow_sizes",
    "relative_gap",
    "routing_statistics",
    "solve_ilp2",
]
