"""CRAFT's algorithms, arrays in and out: replica ladder, benefit table, allocation DP, interleaved capacity, placement.

After "CRAFT: Cost-Aware Expert Replica Allocation with Fine-Grained Layerwise Estimations"; our readings of
the points the paper leaves open are in ``docs/papers/craft.md``. The policy adapter is
:mod:`moebalance.policies.craft`.

Legend: ``B`` batches, ``L`` layers, ``E`` experts, ``G`` GPUs (the paper's ``D``), ``K`` replica counts
tried per layer, ``R`` replicas per GPU (the replication factor), ``C = R * G`` extra replicas in all.

1. **Benefit estimation** (Alg. 1, :func:`benefit_table`): for ``r`` in ``{0} u {1, 2, 4, ..., G}`` replicas
   in every layer, plan each layer on the summed load and replay every profiled batch through it; the gain
   ``T[r][l]`` is layer ``l``'s mean balancedness minus its placement-only (``r = 0``) balancedness.
2. **Replication factor** (Step 2, :func:`auto_replicas_per_gpu`): a user-given ``R`` or, with ``auto``,
   the knee of the budget/gain curve.
3. **Allocation** (Alg. 2, :func:`allocate_replicas`): an exact multiple-choice-knapsack DP choosing one
   replica count per layer so that the counts sum to ``C`` and the total gain is largest.
4. **Interleaved assignment** (Alg. 3, :func:`interleaved_capacity`): per-layer, per-GPU expert capacities,
   within one of each other in a layer, with equal per-GPU totals over all layers, remainders spread across
   nodes.
5. **Capacity-aware greedy placement** (Section 4.2.2 step 5, :func:`place`): replicate by highest
   per-replica load, then put the heaviest remaining replica on the least-loaded GPU with room that does not
   already hold that expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from moebalance.algorithms.packing import greedy_pack, placement_from_assignment, repair_duplicates
from moebalance.algorithms.split import apply_shares
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement

__all__ = [
    "BenefitTable",
    "Objective",
    "allocate_replicas",
    "auto_replicas_per_gpu",
    "benefit_table",
    "interleaved_capacity",
    "place",
    "plan_from_table",
    "plan_with_allocation",
    "replica_ladder",
    "replicate",
    "total_gain",
    "uniform_allocation",
]

Objective = Literal["gain", "weighted"]


def replica_ladder(num_gpus: int) -> tuple[int, ...]:
    """``(1, 2, 4, ..., G)``: the ``K = log2 G + 1`` positive replica counts of Section 4.2.1 (``G`` appended
    when it is not a power of two)."""
    ladder = [1 << i for i in range(int(math.log2(num_gpus)) + 1)]
    if ladder[-1] != num_gpus:
        ladder.append(num_gpus)
    return tuple(ladder)


def replicate(weight: np.ndarray, extra: np.ndarray, max_replicas: int) -> np.ndarray:
    """``int64 [L, E]`` replica counts: ``extra[l]`` replicas each go to the expert with the largest load per
    replica (ties: lowest id; EPLB's rule), never above ``max_replicas`` per expert."""
    L, E = weight.shape
    counts = np.ones((L, E), dtype=np.int64)
    rows = np.arange(L)
    per_replica = weight.astype(np.float64).copy()
    # a layer whose experts are all at max_replicas takes no more: E * (max_replicas - 1) extras at most
    extra = np.minimum(np.asarray(extra, dtype=np.int64), E * (max_replicas - 1))
    for step in range(int(extra.max(initial=0))):
        score = np.where(counts < max_replicas, per_replica, -np.inf)
        best = np.argmax(score, axis=1)
        live = (extra > step) & np.isfinite(score[rows, best])
        if not live.any():
            break
        r, e = rows[live], best[live]
        counts[r, e] += 1
        per_replica[r, e] = weight[r, e] / counts[r, e]
    return counts


def _interleave_select(candidates: np.ndarray, k: int) -> np.ndarray:
    """``k`` of the ordered ``candidates``, evenly spread: positions ``floor(i * n / k)`` (Figure 10)."""
    n = candidates.size
    return candidates[(np.arange(k) * n) // k]


def interleaved_capacity(num_experts: int, num_gpus: int, extra: np.ndarray) -> np.ndarray:
    """Alg. 3: ``int64 [L, G]`` experts per GPU per layer for ``E + extra[l]`` slots in layer ``l``.

    Every GPU first gets ``floor((E + extra[l]) / G)``; the remainder goes to the GPUs with the fewest experts
    so far over all layers (``MinCutoff``), ties spread evenly (``InterleaveSelect``). Capacities within a layer
    differ by at most one, and per-GPU totals over layers differ by at most one (equal when
    ``sum_l (E + extra[l])`` is a multiple of ``G``).
    """
    slots = num_experts + np.asarray(extra, dtype=np.int64)
    A = np.repeat((slots // num_gpus)[:, None], num_gpus, axis=1)
    totals = A.sum(axis=0)
    for layer, rem in enumerate(slots % num_gpus):
        if rem == 0:
            continue
        cutoff = np.sort(totals)[rem - 1]  # MinCutoff: the rem-th smallest total
        below = np.flatnonzero(totals < cutoff)
        tied = np.flatnonzero(totals == cutoff)
        chosen = np.concatenate([below, _interleave_select(tied, int(rem) - below.size)])
        A[layer, chosen] += 1
        totals[chosen] += 1
    return A


def place(weight: np.ndarray, counts: np.ndarray, capacity: np.ndarray,
          gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Step 5: capacity-aware greedy placement of the replicas ``counts [L, E]`` of ``weight [L, E]``.

    Returns ``(gpu_of_slot, expert_of_slot)``, both ``int64 [L, P]`` with ``P = max_l counts[l].sum()``;
    shorter layers are padded with -1.
    """
    L, E = weight.shape
    P = int(counts.sum(axis=1).max())
    expert_of_slot = np.full((L, P), -1, dtype=np.int64)
    slot_weight = np.full((L, P), -np.inf)
    for layer in range(L):
        ids = np.repeat(np.arange(E), counts[layer])
        expert_of_slot[layer, : ids.size] = ids
        slot_weight[layer, : ids.size] = weight[layer, ids] / counts[layer, ids]
    gpu = greedy_pack(slot_weight, capacity, np.maximum(expert_of_slot, 0))
    # Greedy can corner itself (a replicated expert meeting only GPUs that already hold it); swaps fix it.
    expert_of_slot, _ = repair_duplicates(gpu, expert_of_slot, weight, gpus_per_node)
    return gpu, expert_of_slot


def _shares(gpu_of_slot: np.ndarray, expert_of_slot: np.ndarray, num_experts: int, num_gpus: int) -> np.ndarray:
    """``float64 [L, E, G]``: equal-split share of expert ``e``'s tokens served by GPU ``g``."""
    L = gpu_of_slot.shape[0]
    copies = np.zeros((L, num_experts, num_gpus))
    live = gpu_of_slot >= 0
    layer = np.broadcast_to(np.arange(L)[:, None], gpu_of_slot.shape)
    np.add.at(copies, (layer[live], expert_of_slot[live], gpu_of_slot[live]), 1.0)
    return copies / copies.sum(axis=2, keepdims=True)


def _mean_balancedness(counts: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """``float64 [L]``: balancedness (mean / max GPU load) per layer, averaged over batches with load."""

    loads = apply_shares(counts, shares)
    peak = loads.max(axis=2)
    active = peak > 0
    bal = np.where(active, loads.mean(axis=2) / np.where(active, peak, 1.0), 0.0)
    n = active.sum(axis=0)
    return np.where(n > 0, bal.sum(axis=0) / np.maximum(n, 1), 1.0)


@dataclass(frozen=True, slots=True)
class BenefitTable:
    """Alg. 1's output: per-layer balancedness gain of each replica count over placement only.

    Example: ``replica_counts = [1, 2, 4]``, ``gain[1, 7] = 0.12`` means two extra replicas in layer 7
    raise its mean balancedness by 0.12 over the placement-only plan (``base[7]``).
    """

    #: ``int64 [K]``: the positive replica counts ``r`` tried (the paper's ``R = keys(T)``).
    replica_counts: np.ndarray
    #: ``float64 [K, L]``: ``T[r][l]``, mean balancedness with ``r`` replicas minus ``base[l]``.
    gain: np.ndarray
    #: ``float64 [L]``: mean balancedness of the placement-only plan (``r = 0``).
    base: np.ndarray


def benefit_table(counts: np.ndarray, cluster: Cluster, replica_counts: tuple[int, ...] | None = None,
                  on_step: object = None) -> BenefitTable:
    """Alg. 1 on ``counts [B, L, E]``: replay every batch through the plan for each replica count.

    ``on_step()`` (if callable) is called after each replica count, for a progress bar.
    """
    _, L, E = counts.shape
    G = cluster.num_gpus
    ladder = replica_ladder(G) if replica_counts is None else tuple(replica_counts)
    summed = counts.sum(axis=0).astype(np.float64)
    bal = []
    for r in (0, *ladder):
        extra = np.full(L, r, dtype=np.int64)
        reps = replicate(summed, extra, G)
        gpu, expert = place(summed, reps, interleaved_capacity(E, G, extra), cluster.gpus_per_node)
        bal.append(_mean_balancedness(counts, _shares(gpu, expert, E, G)))
        if callable(on_step):
            on_step()
    base = bal[0]
    return BenefitTable(np.asarray(ladder, dtype=np.int64), np.stack(bal[1:]) - base, base)


def allocate_replicas(table: BenefitTable, total: int, objective: Objective = "gain") -> np.ndarray:
    """Alg. 2: ``int64 [L]`` replica counts, each 0 or one of ``table.replica_counts``, summing to ``total``,
    that maximise ``sum_l T[x_l][l]`` (``objective="gain"``) or the printed ``sum_l x_l * T[x_l][l]``
    (``"weighted"``). Exact dynamic programme over (layer, replicas used), O(L * C * K).

    Ties keep the earlier option (no replication, then smaller counts), as Alg. 2's strict ``>``.
    If ``total`` exceeds what the ladder can absorb (``L * max(r)``), every layer takes the largest count.
    Alg. 2 backtracks from exactly ``C``; a ladder without 1 (``replica_counts=[4, 8]``) may not reach
    ``C`` exactly, and then we take the best reachable ``c < C`` (ties: the larger ``c``): a budget is a
    maximum, so spending less of it is allowed, and the plan records what it used.
    """
    K, L = table.gain.shape
    ladder = table.replica_counts
    C = int(min(total, L * int(ladder.max())))
    value = table.gain * (ladder[:, None] if objective == "weighted" else 1.0)
    dp = np.full(C + 1, -np.inf)
    dp[0] = 0.0
    choice = np.zeros((L, C + 1), dtype=np.int64)  # 0: no replication for this layer
    for layer in range(L):
        new = dp.copy()
        pick = np.zeros(C + 1, dtype=np.int64)
        for k in range(K):
            r = int(ladder[k])
            if r > C:
                continue
            cand = np.full(C + 1, -np.inf)
            cand[r:] = dp[: C + 1 - r] + value[k, layer]
            better = cand > new
            new = np.where(better, cand, new)
            pick = np.where(better, r, pick)
        dp, choice[layer] = new, pick
    c = C
    if not np.isfinite(dp[C]):  # dp[0] = 0 is always reachable
        reachable = np.flatnonzero(np.isfinite(dp))
        c = int(reachable[np.flatnonzero(dp[reachable] == dp[reachable].max())[-1]])
    x = np.zeros(L, dtype=np.int64)
    for layer in range(L - 1, -1, -1):
        x[layer] = choice[layer, c]
        c -= x[layer]
    assert c == 0
    return x


def auto_replicas_per_gpu(table: BenefitTable, num_gpus: int, candidates: tuple[int, ...] | None = None,
                          objective: Objective = "gain") -> tuple[int, np.ndarray]:
    """Step 2: choose ``R`` automatically; returns ``(R, mean gain per candidate)``.

    The knee of the curve of mean gain against ``log2 R`` over ``R = 1, 2, 4, ..., L``: the candidate
    farthest above the chord from the first to the last point (the Kneedle rule), i.e. where doubling ``R``
    stops paying as much as it did (why not the literal "highest per-replica gain": ``docs/papers/craft.md``).
    """
    L = table.gain.shape[1]
    cands = candidates or tuple(1 << i for i in range(int(math.log2(max(L, 1))) + 1))
    gains = np.array([total_gain(table, allocate_replicas(table, R * num_gpus, objective)) / L for R in cands])
    if len(cands) < 3:
        return int(cands[int(np.argmax(gains))]), gains
    xs = np.log2(np.asarray(cands, dtype=np.float64))
    xs = (xs - xs[0]) / (xs[-1] - xs[0])
    span = gains[-1] - gains[0]
    ys = (gains - gains[0]) / span if span > 0 else np.zeros_like(gains)
    return int(cands[int(np.argmax(ys - xs))]), gains


def total_gain(table: BenefitTable, x: np.ndarray) -> float:
    """``sum_l T[x_l][l]`` (0 for layers without replicas)."""
    L = x.size
    k = np.searchsorted(table.replica_counts, x)
    g = table.gain[np.minimum(k, table.gain.shape[0] - 1), np.arange(L)]
    return float(np.where(x > 0, g, 0.0).sum())


def uniform_allocation(num_layers: int, total: int) -> np.ndarray:
    """``int64 [L]``: ``total`` replicas spread as evenly as possible, the first layers taking the remainder
    (the per-layer uniform replication of CRAFT's Figure 8, at any total)."""
    x = np.full(num_layers, total // num_layers, dtype=np.int64)
    x[: total % num_layers] += 1
    return x


def plan_from_table(load: LoadMatrix, cluster: Cluster, table: BenefitTable, replicas_per_gpu: int,
                    objective: Objective = "gain", params: dict[str, object] | None = None) -> Placement:
    """Steps 3-5 for ``R = replicas_per_gpu`` from an existing benefit table (a budget sweep reuses one)."""
    L = load.num_layers
    x = allocate_replicas(table, replicas_per_gpu * cluster.num_gpus, objective)
    extra = dict(params or {"objective": objective, "replica_counts": table.replica_counts.tolist(),
                            "allocation": "benefit", "replicas_per_gpu": replicas_per_gpu})
    extra.update(predicted_gain=round(total_gain(table, x) / L, 6),
                 placement_only_balancedness=round(float(table.base.mean()), 6))
    return plan_with_allocation(load, cluster, x, extra)


def plan_with_allocation(load: LoadMatrix, cluster: Cluster, layer_replicas: np.ndarray,
                         params: dict[str, object]) -> Placement:
    """Steps 4-5: replicate ``layer_replicas[l]`` times in layer ``l``, assign capacities, place."""
    E, G = load.num_experts, cluster.num_gpus
    summed = load.total().astype(np.float64)
    reps = replicate(summed, layer_replicas, G)
    gpu, expert = place(summed, reps, interleaved_capacity(E, G, reps.sum(axis=1) - E), cluster.gpus_per_node)
    return placement_from_assignment(gpu, expert, cluster, E, "craft",
                                     {**params, "layer_replicas": (reps.sum(axis=1) - E).tolist()})
