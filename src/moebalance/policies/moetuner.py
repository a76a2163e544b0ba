"""``moetuner``: MoETuner, ILP-based expert placement (seed paper 004, Sections 3-4).

Legend: ``L`` layers, ``E`` experts per layer, ``G`` GPUs (one expert *cluster* per GPU and layer),
``N`` nodes, ``M = G / N`` GPUs per node, ``S`` a layer's load, ``T_mean = S / G``.

MoETuner places experts with two integer programs solved in sequence (Section 4.2), as the paper does:

1. **Routing statistics** (Section 4.1, :func:`routing_statistics`): the load ``P[e, l]`` of every expert
   and the cross-layer transitions ``R[l, i, j]``: (token, pick) pairs going from expert ``i`` of layer
   ``l`` to expert ``j`` of layer ``l + 1`` (:meth:`RoutingTrace.transitions`; ``K * K`` pairs per token).
2. **ILP 1, load-balanced clustering** (Eq. 1-7, :func:`cluster_experts`): per layer, split the experts
   into ``G`` clusters minimising ``O1 = sum_c |T_c - T_mean|``.
3. **ILP 2, cluster-to-GPU assignment** (Eq. 8-15, :func:`assign_clusters`): one cluster per GPU in every
   layer, minimising ``O2 = sum_l max_{g1, g2} C[l, cluster on g1, cluster on g2] / B[g1, g2]``, the
   bandwidth-weighted all-to-all tail between adjacent layers.

What we solve, exactly (where the paper is ambiguous, the choice is written down):

- **ILP 1**, one MILP per layer: Eq. 1 is a sum of per-layer terms and no constraint links layers, so
  solving layers apart is exact. Variables ``x[c, e]`` (Eq. 2); Eq. 1-6 with ``|.|`` linearised by
  ``d_c >= +-(G * T_c - S)`` (integers: ``d_c / G = |T_c - T_mean|``); what the printed program leaves
  implicit, every expert in exactly one cluster; Eq. 7 (no empty cluster) whenever ``E >= G``.
  **Memory (Eq. 13)**, parameter ``memory``. The paper asks only that every GPU hold ``E * L / G`` experts
  summed over layers (Eq. 13, in ILP 2), so a cluster may have any size (its Figure 10 has a hot expert
  alone on a GPU in one layer). That is ``memory="total"``: ILP 1 with clusters of 1 to ``E - G + 1``
  experts (capped by ``slots_per_gpu``), then Eq. 13 in ILP 2. Megatron-LM's, vLLM's and SGLang's EP need
  the same experts on every GPU in every layer, so the default is ``memory="layer"``: clusters of
  ``floor(E / G)`` to ``ceil(E / G)`` experts (:func:`cluster_sizes`), ``E / G`` each when ``G`` divides
  ``E``; Eq. 13 then holds by itself when ``G | E``, and ILP 2 rotates the larger clusters otherwise.
  When ``G`` does not divide ``E * L`` Eq. 13 cannot hold exactly: each GPU gets ``floor`` to ``ceil`` of
  ``E * L / G`` (:func:`memory_totals`). With one layer the two modes are the same program.
  Three additions change no optimum: clusters are ordered by their smallest expert id
  (``x[c, e] <= sum_{e' < e} x[c - 1, e']``, removing the ``G!`` relabellings); a valid cut
  ``sum_c d_c >= LB`` (:func:`_ilp1_lower_bound`: integrality of ``T_c`` and the hottest experts), which
  proves most layers optimal at the root; and a warm start (greedy, then swap/move local search).
  **Gap.** The relative gap of Gurobi and HiGHS, ``(O1 - bound) / O1``, cannot close when the optimum is
  a near-perfect split (``O1`` of a few tokens, bound 0; the common case with many experts), so each layer's
  solve stops at ``(O1 - bound) / max(O1, T_mean) <= mip_gap`` (:func:`ilp1_gap`): the usual relative gap
  in skewed layers, and "within ``mip_gap`` of a GPU's mean load" in balanced ones. Params report the
  worst layer's value of that (``ilp1_gap_vs_mean_load``) and the usual relative gap of the whole ILP 1,
  ``ilp1_gap = (sum_l O1 - sum_l bound) / sum_l O1`` (``ilp1_bound`` is the summed proven bound).
- **ILP 2**, over all layers (Eq. 8 chains layer ``l`` to ``l + 1``). Eq. 8 as printed puts the ``max``
  around the whole double sum, where it does nothing; the text ("the maximum communication cost across
  all GPU pairs") makes it a max over GPU pairs of ``C[l, c1, c2] / B[g1, g2]`` for ``c1`` on ``g1`` in
  layer ``l`` and ``c2`` on ``g2`` in ``l + 1``, a pair on one GPU being free (``B = inf``); the sum runs
  over the ``L - 1`` adjacent pairs. ``C`` is Eq. 9/12 (:func:`cluster_traffic`), computed from ILP 1's
  clusters before ILP 2, as in the paper. Linearising ``y[c1, g1, l] * y[c2, g2, l + 1]`` GPU by GPU
  takes ``G^4`` McCormick products per layer pair and its LP bound is about 0, so we use that our
  :class:`Cluster` has three kinds of link (same GPU, same node, other node; weights ``0``,
  ``w_n = 1 / B_intra``, ``w_x = 1 / B_inter``) and that a GPU holds one cluster per layer: the tail of
  pair ``l`` is ``max_{c1, c2} C[l, c1, c2] * w(link of c1 and c2)``, which depends only on which
  clusters of ``l`` and ``l + 1`` share a GPU (a perfect matching) and which share a node. Two exact
  solvers of that program:

  * ``"dp"``: given each layer's *node layout* (which clusters are on which node), the best matchings are
    independent per node and layer pair: a bottleneck matching whose value is the first entry, in
    descending order, that shares a row or column with a larger one (:func:`_bottleneck_value`). A
    dynamic program over the ``G! / (M!)^N`` layouts per layer then gives the optimum (one layout on one
    node, or with one GPU per node, or equal bandwidths: ILP 2 then splits into independent per-pair
    matchings). Used when there are at most :data:`MAX_DP_LAYOUTS` layouts (e.g. 70 for 2 nodes x 4).
  * ``"milp"`` (HiGHS), otherwise: binaries ``a[l, c1, c2]`` (share a GPU; perfect matching, Eq. 14-15)
    and ``Y[l, c, n]`` (``M`` clusters per node), ``b[l, c1, c2, n] = Y[l, c1, n] * Y[l + 1, c2, n]``
    linearised by McCormick upper envelopes plus the RLT equalities ``sum_{c2} b[l, c1, c2, n] =
    M * Y[l, c1, n]`` (and transposed), which make ``b`` exact at integer ``Y``; ``a <= sum_n b`` and
    ``t_l >= C[l, c1, c2] * (w_x - (w_x - w_n) * sum_n b - w_n * a)``, minimising ``sum_l t_l``. Cluster 0
    of layer 0 is fixed to node 0 (node labels are interchangeable); warm start: heaviest transition
    first into its source's node. Its LP bound is weak, so big instances stop at the time limit.

  Any matching-and-layout solution is realised by GPU permutations (lay out layer 0, then give each
  cluster of layer ``l + 1`` its matched cluster's GPU) and every GPU assignment yields one with the same
  cost, so both optima equal the paper's ILP 2 optimum; the tests check this against brute force over all
  ``(G!)^L`` assignments.

  **Eq. 13 in ILP 2.** The program above is first solved without Eq. 13. Its optimum bounds the one with
  Eq. 13 from below; if it meets Eq. 13 (always, when every cluster has the same size) it is optimal
  (``"eq13": "held"``). Else a repair swaps two clusters of one layer between two GPUs, each swap
  lowering the spread of GPU totals and, among those, raising Eq. 8 least (:func:`_balance_totals`; for
  half the time left, then by spread alone; stuck, it exchanges two GPUs' clusters in a subset of layers
  or kicks with a seeded random swap); if the result is within ``mip_gap`` of the bound it is kept (``ilp2_method`` ``"dp+swaps"``). Otherwise
  the MILP is solved with Eq. 13, warm-started from the repair: a GPU's total is carried along the
  matching chain, ``s[l + 1, c2] = size[l + 1, c2] + s[l, c1]`` where ``a[l, c1, c2] = 1`` (big-M rows
  with ``M`` the range ``s`` can span at that layer), and Eq. 13 bounds ``s[L - 1, c]``. The tests check
  both paths against brute force over the ``(G!)^L`` assignments that meet Eq. 13. If no assignment
  meets it (``memory="total"``: ILP 1 ignores Eq. 13, and can give, say, every layer one GPU with a lone
  hot expert and the others five experts each, which no rotation balances over two layers; or none is found
  before the time limit), ILP 1 is solved again with the cluster sizes narrowed towards ``E / G`` (both ends
  halfway each time) until one does; the last step, ``floor`` to ``ceil`` of ``E / G``, always admits one
  (:func:`_lpt_totals`). Params record the sizes used (``cluster_sizes``) and, if narrowed, an ``eq13_note``;
  ``ilp1_seconds`` and ``ilp2_seconds`` sum over the rounds. The paper does not say what to do here.
- **Joint solve.** One program for ILP 1 and 2 would let ILP 2 choose among equally balanced partitions,
  but ``C`` multiplies the ``x`` of two layers (cubic), and the paper solves them in sequence; so do we.
- **Without a token-level trace** there are no transitions: ILP 1 runs as above and ILP 2's objective
  is 0 for every assignment, so only Eq. 13 places the clusters (cluster ``c`` on GPU ``c`` when it holds);
  params say ``"statistics": "load_only"`` and carry a ``"warning"``.
- **Solver and budget** (:mod:`moebalance.algorithms.milp`): HiGHS via ``highspy``, one thread, ``random_seed =
  seed``, ``mip_gap`` 0.025 by default (Section 5.1's tolerance, used with Gurobi). ``time_limit`` is the
  policy's total wall-clock budget in seconds (default 60; ``None`` or ``inf``: no limit): ILP 1 gets 90%
  of it when ILP 2 goes to the DP, else half; each layer first gets an equal share, then the layers that hit
  their share are solved again, warm-started, with what the others left; ILP 2 gets the rest (a second
  ``memory="total"`` round, after narrowing, splits the time then left the same way). A MILP is
  not even built when building it would take longer than the time left (:data:`_SECONDS_PER_NONZERO`).
  A stopped solve keeps its best solution and ``"time_limit_hit": true`` is recorded, with
  ``ilp1_time_limit_hit`` and ``ilp2_time_limit_hit`` saying which; only then may the plan depend on the
  machine's speed. Params record ``ilp1_objective`` (``O1`` in tokens, summed over layers) with its bound
  and gaps, ``ilp2_objective`` (``O2`` in tokens / (GB/s)) with its proven ``ilp2_bound`` and
  ``ilp2_gap``, ``ilp2_method``, ``eq13`` and ``experts_per_gpu_total`` (the least and most experts a GPU
  holds over all layers), and the seconds spent.

Solve times and proven gaps for Mixtral-8x7B-like (8 experts, 32 layers) and OLMoE-like (64 experts, 16
layers) traces on 4 to 16 GPUs, in both memory modes, are measured by ``bench/moetuner_acceptance.py``
(docs/results/moetuner.md): the Mixtral cases and 64 experts on up to 8 GPUs solve to the requested gap in
about a second; at 16 GPUs (4 experts per GPU) a near-balanced ILP 1 layer stays a few percent of a GPU's
mean load from its proven bound, and ILP 2's MILP (12,870 or 63 million node layouts, beyond the DP) ends
at the limit with a weak bound: the plan is the best found, and its params say so.

Solver choice (ILP 1, same model and warm start, one thread): HiGHS 7.9 s vs OR-Tools CP-SAT 19.0 s for
OLMoE's 16 layers on 8 GPUs; 0.43 s vs 0.16 s for Mixtral's 32 layers on 4 GPUs; 37.1 s vs 36.8 s on 16
GPUs (5 s limit per layer, same 7 layers unproven, same objectives; before the hot-expert cut). HiGHS
also takes ILP 2's fractional bandwidth weights, which CP-SAT would need scaled to integers, and the two
wheels cannot be imported into one process (each bundles its own HiGHS: undefined-symbol errors).
``scipy.optimize.milp`` runs the same HiGHS without warm starts.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from moebalance.algorithms.milp import Milp, MilpResult
from moebalance.algorithms.packing import placement_from_assignment
from moebalance.core.budget import Budget, resolve_budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.routing.simulate import CrossLayerTraffic, cross_layer_traffic, processing_load

__all__ = [
    "CrossLayerTraffic",
    "Ilp2Solution",
    "assign_clusters",
    "cluster_experts",
    "cluster_sizes",
    "cluster_traffic",
    "cross_layer_traffic",
    "ilp1_gap",
    "ilp1_objective",
    "ilp2_objective",
    "moetuner",
    "processing_load",
    "routing_statistics",
]

#: Relative MIP gap of Section 5.1 ("Both ILPs were set to execute until reaching a tolerance of 0.025").
DEFAULT_MIP_GAP = 0.025
#: Default total time budget in seconds (see the module docstring).
DEFAULT_TIME_LIMIT = 60.0
#: A solve given less time than this is skipped: ILP 1 keeps its warm start (and says the limit was hit).
MIN_SOLVE_SECONDS = 0.05


# --------------------------------------------------------------------------------------------------
# Section 4.1: routing statistics
# --------------------------------------------------------------------------------------------------

def routing_statistics(load: LoadMatrix) -> tuple[np.ndarray, np.ndarray | None]:
    """``(P, R)``: ``P int64 [E, L]`` tokens per expert (the paper's ``P_{e,l}``) and
    ``R int64 [L-1, E, E]`` cross-layer transitions (``R_{e1,e2,l}``), or ``None`` without a token-level trace.
    """
    P = load.total().T.copy()
    R = None if load.trace is None else load.trace.transitions()
    return P, R


# --------------------------------------------------------------------------------------------------
# ILP 1 (Eq. 1-7): load-balanced expert clustering, one layer at a time
# --------------------------------------------------------------------------------------------------

def cluster_sizes(num_experts: int, num_gpus: int, memory: str = "layer",
                  max_size: int | None = None) -> tuple[int, int]:
    """``(lo, hi)`` experts per cluster (one cluster per GPU and layer).

    ``memory="layer"``: ``floor(E / G)`` to ``ceil(E / G)`` (``E / G`` each when ``G`` divides ``E``; 0 to 1 when
    ``E < G``, where Eq. 7 cannot hold): the memory of equal-slot EP engines, ``ceil(E / G)`` slots per GPU
    and layer, and Eq. 13 over layers within one expert (ILP 2 rotates the larger clusters).
    ``memory="total"`` (the paper's Eq. 7 and 13): any non-empty cluster, 1 to ``E - G + 1`` (0 to ``E``
    when ``E < G``), equal memory being asked only of a GPU's sum over layers. ``max_size`` (a slot budget)
    caps ``hi``.
    """
    E, G = num_experts, num_gpus
    if memory == "layer":
        lo, hi = E // G, -(-E // G)
    elif memory == "total":
        lo, hi = (1, E - G + 1) if E >= G else (0, E)
    else:
        raise InputError(f"memory ({memory!r}) must be 'layer' (equal experts per GPU in every layer) or "
                         "'total' (the paper's Eq. 13: equal experts per GPU summed over layers)")
    if max_size is not None:
        hi = max(min(hi, max_size), lo)
    return lo, hi


def memory_totals(num_experts: int, num_layers: int, num_gpus: int) -> tuple[int, int]:
    """Eq. 13's range for a GPU's experts summed over layers: ``E * L / G`` when ``G`` divides ``E * L``,
    else ``floor`` to ``ceil`` of it (the closest to equal that integers allow)."""
    n = num_experts * num_layers
    return n // num_gpus, -(-n // num_gpus)


def gpu_totals(sizes: np.ndarray, gpu_of_cluster: np.ndarray) -> np.ndarray:
    """``int64 [G]``: experts each GPU holds over all layers (the left side of Eq. 13).

    ``sizes int [L, G]`` experts in cluster ``c`` of layer ``l``; ``gpu_of_cluster int [L, G]``.
    """
    return _sizes_on_gpus(sizes, gpu_of_cluster).sum(axis=0)


def _sizes_on_gpus(sizes: np.ndarray, gpu_of_cluster: np.ndarray) -> np.ndarray:
    """``int64 [L, G]``: experts GPU ``g`` holds in layer ``l`` (``sizes`` reindexed from clusters to GPUs)."""
    on = np.empty(sizes.shape, dtype=np.int64)
    on[np.arange(sizes.shape[0])[:, None], gpu_of_cluster] = sizes
    return on


def _swap_gpus(gpu_of_cluster: np.ndarray, layer: int, a: int, b: int) -> None:
    """In place: the clusters on GPUs ``a`` and ``b`` in ``layer`` trade places."""
    row = gpu_of_cluster[layer]
    on_a, on_b = row == a, row == b
    row[on_a], row[on_b] = b, a


def ilp1_objective(weight: np.ndarray, cluster_of_expert: np.ndarray, num_gpus: int) -> float:
    """Eq. 1 for one layer: ``sum_c |T_c - S / G|`` for ``weight [E]`` and ``cluster_of_expert [E]``."""
    T = np.bincount(cluster_of_expert, weights=weight.astype(np.float64), minlength=num_gpus)
    return float(np.abs(T - weight.sum() / num_gpus).sum())


def _canonical(cluster_of_expert: np.ndarray, num_gpus: int) -> np.ndarray:
    """Relabel clusters by their smallest expert id (empty clusters last): ILP 1's symmetry-free form."""
    E = cluster_of_expert.shape[0]
    first = np.full(num_gpus, E, dtype=np.int64)
    np.minimum.at(first, cluster_of_expert, np.arange(E))
    rank = np.empty(num_gpus, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(num_gpus)
    return rank[cluster_of_expert]


def _balanced_start(weight: np.ndarray, num_gpus: int, lo: int, hi: int) -> np.ndarray:
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
    return _canonical(_improve(weight, out, G, lo, hi), G)


def _improve(weight: np.ndarray, cluster_of: np.ndarray, num_gpus: int, lo: int, hi: int,
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


def _ilp1_lower_bound(weight: np.ndarray, num_gpus: int, lo: int) -> float:
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
    start = _balanced_start(weight, G, lo, hi) if start is None else _canonical(np.asarray(start), G)
    if G == 1 or hi == 1:  # one cluster, or one expert per cluster: nothing to choose up to relabelling
        return start, None
    w = weight.astype(np.float64)
    S = float(w.sum())
    lower = _ilp1_lower_bound(weight, G, lo)
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
    assert np.all(sol.sum(axis=0) == 1)
    return cluster_of, result


# --------------------------------------------------------------------------------------------------
# ILP 2 (Eq. 8-15): communication-aware cluster-to-GPU assignment over all layers
# --------------------------------------------------------------------------------------------------

def cluster_traffic(R: np.ndarray, cluster_of_expert: np.ndarray, num_gpus: int) -> np.ndarray:
    """Eq. 9/12: ``C float64 [L-1, G, G]``, transitions from cluster ``c1`` (layer ``l``) to ``c2`` (``l + 1``).

    ``R [L-1, E, E]``, ``cluster_of_expert int [L, E]``.
    """
    L = cluster_of_expert.shape[0]
    onehot = np.zeros((L, cluster_of_expert.shape[1], num_gpus))
    np.put_along_axis(onehot, cluster_of_expert[..., None], 1.0, axis=2)
    return np.einsum("lic,lij,ljd->lcd", onehot[:-1], R.astype(np.float64), onehot[1:])


def _inverse_bandwidth(cluster: Cluster) -> np.ndarray:
    """``float64 [G, G]``: ``1 / B[g1, g2]`` in s/GB, 0 on the diagonal (a token staying on its GPU is free)."""
    return 1.0 / cluster.bandwidth_matrix()


def ilp2_objective(traffic: np.ndarray, gpu_of_cluster: np.ndarray, cluster: Cluster) -> float:
    """Eq. 8 evaluated GPU by GPU: ``sum_l max_{g1, g2} C[l, c1, c2] / B[g1, g2]`` for the clusters on them.

    ``traffic [L-1, G, G]`` (:func:`cluster_traffic`), ``gpu_of_cluster int [L, G]``. In tokens / (GB/s).
    """
    if traffic.shape[0] == 0:
        return 0.0
    inv = _inverse_bandwidth(cluster)
    w = inv[gpu_of_cluster[:-1, :, None], gpu_of_cluster[1:, None, :]]  # [L-1, G, G] cost per cluster pair
    return float((traffic * w).max(axis=(1, 2)).sum())


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
    #: :func:`_balance_totals` then met Eq. 13 within the gap.
    method: str
    time_limit_hit: bool = False
    #: Proven lower bound on ``objective``.
    bound: float = 0.0
    #: Eq. 13: ``"not asked"``, ``"held"`` (the optimum without it meets it) or ``"enforced"`` (a MILP with it).
    eq13: str = "not asked"


def _link_weights(cluster: Cluster) -> tuple[float, float, bool]:
    """``(w_n, w_x, two_level)``: cost per token to another GPU of the node and to another node (1 / GB/s),
    and whether the two differ in a way placement can use (more than one node of more than one GPU)."""
    N, M = cluster.num_nodes, cluster.gpus_per_node
    w_n, w_x = 1.0 / cluster.intra_node_bandwidth, 1.0 / cluster.inter_node_bandwidth
    if N == 1:
        w_x = w_n  # there is no other node
    if M == 1:
        w_n = w_x  # another GPU is another node
    return w_n, w_x, N > 1 and M > 1 and w_n != w_x


def _bottleneck_value(sub: np.ndarray) -> np.ndarray:
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


def _bottleneck_matching(sub: np.ndarray) -> np.ndarray:
    """``int64 [M]``: a perfect matching (column of each row) reaching :func:`_bottleneck_value` of ``sub [M, M]``."""
    M = sub.shape[0]
    v = float(_bottleneck_value(sub))
    match = np.full(M, -1, dtype=np.int64)
    for i, j in np.argwhere(sub > v):  # the entries that must be matched: a partial matching
        match[i] = j
    free_cols = [j for j in range(M) if j not in set(match.tolist())]
    for i in np.flatnonzero(match < 0):
        match[i] = free_cols.pop(0)
    return match


def _node_layouts(num_nodes: int, gpus_per_node: int) -> np.ndarray:
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


def _num_layouts(num_nodes: int, gpus_per_node: int) -> int:
    return math.factorial(num_nodes * gpus_per_node) // math.factorial(gpus_per_node) ** num_nodes


def _pair_costs(C: np.ndarray, layouts: np.ndarray, num_nodes: int, w_n: float, w_x: float) -> np.ndarray:
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
        cost = np.maximum(cost, w_n * _bottleneck_value(sub))
    return cost


def _realise(C: np.ndarray, layouts: np.ndarray, num_nodes: int) -> np.ndarray:
    """``int64 [L, G]`` GPUs from per-layer layouts ``[L, G]`` (node of each cluster), optimal matchings."""
    L, G = layouts.shape
    gpu = np.empty((L, G), dtype=np.int64)
    order = np.lexsort((np.arange(G), layouts[0]))  # layer 0: node by node, clusters in id order
    gpu[0, order] = np.arange(G)
    for layer in range(L - 1):
        for n in range(num_nodes):
            src = np.flatnonzero(layouts[layer] == n)
            dst = np.flatnonzero(layouts[layer + 1] == n)
            match = _bottleneck_matching(C[layer][np.ix_(src, dst)])
            gpu[layer + 1, dst[match]] = gpu[layer, src]
    return gpu


def _solve_dp(C: np.ndarray, cluster: Cluster) -> np.ndarray:
    """Exact ILP 2 by dynamic programming over node layouts (see :func:`assign_clusters`)."""
    w_n, w_x, two_level = _link_weights(cluster)
    N = cluster.num_nodes if two_level else 1
    G = cluster.num_gpus
    layouts = _node_layouts(N, G // N)
    L = C.shape[0] + 1
    value = np.zeros(len(layouts))
    back = np.empty((L - 1, len(layouts)), dtype=np.int64)
    for layer in range(L - 1):
        total = value[:, None] + _pair_costs(C[layer], layouts, N, w_n, w_x if two_level else w_n)
        back[layer] = np.argmin(total, axis=0)  # ties: the lowest layout index
        value = total[back[layer], np.arange(len(layouts))]
    path = np.empty(L, dtype=np.int64)
    path[-1] = int(np.argmin(value))
    for layer in range(L - 2, -1, -1):
        path[layer] = back[layer, path[layer + 1]]
    return _realise(C, layouts[path], N)


def _greedy_assignment(C: np.ndarray, cluster: Cluster) -> np.ndarray:
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
    return _realise(C, layouts, N)


def _balance_totals(sizes: np.ndarray, gpu_of_cluster: np.ndarray, totals: tuple[int, int],
                    traffic: np.ndarray | None = None, cluster: Cluster | None = None,
                    max_swaps: int = 100_000, max_kicks: int = 200,
                    deadline: float | None = None) -> np.ndarray | None:
    """A GPU assignment meeting Eq. 13 (``totals[0] <= gpu_totals <= totals[1]``) found by swapping two
    clusters of one layer between two GPUs, from ``gpu_of_cluster int [L, G]``; ``None`` if it gets stuck.

    Every swap lowers ``sum_g (total_g - mean)^2``: swapping sizes ``s_a`` on GPU ``a`` and ``s_b`` on ``b``
    (``d = s_a - s_b``) changes it by ``2 d (d - (total_a - total_b))``, so each descent ends. Among such swaps
    it takes the one that raises Eq. 8 least when ``traffic [L-1, G, G]`` and ``cluster`` are given (until
    ``deadline``, a :func:`time.perf_counter` value: that costs ``O(L G^4)`` per swap), else the one that
    lowers the spread most. Where no single swap lowers it, two GPUs exchange their clusters in a subset of
    layers (:func:`_pair_subset_swap`); where that fails too, a seeded random swap (at most ``max_kicks``)
    restarts the descent. A heuristic: it repairs ILP 2's optimum without Eq. 13 (whose value bounds the
    optimum with it, so the repair's gap is known) and warm-starts the Eq. 13 MILP.
    """
    L, G = sizes.shape
    gpu = gpu_of_cluster.copy()
    swap = np.tile(np.arange(G), (G, G, 1))  # swap[a, b, g]: GPU g with a and b exchanged
    ga, gb = np.meshgrid(np.arange(G), np.arange(G), indexing="ij")
    swap[ga, gb, ga], swap[ga, gb, gb] = gb, ga
    inv = None if cluster is None else _inverse_bandwidth(cluster)
    rng = np.random.default_rng(0)
    kicks = max_kicks

    def pair_cost(layer: int, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        assert traffic is not None and inv is not None
        return (traffic[layer] * inv[first[..., :, None], second[..., None, :]]).max(axis=(-2, -1))

    for _ in range(max_swaps):
        tot = gpu_totals(sizes, gpu)
        if tot.min() >= totals[0] and tot.max() <= totals[1]:
            return gpu
        on = _sizes_on_gpus(sizes, gpu)  # [L, G]
        d = on[:, :, None] - on[:, None, :]  # [L, G(a), G(b)]
        change = (d * (d - (tot[:, None] - tot[None, :])[None])).astype(np.float64)
        if change.min() >= 0:  # no single swap helps: exchange two GPUs' clusters in a subset of layers
            exchange = _pair_subset_swap(on, tot, totals)
            if exchange is None:  # a local minimum: a seeded random swap, then descend again
                if kicks == 0:
                    return None
                kicks -= 1
                ka, kb = rng.choice(G, size=2, replace=False)
                exchange = [int(rng.integers(L))], int(ka), int(kb)
            ex_layers, ex_a, ex_b = exchange
            for ly in ex_layers:
                _swap_gpus(gpu, ly, ex_a, ex_b)
            continue
        if traffic is None or not np.any(traffic > 0) or (deadline is not None and time.perf_counter() > deadline):
            layer, g1, g2 = np.unravel_index(int(np.argmin(change)), change.shape)
        else:
            cost = np.zeros((L, G, G))
            for ly in range(L):
                if not np.any(change[ly] < 0):
                    continue
                moved = swap[:, :, gpu[ly]]  # [G(a), G(b), G(c)]: the layer's GPUs after swapping a and b
                if ly > 0:
                    cost[ly] += pair_cost(ly - 1, gpu[ly - 1], moved) - pair_cost(ly - 1, gpu[ly - 1], gpu[ly])
                if ly < L - 1:
                    cost[ly] += pair_cost(ly, moved, gpu[ly + 1]) - pair_cost(ly, gpu[ly], gpu[ly + 1])
            cost = np.where(change < 0, cost, np.inf)
            best = np.flatnonzero(cost.ravel() <= cost.min() + 1e-12 * max(1.0, abs(cost.min())))
            layer, g1, g2 = np.unravel_index(int(best[np.argmin(change.ravel()[best])]), change.shape)
        _swap_gpus(gpu, int(layer), int(g1), int(g2))
    return None


def _pair_subset_swap(on: np.ndarray, tot: np.ndarray, totals: tuple[int, int]) -> tuple[list[int], int, int] | None:
    """Layers in which to exchange the clusters of GPUs ``a`` and ``b`` so that ``sum_g (total_g - mean)^2``
    falls the most, for a GPU ``a`` or ``b`` outside ``totals``; ``None`` if no such exchange lowers it.

    ``on int [L, G]`` experts on GPU ``g`` in layer ``l``, ``tot int [G]`` their sums. Moving ``D = sum over
    the chosen layers of on[l, a] - on[l, b]`` from ``a`` to ``b`` changes the sum by ``2 D (D - (tot_a -
    tot_b))``, negative iff ``0 < D < tot_a - tot_b``; the reachable ``D`` are a subset sum (a DP over layers).
    """
    L, G = on.shape
    out_of_range = (tot < totals[0]) | (tot > totals[1])
    best: tuple[int, list[int], int, int] | None = None  # (change, layers, a, b)
    for a in range(G):
        for b in range(G):
            gap = int(tot[a] - tot[b])
            if gap < 2 or not (out_of_range[a] or out_of_range[b]):
                continue
            d = on[:, a] - on[:, b]  # [L]
            span = int(np.abs(d).sum())
            reach = np.zeros((L + 1, 2 * span + 1), dtype=bool)  # reach[l, span + D]: D from layers < l
            reach[0, span] = True
            for layer in range(L):
                reach[layer + 1] = reach[layer]
                if d[layer] > 0:
                    reach[layer + 1, d[layer]:] |= reach[layer, :-d[layer]]
                elif d[layer] < 0:
                    reach[layer + 1, :d[layer]] |= reach[layer, -d[layer]:]
            sums = np.arange(-span, span + 1)
            ok = reach[L] & (sums > 0) & (sums < gap)
            if not ok.any():
                continue
            D = int(sums[ok][np.argmin(np.abs(2 * sums[ok] - gap))])  # the largest fall: D nearest gap / 2
            change = D * (D - gap)
            if best is not None and change >= best[0]:
                continue
            layers, rest = [], D
            for layer in range(L - 1, -1, -1):  # walk back: take a layer only if the sum needs it
                if not reach[layer, span + rest]:
                    layers.append(layer)
                    rest -= int(d[layer])
            assert rest == 0
            best = (change, layers, a, b)
    return None if best is None else (best[1], best[2], best[3])


#: Seconds per (estimated) non-zero to build ILP 2's MILP and hand it to HiGHS: 0.6-1.3 microseconds on the
#: 2-core machine (highspy 1.15), timing ``_solve_milp(C, cluster, time_limit=0.001, ...)`` on random ``C`` for
#: 2 x 8 and 4 x 4 GPUs (16 layers) and 8 x 8 (8 layers), divided by :func:`_milp_nonzeros`. The MILP is not built when that alone
#: would take longer than the time left; the best assignment at hand is kept and the limit reported as hit.
_SECONDS_PER_NONZERO = 1.5e-6


def _milp_nonzeros(L: int, G: int, N: int, use_nodes: bool, chained: bool) -> int:
    """Rough count of ILP 2's MILP non-zeros (the rows dominate: ``(L - 1) G^2 N`` products of node variables)."""
    per_pair = G * G * (3 + (6 * N + 3 if use_nodes else 0) + (6 if chained else 0))
    return (L - 1) * per_pair


def _solve_milp(C: np.ndarray, cluster: Cluster, *, time_limit: float | None, mip_gap: float, seed: int,
                sizes: np.ndarray | None = None, totals: tuple[int, int] | None = None,
                start: np.ndarray | None = None, lower_bound: float = 0.0) -> tuple[np.ndarray, MilpResult]:
    """ILP 2 as one MILP over all layers (the matching reformulation of :func:`assign_clusters`).

    With ``sizes int [L, G]`` and ``totals`` the program also has Eq. 13: the experts of the GPU that holds
    cluster ``c`` of layer ``l``, summed over layers ``0..l``, are carried along the matching chain,
    ``s[l + 1, c2] = sizes[l + 1, c2] + s[l, c1]`` where ``a[l, c1, c2] = 1`` (big-M rows, ``M`` the range
    ``s`` can span), and ``totals[0] <= s[L - 1, c] <= totals[1]``. ``start int [L, G]`` is a feasible GPU
    assignment to warm-start from (default: the greedy one, when it meets Eq. 13). ``lower_bound`` (in
    tokens / (GB/s)), a proven bound such as the optimum without Eq. 13, enters as the cut ``sum_l t_l >=
    lower_bound`` so that HiGHS stops as soon as its incumbent is within the gap of it.
    """
    L, G = C.shape[0] + 1, cluster.num_gpus
    N, M = cluster.num_nodes, cluster.gpus_per_node
    w_n, w_x, use_nodes = _link_weights(cluster)
    scale = max(w_n, w_x)  # solve in units of the slowest link, report in tokens / (GB/s)
    w_n, w_x = w_n / scale, w_x / scale
    chained = sizes is not None and totals is not None
    if start is None:
        start = _greedy_assignment(C, cluster)
    if chained:
        assert sizes is not None and totals is not None
        tot = gpu_totals(sizes, start)
        if tot.min() < totals[0] or tot.max() > totals[1]:
            start = _balance_totals(sizes, start, totals)
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
            raise PlanError(f"Eq. 13 cannot hold: the clusters hold {int(sz.sum())} experts, which cannot give "
                            f"every GPU {totals[0]} to {totals[1]}; use memory='layer'")
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
    x0 = None if start is None else _milp_start(C, cluster, start, m.num_vars, a, t, parts, sizes, w_n, w_x)
    result = m.solve(time_limit=time_limit, mip_gap=mip_gap, seed=seed, start=x0)
    if result.status == "infeasible":
        raise PlanError("Eq. 13 cannot hold for these clusters: no GPU assignment gives every GPU "
                        f"{totals[0] if totals else '?'} to {totals[1] if totals else '?'} experts over all layers; "
                        "use memory='layer'")
    if result.status == "no_solution":
        raise PlanError("the time limit ran out before ILP 2 (with Eq. 13) found a feasible GPU assignment; "
                        "raise time_limit or use memory='layer'")
    partner = np.argmax(result.x[a].round(), axis=1)  # [L-1, G]: the layer-l cluster each c2 shares a GPU with
    gpu = np.empty((L, G), dtype=np.int64)
    if use_nodes:
        node0 = np.argmax(result.x[parts["Y"][0]].round(), axis=1)
        gpu[0, np.lexsort((np.arange(G), node0))] = np.arange(G)  # clusters of layer 0 by node, then id
    else:
        gpu[0] = np.arange(G)
    for layer in range(L - 1):
        gpu[layer + 1] = gpu[layer, partner[layer]]
    assert np.all(np.sort(gpu, axis=1) == np.arange(G))
    assert math.isclose(ilp2_objective(C, gpu, cluster), result.objective * scale, rel_tol=1e-6,
                        abs_tol=1e-9 * max(1.0, float(C.max()) * scale))
    if chained:
        assert sizes is not None and totals is not None
        tot = gpu_totals(sizes, gpu)
        assert tot.min() >= totals[0] and tot.max() <= totals[1], tot
    # t >= 0: a solve stopped before its root LP reports a bound of -inf, 0 is proven all the same
    return gpu, dataclasses.replace(result, objective=result.objective * scale, bound=max(result.bound, 0.0) * scale)


def _milp_start(C: np.ndarray, cluster: Cluster, gpu: np.ndarray, num_vars: int, a: np.ndarray, t: np.ndarray,
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
        running = np.cumsum(_sizes_on_gpus(sizes, gpu), axis=0)  # [L, G]: a GPU's experts in layers 0..l
        x0[parts["s"]] = np.take_along_axis(running, gpu, axis=1)
    return x0


def _ilp2_method(cluster: Cluster) -> str:
    """``"dp"`` when a layer has at most :data:`MAX_DP_LAYOUTS` node layouts, else ``"milp"``."""
    _, _, two_level = _link_weights(cluster)
    layouts = _num_layouts(cluster.num_nodes, cluster.gpus_per_node) if two_level else 1
    return "dp" if layouts <= MAX_DP_LAYOUTS else "milp"


def assign_clusters(traffic: np.ndarray, cluster: Cluster, *, time_limit: float | None = None,
                    mip_gap: float = DEFAULT_MIP_GAP, seed: int = 0, method: str = "auto",
                    sizes: np.ndarray | None = None, totals: tuple[int, int] | None = None) -> Ilp2Solution:
    """ILP 2 (Eq. 8-15): the GPU of every cluster in every layer (:class:`Ilp2Solution`).

    ``traffic float [L-1, G, G]`` is ``C`` of Eq. 9 (:func:`cluster_traffic`). ``method``: ``"dp"`` (exact
    dynamic programming over node layouts), ``"milp"`` (HiGHS on the matching reformulation), or
    ``"auto"``: the DP when a layer has at most :data:`MAX_DP_LAYOUTS` node layouts, else the MILP.
    Both solve the module docstring's program; the DP exactly, the MILP to ``mip_gap`` or ``time_limit``.

    Eq. 13: with ``sizes int [L, G]`` (experts of each cluster) and ``totals = (lo, hi)``, every GPU must hold
    ``lo`` to ``hi`` experts over all layers. The program is first solved without it; if that optimum meets
    it, it is optimal with it too; else the MILP is solved with Eq. 13 (:func:`_solve_milp`), the first
    optimum being a proven lower bound. Raises :class:`PlanError` if Eq. 13 cannot hold.
    """
    L, G = traffic.shape[0] + 1, cluster.num_gpus
    C = np.asarray(traffic, dtype=np.float64)
    if method not in ("auto", "dp", "milp"):
        raise InputError(f"method ({method!r}) must be 'auto', 'dp' or 'milp'")
    if (sizes is None) != (totals is None):
        raise InputError("give both sizes and totals for Eq. 13, or neither")
    t0 = time.perf_counter()

    def left() -> float | None:
        return None if time_limit is None else max(time_limit - (time.perf_counter() - t0), 0.0)

    _, _, two_level = _link_weights(cluster)
    N = cluster.num_nodes if two_level else 1

    def no_time_for_milp(chained: bool) -> bool:
        limit = left()
        nnz = _milp_nonzeros(L, G, N, two_level, chained)
        return limit is not None and (limit < MIN_SOLVE_SECONDS or nnz * _SECONDS_PER_NONZERO > limit)

    hit = False
    if G == 1 or L == 1 or not np.any(C > 0):
        gpu = np.tile(np.arange(G, dtype=np.int64), (L, 1))
        kind, bound = "trivial", ilp2_objective(C, gpu, cluster)
    else:
        layouts = _num_layouts(cluster.num_nodes, cluster.gpus_per_node) if two_level else 1
        kind = _ilp2_method(cluster) if method == "auto" else method
        if kind == "dp":
            if layouts > 16 * MAX_DP_LAYOUTS:
                raise InputError(f"{layouts} node layouts are too many for the exact DP; use method='milp'")
            gpu = _solve_dp(C, cluster)
            bound = ilp2_objective(C, gpu, cluster)
        else:
            if no_time_for_milp(chained=False):
                gpu, bound, hit = _greedy_assignment(C, cluster), 0.0, True
            else:
                gpu, res = _solve_milp(C, cluster, time_limit=left(), mip_gap=mip_gap, seed=seed)
                bound, hit = res.bound, res.time_limit_hit
    objective = ilp2_objective(C, gpu, cluster)
    gap = _rel_gap(objective, bound)
    if sizes is None or totals is None:
        return Ilp2Solution(gpu, objective, gap, kind, hit, bound)
    tot = gpu_totals(sizes, gpu)
    if tot.min() >= totals[0] and tot.max() <= totals[1]:
        return Ilp2Solution(gpu, objective, gap, kind, hit, bound, "held")
    if L == 1 or G == 1:
        raise PlanError(f"Eq. 13 cannot hold: one layer's clusters hold {sorted(tot.tolist())} experts but every GPU "
                        f"needs {totals[0]} to {totals[1]}; use memory='layer'")
    # (without traffic every assignment costs 0, so the first repair that meets Eq. 13 is optimal below)
    exact_bound = bound  # the optimum without Eq. 13, or a proven bound on it, bounds the one with it
    limit = left()
    repaired = _balance_totals(sizes, gpu, totals, C, cluster,
                               deadline=None if limit is None else time.perf_counter() + limit / 2)
    if repaired is None:  # start again from the most balanced greedy layout (no traffic weighed)
        repaired = _balance_totals(sizes, _lpt_totals(sizes), totals)
    if repaired is not None:
        obj = ilp2_objective(C, repaired, cluster)
        if _rel_gap(obj, exact_bound) <= mip_gap:  # proven within the gap by the bound: no MILP needed
            return Ilp2Solution(repaired, obj, _rel_gap(obj, exact_bound), f"{kind}+swaps", hit, exact_bound,
                                "enforced")
    if no_time_for_milp(chained=True):
        if repaired is None:
            raise PlanError("the time limit ran out before ILP 2 with Eq. 13 could be solved, and no quick GPU "
                            "assignment meets Eq. 13; raise time_limit or use memory='layer'")
        obj = ilp2_objective(C, repaired, cluster)
        return Ilp2Solution(repaired, obj, _rel_gap(obj, exact_bound), f"{kind}+swaps", True, exact_bound,
                            "enforced")
    gpu2, res = _solve_milp(C, cluster, time_limit=left(), mip_gap=mip_gap, seed=seed, sizes=sizes, totals=totals,
                            start=repaired, lower_bound=exact_bound)
    obj = ilp2_objective(C, gpu2, cluster)
    bound2 = max(res.bound, exact_bound)
    return Ilp2Solution(gpu2, obj, _rel_gap(obj, bound2), "milp", hit or res.time_limit_hit, bound2, "enforced")


def _lpt_totals(sizes: np.ndarray) -> np.ndarray:
    """``int64 [L, G]``: layer by layer, the largest cluster to the GPU with the fewest experts so far.

    When every cluster has ``floor(E / G)`` or ``ceil(E / G)`` experts (``memory="layer"``) the totals then
    stay within one expert of each other after every layer, so Eq. 13 holds: the fallback that always works.
    """
    L, G = sizes.shape
    gpu = np.empty((L, G), dtype=np.int64)
    tot = np.zeros(G, dtype=np.int64)
    for layer in range(L):
        by_size = np.argsort(-sizes[layer], kind="stable")
        by_total = np.lexsort((np.arange(G), tot))  # fewest experts first, ties by GPU id
        gpu[layer, by_size] = by_total
        tot[by_total] += sizes[layer, by_size]
    return gpu


def _rel_gap(objective: float, bound: float) -> float:
    """``(objective - bound) / objective`` in ``[0, 1]`` (0 when they meet)."""
    diff = objective - bound
    if diff <= 1e-9 * max(1.0, abs(objective)):
        return 0.0
    return min(diff / objective, 1.0) if objective > 0 else 0.0


# --------------------------------------------------------------------------------------------------
# The policy
# --------------------------------------------------------------------------------------------------

def _check_params(time_limit: Any, mip_gap: Any, seed: Any, memory: Any) -> tuple[float | None, float, int]:
    """Validated ``(time_limit, mip_gap, seed)``: ``inf`` or ``None`` is no limit; numpy scalars are accepted."""
    if isinstance(time_limit, np.generic):
        time_limit = time_limit.item()
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(time_limit, int | float)
                                   or math.isnan(time_limit) or time_limit <= 0):
        raise InputError(f"time_limit ({time_limit!r}) must be a positive number of seconds, or None for no limit")
    if time_limit is not None and math.isinf(time_limit):
        time_limit = None
    if isinstance(mip_gap, np.generic):
        mip_gap = mip_gap.item()
    if isinstance(mip_gap, bool) or not isinstance(mip_gap, int | float) or not 0.0 <= mip_gap < 1.0:
        raise InputError(f"mip_gap ({mip_gap!r}) must be a relative gap in [0, 1), e.g. 0.025 (the paper's)")
    if isinstance(seed, np.integer):
        seed = int(seed)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise InputError(f"seed ({seed!r}) must be an integer in [0, 2**31)")
    if memory not in ("layer", "total"):
        raise InputError(f"memory ({memory!r}) must be 'layer' (equal experts per GPU in every layer) or "
                         "'total' (the paper's Eq. 13: equal experts per GPU summed over layers)")
    return (None if time_limit is None else float(time_limit)), float(mip_gap), seed


def _json_float(x: float) -> float | None:
    return round(float(x), 9) if math.isfinite(x) else None


def moetuner(*, load: LoadMatrix, cluster: Cluster, budget: Budget, time_limit: float | None = DEFAULT_TIME_LIMIT,
             mip_gap: float = DEFAULT_MIP_GAP, seed: int = 0, memory: str = "layer") -> Placement:
    """MoETuner placement: ILP 1 per layer, then ILP 2 over all layers (see the module docstring).

    ``time_limit``: total seconds for all solves (None or inf: no limit); ``mip_gap``: relative gap each
    solve stops at; ``seed``: HiGHS's random seed; ``memory``: ``"layer"`` (equal experts per GPU in every
    layer, what EP engines run) or ``"total"`` (the paper's Eq. 13 only: clusters of any size, equal
    experts per GPU summed over layers). No replicas: a ``replicas_per_gpu`` budget is met with 0.
    """
    time_limit, mip_gap, seed = _check_params(time_limit, mip_gap, seed, memory)
    E, L, G = load.num_experts, load.num_layers, cluster.num_gpus
    capacity = resolve_budget(budget, E, G, L)  # refuses slots_per_gpu < ceil(E / G)
    if budget.replicas_per_gpu is not None:
        capacity.replicas("moetuner")  # "auto" is for policies that choose R; moetuner uses none
    # with one layer, Eq. 13 is the per-layer balance: "total" is "layer"
    lo, hi = cluster_sizes(E, G, memory if L > 1 else "layer", budget.slots_per_gpu)
    totals = memory_totals(E, L, G)
    # MoETuner's traffic model follows tokens from expert to expert; the trace's src_gpu is not used
    P, R = routing_statistics(load)
    ilp2_exact = R is None or _ilp2_method(cluster) == "dp"
    t0 = time.perf_counter()
    deadline = None if time_limit is None else t0 + time_limit
    # ILP 1's share of the budget: most of it when ILP 2 is solved by the DP (well under a second), else half
    ilp1_part = (0.9 if ilp2_exact else 0.5)

    def left(until: float | None, parts: int) -> float | None:
        return None if until is None else max(until - time.perf_counter(), 0.0) / parts

    def solve_ilp1(lo: int, hi: int) -> tuple[np.ndarray, list[MilpResult | None]]:
        """ILP 1, layer by layer: a first pass with an equal share per layer, then the layers that hit their
        share again, warm-started, sharing what the easy layers left."""
        cluster_of = np.empty((L, E), dtype=np.int64)
        results: list[MilpResult | None] = []
        # each round (memory="total" may need several) takes ILP 1's part of the time still left
        now = time.perf_counter()
        budget1 = None if deadline is None else max(deadline - now, 0.0) * ilp1_part
        ilp1_deadline = None if budget1 is None else now + budget1
        share = None if budget1 is None else budget1 / (2 * L)
        for layer in range(L):
            limit = None if share is None else min(share, left(ilp1_deadline, L - layer) or 0.0)
            cluster_of[layer], res = cluster_experts(P[:, layer], G, time_limit=limit, mip_gap=mip_gap, seed=seed,
                                                     sizes=(lo, hi))
            results.append(res)
        again = [layer for layer, res in enumerate(results) if res is not None and res.time_limit_hit]
        for i, layer in enumerate(again):
            first = results[layer]
            assert first is not None
            cluster_of[layer], res = cluster_experts(P[:, layer], G, time_limit=left(ilp1_deadline, len(again) - i),
                                                     mip_gap=mip_gap, seed=seed, start=cluster_of[layer],
                                                     sizes=(lo, hi))
            assert res is not None
            # a stopped solve proves at least the better of its two bounds
            results[layer] = dataclasses.replace(res, bound=max(res.bound, first.bound))
        return cluster_of, results

    params: dict[str, Any] = {**budget.as_params(), "time_limit": time_limit, "mip_gap": mip_gap, "seed": seed,
                              "memory": memory}
    layer_lo, layer_hi = cluster_sizes(E, G, "layer")
    tightened: list[str] = []
    ilp1_seconds = ilp2_seconds = 0.0  # summed over the narrowing rounds below
    while True:
        t_round = time.perf_counter()
        cluster_of, results = solve_ilp1(lo, hi)
        t1 = time.perf_counter()
        ilp1_seconds += t1 - t_round
        # ILP 2 over all layers, with Eq. 13 wherever cluster sizes differ
        sizes = np.stack([np.bincount(row, minlength=G) for row in cluster_of])  # [L, G]
        C = np.zeros((L - 1, G, G)) if R is None else cluster_traffic(R, cluster_of, G)
        limit = None if deadline is None else max(deadline - time.perf_counter(), 0.0)
        try:
            sol = assign_clusters(C, cluster, time_limit=limit, mip_gap=mip_gap, seed=seed, sizes=sizes, totals=totals)
            break
        except PlanError:
            ilp2_seconds += time.perf_counter() - t1
            # memory="total": ILP 1 ignores Eq. 13, so its cluster sizes may admit no balanced assignment (or
            # none found in time). Narrow the sizes towards E / G and solve again; the last step, floor to
            # ceil of E / G, always admits one (rotations), so the loop ends.
            if (lo, hi) == (layer_lo, layer_hi):
                raise
            tightened.append(f"{lo} to {hi}")
            lo, hi = min(layer_lo, (lo + layer_lo + 1) // 2), max(layer_hi, (hi + layer_hi) // 2)
    o1_layers = np.array([ilp1_objective(P[:, layer], cluster_of[layer], G) for layer in range(L)])
    # the solves work in G * tokens; a trivial layer (nothing to choose) is its own bound
    b1_layers = np.array([o1_layers[layer] if res is None else min(res.bound / G, o1_layers[layer])
                          for layer, res in enumerate(results)])
    o1, b1 = float(o1_layers.sum()), float(b1_layers.sum())
    gap1_mean = max((ilp1_gap(res, float(P[:, layer].sum())) for layer, res in enumerate(results)
                     if res is not None), default=0.0)
    hit1 = any(res is not None and res.time_limit_hit for res in results)
    params["cluster_sizes"] = [lo, hi]
    if tightened:
        params["eq13_note"] = (f"no GPU assignment meeting Eq. 13 was found with clusters of {', then '.join(tightened)} experts, "
                               f"so ILP 1 was solved again with clusters of {lo} to {hi}")
    gpu_of_cluster = sol.gpu_of_cluster
    if R is None:
        params["statistics"] = "load_only"
        params["warning"] = ("no token-level trace: ILP 2 (Eq. 8-15) needs cross-layer transitions, so only "
                             "Eq. 13 placed the clusters; give a trace with topk_ids for the full policy")
        method2, o2, gap2, b2 = "skipped", None, None, None
    else:
        params["statistics"] = "transitions"
        method2, o2, gap2, b2 = sol.method, _json_float(sol.objective), _json_float(sol.gap), _json_float(sol.bound)
    t2 = time.perf_counter()
    tot = gpu_totals(sizes, gpu_of_cluster)
    params.update({
        "solver": "highs",
        "ilp1_objective": _json_float(o1),
        "ilp1_bound": _json_float(b1),
        "ilp1_gap": _json_float(_rel_gap(o1, b1)),
        "ilp1_gap_vs_mean_load": _json_float(gap1_mean),
        "ilp1_seconds": round(ilp1_seconds, 3),
        "ilp1_time_limit_hit": bool(hit1),
        "ilp2_method": method2,
        "ilp2_objective": o2,
        "ilp2_bound": b2,
        "ilp2_gap": gap2,
        "ilp2_seconds": round(ilp2_seconds + t2 - t1, 3),
        "ilp2_time_limit_hit": bool(sol.time_limit_hit),
        "eq13": sol.eq13,
        "experts_per_gpu_total": [int(tot.min()), int(tot.max())],
        "time_limit_hit": bool(hit1 or sol.time_limit_hit),
    })
    if hit1 or sol.time_limit_hit:
        params["note"] = ("a time limit stopped a solve: the best solution found is used, and the gaps above "
                          "are what was proven")
    gpu_of_expert = np.take_along_axis(gpu_of_cluster, cluster_of, axis=1)
    return placement_from_assignment(gpu_of_expert, np.tile(np.arange(E), (L, 1)), cluster, E, "moetuner", params)
