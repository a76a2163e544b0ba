"""Placement plans: which GPU hosts which experts in every layer, and the plan file.

Legend: ``L`` layers, ``E`` logical experts per layer, ``G`` GPUs, ``P`` physical slots of a layer,
``R`` the largest replica count of any expert.

A :class:`Placement` lists, for every layer ``l`` and GPU ``g``, the logical experts ``g`` hosts
(``gpu_experts[l][g]``). GPUs may host different numbers of experts, and a layer may have more slots than
another (CRAFT). Every expert of every layer must appear at least once. Two copies of one expert on one GPU
are allowed but reported as a warning: DeepSeek's reference EPLB produces them (docs/design.md, "Data formats").

Plan file (docs/design.md, "Data formats"; a contract)::

    {"format": "moebalance.plan", "version": 1, "policy": "eplb", "params": {...},
     "cluster": {"num_nodes": 8, "gpus_per_node": 8}, "num_layers": 58, "num_experts": 256,
     "placement": [[[0, 17, 33], [5, 2], ...], ...], "weights": [...]}   # weights optional

Conversions to and from DeepSeek EPLB's ``phy2log [L, P]``, ``log2phy [L, E, R]`` (padded with -1) and
``logcnt [L, E]`` exist for plans with equal slots on every GPU: physical slot ``p`` is position
``p % S`` on GPU ``p // S``, where ``S = P / G``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.io import atomic_path, read_json
from moebalance.core.limits import check_alloc

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "EplbTensors", "Placement", "check_layer_params", "read_plan",
           "with_dense_layers", "write_plan"]

PLAN_FORMAT = "moebalance.plan"
PLAN_VERSION = 1


@dataclass(frozen=True, slots=True)
class EplbTensors:
    """A plan as DeepSeek EPLB's three tensors.

    For 2 GPUs, 3 experts, 2 slots per GPU with expert 0 replicated: ``phy2log = [[0, 1, 2, 0]]``,
    ``log2phy = [[[0, 3], [1, -1], [2, -1]]]``, ``logcnt = [[2, 1, 1]]``.
    """

    #: ``int64 [L, P]``: logical expert in physical slot ``p`` (GPU ``p // (P / G)``).
    phy2log: np.ndarray
    #: ``int64 [L, E, R]``: physical slots of each logical expert, padded with -1.
    log2phy: np.ndarray
    #: ``int64 [L, E]``: replica count of each logical expert.
    logcnt: np.ndarray


@dataclass(frozen=True, slots=True)
class Placement:
    """Which experts each GPU hosts, per layer.

    Example (1 layer, 4 experts, 2 GPUs, expert 0 replicated)::

        Placement(gpu_experts=[[[0, 1], [0, 2, 3]]], num_experts=4,
                  cluster=Cluster(num_nodes=1, gpus_per_node=2))

    has ``replica_counts() == [[2, 1, 1, 1]]``, ``slots() == [[2, 3]]`` and ``extra_replicas == 1``.
    """

    #: ``[L][G]`` tuples of logical expert ids hosted by GPU ``g`` in layer ``l``.
    gpu_experts: Sequence[Sequence[Sequence[int]]]
    #: ``E``, logical experts per layer.
    num_experts: int
    cluster: Cluster
    #: Name of the policy that made the plan.
    policy: str = "custom"
    #: The policy's parameters and facts it reports (JSON-serialisable).
    params: Mapping[str, Any] = field(default_factory=dict)
    #: Optional ``[L][G]`` routing share of each replica for a static weighted router, mirroring ``gpu_experts``.
    weights: Sequence[Sequence[Sequence[float]]] | None = None
    #: ``int64 [L, E, G]``: copies of expert ``e`` on GPU ``g`` in layer ``l`` (derived).
    copies: np.ndarray = field(init=False, repr=False, compare=False)
    #: Human-readable warnings found by validation (e.g. two copies of one expert on one GPU).
    warnings: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        G, E = self.cluster.num_gpus, int(self.num_experts)
        if E < 1:
            raise PlanError(f"num_experts ({E}) must be positive")
        object.__setattr__(self, "num_experts", E)
        layers = self.gpu_experts
        if isinstance(layers, str | bytes) or not isinstance(layers, Sequence) or len(layers) == 0:
            raise PlanError("placement must be a non-empty list of layers, each a list of per-GPU expert lists")
        frozen: list[tuple[tuple[int, ...], ...]] = []
        lay_idx: list[int] = []
        exp_idx: list[int] = []
        gpu_idx: list[int] = []
        for li, layer in enumerate(layers):
            if (type(layer) not in (list, tuple) and (isinstance(layer, str | bytes) or not isinstance(layer, Sequence))) \
                    or len(layer) != G:
                n = len(layer) if isinstance(layer, Sequence) else type(layer).__name__
                raise PlanError(f"placement[{li}] has {n} GPU lists but the cluster has {G} GPUs")
            row: list[tuple[int, ...]] = []
            for gi, experts in enumerate(layer):
                if type(experts) not in (list, tuple) and (
                        isinstance(experts, str | bytes) or not isinstance(experts, Sequence)):
                    raise PlanError(f"placement[{li}][{gi}] must be a list of expert ids")
                # fast path for plain ints (ABC isinstance checks are slow on 10^4+ slots)
                if all(type(e) is int for e in experts):
                    ids = list(experts)
                else:
                    ids = []
                    for e in experts:
                        if isinstance(e, bool) or not isinstance(e, int | np.integer):
                            raise PlanError(f"placement[{li}][{gi}] holds {e!r}; expert ids are integers")
                        ids.append(int(e))
                if ids and (min(ids) < 0 or max(ids) >= E):
                    bad = min(ids) if min(ids) < 0 else max(ids)
                    raise PlanError(f"placement[{li}][{gi}] holds expert {bad}; ids must lie in [0, {E})")
                row.append(tuple(ids))
                lay_idx.extend([li] * len(ids))
                gpu_idx.extend([gi] * len(ids))
                exp_idx.extend(ids)
            frozen.append(tuple(row))
        L = len(frozen)
        layer_slots = [sum(len(ids) for ids in row) for row in frozen]
        if min(layer_slots) < E:  # fewer slots than experts: name a missing one before allocating [L, E, G]
            li, e = _first_missing(frozen, E)
            raise PlanError(f"expert {e} of layer {li} has no replica; every expert must be placed at least once")
        check_alloc((L, E, G), 8, "the plan's copies [L, E, G]", "num_experts must be the model's expert count")
        copies = np.zeros((L, E, G), dtype=np.int64)
        np.add.at(copies, (np.asarray(lay_idx, dtype=np.int64), np.asarray(exp_idx, dtype=np.int64),
                           np.asarray(gpu_idx, dtype=np.int64)), 1)
        missing = copies.sum(axis=2) == 0
        if missing.any():
            li, e = (int(i) for i in np.argwhere(missing)[0])
            raise PlanError(f"expert {e} of layer {li} has no replica; every expert must be placed at least once")
        warnings: list[str] = []
        dup = copies > 1
        if dup.any():
            li, e, g = (int(i) for i in np.argwhere(dup)[0])
            pairs = int(np.any(dup, axis=1).sum())
            warnings.append(
                f"{pairs} layer-GPU pairs host two copies of one expert (first: layer {li}, GPU {g}, expert {e}); "
                "such copies use memory without improving balance"
            )
        object.__setattr__(self, "gpu_experts", tuple(frozen))
        object.__setattr__(self, "copies", copies)
        object.__setattr__(self, "warnings", tuple(warnings))
        object.__setattr__(self, "params", check_layer_params(self.params, L, max(layer_slots)))
        if self.weights is not None:
            object.__setattr__(self, "weights", self._check_weights(self.weights))

    def _check_weights(self, weights: object) -> tuple[tuple[tuple[float, ...], ...], ...]:
        def seq(x: object) -> bool:
            return isinstance(x, Sequence) and not isinstance(x, str | bytes)

        if not seq(weights) or len(weights) != self.num_layers:  # type: ignore[arg-type]
            n = len(weights) if seq(weights) else type(weights).__name__  # type: ignore[arg-type]
            raise PlanError(f"weights has {n} layers but placement has {self.num_layers}; it must mirror placement")
        out = []
        for li, (wl, pl) in enumerate(zip(weights, self.gpu_experts, strict=True)):  # type: ignore[call-overload]
            if not seq(wl) or len(wl) != len(pl):
                raise PlanError(f"weights[{li}] must be a list of {len(pl)} per-GPU share lists, mirroring placement")
            row = []
            for gi, (wg, pg) in enumerate(zip(wl, pl, strict=True)):
                if not seq(wg) or len(wg) != len(pg):
                    raise PlanError(f"weights[{li}][{gi}] must list {len(pg)} shares, one per replica in placement")
                if any(isinstance(w, bool) or not isinstance(w, int | float) for w in wg):
                    raise PlanError(f"weights[{li}][{gi}] holds {list(wg)!r}; shares must be numbers")
                vals = tuple(float(w) for w in wg)
                if any(not math.isfinite(w) or w < 0 for w in vals):
                    raise PlanError(f"weights[{li}][{gi}] holds {vals}; shares must be finite and non-negative")
                row.append(vals)
            out.append(tuple(row))
            total = np.zeros(self.num_experts)
            for experts, shares in zip(pl, row, strict=True):
                np.add.at(total, np.asarray(experts, dtype=np.int64), np.asarray(shares, dtype=np.float64))
            if np.any(total <= 0):
                e = int(np.argmax(total <= 0))
                raise PlanError(f"weights[{li}] give expert {e} a total share of 0; a weighted router could not route it")
        return tuple(out)

    @property
    def dense_layers(self) -> frozenset[int]:
        """Layers recorded as an engine's dense layers (``params["dense_layers"]``; :func:`with_dense_layers`): no
        experts there in the engine, whatever the row lists."""
        return frozenset(self.params.get("dense_layers", []))

    @property
    def layer_ids(self) -> list[int] | None:
        """The model's layer number of each plan layer (``params["layer_ids"]``, recorded when the plan's load left
        dense layers out); ``None``: plan layer ``l`` is the model's layer ``l``."""
        ids = self.params.get("layer_ids")
        return None if ids is None else list(ids)

    def with_params(self, params: Mapping[str, Any], policy: str | None = None) -> Placement:
        """The same plan with other ``params`` (and ``policy``), without validating the placement again (the params'
        layer lists are checked: :func:`check_layer_params`)."""
        out = object.__new__(type(self))
        for name in ("gpu_experts", "num_experts", "cluster", "weights", "copies", "warnings"):
            object.__setattr__(out, name, getattr(self, name))
        object.__setattr__(out, "params", check_layer_params(params, self.num_layers,
                                                             int(self.copies.sum(axis=(1, 2)).max())))
        object.__setattr__(out, "policy", self.policy if policy is None else policy)
        return out

    # ----- shape facts -------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.gpu_experts)

    @property
    def num_gpus(self) -> int:
        return self.cluster.num_gpus

    def replica_counts(self) -> np.ndarray:
        """``int64 [L, E]``: replicas of each expert (``r[l, e] >= 1``)."""
        return self.copies.sum(axis=2)

    def slots(self) -> np.ndarray:
        """``int64 [L, G]``: experts hosted by GPU ``g`` in layer ``l``."""
        return self.copies.sum(axis=1)

    @property
    def extra_replicas(self) -> int:
        """Physical slots minus logical experts, summed over layers (the memory the plan costs)."""
        return int(self.copies.sum()) - self.num_layers * self.num_experts

    @property
    def max_slots_per_gpu(self) -> int:
        """The most experts any GPU hosts in any one layer (EPLB's ``slots_per_gpu``)."""
        return int(self.slots().max())

    def replica_gpus(self) -> np.ndarray:
        """``int64 [L, E, R]``: the GPU of each replica of each expert, in GPU order, padded with -1."""
        L, E, G = self.copies.shape
        R = int(self.replica_counts().max())
        flat = self.copies.reshape(L * E, G)
        # Repeat each GPU id by its copy count, row by row, then left-align into R columns.
        rows = np.repeat(np.arange(L * E), flat.sum(axis=1))
        gpus = np.repeat(np.tile(np.arange(G), L * E), flat.ravel())
        start = np.concatenate(([0], np.cumsum(flat.sum(axis=1))[:-1]))
        col = np.arange(rows.size) - start[rows]
        out = np.full((L * E, R), -1, dtype=np.int64)
        out[rows, col] = gpus
        return out.reshape(L, E, R)

    # ----- EPLB tensors ------------------------------------------------------------------------------------
    def to_eplb(self) -> EplbTensors:
        """This plan as ``(phy2log, log2phy, logcnt)``; needs the same slot count on every GPU and layer."""
        slots = self.slots()
        S = int(slots[0, 0])
        if not np.all(slots == S):
            raise PlanError(
                f"EPLB tensors need equal slots on every GPU and layer, but this plan has {int(slots.min())} to "
                f"{int(slots.max())}; CRAFT-style plans have no phy2log form"
            )
        phy2log = np.asarray(self.gpu_experts, dtype=np.int64).reshape(self.num_layers, -1)
        return EplbTensors(phy2log=phy2log, log2phy=_log2phy(phy2log, self.num_experts), logcnt=self.replica_counts())

    @classmethod
    def from_eplb(cls, phy2log: Any, cluster: Cluster, *, num_experts: int | None = None, policy: str = "eplb",
                  params: Mapping[str, Any] | None = None) -> Placement:
        """Build from ``phy2log [L, P]`` (numpy or torch); slot ``p`` lives on GPU ``p // (P / G)``."""
        arr = np.asarray(phy2log.cpu().numpy() if hasattr(phy2log, "cpu") else phy2log)
        if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
            raise PlanError(f"phy2log must be an integer [L, P] array, got {arr.dtype} {arr.shape}")
        L, P = arr.shape
        G = cluster.num_gpus
        if P % G:
            raise PlanError(f"phy2log has {P} physical slots, which {G} GPUs cannot share equally")
        E = int(arr.max()) + 1 if num_experts is None else num_experts
        layers = arr.reshape(L, G, P // G).tolist()
        return cls(layers, E, cluster, policy=policy, params=params or {})

    # ----- JSON --------------------------------------------------------------------------------------------
    def to_json_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "policy": self.policy,
            "params": dict(self.params),
            "cluster": self.cluster.to_dict(),
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "placement": [[list(g) for g in layer] for layer in self.gpu_experts],
        }
        if self.weights is not None:
            out["weights"] = [[list(g) for g in layer] for layer in self.weights]
        return out

    @classmethod
    def from_json_dict(cls, doc: Any, source: str = "plan") -> Placement:
        """Validate a parsed plan document; the error names the first thing that is wrong."""
        if not isinstance(doc, dict):
            raise PlanError(f"{source} must hold a JSON object, not {type(doc).__name__}")
        if doc.get("format") != PLAN_FORMAT:
            raise PlanError(f"{source} has format {doc.get('format')!r}; expected {PLAN_FORMAT!r}")
        if type(doc.get("version")) is not int or doc.get("version") != PLAN_VERSION:
            raise PlanError(f"{source} has version {doc.get('version')!r}; this moebalance reads version {PLAN_VERSION}")
        for key in ("cluster", "num_layers", "num_experts", "placement"):
            if key not in doc:
                raise PlanError(f"{source} lacks the key {key!r}")
        cl = doc["cluster"]
        if not isinstance(cl, dict) or "num_nodes" not in cl or "gpus_per_node" not in cl:
            raise PlanError(f"{source}: 'cluster' must be {{\"num_nodes\": N, \"gpus_per_node\": M}}")
        unknown = sorted(set(cl) - {"num_nodes", "gpus_per_node"})
        if unknown:
            raise PlanError(f"{source}: 'cluster' has unknown keys {unknown}; it holds only num_nodes and gpus_per_node")
        try:
            cluster = Cluster(num_nodes=cl["num_nodes"], gpus_per_node=cl["gpus_per_node"])
        except InputError as exc:
            raise PlanError(f"{source}: cluster: {exc}") from None
        num_layers, num_experts = doc["num_layers"], doc["num_experts"]
        for key, v in (("num_layers", num_layers), ("num_experts", num_experts)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"{source}: {key} ({v!r}) must be a positive integer")
        placement = doc["placement"]
        if not isinstance(placement, list) or len(placement) != num_layers:
            n = len(placement) if isinstance(placement, list) else type(placement).__name__
            raise PlanError(f"{source}: placement has {n} layers but num_layers is {num_layers}")
        params = doc.get("params", {})
        if not isinstance(params, dict):
            raise PlanError(f"{source}: 'params' must be a JSON object")
        policy = doc.get("policy", "custom")
        if not isinstance(policy, str):
            raise PlanError(f"{source}: 'policy' must be a string, not {policy!r}")
        return cls(placement, num_experts, cluster, policy=policy, params=params, weights=doc.get("weights"))


