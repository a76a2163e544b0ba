"""Eq. 13 of MoETuner (equal experts per GPU summed over layers): repairs of a GPU assignment that breaks it.

Heuristics that swap clusters of one layer between GPUs (:func:`balance_totals`), exchange two GPUs'
clusters in a subset of layers (:func:`pair_subset_swap`) or lay clusters out largest-first
(:func:`lpt_totals`). None of them raises: each returns an assignment, or ``None`` when it gets stuck, and
:class:`Eq13Infeasible` is the explicit "no assignment meets Eq. 13" answer the ILP 2 solver returns.
See ``docs/papers/moetuner.md``; paper: arXiv 2502.06643.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.algorithms.moetuner.deadline import Deadline
from moebalance.algorithms.moetuner.statistics import gpu_totals, inverse_bandwidth, sizes_on_gpus, swap_gpus
from moebalance.core.cluster import Cluster
from moebalance.core.limits import check_alloc

__all__ = ["Eq13Infeasible", "balance_totals", "lpt_totals", "meets_totals", "narrow_sizes", "pair_subset_swap"]


@dataclass(frozen=True, slots=True)
class Eq13Infeasible:
    """No GPU assignment meeting Eq. 13 was found (proven, or not in time); ``reason`` is a one-line message."""

    reason: str


def meets_totals(sizes: np.ndarray, gpu_of_cluster: np.ndarray, totals: tuple[int, int]) -> bool:
    """Whether every GPU holds ``totals[0]`` to ``totals[1]`` experts over all layers (Eq. 13)."""
    tot = gpu_totals(sizes, gpu_of_cluster)
    return bool(tot.min() >= totals[0] and tot.max() <= totals[1])


def narrow_sizes(sizes: tuple[int, int], layer_sizes: tuple[int, int]) -> tuple[int, int]:
    """Cluster sizes ``(lo, hi)`` moved halfway (both ends) towards ``layer_sizes``, ``floor`` to ``ceil`` of
    ``E / G``: the next ILP 1 round when no assignment met Eq. 13. Reaches ``layer_sizes`` in finitely many steps."""
    (lo, hi), (layer_lo, layer_hi) = sizes, layer_sizes
    return min(layer_lo, (lo + layer_lo + 1) // 2), max(layer_hi, (hi + layer_hi) // 2)


def balance_totals(sizes: np.ndarray, gpu_of_cluster: np.ndarray, totals: tuple[int, int],
                    traffic: np.ndarray | None = None, cluster: Cluster | None = None,
                    max_swaps: int = 100_000, max_kicks: int = 200,
                    deadline: Deadline | None = None) -> np.ndarray | None:
    """A GPU assignment meeting Eq. 13 (``totals[0] <= gpu_totals <= totals[1]``) found by swapping two
    clusters of one layer between two GPUs, from ``gpu_of_cluster int [L, G]``; ``None`` if it gets stuck.

    Every swap lowers ``sum_g (total_g - mean)^2``: swapping sizes ``s_a`` on GPU ``a`` and ``s_b`` on ``b``
    (``d = s_a - s_b``) changes it by ``2 d (d - (total_a - total_b))``, so each descent ends. Among such swaps
    it takes the one that raises Eq. 8 least when ``traffic [L-1, G, G]`` and ``cluster`` are given (until
    ``deadline``: that costs ``O(L G^4)`` per swap), else the one that
    lowers the spread most. Where no single swap lowers it, two GPUs exchange their clusters in a subset of
    layers (:func:`pair_subset_swap`); where that fails too, a seeded random swap (at most ``max_kicks``)
    restarts the descent. A heuristic: it repairs ILP 2's optimum without Eq. 13 (whose value bounds the
    optimum with it, so the repair's gap is known) and warm-starts the Eq. 13 MILP.
    """
    L, G = sizes.shape
    gpu = gpu_of_cluster.copy()
    check_alloc((G, G, G), 8, "Eq. 13's swap table [G, G, G]", "MoETuner's integer programs are for tens of GPUs, "
                "not thousands: plan fewer GPUs, or use eplb or craft")
    swap = np.tile(np.arange(G), (G, G, 1))  # swap[a, b, g]: GPU g with a and b exchanged
    ga, gb = np.meshgrid(np.arange(G), np.arange(G), indexing="ij")
    swap[ga, gb, ga], swap[ga, gb, gb] = gb, ga
    inv = None if cluster is None else inverse_bandwidth(cluster)
    rng = np.random.default_rng(0)
    kicks = max_kicks

    def pair_cost(layer: int, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        assert traffic is not None and inv is not None
        return (traffic[layer] * inv[first[..., :, None], second[..., None, :]]).max(axis=(-2, -1))

    for _ in range(max_swaps):
        tot = gpu_totals(sizes, gpu)
        if tot.min() >= totals[0] and tot.max() <= totals[1]:
            return gpu
        on = sizes_on_gpus(sizes, gpu)  # [L, G]
        d = on[:, :, None] - on[:, None, :]  # [L, G(a), G(b)]
        change = (d * (d - (tot[:, None] - tot[None, :])[None])).astype(np.float64)
        if change.min() >= 0:  # no single swap helps: exchange two GPUs' clusters in a subset of layers
            exchange = pair_subset_swap(on, tot, totals)
            if exchange is None:  # a local minimum: a seeded random swap, then descend again
                if kicks == 0:
                    return None
                kicks -= 1
                ka, kb = rng.choice(G, size=2, replace=False)
                exchange = [int(rng.integers(L))], int(ka), int(kb)
            ex_layers, ex_a, ex_b = exchange
            for ly in ex_layers:
                swap_gpus(gpu, ly, ex_a, ex_b)
            continue
        if traffic is None or not np.any(traffic > 0) or (deadline is not None and deadline.expired()):
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
        swap_gpus(gpu, int(layer), int(g1), int(g2))
    return None


def pair_subset_swap(on: np.ndarray, tot: np.ndarray, totals: tuple[int, int]) -> tuple[list[int], int, int] | None:
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


def lpt_totals(sizes: np.ndarray) -> np.ndarray:
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
