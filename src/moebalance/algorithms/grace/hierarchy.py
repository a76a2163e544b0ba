"""GRACE-MoE's hierarchical grouping of one layer (Section 4.1): node groups, then GPU groups, ``r`` at the knee.

After "GRACE-MoE: Grouping and Replication with Locality-Aware Routing for Efficient Distributed MoE
Inference"; the readings are in ``docs/papers/grace.md`` ("Grouping").

Legend: ``E`` experts of the layer, ``N`` nodes, ``M`` GPUs per node, ``G = N * M`` GPUs, ``r`` the
non-uniformity ratio. Section 4.1 bounds the size of every GPU group to ``[E_g - delta, E_g + delta]`` with
``E_g = E / G`` -- "the number of experts per layer" over the number of groups -- and ``delta = E_g * r``
(Alg. 2's rounding, :func:`moebalance.algorithms.grace.grouping.alg2_bounds`). So, per candidate ``r``:

1. node groups: spectral clustering of the layer into ``N`` clusters, "fully non-uniform" -- no size rule of
   their own -- but each node must hold what its ``M`` GPU groups may hold, ``[M * num_min, M * num_max]``
   (and what memory allows), so Alg. 2's lines 6-21 trim the clusters to that;
2. GPU groups inside each node: spectral clustering of the node's members into ``M`` clusters, refined by
   Alg. 2 to ``[num_min, num_max]`` (capped by memory);
3. ``r`` is the knee of Eq. 1's ``(S(r), U(r))`` over :data:`RATIO_GRID`, with ``S`` and ``U`` of the layer's
   ``G`` GPU groups.

:func:`hierarchical_layer` returns the GPU of each expert; :func:`uniform_groups` is the paper's Vanilla.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.algorithms.grace.grouping import (
    RATIO_GRID,
    alg2_bounds,
    knee_index,
    refine_groups,
    size_deviation,
    spectral_clustering_in_context,
    utilization,
)
from moebalance.core.cluster import Cluster

__all__ = ["LayerGroups", "hierarchical_layer", "uniform_groups"]


def uniform_groups(num_experts: int, num_gpus: int) -> np.ndarray:
    """Vanilla: ``int64 [E]`` GPU of each expert, contiguous blocks (the first ``E mod G`` GPUs take one more).

    Example: 10 experts on 4 GPUs -> ``[0, 0, 0, 1, 1, 1, 2, 2, 3, 3]``.
    """
    q, m = divmod(num_experts, num_gpus)
    return np.repeat(np.arange(num_gpus), np.where(np.arange(num_gpus) < m, q + 1, q))


@dataclass(frozen=True, slots=True)
class LayerGroups:
    """One layer's hierarchical grouping."""

    #: ``int64 [E]``: the GPU of each expert.
    gpu: np.ndarray
    #: The ``r`` used: the given ratio, the knee's, or None where the grid offered no choice (every ``r`` gave
    #: the same group sizes, e.g. when memory forces them, or a single group).
    ratio: float | None
    #: Experts per node, ``[N]``.
    node_experts: list[int]


def _node_start(a: np.ndarray, num_nodes: int, gpu_cap: np.ndarray, seed: tuple[int, ...]) -> np.ndarray:
    """``int64 [E]``: the node of each expert by spectral clustering, largest cluster to the roomiest node."""
    if num_nodes == 1:
        return np.zeros(a.shape[0], dtype=np.int64)
    labels = spectral_clustering_in_context(a, num_nodes, seed)
    sizes = np.bincount(labels, minlength=num_nodes)
    node_of_cluster = np.empty(num_nodes, dtype=np.int64)
    order = np.arange(num_nodes)
    node_of_cluster[np.lexsort((order, -sizes))] = np.lexsort((order, -gpu_cap))
    return node_of_cluster[labels]


