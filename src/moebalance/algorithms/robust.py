"""Plans that hold across workloads: EPLB's and CRAFT's steps for the worst of several loads, arrays in and out.

A deployment serves several workloads, and a plan made on one of them (or on their sum, where the largest
dominates) can fall near contiguous blocks on another. ``objective="worst"`` plans so that the *worst* workload
is as balanced as possible. The policies ``eplb`` and ``craft`` call these functions (``docs/design.md``,
"Policies"); their default ``objective="sum"`` is the published algorithm on the summed load, unchanged.

Legend: ``K`` workloads, ``B`` batches (each workload a contiguous run of them), ``L`` layers, ``E`` experts,
``G`` GPUs, ``N`` nodes, ``P`` physical slots per layer, ``X`` rows processed at once (layers, or layer-node
pairs), ``M`` bins (GPUs or nodes) per row.

Normalisation: each workload's load in each layer is divided by its total there (:func:`normalise`), so that a
GPU's normalised load times ``G`` is its load relative to the mean, the imbalance ratio's terms; a workload with
ten times the tokens does not outweigh the others. The objective of a plan is
``max_k max_g G * load_k[g]``, the worst workload's imbalance ratio on its planned (summed) load; its inverse is
that workload's balancedness.

EPLB for the worst workload (:func:`eplb_worst`), the structure of DeepSeek's EPLB (DeepSeek-V3 technical
report, arXiv 2412.19437, Section 3.4) with a vector of loads per item:

1. hierarchical when ``N`` divides the groups: groups are packed onto nodes, ``E / N`` experts per node;
2. replication (:func:`replicate_worst`): each further slot goes to the expert with the largest
   ``max_k w[k, e] / r_e``, never above one copy per GPU while another expert can take it. This is optimal for
   the bound it minimises, ``max_e max_k w[k, e] / r_e`` (every GPU holding a copy of ``e`` carries at least that
   share for the workload ``k`` where it peaks): the expert at the maximum keeps it until it gets a slot, so any
   allocation with a lower maximum gives every expert at least the replicas the greedy gave when it first
   reached that level (the water-filling argument);
3. packing (:func:`pack_worst`): slots heaviest first (by their largest normalised load), each onto the GPU with
   room that minimises the resulting ``max_k`` of its load (ties: the smaller sum over workloads, then the lowest
   GPU), never a second copy of an expert on a GPU while another GPU with room has none. This is a heuristic:
   on small cases it is often, not always, optimal (``tests/test_robust.py`` enumerates them).

CRAFT for the worst workload (after "CRAFT: Cost-Aware Expert Replica Allocation with Fine-Grained Layerwise
Estimations"): the benefit table (Alg. 1) is measured per workload on that workload's batches
(:func:`worst_benefit_tables`), the plans behind it made with the steps above (replication capped at ``G``,
the interleaved capacities of Alg. 3). The allocation (Alg. 2) maximises the worst workload's mean balancedness
``min_k s_k(x)``, which does not add up over layers; :func:`allocate_worst` runs Alg. 2's exact DP on the
weighted sum ``sum_k lambda_k s_k`` and moves the weights towards the workloads that come out worst
(multiplicative weights), keeping the best allocation seen. Each DP's value is an upper bound on the optimum
(``min_k s_k <= sum_k lambda_k s_k`` for every allocation), so the plan records how far from optimal it can be.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moebalance.algorithms.craft import BenefitTable, allocate_replicas, interleaved_capacity, total_gain
from moebalance.algorithms.packing import repair_duplicates
from moebalance.algorithms.split import apply_shares
from moebalance.core.errors import BudgetError, InputError

__all__ = [
    "OBJECTIVES",
    "WorstAllocation",
    "WorstTable",
    "allocate_worst",
    "check_workloads",
    "eplb_worst",
    "normalise",
    "pack_worst",
    "place_worst",
    "plan_layers_worst",
    "replicate_worst",
    "workload_balancedness",
    "workload_loads",
    "workload_starts",
    "worst_benefit_tables",
]


#: What a policy's plan may be made for: the load summed over its batches, or the worst of its workloads.
OBJECTIVES = ("sum", "worst")


def check_workloads(objective: object, workload_batches: object) -> list[int] | None:
    """A policy's ``objective`` (``"sum"`` or ``"worst"``) and ``workload_batches`` (each workload's batch count in
    the load, in order; None: one workload) checked together: the batch counts as a list, or None."""
    if objective not in OBJECTIVES:
        raise InputError(f"objective ({objective!r}) must be 'sum' (plan on the summed load) or 'worst' (plan for "
                         "the worst of several workloads)")
    counts = None
    if workload_batches is not None:
        values = list(workload_batches) if isinstance(workload_batches, list | tuple) else []
        if not values or not all(isinstance(n, int | np.integer) and not isinstance(n, bool) and n >= 1
                                 for n in values):
            raise InputError(f"workload_batches ({workload_batches!r}) must be a non-empty list of batch counts >= 1, "
                             "one per workload in the order of the load's batches")
        counts = [int(n) for n in values]
    if objective == "worst" and (counts is None or len(counts) < 2):
        raise _one_workload()
    return counts


def _one_workload() -> InputError:
    return InputError("objective 'worst' plans for the worst of several workloads but got one; give moebalance plan "
                      "or advise two or more --load files (workload_batches in the API)")


def workload_starts(workload_batches: Sequence[int] | None, num_batches: int) -> np.ndarray:
    """``int64 [K + 1]``: where each workload's batches start in the load, and its end (``[0, 3, 5]``: workload 0
    is batches 0-2, workload 1 batches 3-4). ``workload_batches`` lists each workload's batch count, in order,
    two or more, summing to ``num_batches``."""
    if workload_batches is None or len(workload_batches) < 2:
        raise _one_workload()
    counts = np.asarray(list(workload_batches), dtype=np.int64)
    if int(counts.sum()) != num_batches:
        raise InputError(f"workload_batches {counts.tolist()} sum to {int(counts.sum())} batches but the load has "
                         f"{num_batches}; give each workload's batch count, in order")
    return np.concatenate([[0], np.cumsum(counts)])


def workload_loads(counts: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``counts [B, L, E]`` summed over each workload's batches: ``int64 [K, L, E]``."""
    return np.add.reduceat(counts, starts[:-1], axis=0)


