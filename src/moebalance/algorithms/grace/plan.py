"""GRACE-MoE's plan: hierarchical affinity grouping (Section 4.1), Eq. 2 replication and Eq. 3 routing shares.

After "GRACE-MoE: Grouping and Replication with Locality-Aware Routing for Efficient Distributed MoE
Inference"; our readings of the points the paper leaves open (the group-size bound, which groups, determinism,
budgets) are in ``docs/papers/grace.md``. The policy adapter is :mod:`moebalance.policies.grace`.

Legend: ``L`` layers, ``E`` experts per layer, ``N`` nodes, ``M`` GPUs per node, ``G = N * M`` GPUs,
``q = ceil(E / G)`` slots of a uniform placement, ``W_g`` the load of GPU ``g``'s group, ``n`` replicas per
hot expert. Per layer:

1. **Affinity** (Section 4, Fig. 2a): ``A[i, j]`` tokens that picked both ``i`` and ``j``; :func:`grace_plan`
   takes any affinity, e.g. :func:`moebalance.algorithms.grace.grouping.mixed_affinity` (Section 5.4).
2. **Hierarchical grouping** (Section 4.1, :mod:`moebalance.algorithms.grace.hierarchy`): spectral node
   groups, then Alg. 2's controlled non-uniform GPU groups, every GPU group within ``E / G +- delta`` for the
   ratio ``r`` (given, or the knee of Eq. 1's ``(S(r), U(r))`` curve over ``RATIO_GRID``).
   ``grouping="uniform"`` is the paper's Vanilla: contiguous blocks of ``E / G`` experts.
3. **Replication** (Section 4.2, Eq. 2, :func:`moebalance.algorithms.grace.replication.replicate_layer`):
   ``n = min(max(1, floor(rho)), G - 1)``; each hot expert of the heaviest group gets ``n`` copies on the
   least-loaded GPUs with room. ``replication="fixed"``: ``n = 1`` (FR, Section 5.3); ``"none"``: no replicas.
4. **Load prediction** (Eq. 3): each replica's routing share is proportional to ``1 / W'_g``; the plan's
   ``weights`` hold them and :attr:`GraceRecord.predicted_gpu_load` the ``W'_g``.

Memory comes as a resolved :class:`~moebalance.core.budget.Capacity`: with ``slots_per_gpu S`` a GPU holds at
most ``S`` experts in every layer; with ``replicas_per_gpu R`` at most ``R * G`` replicas over all layers and
``L * q + R`` experts per GPU, replicas going to layers by decreasing skew. Where memory does not hold Eq. 2's
``n``, ``n`` is lowered (:attr:`GraceRecord.replicas_wanted` keeps Eq. 2's ``n``, ``replicas`` the ``n`` used).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from moebalance.algorithms.grace.grouping import blas_single_thread, check_ratio, import_spectral
from moebalance.algorithms.grace.hierarchy import hierarchical_layer, uniform_groups
from moebalance.algorithms.grace.replication import (
    LayerReplicas,
    check_load,
    replica_shares,
    replicate_layer,
    skew_ratio,
)
from moebalance.core.budget import Capacity
from moebalance.core.cluster import Cluster
from moebalance.core.errors import BudgetError, InputError
from moebalance.core.options import check_choice, check_int
from moebalance.core.plan import Placement

__all__ = ["GROUPINGS", "REPLICATIONS", "GracePlan", "GraceRecord", "Grouping", "Replication", "grace_plan"]

Grouping = Literal["hierarchical", "uniform"]
Replication = Literal["dynamic", "fixed", "none"]
GROUPINGS: tuple[Grouping, ...] = ("hierarchical", "uniform")
REPLICATIONS: tuple[Replication, ...] = ("dynamic", "fixed", "none")


@dataclass(kw_only=True, frozen=True, slots=True)
class GraceRecord:
    """What GRACE decided, per planned layer (JSON values; the policy stores them in the plan's params)."""

    #: Eq. 2's ``n`` (1 for ``fixed``), and the ``n`` the memory allowed (0: no replica).
    replicas_wanted: list[int]
    replicas: list[int]
    #: The hot experts copied, hottest first, and those of the hot set left without a copy (memory ran out).
    hot_experts: list[list[int]]
    hot_left_out: list[int]
    #: Eq. 2's ``rho = W_max / mean(W)`` of the groups (4 decimals).
    skew: list[float]
    #: Eq. 3's ``W'_g`` ``[L][G]`` (3 decimals).
    predicted_gpu_load: list[list[float]]
    #: The ``r`` of each layer's GPU groups (given, knee, or None where the grid offered no choice), and the
    #: experts of each node ``[L][N]``; None for ``grouping="uniform"``.
    chosen_ratio: list[float | None] | None = None
    node_experts: list[list[int]] | None = None

    def as_params(self) -> dict[str, Any]:
        """The record as JSON values, field by field."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True, slots=True)
class GracePlan:
    """:func:`grace_plan`'s result: the placement (with Eq. 3 weights) and the record of how it was made."""

    placement: Placement
    record: GraceRecord


def _memory(capacity: Capacity, E: int, G: int, L: int, replicate: bool) -> tuple[int | None, int]:
    """``(S, R)``: the per-layer slots (None under a replicas budget) and the replicas per GPU (0 under slots)."""
    resolved = [capacity.num_layers, capacity.num_experts, capacity.num_gpus]
    if resolved != [L, E, G]:
        raise InputError(f"the capacity was resolved for [L, E, G] = {resolved} but the load and cluster are "
                         f"{[L, E, G]}; resolve the budget for them (moebalance.core.budget.resolve_budget)")
    S = capacity.layer_slots
    R = 0 if S is not None else int(capacity.replicas("grace")[0] or 0)  # refuses auto
    if replicate and S is not None and S * G == E:
        raise BudgetError(f"slots_per_gpu ({S}) fills all {G} GPUs with the {E} experts and leaves no slot for "
                          f"GRACE's replicas; give at least {S + 1}, or replication='none'")
    if replicate and S is None and R == 0:
        raise BudgetError("replicas_per_gpu (0) leaves no memory for GRACE's replicas; give at least 1, "
                          "or replication='none'")
    return S, R


def _affinity(affinity: np.ndarray | None, L: int, E: int) -> np.ndarray:
    if affinity is None:
        raise InputError(f"hierarchical grouping needs an affinity [L, E, E] = {[L, E, E]}, got None "
                         f"(use grouping='uniform' to plan without one)")
    aff = check_load("affinity", affinity, 3, f"co-activation counts [L, E, E] = {[L, E, E]}")
    if aff.shape != (L, E, E):
        raise InputError(f"hierarchical grouping needs an affinity [L, E, E] = {[L, E, E]} to match weight "
                         f"[L, E] = {[L, E]}, got {list(aff.shape)}")
    return aff


def grace_plan(*, weight: np.ndarray, affinity: np.ndarray | None, cluster: Cluster, capacity: Capacity,
               grouping: Grouping = "hierarchical", replication: Replication = "dynamic",
               ratio: float | None = None, node_ratio: float | None = None, seed: int = 0) -> GracePlan:
    """GRACE on a planning load ``weight [L, E]`` and an affinity ``[L, E, E]`` (None for ``grouping="uniform"``)
    within ``capacity`` (:func:`moebalance.core.budget.resolve_budget` of a budget for ``L``, ``E`` and the
    cluster's GPUs; ``replicas_per_gpu="auto"`` is refused: GRACE does not choose ``R``).

    The policy :mod:`moebalance.policies.grace` calls this with the load's own summed counts and co-activation;
    call it directly to plan with another affinity, e.g.
    :func:`moebalance.algorithms.grace.grouping.mixed_affinity` of several datasets.
    """
    check_choice("grouping", grouping, GROUPINGS)
    check_choice("replication", replication, REPLICATIONS)
    r_fixed = check_ratio("ratio", ratio, "the knee of Eq. 1")
    r_node = check_ratio("node_ratio", node_ratio, "node groups bounded only by their GPUs'")
    seed = check_int("seed", seed, minimum=0)
    w = check_load("weight", weight, 2, "the planning load [L, E] (tokens per layer and expert)")
    L, E = w.shape
    G = cluster.num_gpus
    replicate = replication != "none" and G > 1
    S, R = _memory(capacity, E, G, L, replicate)
    aff = _affinity(affinity, L, E) if grouping == "hierarchical" else None
    if aff is not None:
        import_spectral()  # before BLAS is limited, so that the limit reaches SciPy's BLAS too
    with blas_single_thread():
        return _grace_plan(w, aff, cluster, capacity, S, R, replication, r_fixed, r_node, seed)


def _grace_plan(w: np.ndarray, aff: np.ndarray | None, cluster: Cluster, capacity: Capacity, S: int | None, R: int,
                replication: Replication, r_fixed: float | None, r_node: float | None, seed: int) -> GracePlan:
    L, E = w.shape
    G = cluster.num_gpus
    q = capacity.placement_slots
    memory = L * q + R  # replicas_per_gpu: experts per GPU over all layers

    # --- grouping (Section 4.1): the GPU of each expert, layer by layer
    gpu_of = np.empty((L, E), dtype=np.int64)
    used = np.zeros(G, dtype=np.int64)
    chosen_ratio: list[float | None] = []
    node_experts: list[list[int]] = []
    for layer in range(L):
        if aff is None:
            gpu_of[layer] = uniform_groups(E, G)
        else:
            cap = np.full(G, S) if S is not None else (layer + 1) * q + R - used  # >= q: later layers keep q each
            groups = hierarchical_layer(aff[layer], cluster, cap, used, r_fixed, r_node, (seed, layer))
            gpu_of[layer] = groups.gpu
            chosen_ratio.append(groups.ratio)
            node_experts.append(groups.node_experts)
        used += np.bincount(gpu_of[layer], minlength=G)
    group_size = np.stack([np.bincount(g, minlength=G) for g in gpu_of])  # [L, G]
    group_load = np.stack([np.bincount(g, weights=wl, minlength=G) for g, wl in zip(gpu_of, w, strict=True)])

    # --- replication (Section 4.2, Eq. 2) and load prediction (Eq. 3)
    skew = [skew_ratio(row) for row in group_load]  # exact, as Eq. 2's floor needs
    done: dict[int, LayerReplicas] = {}
    extra_left = R * G
    layers = list(range(L)) if S is not None else sorted(range(L), key=lambda i: (-skew[i], i))
    for layer in layers if replication != "none" else []:
        room = S - group_size[layer] if S is not None else memory - used
        done[layer] = rep = replicate_layer(group_load[layer], w[layer], gpu_of[layer],
                                            "fixed" if replication == "fixed" else "dynamic", room,
                                            None if S is not None else extra_left)
        if S is None:
            for t in rep.targets:
                used[t] += 1
                extra_left -= t.size

    # --- the plan: originals plus replicas, with Eq. 3 routing shares
    layers_out: list[list[list[int]]] = []
    weights_out: list[list[list[float]]] = []
    predicted = group_load.copy()
    for layer in range(L):
        per_gpu: list[list[int]] = [[] for _ in range(G)]
        for e, g in enumerate(gpu_of[layer].tolist()):
            per_gpu[g].append(e)
        share: dict[tuple[int, int], float] = {}
        made = done.get(layer)
        if made is not None:
            predicted[layer] = made.predicted
            for e, targets in zip(made.hot.tolist(), made.targets, strict=True):
                hosts = np.concatenate(([gpu_of[layer, e]], targets))
                for g, s in zip(hosts.tolist(), replica_shares(made.predicted, hosts).tolist(), strict=True):
                    share[(e, g)] = s
                for g in targets.tolist():
                    per_gpu[g].append(e)
        for g in range(G):
            per_gpu[g].sort()
        layers_out.append(per_gpu)
        weights_out.append([[share.get((e, g), 1.0) for e in per_gpu[g]] for g in range(G)])
    reps = [done.get(layer) for layer in range(L)]
    record = GraceRecord(
        replicas_wanted=[0 if r is None else r.wanted for r in reps],
        replicas=[0 if r is None else r.num_replicas for r in reps],
        hot_experts=[[] if r is None else r.hot.tolist() for r in reps],
        hot_left_out=[0 if r is None else r.left_out for r in reps],
        skew=[round(float(v), 4) for v in skew],
        predicted_gpu_load=[[round(float(v), 3) for v in row] for row in predicted],
        chosen_ratio=None if aff is None else chosen_ratio,
        node_experts=None if aff is None else node_experts,
    )
    params: dict[str, Any] = {
        **capacity.budget.as_params(),
        "grouping": "uniform" if aff is None else "hierarchical",
        "replication": replication,
        "ratio": r_fixed,
        "node_ratio": r_node,
        "seed": seed,
        **record.as_params(),
    }
    placement = Placement(layers_out, E, cluster, policy="grace", params=params, weights=weights_out)
    return GracePlan(placement, record)
