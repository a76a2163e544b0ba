"""``moetuner``: MoETuner's two integer programs as a policy.

"MoETuner: Optimized Mixture of Expert Serving with Balanced Expert Placement and Token Routing" (arXiv
2502.06643): routing statistics (Section 4.1), then ILP 1 per layer (Eq. 1-7: balanced expert clusters),
then ILP 2 over all layers (Eq. 8-15: clusters to GPUs, weighing cross-layer traffic by bandwidth), then the
plan. The algorithms are in :mod:`moebalance.algorithms.moetuner`; what we solve exactly, the memory modes,
Eq. 13 and the time budget are explained in ``docs/papers/moetuner.md``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from moebalance.algorithms.moetuner import (
    DEFAULT_MIP_GAP,
    DEFAULT_TIME_LIMIT,
    Deadline,
    Eq13Infeasible,
    cluster_layers,
    cluster_sizes,
    cluster_traffic,
    gpu_totals,
    ilp1_gap,
    ilp1_objective,
    ilp2_method,
    memory_totals,
    narrow_sizes,
    relative_gap,
    routing_statistics,
    solve_ilp2,
)
from moebalance.algorithms.packing import placement_from_assignment
from moebalance.core.budget import Capacity
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.load import LoadMatrix
from moebalance.policies.base import Diagnostics, Planned, Policy, PolicyConfig

__all__ = ["MOETUNER", "MoetunerConfig", "MoetunerDiagnostics", "moetuner"]


@dataclass(kw_only=True, frozen=True, slots=True)
class MoetunerConfig(PolicyConfig):
    """``time_limit``: total seconds for all solves (None or inf: no limit); ``mip_gap``: relative gap each solve
    stops at (the paper's 0.025); ``seed``: HiGHS's random seed; ``memory``: ``"layer"`` (equal experts per GPU
    in every layer, what EP engines run) or ``"total"`` (the paper's Eq. 13 only, summed over layers)."""

    time_limit: float | None = DEFAULT_TIME_LIMIT
    mip_gap: float = DEFAULT_MIP_GAP
    seed: int = 0
    memory: str = "layer"

    def __post_init__(self) -> None:
        time_limit, mip_gap, seed = self.time_limit, self.mip_gap, self.seed
        if isinstance(time_limit, np.generic):
            time_limit = time_limit.item()
        if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(time_limit, int | float)
                                       or math.isnan(time_limit) or time_limit <= 0):
            raise InputError(f"time_limit ({time_limit!r}) must be a positive number of seconds, or None for no "
                             "limit")
        if isinstance(mip_gap, np.generic):
            mip_gap = mip_gap.item()
        if isinstance(mip_gap, bool) or not isinstance(mip_gap, int | float) or not 0.0 <= mip_gap < 1.0:
            raise InputError(f"mip_gap ({mip_gap!r}) must be a relative gap in [0, 1), e.g. 0.025 (the paper's)")
        if isinstance(seed, np.integer):
            seed = int(seed)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise InputError(f"seed ({seed!r}) must be an integer in [0, 2**31)")
        if self.memory not in ("layer", "total"):
            raise InputError(f"memory ({self.memory!r}) must be 'layer' (equal experts per GPU in every layer) or "
                             "'total' (the paper's Eq. 13: equal experts per GPU summed over layers)")
        no_limit = time_limit is None or math.isinf(time_limit)
        object.__setattr__(self, "time_limit", None if no_limit else float(time_limit))  # type: ignore[arg-type]
        object.__setattr__(self, "mip_gap", float(mip_gap))
        object.__setattr__(self, "seed", seed)


def _json_float(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), 9)


