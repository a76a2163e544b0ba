"""GRACE-MoE's plan: hierarchical affinity grouping (Section 4.1), Eq. 2 replication and Eq. 3 routing shares.

After "GRACE-MoE: Grouping and Replication with Locality-Aware Routing for Efficient Distributed MoE
Inference"; our readings of the points the paper leaves open (node level, which groups, determinism, budgets)
are in ``docs/papers/grace.md``. The policy adapter is :mod:`moebalance.policies.grace`.

Legend: ``L`` layers, ``E`` experts per layer, ``N`` nodes, ``M`` GPUs per node, ``G = N * M`` GPUs,
``q = ceil(E / G)`` slots of a uniform placement, ``W_g`` the load of GPU ``g``'s group, ``n`` replicas per
hot expert. Per layer:

1. **Affinity** (Section 4, Fig. 2a): ``A[i, j]`` tokens that picked both ``i`` and ``j``; :func:`grace_plan`
   takes any affinity, e.g. :func:`moebalance.algorithms.grace.grouping.mixed_affinity` (Section 5.4).
2. **Hierarchical grouping** (Section 4.1): spectral clustering into ``N`` fully non-uniform node groups, then
   inside each node Alg. 2's controlled non-uniform grouping into ``M`` GPU groups with ratio ``r`` (given, or
   the knee of Eq. 1's ``(S(r), U(r))`` curve over ``RATIO_GRID``). ``grouping="uniform"`` is the paper's
   Vanilla: contiguous blocks of ``E / G`` experts.
3. **Replication** (Section 4.2, Eq. 2): ``n = min(max(1, floor(rho)), G - 1)``; the heaviest group's hot
   experts are copied to the ``n`` GPUs with the lowest ``W_g``. ``replication="fixed"``: ``n = 1`` (FR,
   Section 5.3); ``"none"``: no replicas.
4. **Load prediction** (Eq. 3): each replica's routing share is proportional to ``1 / W'_g``; the plan's
   ``weights`` hold them and ``params["predicted_gpu_load"]`` the ``W'_g``.

Memory: with ``slots_per_gpu S`` a GPU holds at most ``S`` experts in every layer; with ``replicas_per_gpu R``
at most ``R * G`` replicas over all layers and ``L * q + R`` experts per GPU, replicas going to layers by
decreasing skew. Where the budget does not fit Eq. 2's ``n``, ``n`` is lowered (``params["replicas_wanted"]``
keeps Eq. 2's ``n``, ``params["replicas"]`` the ``n`` used).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np

from moebalance.algorithms.grace.grouping import (
    RATIO_GRID,
    alg2_bounds,
    blas_single_thread,
    import_spectral,
    knee_index,
    refine_groups,
    size_deviation,
    spectral_clustering_in_context,
    utilization,
)
from moebalance.algorithms.grace.replication import (
    check_load,
    hot_experts,
    predict_loads,
    replica_count,
    replica_shares,
    skew_ratio,
)
from moebalance.core.budget import Budget, resolve_budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import BudgetError, InputError
from moebalance.core.plan import Placement

__all__ = ["Grouping", "Replication", "check_option", "check_ratio", "check_seed", "grace_plan"]

Grouping = Literal["hierarchical", "uniform"]
Replication = Literal["dynamic", "fixed", "none"]


# ----- grouping ---------------------------------------------------------------------------------------------

def _uniform_groups(num_experts: int, num_gpus: int) -> np.ndarray:
    """Vanilla: ``int64 [E]`` GPU of each expert, contiguous blocks (the first ``E mod G`` GPUs take one more)."""
    q, m = divmod(num_experts, num_gpus)
    return np.repeat(np.arange(num_gpus), np.where(np.arange(num_gpus) < m, q + 1, q))


def _gpu_groups(a: np.ndarray, num_groups: int, ratio: float | None, cap: int,
                seed: tuple[int, ...]) -> tuple[np.ndarray, float | None]:
    """Alg. 2 inside one node: ``(group of each expert, r used)``, ``r`` at the knee when ``ratio`` is None.

    ``r`` is None where none was chosen: one group, no experts, or ``S(r)`` equal for every ``r`` of the grid.
    """
    n = a.shape[0]
    if num_groups == 1 or n == 0:
        return np.zeros(n, dtype=np.int64), None
    labels = spectral_clustering_in_context(a, num_groups, seed)
    rs = (ratio,) if ratio is not None else RATIO_GRID
    cache: dict[tuple[int, int], np.ndarray] = {}
    found: list[np.ndarray] = []
    for r in rs:
        _, _, lo, hi = alg2_bounds(n, num_groups, r)
        key = (lo, min(hi, cap))
        if key not in cache:
            cache[key] = refine_groups(a, labels, num_groups, key[0], key[1])
        found.append(cache[key])
    if len(rs) == 1:
        return found[0], rs[0]
    s = [size_deviation(g, num_groups) for g in found]
    u = [utilization(a, g) for g in found]
    k = knee_index(s, u)
    if max(s) == min(s):  # every r gave the same sizes (e.g. the cap forces them): no knee, no r chosen
        return found[k], None
    return found[k], rs[k]


def _hierarchical_layer(a: np.ndarray, cluster: Cluster, cap: np.ndarray, used: np.ndarray, ratio: float | None,
                        node_ratio: float | None, seed: int,
                        layer: int) -> tuple[np.ndarray, list[float | None], list[int]]:
    """One layer's hierarchical grouping: ``(GPU of each expert [E], r per node, experts per node)``.

    ``cap [G]`` is what each GPU may hold in this layer, ``used [G]`` its experts in earlier layers.
    """
    N, M = cluster.num_nodes, cluster.gpus_per_node
    E = a.shape[0]
    gpu_cap = cap.reshape(N, M).min(axis=1)  # [N]: one Alg. 2 num_max per node
    node_cap = M * gpu_cap
    if N == 1:
        node = np.zeros(E, dtype=np.int64)
    else:
        labels = spectral_clustering_in_context(a, N, (seed, layer, 0))
        sizes = np.bincount(labels, minlength=N)
        node_of_cluster = np.empty(N, dtype=np.int64)
        node_of_cluster[np.lexsort((np.arange(N), -sizes))] = np.lexsort((np.arange(N), -node_cap))
        lo, hi = 0, node_cap  # fully non-uniform: only memory bounds a node group
        if node_ratio is not None:  # Alg. 2's bounds at the node level too (beyond the paper)
            _, _, lo, hi_r = alg2_bounds(E, N, node_ratio)
            hi = np.minimum(hi_r, node_cap)
        node = refine_groups(a, node_of_cluster[labels], N, lo, hi)
    gpu = np.empty(E, dtype=np.int64)
    ratios: list[float | None] = []
    for nd in range(N):
        members = np.flatnonzero(node == nd)
        groups, r = _gpu_groups(a[np.ix_(members, members)], M, ratio, int(gpu_cap[nd]), (seed, layer, 1 + nd))
        ratios.append(r)
        sizes = np.bincount(groups, minlength=M)
        gpus = nd * M + np.arange(M)
        # largest group first (ties: lower group index) to the GPU with the fewest experts so far (ties: lower id)
        order = np.lexsort((np.arange(M), -sizes))
        slots = gpus[np.lexsort((gpus, used[gpus]))]
        gpu_of_group = np.empty(M, dtype=np.int64)
        gpu_of_group[order] = slots
        gpu[members] = gpu_of_group[groups]
    return gpu, ratios, np.bincount(node, minlength=N).tolist()


# ----- options ----------------------------------------------------------------------------------------------

def check_option(name: str, value: object, choices: tuple[str, ...]) -> None:
    """``value`` must be one of ``choices`` (also refuses non-strings)."""
    if not isinstance(value, str) or value not in choices:
        raise InputError(f"{name} ({value!r}) must be one of: {', '.join(choices)}")


def check_ratio(name: str, value: object, none_means: str) -> float | None:
    """A non-negative finite ratio as a ``float``, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise InputError(f"{name} ({value!r}) must be a non-negative number (GRACE's r, e.g. 0.3), "
                         f"or None for {none_means}")
    return float(value)