def normalise(weight: np.ndarray) -> np.ndarray:
    """``weight [K, L, E]`` with each workload's row in each layer divided by its total: ``float64 [K, L, E]``, rows
    summing to 1 (rows without load stay 0, so that workload does not constrain that layer)."""
    w = np.asarray(weight, dtype=np.float64)
    total = w.sum(axis=-1, keepdims=True)
    return np.divide(w, total, out=np.zeros_like(w), where=total > 0)


def replicate_worst(weight: np.ndarray, extra: int | np.ndarray, max_replicas: int) -> np.ndarray:
    """``int64 [X, E]`` replica counts for normalised ``weight [K, X, E]``: one copy each, then ``extra`` (an int
    or ``[X]``) further copies per row, each to the expert with the largest ``max_k weight / r`` (lowest id on
    ties), among experts below ``max_replicas`` while any is (module docstring: optimal for its bound)."""
    peak = np.asarray(weight, dtype=np.float64).max(axis=0)  # [X, E]
    X, E = peak.shape
    extra_rows = np.broadcast_to(np.asarray(extra, dtype=np.int64), (X,))
    counts = np.ones((X, E), dtype=np.int64)
    per_copy = peak.copy()
    rows = np.arange(X)
    for step in range(int(extra_rows.max(initial=0))):
        capped = np.where(counts < max_replicas, per_copy, -np.inf)
        score = np.where(np.isfinite(capped).any(axis=1, keepdims=True), capped, per_copy)
        best = np.argmax(score, axis=1)
        live = extra_rows > step
        r, e = rows[live], best[live]
        counts[r, e] += 1
        per_copy[r, e] = peak[r, e] / counts[r, e]
    return counts


