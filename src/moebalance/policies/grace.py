"""``grace``: GRACE-MoE, affinity grouping with dynamic replication (seed paper 001, Sections 4.1-4.3, App. A.2).

Legend: ``L`` layers, ``E`` experts per layer, ``N`` nodes, ``M`` GPUs per node, ``G = N * M`` GPUs (the
paper's ``n_gpu``), ``q = ceil(E / G)`` slots of a uniform placement, ``W_g`` the load of GPU ``g``'s group
(tokens of the planning batches), ``n`` replicas per hot expert (the paper's ``n_replica``).

Per layer:

1. **Affinity** (Section 4, Fig. 2a): ``A[i, j]`` tokens that picked both ``i`` and ``j`` (off the diagonal),
   from the load's token-level trace (:func:`moebalance.algorithms.grace.grouping.affinity`). :func:`grace_plan` takes any
   affinity, e.g. :func:`moebalance.algorithms.grace.grouping.mixed_affinity` over several datasets (Section 5.4).
2. **Hierarchical grouping** (Section 4.1): spectral clustering of the layer's experts into ``N`` node groups,
   *fully non-uniform* (sizes set by affinity alone), then inside each node Alg. 2's *controlled non-uniform*
   grouping into ``M`` GPU groups with ratio ``r``: the given ``ratio``, or per (layer, node) the knee of the
   ``(S(r), U(r))`` curve of Eq. 1 over :data:`~moebalance.algorithms.grace.grouping.RATIO_GRID` (``0, 0.1, ..., 1``).
   ``grouping="uniform"`` is the paper's Vanilla (average grouping): contiguous blocks of ``E / G`` experts,
   as the ``contiguous`` policy.
3. **Replication** (Section 4.2, Eq. 2): ``rho = W_max / mean(W)`` (exact: ``G * W_max / sum(W)`` in rationals,
   so that ``rho = 7`` is not floored to 6), ``n = min(max(1, floor(rho)), G - 1)``;
   in the heaviest group (ties: lowest GPU id) the hot experts are replicated onto the ``n`` GPUs with the
   lowest ``W_g`` (excluding the heaviest; ties: lowest id); originals stay. ``replication="fixed"`` is the
   FR baseline of Section 5.3 (RQ2): ``n = 1``, to the least-loaded GPU; ``"none"`` replicates nothing.
4. **Load prediction** (Eq. 3) for the ``wrr``/``locality`` routers (Section 4.3, Alg. 3): each replica's
   routing share is proportional to ``1 / W'_g`` of the GPU holding it, normalised per expert; the plan's
   ``weights`` hold them and ``params["predicted_gpu_load"]`` the ``W'_g``.

Readings where the paper is ambiguous (Alg. 2 and the knee: see :mod:`moebalance.algorithms.grace.grouping`):

- **Hot experts.** "experts are ranked by individual load, and those whose cumulative load exceeds
  ``W_max * n / (1 + n)`` are identified as hot": taken literally, the experts *after* the crossing would be
  the cold tail. We read it as the smallest prefix of the ranking (heaviest first; ties: lowest id) whose
  cumulative load *strictly exceeds* the threshold. Example: loads ``50, 30, 15, 5`` (``W_max = 100``) with
  ``n = 1``: threshold 50; ``50`` does not exceed it, ``50 + 30`` does: the hot experts are the first two.
- **Eq. 3.** The text says the replicated load ``W_r`` "is evenly split across all ``n + 1`` instances" and
  then prints ``W_p = W_max / (n + 1)``. Only ``W_p = W_r / (n + 1)`` conserves tokens (the heaviest GPU keeps
  ``W_max - W_r + W_p``, each of the ``n`` targets gains ``W_p``), so we read the printed ``W_max`` as a typo
  for ``W_r``. Example: ``W = [60, 10, 10, 10]``, hot load ``W_r = 45`` copied to GPUs 1 and 2 (``n = 2``):
  ``W_p = 15`` predicts ``[30, 25, 25, 10]`` (90 tokens; the printed ``W_p = 20`` would predict
  ``[35, 30, 30, 10]``, 105), and the hot expert's shares are ``1/30 : 1/25 : 1/25 = 5/17, 6/17, 6/17``.
- **Which groups.** Eq. 2's groups are the final GPU groups (a GPU's load is its group's), ``mean(W)`` is over
  all ``G`` GPUs, and every hot expert goes to the same ``n`` targets (all or none of them per target).
- **Node level.** Fully non-uniform node groups are capped by what the node's GPUs may hold (see budgets):
  Alg. 2 lines 6-16 with ``num_max`` = node capacity and ``num_min = 0``. Spectral clusters are matched to
  nodes largest to roomiest. A node may hold fewer experts than GPUs, leaving GPUs empty (they are then the
  first replica targets). Fully non-uniform can be very uneven: on the synthetic Qwen3 trace with a
  ``replicas_per_gpu`` budget (which hardly caps a layer) some layers split 121 / 7 over 2 nodes. The
  optional ``node_ratio`` (beyond the paper; default ``None`` = the paper's fully non-uniform) bounds node
  groups as Alg. 2 bounds GPU groups: ``E / N +- max(1, round(E / N * node_ratio))``. Inside a node, groups go to GPUs largest first, to the GPU with the fewest experts so
  far over earlier layers (ties: lowest id), which keeps per-GPU memory even across layers.
- **Determinism.** The k-means restarts of the spectral clustering of layer ``l`` (scikit-learn's ``KMeans``
  on an embedding from SciPy's dense ``eigh``, see :mod:`moebalance.algorithms.grace.grouping`) are seeded with
  ``(seed, l, 0)`` at the node level and ``(seed, l, 1 + node)`` inside a node, and run on one thread, so a
  plan depends only on its inputs.

Budgets (a budget is a maximum; GRACE uses what it needs within it and records what it could not do):

- ``slots_per_gpu S``: every GPU holds at most ``S`` experts (groups and replicas) in every layer. Alg. 2's
  ``num_max`` is capped at ``S`` and a node holds at most ``M * S`` experts; replicas go only to GPUs with
  a free slot for every hot expert. ``S < q`` is refused, and so is ``S * G == E`` with replication on (no
  free slot anywhere: give ``S + 1``, or ``replication="none"``).
- ``replicas_per_gpu R``: at most ``R * G`` replicas over all layers, and at most ``L * q + R`` experts per GPU
  over all layers (``Budget.check``). The groups use part of that memory: layer by layer, GPU ``g`` may hold
  at most ``(l + 1) * q + R - used_g`` experts in layer ``l`` (``used_g``: its experts in layers ``< l``), which
  leaves every later layer at least ``q`` on every GPU. Then replicas are given to layers in order of
  decreasing skew ``rho`` (ties: lower layer) while the ``R * G`` total and the per-GPU memory last. ``R = 0``
  with replication on is refused (no replica fits); ``auto`` is refused (GRACE does not choose ``R``).
- When the budget does not fit Eq. 2's ``n`` in a layer, ``n`` is lowered to the largest count whose hot set
  fits on that many targets (the hot set is recomputed for the lower ``n``, as Eq. 2's threshold depends on
  it); ``params["replicas_wanted"]`` keeps Eq. 2's ``n`` and ``params["replicas"]`` the ``n`` used.

Other facts recorded in ``params``: ``chosen_ratio [L][N]``, the ``r`` of each node's GPU groups: the given
``ratio``, else the knee's; ``None`` where no ``r`` was chosen, because the node needed no GPU-level split (one
GPU per node, or no experts) or because every ``r`` of the grid gave the same group sizes (``S(r)`` constant,
typically when the slot cap forces equal groups: ``M * S`` slots for ``M * S`` experts), so that no knee
exists and recording ``0.0`` would claim a choice that was not made (the groups are then those of the
largest ``U(r)``, ties to the smaller ``r``). Also ``node_experts [L][N]``, ``skew [L]`` (``rho`` of Eq. 2,
rounded to 4 decimals), ``hot_experts [L]`` (ids, hottest first), ``predicted_gpu_load [L][G]``.

Speed: a Qwen3-30B-A3B-like trace (48 layers x 128 experts, top-8, 32 batches x 512 tokens on 16 ranks, from
``synthesize``) plans in 1.4-1.5 s for 2 nodes x 8 GPUs and 1.7-1.9 s for 4 nodes x 4 GPUs, either budget kind
(``slots_per_gpu=10`` or ``replicas_per_gpu=4``; median of 3), on a 2-core machine with other processes
busy (load about 2.5; knee search included; the affinity takes 0.25 s of it); a DeepSeek-V3-like trace (58 x
256, top-8, 16 x 512 tokens on 64 ranks) plans in 4.7-4.9 s on 8 nodes x 8 GPUs, 522 clusterings of 4-7 ms
each, most of it scikit-learn's k-means++ seeding. ``grouping="uniform"`` takes 0.02 s. The first
hierarchical plan in a process also imports scikit-learn's clustering (about 1.1 s). BLAS and OpenMP are
held to one thread while planning (see :func:`moebalance.algorithms.grace.grouping.blas_single_thread`), entered once per
plan (entering it costs about 2 ms; once per clustering made the 2 x 8 plan about 0.15 s slower).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Literal

import numpy as np

from moebalance.algorithms.grace.grouping import (
    RATIO_GRID,
    _import_spectral,
    _spectral_clustering_in_context,
    alg2_bounds,
    blas_single_thread,
    knee_index,
    refine_groups,
    size_deviation,
    utilization,
)
from moebalance.algorithms.grace.grouping import affinity as trace_affinity
from moebalance.core.budget import Budget, resolve_budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import BudgetError, InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement

__all__ = ["grace", "grace_plan", "hot_experts", "predict_loads", "replica_count", "replica_shares", "skew_ratio"]

Grouping = Literal["hierarchical", "uniform"]
Replication = Literal["dynamic", "fixed", "none"]


# ----- Section 4.2 and Eq. 2-3 ------------------------------------------------------------------------------

def _check_load(name: str, value: object, ndim: int, shape_text: str) -> np.ndarray:
    """``float64``: a load-like array of ``ndim`` dimensions with finite, non-negative entries."""
    try:
        a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"{name} ({type(value).__name__}) is not a numeric array; give {shape_text}") from None
    if a.ndim != ndim:
        raise InputError(f"{name} has shape {list(a.shape)}; give {shape_text}")
    bad = ~np.isfinite(a) | (a < 0)
    if bad.any():
        where = [int(i) for i in np.argwhere(bad)[0]]
        raise InputError(f"{name} has {int(bad.sum())} NaN, infinite or negative entries (the first, "
                         f"{a[tuple(where)]}, at {where}); give finite counts >= 0")
    return a


def skew_ratio(group_load: np.ndarray) -> Fraction:
    """Eq. 2's ``rho = W_max / mean(W) = G * W_max / sum(W)``, exact (a ``Fraction``; 0 if there is no load).

    Float division can land just below an integer (``9 / (18 / 14)`` is ``6.999999999999999``), which Eq. 2's
    ``floor`` would then lower by one; loads are converted to fractions exactly, so ``rho`` is too.
    Example: ``W = [9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]``: ``rho = 14 * 9 / 18 = 7``.
    """
    w = _check_load("group_load", group_load, 1, "one load per GPU, [G]")
    total = sum((Fraction(float(v)) for v in w), Fraction(0))
    if total <= 0:
        return Fraction(0)
    return Fraction(float(w.max())) * w.size / total


def replica_count(group_load: np.ndarray) -> int:
    """Eq. 2: ``n = min(max(1, floor(W_max / mean(W))), G - 1)`` for the group loads ``W [G]`` (0 if all zero).

    ``rho`` is computed exactly (:func:`skew_ratio`). Example: ``W = [10, 2, 2, 2]``: ``rho = 10 / 4 = 2.5``,
    so ``n = 2``.
    """
    rho = skew_ratio(group_load)
    if rho <= 0:
        return 0
    return int(min(max(1, math.floor(rho)), np.size(group_load) - 1))


def hot_experts(expert_load: np.ndarray, experts: np.ndarray, num_replicas: int) -> np.ndarray:
    """The hot experts of the heaviest group: the smallest prefix of ``experts`` ranked by ``expert_load``
    (heaviest first, ties: lowest id) whose cumulative load strictly exceeds ``W_max * n / (1 + n)``, with
    ``W_max = sum(expert_load)``. Returns the ids, hottest first (empty if the group has no load).

    Example: loads ``[5, 50, 30, 15]`` of experts ``[7, 3, 4, 9]`` with ``n = 1`` -> ``[3, 4]``.
    """
    w = np.asarray(expert_load, dtype=np.float64)
    ids = np.asarray(experts, dtype=np.int64)
    total = w.sum()
    if total <= 0 or num_replicas < 1:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((ids, -w))
    threshold = total * num_replicas / (1 + num_replicas)
    count = int(np.argmax(np.cumsum(w[order]) > threshold)) + 1
    return ids[order[:count]]


def predict_loads(group_load: np.ndarray, heaviest: int, targets: np.ndarray, replicated_load: float) -> np.ndarray:
    """Eq. 3: ``float64 [G]`` predicted loads after replicating load ``W_r`` of GPU ``heaviest`` to ``targets``.

    ``W_p = W_r / (n + 1)`` (see the module docstring); ``W'_heaviest = W_max - W_r + W_p``,
    ``W'_i = W_i + W_p`` on each target, the rest unchanged. Tokens are conserved.
    """
    out = np.asarray(group_load, dtype=np.float64).copy()
    t = np.asarray(targets, dtype=np.int64)
    if t.size == 0:
        return out
    wp = replicated_load / (t.size + 1)
    out[heaviest] += wp - replicated_load
    out[t] += wp
    return out


def replica_shares(predicted: np.ndarray, hosts: np.ndarray) -> np.ndarray:
    """Routing shares of one expert's replicas on GPUs ``hosts``: ``1 / W'_g`` normalised (Alg. 3's weights).

    GPUs predicted to be idle (``W'_g = 0``, only possible without load) share equally.
    """
    p = np.asarray(predicted, dtype=np.float64)[np.asarray(hosts, dtype=np.int64)]
    if np.any(p <= 0):
        return np.full(p.size, 1.0 / p.size)
    inv = 1.0 / p
    return inv / inv.sum()


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
    labels = _spectral_clustering_in_context(a, num_groups, seed)
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
        labels = _spectral_clustering_in_context(a, N, (seed, layer, 0))
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


# ----- the policy -------------------------------------------------------------------------------------------

def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise InputError(f"{name} ({value!r}) must be one of: {', '.join(choices)}")


def _check_ratio(name: str, value: object, none_means: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise InputError(f"{name} ({value!r}) must be a non-negative number (GRACE's r, e.g. 0.3), "
                         f"or None for {none_means}")
    return float(value)


def grace_plan(*, weight: np.ndarray, affinity: np.ndarray | None, cluster: Cluster, budget: Budget,
               grouping: Grouping = "hierarchical", replication: Replication = "dynamic",
               ratio: float | None = None, node_ratio: float | None = None, seed: int = 0) -> Placement:
    """GRACE on a planning load ``weight [L, E]`` and an affinity ``[L, E, E]`` (None for ``grouping="uniform"``).

    The policy :func:`grace` calls this with the load's own summed counts and co-activation; call it directly
    to plan with another affinity, e.g. :func:`moebalance.algorithms.grace.grouping.mixed_affinity` of several datasets.
    """
    if grouping == "hierarchical":
        _import_spectral()  # before BLAS is limited, so that the limit reaches SciPy's BLAS too
    with blas_single_thread():
        return _grace_plan(weight, affinity, cluster, budget, grouping, replication, ratio, node_ratio, seed)


def _grace_plan(weight: np.ndarray, affinity: np.ndarray | None, cluster: Cluster, budget: Budget,
                grouping: Grouping, replication: Replication, ratio: float | None, node_ratio: float | None,
                seed: int) -> Placement:
    _check_choice("grouping", grouping, ("hierarchical", "uniform"))
    _check_choice("replication", replication, ("dynamic", "fixed", "none"))
    r_fixed = _check_ratio("ratio", ratio, "the knee of Eq. 1")
    r_node = _check_ratio("node_ratio", node_ratio, "fully non-uniform node groups")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise InputError(f"seed ({seed!r}) must be a non-negative integer")
    w = _check_load("weight", weight, 2, "the planning load [L, E] (tokens per layer and expert)")
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
        aff = _check_load("affinity", affinity, 3, f"co-activation counts [L, E, E] = {[L, E, E]}")
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
        "seed": int(seed),
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


def grace(*, load: LoadMatrix, cluster: Cluster, budget: Budget, grouping: Grouping = "hierarchical",
          replication: Replication = "dynamic", ratio: float | None = None, node_ratio: float | None = None,
          seed: int = 0) -> Placement:
    """GRACE-MoE on a token-level load: affinity grouping (Alg. 1-2), Eq. 2 replication, Eq. 3 weights.

    ``grouping``: ``"hierarchical"`` (Section 4.1; needs the token-level trace, ``topk_ids``, to measure
    affinity) or ``"uniform"`` (Vanilla, contiguous blocks; counts suffice). ``replication``: ``"dynamic"``
    (Eq. 2), ``"fixed"`` (one replica of the hot experts, Section 5.3) or ``"none"``. ``ratio``: Alg. 2's ``r``
    for the GPU level, or None for the knee of Eq. 1 per (layer, node). ``node_ratio``: None (fully
    non-uniform node groups, as the paper) or a ratio bounding them likewise. ``seed``: k-means restarts.
    """
    _check_choice("grouping", grouping, ("hierarchical", "uniform"))
    aff = None
    if grouping == "hierarchical":
        if load.trace is None:
            raise InputError("policy 'grace' groups experts by co-activation and needs a token-level trace "
                             "(topk_ids, src_gpu, batch); this load has counts only (synthesize with "
                             "token_level=True, or use grouping='uniform')")
        aff = trace_affinity(load.trace)
    return grace_plan(weight=load.total(), affinity=aff, cluster=cluster, budget=budget, grouping=grouping,
                      replication=replication, ratio=ratio, node_ratio=node_ratio, seed=seed)
