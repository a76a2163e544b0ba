"""MoETuner's routing statistics (Section 4.1) and the sizes both ILPs share.

Legend: ``L`` layers, ``E`` experts per layer, ``G`` GPUs (one expert cluster per GPU and layer).
From "MoETuner: Optimized Mixture of Expert Serving with Balanced Expert Placement and Token Routing"
(arXiv 2502.06643); the readings we chose are in ``docs/papers/moetuner.md``.
"""

from __future__ import annotations

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix

__all__ = [
    "cluster_sizes",
    "cluster_traffic",
    "gpu_totals",
    "inverse_bandwidth",
    "memory_totals",
    "relative_gap",
    "routing_statistics",
    "sizes_on_gpus",
    "swap_gpus",
]


def routing_statistics(load: LoadMatrix) -> tuple[np.ndarray, np.ndarray | None]:
    """``(P, R)``: ``P int64 [E, L]`` tokens per expert (the paper's ``P_{e,l}``) and
    ``R int64 [L-1, E, E]`` cross-layer transitions (``R_{e1,e2,l}``), or ``None`` without a token-level trace.
    """
    P = load.total().T.copy()
    R = None if load.trace is None else load.trace.transitions()
    return P, R


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
    return sizes_on_gpus(sizes, gpu_of_cluster).sum(axis=0)


def sizes_on_gpus(sizes: np.ndarray, gpu_of_cluster: np.ndarray) -> np.ndarray:
    """``int64 [L, G]``: experts GPU ``g`` holds in layer ``l`` (``sizes`` reindexed from clusters to GPUs)."""
    on = np.empty(sizes.shape, dtype=np.int64)
    on[np.arange(sizes.shape[0])[:, None], gpu_of_cluster] = sizes
    return on


def swap_gpus(gpu_of_cluster: np.ndarray, layer: int, a: int, b: int) -> None:
    """In place: the clusters on GPUs ``a`` and ``b`` in ``layer`` trade places."""
    row = gpu_of_cluster[layer]
    on_a, on_b = row == a, row == b
    row[on_a], row[on_b] = b, a


def cluster_traffic(R: np.ndarray, cluster_of_expert: np.ndarray, num_gpus: int) -> np.ndarray:
    """Eq. 9/12: ``C float64 [L-1, G, G]``, transitions from cluster ``c1`` (layer ``l``) to ``c2`` (``l + 1``).

    ``R [L-1, E, E]``, ``cluster_of_expert int [L, E]``.
    """
    L = cluster_of_expert.shape[0]
    onehot = np.zeros((L, cluster_of_expert.shape[1], num_gpus))
    np.put_along_axis(onehot, cluster_of_expert[..., None], 1.0, axis=2)
    return np.einsum("lic,lij,ljd->lcd", onehot[:-1], R.astype(np.float64), onehot[1:])


def inverse_bandwidth(cluster: Cluster) -> np.ndarray:
    """``float64 [G, G]``: ``1 / B[g1, g2]`` in s/GB, 0 on the diagonal (a token staying on its GPU is free)."""
    return 1.0 / cluster.bandwidth_matrix()


def relative_gap(objective: float, bound: float) -> float:
    """``(objective - bound) / objective`` in ``[0, 1]`` (0 when they meet)."""
    diff = objective - bound
    if diff <= 1e-9 * max(1.0, abs(objective)):
        return 0.0
    return min(diff / objective, 1.0) if objective > 0 else 0.0