def check_seed(seed: object) -> int:
    """The k-means seed, a non-negative integer."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise InputError(f"seed ({seed!r}) must be a non-negative integer")
    return int(seed)


# ----- the plan ---------------------------------------------------------------------------------------------

def grace_plan(*, weight: np.ndarray, affinity: np.ndarray | None, cluster: Cluster,
               slots_per_gpu: int | None = None, replicas_per_gpu: int | None = None,
               grouping: Grouping = "hierarchical", replication: Replication = "dynamic",
               ratio: float | None = None, node_ratio: float | None = None, seed: int = 0) -> Placement:
    """GRACE on a planning load ``weight [L, E]`` and an affinity ``[L, E, E]`` (None for ``grouping="uniform"``),
    within exactly one of ``slots_per_gpu S`` (per layer) and ``replicas_per_gpu R`` (over all layers).

    The policy :mod:`moebalance.policies.grace` calls this with the load's own summed counts and co-activation;
    call it directly to plan with another affinity, e.g.
    :func:`moebalance.algorithms.grace.grouping.mixed_affinity` of several datasets.
    """
    budget = Budget(slots_per_gpu=slots_per_gpu, replicas_per_gpu=replicas_per_gpu)
    if grouping == "hierarchical":
        import_spectral()  # before BLAS is limited, so that the limit reaches SciPy's BLAS too
    with blas_single_thread():
        return _grace_plan(weight, affinity, cluster, budget, grouping, replication, ratio, node_ratio, seed)


def _grace_plan(weight: np.ndarray, affinity: np.ndarray | None, cluster: Cluster, budget: Budget,
                grouping: Grouping, replication: Replication, ratio: float | None, node_ratio: float | None,
                seed: int) -> Placement:
    check_option("grouping", grouping, ("hierarchical", "uniform"))
    check_option("replication", replication, ("dynamic", "fixed", "none"))
    r_fixed = check_ratio("ratio", ratio, "the knee of Eq. 1")
    r_node = check_ratio("node_ratio", node_ratio, "fully non-uniform node groups")
    seed = check_seed(seed)
    w = check_load("weight", weight, 2, "the planning load [L, E] (tokens per layer and expert)")
    L, E = w.shape
    G = cluster.num_gpus
    capacity = resolve_budget(budget, E, G, L)  # refuses slots_per_gpu < ceil(E / G)
    q = capacity.placement_slots
    S = budget.slots_per_gpu
    R = int(capacity.replicas("grace")[0] or 0) if S is None else 0
    replicate = replication != "none" and G > 1
    if replicate and S is not None and S * G == E:
        raise BudgetError(f"slots_per_gpu ({S}) fills all {G} GPUs with the {E} experts and leaves no slot for "
                          f"GRACE's replicas; give at least {S + 1}, or replication='none'")
    if replicate and S is None and R == 0:
        raise BudgetError("replicas_per_gpu (0) leaves no memory for GRACE's replicas; give at least 1, "
                          "or replication='none'")
    if grouping == "hierarchical":
        if affinity is None:
            raise InputError(f"hierarchical grouping needs an affinity [L, E, E] = {[L, E, E]}, got None "
                             f"(use grouping='uniform' to plan without one)")
        aff = check_load("affinity", affinity, 3, f"co-activation counts [L, E, E] = {[L, E, E]}")
        if aff.shape != (L, E, E):
            raise InputError(f"hierarchical grouping needs an affinity [L, E, E] = {[L, E, E]} to match weight "
                             f"[L, E] = {[L, E]}, got {list(aff.shape)}")
    memory = L * q + R  # replicas_per_gpu: experts per GPU over all layers

    # --- grouping (Section 4.1): the GPU of each expert, layer by layer
    gpu_of = np.empty((L, E), dtype=np.int64)
    used = np.zeros(G, dtype=np.int64)
    chosen_ratio: list[list[float | None]] = []
    node_experts: list[list[int]] = []
    for layer in range(L):
        if grouping == "uniform":
            gpu_of[layer] = _uniform_groups(E, G)
        else:
            cap = np.full(G, S) if S is not None else (layer + 1) * q + R - used
            assert np.all(cap >= q)
            gpu_of[layer], ratios, sizes = _hierarchical_layer(aff[layer], cluster, cap, used, r_fixed, r_node, seed,
                                                                layer)
            chosen_ratio.append(ratios)
            node_experts.append(sizes)
        used += np.bincount(gpu_of[layer], minlength=G)
    group_size = np.stack([np.bincount(g, minlength=G) for g in gpu_of])  # [L, G]
    group_load = np.stack([np.bincount(g, weights=wl, minlength=G) for g, wl in zip(gpu_of, w, strict=True)])

    # --- replication (Section 4.2, Eq. 2) and load prediction (Eq. 3)
    predicted = group_load.copy()
    skew = [skew_ratio(row) for row in group_load]  # exact, as Eq. 2's floor needs
    wanted = np.zeros(L, dtype=np.int64)
    got = np.zeros(L, dtype=np.int64)
    hot: list[list[int]] = [[] for _ in range(L)]
    targets_of: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * L
    extra_left = R * G
    layers = list(range(L)) if S is not None else sorted(range(L), key=lambda i: (-skew[i], i))
    for layer in layers:
        W = group_load[layer]
        if not replicate or W.sum() <= 0:
            continue
        wanted[layer] = replica_count(W) if replication == "dynamic" else 1
        h = int(np.argmax(W))
        members = np.flatnonzero(gpu_of[layer] == h)
        room = S - group_size[layer] if S is not None else memory - used
        by_load = np.lexsort((np.arange(G), W))
        by_load = by_load[by_load != h]
        for n in range(int(wanted[layer]), 0, -1):  # Eq. 2's n, lowered until the budget fits it
            H = hot_experts(w[layer, members], members, n)
            fits = by_load[room[by_load] >= H.size]
            if fits.size >= n and (S is not None or n * H.size <= extra_left):
                targets = np.sort(fits[:n])
                got[layer], hot[layer], targets_of[layer] = n, H.tolist(), targets
                predicted[layer] = predict_loads(W, h, targets, float(w[layer, H].sum()))
                if S is None:
                    extra_left -= n * H.size
                    used[targets] += H.size
                break

    # --- the plan: originals plus replicas, with Eq. 3 routing shares
    layers_out: list[list[list[int]]] = []
    weights_out: list[list[list[float]]] = []
    for layer in range(L):
        per_gpu: list[list[int]] = [[] for _ in range(G)]
        for e, g in enumerate(gpu_of[layer].tolist()):
            per_gpu[g].append(e)
        share: dict[tuple[int, int], float] = {}
        for e in hot[layer]:
            hosts = np.concatenate(([gpu_of[layer, e]], targets_of[layer]))
            for g, s in zip(hosts.tolist(), replica_shares(predicted[layer], hosts).tolist(), strict=True):
                share[(e, g)] = s
            for g in targets_of[layer].tolist():
                per_gpu[g].append(e)
        for g in range(G):
            per_gpu[g].sort()
        layers_out.append(per_gpu)
        weights_out.append([[share.get((e, g), 1.0) for e in per_gpu[g]] for g in range(G)])
    params: dict[str, Any] = {
        **budget.as_params(),
        "grouping": grouping,
        "replication": replication,
        "ratio": r_fixed,
        "node_ratio": r_node,
        "seed": seed,
        "replicas_wanted": wanted.tolist(),
        "replicas": got.tolist(),
        "hot_experts": hot,
        "skew": [round(float(v), 4) for v in skew],
        "predicted_gpu_load": [[round(float(v), 3) for v in row] for row in predicted],
    }
    if grouping == "hierarchical":
        params["chosen_ratio"] = chosen_ratio
        params["node_experts"] = node_experts
    return Placement(layers_out, E, cluster, policy="grace", params=params, weights=weights_out)