@dataclass(kw_only=True, frozen=True, slots=True)
class MoetunerDiagnostics(Diagnostics):
    """What the solves found: ``O1`` (tokens, summed over layers) with its proven bound and gaps, ``O2``
    (tokens / (GB/s)) with its bound, how ILP 2 was solved, Eq. 13's outcome, the seconds spent, and notes."""

    cluster_sizes: tuple[int, int]
    statistics: str  # "transitions", or "load_only" without a token-level trace
    ilp1_objective: float
    ilp1_bound: float
    ilp1_gap_vs_mean_load: float
    ilp1_seconds: float
    ilp1_time_limit_hit: bool
    ilp2_method: str  # "skipped" without a trace
    ilp2_objective: float | None
    ilp2_bound: float | None
    ilp2_gap: float | None
    ilp2_seconds: float
    ilp2_time_limit_hit: bool
    eq13: str
    experts_per_gpu_total: tuple[int, int]
    eq13_note: str | None = None

    def as_params(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cluster_sizes": list(self.cluster_sizes)}
        if self.eq13_note is not None:
            out["eq13_note"] = self.eq13_note
        out["statistics"] = self.statistics
        if self.statistics == "load_only":
            out["warning"] = ("no token-level trace: ILP 2 (Eq. 8-15) needs cross-layer transitions, so only "
                              "Eq. 13 placed the clusters; give a trace with topk_ids for the full policy")
        hit = self.ilp1_time_limit_hit or self.ilp2_time_limit_hit
        out.update({
            "solver": "highs",
            "ilp1_objective": _json_float(self.ilp1_objective),
            "ilp1_bound": _json_float(self.ilp1_bound),
            "ilp1_gap": _json_float(relative_gap(self.ilp1_objective, self.ilp1_bound)),
            "ilp1_gap_vs_mean_load": _json_float(self.ilp1_gap_vs_mean_load),
            "ilp1_seconds": round(self.ilp1_seconds, 3),
            "ilp1_time_limit_hit": self.ilp1_time_limit_hit,
            "ilp2_method": self.ilp2_method,
            "ilp2_objective": _json_float(self.ilp2_objective),
            "ilp2_bound": _json_float(self.ilp2_bound),
            "ilp2_gap": _json_float(self.ilp2_gap),
            "ilp2_seconds": round(self.ilp2_seconds, 3),
            "ilp2_time_limit_hit": self.ilp2_time_limit_hit,
            "eq13": self.eq13,
            "experts_per_gpu_total": list(self.experts_per_gpu_total),
            "time_limit_hit": hit,
        })
        if hit:
            out["note"] = ("a time limit stopped a solve: the best solution found is used, and the gaps above "
                           "are what was proven")
        return out


def moetuner(load: LoadMatrix, cluster: Cluster, capacity: Capacity, config: MoetunerConfig) -> Planned:
    """MoETuner placement: statistics, ILP 1 per layer, ILP 2 over all layers. No replicas: a
    ``replicas_per_gpu`` budget is met with 0 (``auto`` is refused)."""
    if capacity.budget.replicas_per_gpu is not None:
        capacity.replicas("moetuner")  # refuses "auto": moetuner places no replicas to choose
    E, L, G = load.num_experts, load.num_layers, cluster.num_gpus
    # with one layer, Eq. 13 is the per-layer balance: "total" is "layer"
    sizes_range = cluster_sizes(E, G, config.memory if L > 1 else "layer", capacity.layer_slots)
    layer_range, totals = cluster_sizes(E, G, "layer"), memory_totals(E, L, G)
    P, R = routing_statistics(load)  # Section 4.1; the trace's src_gpu is not used
    # ILP 1's share of the time left: most of it when ILP 2 goes to the DP (well under a second), else half
    ilp1_part = 0.9 if R is None or ilp2_method(cluster) == "dp" else 0.5
    deadline = Deadline.after(config.time_limit)
    tightened: list[str] = []
    seconds1 = seconds2 = 0.0
    while True:  # one round, unless memory="total" sizes admit no assignment meeting Eq. 13
        t0 = time.perf_counter()
        cluster_of, results = cluster_layers(P, G, deadline.share(ilp1_part), mip_gap=config.mip_gap,
                                             seed=config.seed, sizes=sizes_range)
        t1 = time.perf_counter()
        sizes = np.stack([np.bincount(row, minlength=G) for row in cluster_of])  # [L, G]
        C = np.zeros((L - 1, G, G)) if R is None else cluster_traffic(R, cluster_of, G)
        sol = solve_ilp2(C, cluster, deadline, mip_gap=config.mip_gap, seed=config.seed, sizes=sizes, totals=totals)
        seconds1, seconds2 = seconds1 + t1 - t0, seconds2 + time.perf_counter() - t1
        if not isinstance(sol, Eq13Infeasible):
            break
        if sizes_range == layer_range:  # floor to ceil of E / G always admits one (lpt_totals): not reached
            raise PlanError(sol.reason)
        tightened.append(f"{sizes_range[0]} to {sizes_range[1]}")
        sizes_range = narrow_sizes(sizes_range, layer_range)
    o1 = np.array([ilp1_objective(P[:, layer], cluster_of[layer], G) for layer in range(L)])
    # the solves work in G * tokens; a trivial layer (nothing to choose) is its own bound
    b1 = [o1[layer] if res is None else min(res.bound / G, o1[layer]) for layer, res in enumerate(results)]
    tot = gpu_totals(sizes, sol.gpu_of_cluster)
    diagnostics = MoetunerDiagnostics(
        cluster_sizes=sizes_range,
        statistics="load_only" if R is None else "transitions",
        ilp1_objective=float(o1.sum()),
        ilp1_bound=float(np.sum(b1)),
        ilp1_gap_vs_mean_load=max((ilp1_gap(res, float(P[:, layer].sum())) for layer, res in enumerate(results)
                                   if res is not None), default=0.0),
        ilp1_seconds=seconds1,
        ilp1_time_limit_hit=any(res is not None and res.time_limit_hit for res in results),
        ilp2_method="skipped" if R is None else sol.method,
        ilp2_objective=None if R is None else sol.objective,
        ilp2_bound=None if R is None else sol.bound,
        ilp2_gap=None if R is None else sol.gap,
        ilp2_seconds=seconds2,
        ilp2_time_limit_hit=bool(sol.time_limit_hit),
        eq13=sol.eq13,
        experts_per_gpu_total=(int(tot.min()), int(tot.max())),
        eq13_note=None if not tightened else (
            f"no GPU assignment meeting Eq. 13 was found with clusters of {', then '.join(tightened)} experts, "
            f"so ILP 1 was solved again with clusters of {sizes_range[0]} to {sizes_range[1]}"),
    )
    gpu_of_expert = np.take_along_axis(sol.gpu_of_cluster, cluster_of, axis=1)
    plan = placement_from_assignment(gpu_of_expert, np.tile(np.arange(E), (L, 1)), cluster, E, "moetuner", {})
    return Planned(plan, diagnostics)


MOETUNER = Policy("moetuner", MoetunerConfig, moetuner)