def pack_worst(weight: np.ndarray, capacity: np.ndarray, item_expert: np.ndarray | None = None,
               valid: np.ndarray | None = None) -> np.ndarray:
    """Pack items with a load per workload into bins, minimising the largest load of any workload on any bin.

    ``weight [K, X, N]``: each item's normalised load per workload; ``capacity int [X, M]``: the items each bin
    takes (at least the valid items of the row in all); ``item_expert int [X, N]`` (optional): the expert of each
    item, so that a bin takes a second copy of an expert only when every bin with room has one; ``valid bool
    [X, N]`` (optional): padding items are False and get bin -1. Items go heaviest first (by ``max_k``; ties:
    lowest item), each to the bin with room minimising ``max_k`` of the bin's load after it (ties: the smaller
    sum over workloads, then the lowest bin). Returns ``int64 [X, N]``, the bin of each item.
    """
    K, X, N = weight.shape
    M = capacity.shape[1]
    valid = np.ones((X, N), dtype=bool) if valid is None else valid
    if np.any(capacity.sum(axis=1) < valid.sum(axis=1)):
        raise BudgetError("the bins' capacities hold fewer items than there are to pack")
    key = np.where(valid, weight.max(axis=0), -np.inf)
    order = np.argsort(-key, axis=1, kind="stable")
    load = np.zeros((K, X, M))
    used = np.zeros((X, M), dtype=np.int64)
    out = np.full((X, N), -1, dtype=np.int64)
    rows = np.arange(X)
    hosts = None if item_expert is None else np.zeros((X, M, int(item_expert.max(initial=0)) + 1), dtype=bool)
    for j in range(N):
        item = order[:, j]
        live = valid[rows, item]
        if not live.any():
            break  # padding sorts last
        room = used < capacity
        if hosts is not None and item_expert is not None:
            fresh = room & ~hosts[rows, :, item_expert[rows, item]]
            room = np.where(fresh.any(axis=1, keepdims=True), fresh, room)
        after = load + weight[:, rows, item][:, :, None]  # [K, X, M]
        peak = np.where(room, after.max(axis=0), np.inf)
        tied = peak == peak.min(axis=1, keepdims=True)
        g = np.argmin(np.where(tied, after.sum(axis=0), np.inf), axis=1)
        r, g, item = rows[live], g[live], item[live]
        out[r, item] = g
        load[:, r, g] = after[:, r, g]
        used[r, g] += 1
        if hosts is not None and item_expert is not None:
            hosts[r, g, item_expert[r, item]] = True
    return out