def _group(a: np.ndarray, cluster: Cluster, start: np.ndarray, lo: int, gpu_hi: np.ndarray,
           node_bounds: tuple[int, int] | None, seed: tuple[int, ...], inner: dict[tuple[int, ...], np.ndarray]
           ) -> tuple[np.ndarray, np.ndarray]:
    """``(group [E] in [0, G), node [E])`` for GPU-group bounds ``lo`` and ``gpu_hi [N]`` (one per node).

    ``start [E]`` is each expert's spectral node cluster; ``node_bounds`` (``node_ratio``'s Alg. 2 bounds,
    beyond the paper) narrows the node groups further; ``inner`` caches the spectral clusters of a node's
    members across candidate ``r`` (keyed by node and members).
    """
    N, M = cluster.num_nodes, cluster.gpus_per_node
    node = start
    if N > 1:
        node_lo, node_hi = np.full(N, M * lo), M * gpu_hi
        if node_bounds is not None:
            node_lo, node_hi = np.maximum(node_lo, node_bounds[0]), np.minimum(node_hi, node_bounds[1])
        node = refine_groups(a, start, N, node_lo, node_hi)
    group = np.empty(a.shape[0], dtype=np.int64)
    for nd in range(N):
        members = np.flatnonzero(node == nd)
        if M == 1 or members.size == 0:
            group[members] = nd * M
            continue
        sub = a[np.ix_(members, members)]
        key = (nd, *members.tolist())
        if key not in inner:
            inner[key] = spectral_clustering_in_context(sub, M, (*seed, 1 + nd))
        group[members] = nd * M + refine_groups(sub, inner[key], M, lo, int(gpu_hi[nd]))
    return group, node


def hierarchical_layer(a: np.ndarray, cluster: Cluster, cap: np.ndarray, used: np.ndarray, ratio: float | None,
                       node_ratio: float | None, seed: tuple[int, ...]) -> LayerGroups:
    """One layer's hierarchical grouping on its affinity ``a [E, E]`` (module docstring).

    ``cap [G]`` is what each GPU may hold in this layer (a node's GPU groups share its smallest cap) and
    ``used [G]`` each GPU's experts in earlier layers: inside a node, the largest group goes to the GPU with
    the fewest experts so far (ties: lower group, lower GPU id), which keeps memory even across layers.
    ``ratio`` fixes ``r`` (None: the knee); ``node_ratio`` bounds node groups to Alg. 2's bounds for ``N``
    groups as well (None: only what their GPUs may hold). ``seed`` seeds the k-means restarts: ``(*seed, 0)``
    at the node level, ``(*seed, 1 + node)`` inside a node.
    """
    N, M = cluster.num_nodes, cluster.gpus_per_node
    E, G = a.shape[0], cluster.num_gpus
    gpu_cap = cap.reshape(N, M).min(axis=1)
    start = _node_start(a, N, gpu_cap, (*seed, 0))
    inner: dict[tuple[int, ...], np.ndarray] = {}
    node_bounds = None
    if node_ratio is not None:
        _, _, node_lo, node_hi = alg2_bounds(E, N, node_ratio)
        node_bounds = (node_lo, node_hi)
    r, chosen = (0.0, None) if ratio is None else (ratio, ratio)
    if ratio is None:  # the knee of Eq. 1 over the grid
        made: dict[tuple[int, ...], np.ndarray] = {}
        found = []
        for cand in RATIO_GRID:
            _, _, lo, hi = alg2_bounds(E, G, cand)
            gpu_hi = np.minimum(hi, gpu_cap)
            key = (lo, *gpu_hi.tolist())
            if key not in made:
                made[key] = _group(a, cluster, start, lo, gpu_hi, node_bounds, seed, inner)[0]
            found.append(made[key])
        s = [size_deviation(g, G) for g in found]
        k = knee_index(s, [utilization(a, g) for g in found])
        r, chosen = RATIO_GRID[k], None if max(s) == min(s) else RATIO_GRID[k]
    _, _, lo, hi = alg2_bounds(E, G, r)
    group, node = _group(a, cluster, start, lo, np.minimum(hi, gpu_cap), node_bounds, seed, inner)
    gpu = np.empty(E, dtype=np.int64)
    for nd in range(N):
        gpus = nd * M + np.arange(M)
        members = np.flatnonzero(node == nd)
        local = group[members] - nd * M
        order = np.lexsort((np.arange(M), -np.bincount(local, minlength=M)))
        gpu_of_group = np.empty(M, dtype=np.int64)
        gpu_of_group[order] = gpus[np.lexsort((gpus, used[gpus]))]
        gpu[members] = gpu_of_group[local]
    return LayerGroups(gpu, chosen, np.bincount(node, minlength=N).tolist())