def _first_missing(rows: Sequence[Sequence[Sequence[int]]], num_experts: int) -> tuple[int, int]:
    """``(layer, expert)`` of the first expert without a replica, in layer order (one is known to exist)."""
    for li, row in enumerate(rows):
        present = {e for ids in row for e in ids}
        if len(present) < num_experts:
            return li, next(e for e in range(num_experts) if e not in present)  # at most len(present) + 1 steps
    raise AssertionError("every expert is placed")


def _int_list(value: object, key: str) -> list[int]:
    """``value`` as a list of Python ints, or a :class:`PlanError` naming ``params.<key>``."""
    if not isinstance(value, list | tuple | np.ndarray) or (isinstance(value, np.ndarray) and value.ndim != 1):
        raise PlanError(f"params.{key} ({repr(value)[:60]}) must be a list of layer numbers")
    for x in value:
        if isinstance(x, bool | np.bool_) or not isinstance(x, int | np.integer):
            raise PlanError(f"params.{key} holds {repr(x)[:60]}; layer numbers are integers, like [0, 1, 2]")
    return [int(x) for x in value]


def check_layer_params(params: Mapping[str, Any], num_layers: int, slots_per_layer: int) -> dict[str, Any]:
    """``params`` as a dict with ``layer_ids`` and ``dense_layers`` checked against a plan of ``num_layers`` layers
    (of at most ``slots_per_layer`` slots), as lists of Python ints; a :class:`PlanError` names the first problem.

    ``layer_ids`` (the model's layer number of each plan layer) must be ``num_layers`` strictly increasing
    non-negative integers; an engine export writes rows up to the largest, so their size is checked too.
    ``dense_layers`` (plan layers without experts in the engine) must be distinct plan layers ``0..L-1``.
    """
    out = dict(params)
    if "layer_ids" in out:
        ids = _int_list(out["layer_ids"], "layer_ids")
        if len(ids) != num_layers:
            raise PlanError(f"params.layer_ids lists {len(ids)} layers but the plan has {num_layers}; it gives the "
                            "model's layer number of each plan layer")
        if ids[0] < 0 or any(b <= a for a, b in itertools.pairwise(ids)):
            shown = str(ids) if len(ids) <= 8 else f"{str(ids[:8])[:-1]}, ...]"
            raise PlanError(f"params.layer_ids {shown} must be strictly increasing non-negative layer numbers, "
                            "one per plan layer")
        try:  # an export holds each slot as an int64, a list item and JSON text: about 48 bytes
            check_alloc((ids[-1] + 1, slots_per_layer), 48, f"an engine export's rows [model layers, slots] for "
                        f"params.layer_ids up to {ids[-1]:,}", "layer_ids are the model's decoder-layer numbers")
        except InputError as exc:
            raise PlanError(str(exc)) from None
        out["layer_ids"] = ids
    if "dense_layers" in out:
        dense = _int_list(out["dense_layers"], "dense_layers")
        bad = [x for x in dense if not 0 <= x < num_layers]
        if bad:
            raise PlanError(f"params.dense_layers names layer {bad[0]} but the plan's layers are 0..{num_layers - 1}")
        if len(set(dense)) != len(dense):
            dup = next(x for i, x in enumerate(dense) if x in dense[:i])
            raise PlanError(f"params.dense_layers names layer {dup} twice; list each dense layer once")
        out["dense_layers"] = dense
    return out