def _slot_experts(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``counts int [X, E]`` -> ``(expert_of_slot [X, S], valid [X, S])``, ``S`` the largest row total; each row
    lists expert ``e`` ``counts[x, e]`` times in id order, then padding (expert 0, not valid)."""
    totals = counts.sum(axis=1)
    S = int(totals.max(initial=0))
    ends = np.cumsum(counts, axis=1)  # [X, E]
    slot = np.arange(S)
    expert = (slot[None, :, None] >= ends[:, None, :]).sum(axis=2)  # experts whose copies end at or before slot
    valid = slot[None, :] < totals[:, None]
    return np.where(valid, expert, 0), valid


def eplb_worst(weight: np.ndarray, *, num_replicas: int, num_groups: int, num_nodes: int,
               num_gpus: int) -> np.ndarray:
    """EPLB's steps for the worst of ``K`` workloads (module docstring): ``phy2log int64 [L, P]``, slot ``p`` on GPU
    ``p // (P / G)``, as :func:`moebalance.algorithms.eplb.rebalance_experts` returns.

    ``weight [K, L, E]``: each workload's load summed over its batches (normalised here). Hierarchical when
    ``num_nodes`` divides ``num_groups`` (groups of ``E / num_groups`` consecutive experts packed onto nodes,
    then each node's experts replicated and packed onto its GPUs), else global (one group, one node). Copies of
    an expert stay on distinct GPUs whenever the slots allow it.
    """
    K, L, E = weight.shape
    P, G = num_replicas, num_gpus
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    N = num_nodes
    if E % num_groups or G % N or P % G or P < E:
        raise BudgetError(f"EPLB needs the experts ({E}) divisible by the groups ({num_groups}), the GPUs ({G}) by "
                          f"the nodes ({N}) and the slots ({P}) a multiple of the GPUs, at least the experts")
    w = normalise(weight)
    size, per_node = E // num_groups, num_groups // N
    # Step 1: groups to nodes; node_experts [L, N, E / N] lists each node's experts, group by group.
    group_load = w.reshape(K, L, num_groups, size).sum(axis=3)
    node_of_group = (pack_worst(group_load, np.full((L, N), per_node)) if N > 1
                     else np.zeros((L, num_groups), dtype=np.int64))
    groups_by_node = np.argsort(node_of_group * num_groups + np.arange(num_groups), axis=1, kind="stable")
    node_experts = (groups_by_node[:, :, None] * size + np.arange(size)).reshape(L * N, E // N)
    # Step 2: replicate within each node (rows are (layer, node) pairs), at most one copy per GPU of the node.
    layer_of_row = np.repeat(np.arange(L), N)
    wn = w[:, layer_of_row[:, None], node_experts]  # [K, L * N, E / N]
    counts = replicate_worst(wn, P // N - E // N, G // N)
    # Step 3: slots onto the node's GPUs, each carrying an equal share of its expert's load.
    local, _ = _slot_experts(counts)  # [L * N, P / N]: every row is full
    rows = np.arange(L * N)[:, None]
    share = wn[:, rows, local] / counts[rows, local]
    gpu = pack_worst(share, np.full((L * N, G // N), P // G), local)
    order = np.argsort(gpu * (P // N) + np.arange(P // N), axis=1, kind="stable")  # slots GPU by GPU
    phy2log = np.take_along_axis(node_experts, np.take_along_axis(local, order, axis=1), axis=1)
    return phy2log.reshape(L, P)


def place_worst(weight: np.ndarray, counts: np.ndarray, capacity: np.ndarray,
                gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """CRAFT's Step 5 for the worst workload: the copies ``counts [L, E]`` of normalised ``weight [K, L, E]`` onto
    GPUs with ``capacity [L, G]`` slots, by :func:`pack_worst`, then surplus same-GPU copies swapped away
    (:func:`moebalance.algorithms.packing.repair_duplicates`, on each expert's largest normalised load).

    Returns ``(gpu_of_slot, expert_of_slot)``, both ``int64 [L, P]`` with ``P = max_l counts[l].sum()``; shorter
    layers are padded with -1.
    """
    expert, valid = _slot_experts(counts)
    rows = np.arange(counts.shape[0])[:, None]
    share = weight[:, rows, expert] / counts[rows, expert]
    gpu = pack_worst(share, capacity, expert, valid)
    expert = np.where(valid, expert, -1)
    expert, _ = repair_duplicates(gpu, expert, weight.max(axis=0), gpus_per_node)
    return gpu, expert


def workload_balancedness(counts: np.ndarray, starts: np.ndarray, gpu_of_slot: np.ndarray,
                          expert_of_slot: np.ndarray, num_gpus: int) -> np.ndarray:
    """``float64 [K, L]``: each workload's balancedness (mean / max GPU load, the uniform router) per layer, the
    mean over its batches with load (1 where it has none), for the plan ``gpu_of_slot [L, P]`` /
    ``expert_of_slot [L, P]`` (-1 padding) replayed on ``counts [B, L, E]`` (workloads at ``starts [K + 1]``)."""
    L, E = counts.shape[1], counts.shape[2]
    live = gpu_of_slot >= 0
    copies = np.zeros((L, E, num_gpus))
    np.add.at(copies, (np.nonzero(live)[0], expert_of_slot[live], gpu_of_slot[live]), 1.0)
    loads = apply_shares(counts, copies / copies.sum(axis=2, keepdims=True))  # [B, L, G]
    peak = loads.max(axis=2)
    active = peak > 0
    bal = np.divide(loads.mean(axis=2), peak, out=np.zeros_like(peak), where=active)
    total = np.add.reduceat(bal, starts[:-1], axis=0)
    n = np.add.reduceat(active.astype(np.int64), starts[:-1], axis=0)
    return np.divide(total, n, out=np.ones_like(total), where=n > 0)


@dataclass(frozen=True, slots=True)
class WorstTable:
    """Alg. 1 per workload: ``gain[k, i, l]`` is workload ``k``'s mean balancedness in layer ``l`` with
    ``replica_counts[i]`` extra replicas there, minus ``base[k, l]``, its balancedness with none."""

    #: ``int64 [R]``: the positive replica counts tried per layer.
    replica_counts: np.ndarray
    #: ``float64 [K, R, L]``.
    gain: np.ndarray
    #: ``float64 [K, L]``.
    base: np.ndarray

    def scores(self, x: np.ndarray) -> np.ndarray:
        """``float64 [K]``: each workload's mean balancedness over layers under the allocation ``x [L]``."""
        return np.array([self.base[k].mean() + total_gain(BenefitTable(self.replica_counts, self.gain[k],
                                                                       self.base[k]), x) / x.size
                         for k in range(self.gain.shape[0])])

    def weighted(self, lam: np.ndarray) -> BenefitTable:
        """The table of ``sum_k lam[k] * gain[k]``, for Alg. 2."""
        return BenefitTable(self.replica_counts, np.tensordot(lam, self.gain, axes=1), lam @ self.base)


def plan_layers_worst(weight: np.ndarray, extra: np.ndarray, gpus_per_node: int,
                      num_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps 4-5 for ``extra [L]`` replicas per layer on normalised ``weight [K, L, E]``: ``(replicas [L, E],
    gpu_of_slot [L, P], expert_of_slot [L, P])``."""
    E = weight.shape[2]
    reps = replicate_worst(weight, extra, num_gpus)
    cap = interleaved_capacity(E, num_gpus, reps.sum(axis=1) - E)
    gpu, expert = place_worst(weight, reps, cap, gpus_per_node)
    return reps, gpu, expert


def worst_benefit_tables(counts: np.ndarray, starts: np.ndarray, ladder: Sequence[int], gpus_per_node: int,
                         num_gpus: int) -> WorstTable:
    """Alg. 1 per workload on ``counts [B, L, E]`` (workloads at ``starts [K + 1]``): plan every layer with ``r`` in
    ``(0, *ladder)`` extra replicas for the worst workload, replay each workload's batches."""
    w = normalise(workload_loads(counts, starts))
    L = counts.shape[1]
    bal = []
    for r in (0, *ladder):
        _, gpu, expert = plan_layers_worst(w, np.full(L, r, dtype=np.int64), gpus_per_node, num_gpus)
        bal.append(workload_balancedness(counts, starts, gpu, expert, num_gpus))
    stacked = np.stack(bal, axis=1)  # [K, R + 1, L]
    return WorstTable(np.asarray(ladder, dtype=np.int64), stacked[:, 1:] - stacked[:, :1], stacked[:, 0])


@dataclass(frozen=True, slots=True)
class WorstAllocation:
    """:func:`allocate_worst`'s answer."""

    #: ``int64 [L]``: extra replicas per layer (0 or one of the ladder's counts).
    layer_replicas: np.ndarray
    #: ``float64 [K]``: each workload's predicted mean balancedness (the tables' estimate).
    predicted: np.ndarray
    #: An upper bound on the best achievable ``min_k`` predicted score over allocations of the same total.
    bound: float


def allocate_worst(table: WorstTable, total: int, rounds: int = 48) -> WorstAllocation:
    """Alg. 2 for the worst workload: ``total`` extra replicas over layers maximising ``min_k`` of the workloads'
    predicted mean balancedness (module docstring). Each round solves Alg. 2's exact DP on the weighted table
    ``sum_k lam_k gain_k``, then multiplies each ``lam_k`` by ``exp(-eta * s_k)`` (the workloads that came out worst
    weigh more). The best allocation seen is kept (ties: the first); ``bound`` is the least DP value seen, valid
    when every total up to ``total`` is reachable (a ladder holding 1, the default)."""
    K, _, L = table.gain.shape
    lam = np.full(K, 1.0 / K)
    best_x, best_s, bound = None, None, np.inf
    spread = float(np.ptp(table.base.mean(axis=1))) + float(np.abs(table.gain).max(initial=0.0)) + 1e-12
    for step in range(rounds):
        weighted = table.weighted(lam)
        x = allocate_replicas(weighted, total, "gain")
        s = table.scores(x)
        bound = min(bound, float(weighted.base.mean() + total_gain(weighted, x) / L))
        if best_s is None or s.min() > best_s.min():
            best_x, best_s = x, s
        if best_s.min() >= bound - 1e-12:
            break
        lam = lam * np.exp(-(4.0 / np.sqrt(step + 1)) * (s - s.min()) / spread)
        lam /= lam.sum()
    assert best_x is not None and best_s is not None
    return WorstAllocation(best_x, best_s, max(bound, float(best_s.min())))