def _log2phy(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """``log2phy [L, E, R]`` from ``phy2log [L, P]``: replicas numbered in physical-slot order."""
    L, P = phy2log.shape
    counts = np.zeros((L, num_experts), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(L), P), phy2log.ravel()), 1)
    R = int(counts.max())
    # The rank of slot p among its expert's slots: stable sort by expert, position within the run.
    order = np.argsort(phy2log, axis=1, kind="stable")
    sorted_log = np.take_along_axis(phy2log, order, axis=1)
    starts = np.concatenate([np.zeros((L, 1), dtype=np.int64), np.cumsum(counts, axis=1)[:, :-1]], axis=1)
    rank_sorted = np.arange(P)[None, :] - np.take_along_axis(starts, sorted_log, axis=1)
    out = np.full((L, num_experts, R), -1, dtype=np.int64)
    out[np.repeat(np.arange(L), P), sorted_log.ravel(), rank_sorted.ravel()] = order.ravel()
    return out


def with_dense_layers(plan: Placement, dense: Sequence[int]) -> Placement:
    """``plan`` with the layers ``dense`` (an engine's dense layers: no experts there) in contiguous blocks, no copies.

    A plan keeps a row for a dense layer only to follow the model's numbering, so the row costs the least it can:
    ``E / G`` consecutive experts per GPU, the ``E mod G`` one-larger blocks on the GPUs that hold the fewest slots
    over the plan's other layers so far (ties to the lower id), so per-GPU memory stays as even as the plan made it;
    weights 1. The layers are recorded in ``params["dense_layers"]``.
    """
    dense = sorted({int(x) for x in dense})
    if not dense:
        return plan
    E, G = plan.num_experts, plan.num_gpus
    q, m = divmod(E, G)
    dense_set = set(dense)
    total = np.array([sum(len(row[g]) for layer, row in enumerate(plan.gpu_experts) if layer not in dense_set)
                      for g in range(G)])
    rows: list[Any] = list(plan.gpu_experts)
    weights: list[Any] | None = None if plan.weights is None else list(plan.weights)
    for layer in dense:
        sizes = np.full(G, q)
        sizes[np.argsort(total, kind="stable")[:m]] += 1
        total += sizes
        ends = np.cumsum(sizes)
        rows[layer] = [list(range(int(end - n), int(end))) for end, n in zip(ends, sizes, strict=True)]
        if weights is not None:
            weights[layer] = [[1.0] * int(n) for n in sizes]
    return Placement(rows, E, plan.cluster, policy=plan.policy, params={**plan.params, "dense_layers": dense},
                     weights=weights)


def write_plan(path: str | os.PathLike[str], plan: Placement) -> None:
    """Write ``plan`` as JSON, atomically (temporary file in the same folder, then rename)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(plan.to_json_dict(), separators=(",", ":")) + "\n")


def read_plan(path: str | os.PathLike[str]) -> Placement:
    """Read and validate a plan file."""
    return Placement.from_json_dict(read_json(path, "plan file", error=PlanError), source=str(Path(path)))
