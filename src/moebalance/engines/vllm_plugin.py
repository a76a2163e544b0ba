"""A vLLM plug-in that puts moebalance behind vLLM's EPLB policy (``pip install moebalance[vllm]``).

Legend: ``L`` MoE layers, ``E`` logical experts, ``P`` = ``num_replicas`` physical slots, ``R`` = ``num_ranks``.

vLLM loads every entry point of the ``vllm.general_plugins`` group in every process
(``vllm/plugins/__init__.py``, ``load_general_plugins``). Its EPLB picks the policy class
``EPLB_POLICIES[eplb_config.policy]`` (``vllm/distributed/eplb/policy/__init__.py``; only ``"default"`` exists)
and calls the classmethod ``rebalance_experts(weight [L, E], num_replicas, num_groups, num_nodes, num_ranks)``,
which returns the physical-to-logical map ``[L, P]`` (rank ``r`` owning slots ``r * P / R ..``). Releases differ in
three ways: the oldest call it with five arguments and unpack ``(phy2log, log2phy, logcnt)``; one passes the
current map as ``old_global_expert_indices`` and still unpacks the three; newer ones pass it and take ``phy2log``
alone (:func:`returns_tuple` tells them apart by the default policy's return annotation). When the current map is
given, every variant keeps an expert that stays on its rank in its old slot, as vLLM's default does. No public hook
registers another policy, so :func:`register` replaces the ``"default"`` entry, and only when
``MOEBALANCE_VLLM_EPLB`` names a variant:

- ``eplb``: DeepSeek's EPLB, bit-identical to the reference (:func:`moebalance.eplb.rebalance_experts`);
- ``eplb-no-duplicates``: the same, with two copies of one expert on one GPU swapped apart
  (:func:`moebalance.algorithms.packing.repair_duplicates`): a second copy on the same GPU takes a slot and
  balances nothing;
- ``move-aware``: honours ``old_global_expert_indices`` (vLLM RFC #31671 asks for migration-aware placement):
  the current placement is kept, no expert moved, while its balancedness is within ``MOEBALANCE_VLLM_EPLB_TOLERANCE``
  (default 0.02, relative) of a fresh EPLB plan's; otherwise the fresh plan is laid onto the ranks as ``aligned``
  migration lays a re-plan (:func:`moebalance.algorithms.migration.align_rows`, the per-layer step of ``align``):
  each rank takes the fresh per-GPU set that keeps the most distinct experts it holds (an exact assignment per
  layer: no more experts received than by the fresh plan as laid out, often far fewer; a second copy of an expert
  a rank keeps is a local copy) and an expert staying on a rank keeps its slot. Where the fresh plan is
  hierarchical EPLB (``num_nodes > 1`` dividing ``num_groups`` and ``num_ranks``) whole nodes are matched as
  blocks, then ranks within a node, so each node keeps the groups the fresh plan packed onto it. When the
  slot count changes otherwise (elastic EP), the fresh plan is taken as it is; after a scale-down the ranks that stay
  keep their old blocks as the current placement (:func:`surviving`). After an elastic scale-up vLLM passes the
  current map with ``-1`` in the slots it added: those are empty slots, never an expert id. The current placement
  is then judged with them filled (:func:`fill_empty`: experts without a copy first, then the most load per copy),
  and kept only if it holds every expert; no variant ever returns ``-1``.

**Records for** ``moebalance watch``: with ``MOEBALANCE_RECORD_DIR`` set, every call (on the process of rank 0, or
the only one) also writes a record there (:func:`record`): ``vllm-eplb-{ns}-{pid}.npz`` with the load window
``counts [1, L, E]`` vLLM passed (rounded to whole picks), the maps before (``old_map [L, P]``, absent when vLLM
passed none) and after (``new_map [L, P]``), the copies received (``moved``), ``num_ranks`` and the ``variant``,
written atomically (a temporary file, then a rename); ``watch`` reads its counts like any moebalance load.

:func:`register` logs (logger ``"moebalance"``, level INFO) which variant replaced vLLM's policy, and warns when
``MOEBALANCE_VLLM_EPLB`` is set but empty (ignored, as unset). A vLLM that
``VLLM_PLUGINS`` tells to skip the plug-in runs none of its code; :func:`skipped` says so from the environment.

Balancedness here is vLLM's: ``mean / max`` of per-rank load, each expert's load split evenly over its copies.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.core.errors import InputError

__all__ = ["ENTRY_POINT", "ENV", "RECORD_ENV", "TOLERANCE_ENV", "VARIANTS", "balancedness", "fill_empty", "keep_slots",
           "make_policy", "move_aware", "plan_slots", "record", "register", "returns_tuple", "skipped", "surviving"]

#: The environment variable that chooses the variant; unset, the plug-in does nothing.
ENV = "MOEBALANCE_VLLM_EPLB"
#: The plug-in's entry-point name in the ``vllm.general_plugins`` group (what ``VLLM_PLUGINS`` must list).
ENTRY_POINT = "moebalance_eplb"
TOLERANCE_ENV = "MOEBALANCE_VLLM_EPLB_TOLERANCE"
#: The folder each call's record is written to (module docstring); unset, nothing is recorded.
RECORD_ENV = "MOEBALANCE_RECORD_DIR"
VARIANTS = ("eplb", "eplb-no-duplicates", "move-aware")

logger = logging.getLogger("moebalance")


def balancedness(phy2log: np.ndarray, weight: np.ndarray, num_ranks: int) -> np.ndarray:
    """``float64 [L]``: ``mean / max`` of per-rank load of ``phy2log [L, P]`` on ``weight [L, E]`` (1 for an idle
    layer)."""
    L, P = phy2log.shape
    E = weight.shape[1]
    copies = np.zeros((L, E))
    np.add.at(copies, (np.repeat(np.arange(L), P), phy2log.ravel()), 1.0)
    per_slot = np.take_along_axis(weight, phy2log, axis=1) / np.take_along_axis(copies, phy2log, axis=1)
    rank = per_slot.reshape(L, num_ranks, P // num_ranks).sum(axis=2)
    peak = rank.max(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(peak > 0, rank.mean(axis=1) / np.where(peak > 0, peak, 1.0), 1.0)


def plan_slots(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
               avoid_duplicates: bool = False) -> np.ndarray:
    """``int64 [L, P]``: DeepSeek's EPLB, optionally with same-GPU copies swapped apart."""
    from moebalance.algorithms.eplb import eplb_plan
    from moebalance.algorithms.packing import repair_duplicates

    phy2log = np.asarray(eplb_plan(weight, num_replicas=num_replicas, num_groups=num_groups, num_nodes=num_nodes,
                                   num_gpus=num_ranks).physical_to_logical, dtype=np.int64)
    if avoid_duplicates:
        slot_gpu = np.broadcast_to(np.arange(num_replicas) // (num_replicas // num_ranks), phy2log.shape)
        gpus_per_node = num_ranks // num_nodes if num_nodes and num_ranks % num_nodes == 0 else num_ranks
        phy2log, _ = repair_duplicates(slot_gpu, phy2log, weight, gpus_per_node)
    return np.asarray(phy2log, dtype=np.int64)


def fill_empty(old: np.ndarray, weight: np.ndarray, num_ranks: int) -> np.ndarray:
    """``old [L, P]`` with every empty slot (``-1``, as vLLM marks the slots an elastic scale-up adds) filled, in
    slot order: an expert without a copy first (heaviest first), else the one with the most load per copy, never
    one the slot's rank already holds while another is left (ties: fewer copies, then the lower id). On an idle
    window this gives the missing experts in id order, then extra copies round the experts in id order."""
    out = np.array(old, dtype=np.int64)
    E, S = weight.shape[1], old.shape[1] // num_ranks
    ids = np.arange(E)
    for layer in np.flatnonzero((out < 0).any(axis=1)):
        row = out[layer]
        copies = np.bincount(row[row >= 0], minlength=E)
        for p in np.flatnonzero(row < 0):
            block = row[(p // S) * S:(p // S + 1) * S]
            elsewhere = ~np.isin(ids, block[block >= 0])
            cand = ids[elsewhere] if elsewhere.any() else ids
            share = weight[layer, cand] / np.maximum(copies[cand], 1)
            e = int(cand[np.lexsort((cand, copies[cand], -share, copies[cand] > 0))[0]])
            row[p] = e
            copies[e] += 1
    return out


def move_aware(old: np.ndarray, fresh: np.ndarray, weight: np.ndarray, num_ranks: int,
               tolerance: float, num_nodes: int = 1) -> np.ndarray:
    """``int64 [L, P]``: per layer, ``old`` (its empty slots filled, :func:`fill_empty`) if it holds every expert
    and its balancedness is within ``tolerance`` of ``fresh``'s, else ``fresh`` laid onto the ranks as
    :func:`moebalance.algorithms.migration.align` lays a plan (:func:`~moebalance.algorithms.migration.align_rows`
    on ``old``'s rank blocks, its empty slots keeping nothing): each rank takes the fresh block that keeps the most
    of the experts it holds, staying experts in their old slots (module docstring); ``num_nodes > 1``: whole nodes of
    ``num_ranks // num_nodes`` ranks are matched as blocks (hierarchical plans). Never returns an empty slot."""
    from moebalance.algorithms.migration import align_rows

    old = surviving(old, fresh, num_ranks)
    if old.shape != fresh.shape or fresh.shape[1] % num_ranks:  # elastic EP changed the slots: nothing to keep
        return fresh
    P = fresh.shape[1]
    S = P // num_ranks
    E = weight.shape[1]
    filled = fill_empty(old, weight, num_ranks)
    present = np.zeros((filled.shape[0], E), dtype=bool)
    present[np.repeat(np.arange(filled.shape[0]), P), filled.ravel()] = True
    keep = present.all(axis=1) & \
        (balancedness(filled, weight, num_ranks) >= (1.0 - tolerance) * balancedness(fresh, weight, num_ranks))
    out = filled
    nodes = (num_nodes, num_ranks // num_nodes) if num_nodes > 1 and num_ranks % num_nodes == 0 else None
    for layer in np.flatnonzero(~keep):
        new_blocks = fresh[layer].reshape(num_ranks, S)
        picks = align_rows(old[layer].reshape(num_ranks, S).tolist(), new_blocks.tolist(), E, node_blocks=nodes)
        out[layer] = np.concatenate([new_blocks[b][ks] for b, ks in picks])
    return out


def surviving(old: np.ndarray, fresh: np.ndarray, num_ranks: int) -> np.ndarray:
    """``old [L, P_old]`` cut to the slots of the ranks that stay after an elastic scale-down, else ``old``. vLLM keeps
    the slots per rank and releases the ranks from the new size up, renumbering none (vLLM 0.33
    ``distributed/elastic_ep/elastic_execute.py``: old rank ``r`` becomes ``r`` if ``r < new_ep_size``, else -1),
    so rank ``r`` keeps its old block ``r``, as vLLM's default policy pairs them."""
    P = fresh.shape[1]
    if old.ndim != 2 or old.shape[0] != fresh.shape[0] or old.shape[1] <= P or P % num_ranks \
            or old.shape[1] % (P // num_ranks):
        return old
    return old[:, :P]


def keep_slots(old: np.ndarray, fresh: np.ndarray, num_ranks: int) -> np.ndarray:
    """``fresh [L, P]`` with, in every rank block, the experts that were already there kept in their old slots
    (:func:`moebalance.algorithms.migration.in_place_order`)."""
    from moebalance.algorithms.migration import in_place_order

    S = fresh.shape[1] // num_ranks
    out = fresh.copy()
    for layer in range(fresh.shape[0]):
        for r in range(num_ranks):
            block = slice(r * S, (r + 1) * S)
            out[layer, block] = fresh[layer, block][in_place_order(old[layer, block].tolist(),
                                                                   fresh[layer, block].tolist())]
    return out


def make_policy(variant: str, base: type | None = None) -> type:
    """The policy class for ``variant``, a subclass of ``base`` (vLLM's abstract policy) when given."""
    if variant not in VARIANTS:
        raise InputError(f"{ENV}={variant!r} is not a moebalance EPLB variant; choose one of: {', '.join(VARIANTS)}")
    try:
        tolerance = float(os.environ.get(TOLERANCE_ENV, "0.02"))
    except ValueError:
        raise InputError(f"{TOLERANCE_ENV} must be a number like 0.02, got {os.environ[TOLERANCE_ENV]!r}") from None
    if not 0.0 <= tolerance < 1.0:
        raise InputError(f"{TOLERANCE_ENV} ({tolerance}) must be in [0, 1)")

    def rebalance_experts(cls: type, weight: Any, num_replicas: int, num_groups: int, num_nodes: int,
                          num_ranks: int, old_global_expert_indices: Any = None) -> Any:
        import torch

        w = weight.detach().cpu().double().numpy() if isinstance(weight, torch.Tensor) else np.asarray(weight, float)
        fresh = plan_slots(w, num_replicas, num_groups, num_nodes, num_ranks, variant == "eplb-no-duplicates")
        if old_global_expert_indices is not None:
            old = old_global_expert_indices
            old_np = (old.detach().cpu().numpy() if isinstance(old, torch.Tensor) else np.asarray(old)).astype(np.int64)
            if old_np.size and (old_np.min() < -1 or old_np.max() >= w.shape[1]):
                bad = int(old_np.min() if old_np.min() < -1 else old_np.max())
                raise InputError(f"old_global_expert_indices holds {bad}; vLLM marks an empty slot -1 and the experts "
                                 f"0..{w.shape[1] - 1}")
            if variant == "move-aware":
                hierarchical = num_nodes > 1 and num_groups % num_nodes == 0 and num_ranks % num_nodes == 0
                fresh = move_aware(old_np, fresh, w, num_ranks, tolerance, num_nodes if hierarchical else 1)
            elif surviving(old_np, fresh, num_ranks).shape == fresh.shape and fresh.shape[1] % num_ranks == 0:
                # as vLLM's default: experts staying on a rank keep their slot (a scale-down's surviving ranks too)
                fresh = keep_slots(surviving(old_np, fresh, num_ranks), fresh, num_ranks)
        folder = os.environ.get(RECORD_ENV)
        if folder and _rank_zero():
            record(folder, w, None if old_global_expert_indices is None else old_np, fresh, num_ranks, variant)
        return torch.from_numpy(np.ascontiguousarray(fresh))

    rebalance_experts.__doc__ = (f"moebalance {variant}: ``phy2log [L, num_replicas]`` for ``weight [L, E]`` "
                                 "(vLLM's EPLB policy interface)")
    return type(f"Moebalance{variant.title().replace('-', '')}Policy", (base,) if base is not None else (),
                {"rebalance_experts": classmethod(rebalance_experts), "variant": variant})


def _rank_zero() -> bool:
    """Whether this process is rank 0 of the default process group, or in none."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def record(folder: str | os.PathLike[str], weight: np.ndarray, old: np.ndarray | None, new: np.ndarray,
           num_ranks: int, variant: str) -> Path:
    """Write one call's record into ``folder`` (module docstring), atomically; returns its path."""
    from moebalance.core.io import atomic_path

    w = np.asarray(weight, dtype=np.float64)
    if w.ndim != 2 or not np.all(np.isfinite(w)) or (w.size and w.min() < 0):
        raise InputError(f"the load window vLLM passed has shape {w.shape} or values no count has; expected [L, E] "
                         ">= 0")
    new = np.asarray(new, dtype=np.int64)
    arrays: dict[str, np.ndarray] = {"counts": np.rint(w).astype(np.int64)[None], "new_map": new,
                                     "num_ranks": np.array(num_ranks), "variant": np.array(variant)}
    moved = 0
    if old is not None:
        old = np.asarray(old, dtype=np.int64)
        arrays["old_map"] = old
        if old.shape == new.shape and new.shape[1] % num_ranks == 0:
            per = new.shape[1] // num_ranks
            for layer in range(new.shape[0]):
                for r in range(num_ranks):
                    had = set(old[layer, r * per:(r + 1) * per].tolist())
                    moved += sum(1 for e in set(new[layer, r * per:(r + 1) * per].tolist()) if e not in had)
    arrays["moved"] = np.array(moved)
    target = Path(folder) / f"vllm-eplb-{time.time_ns()}-{os.getpid()}.npz"
    with atomic_path(target) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)  # type: ignore[arg-type]
    return target


def _tuple_returning(policy: type) -> type:
    """For a vLLM whose policy returns ``(phy2log, log2phy, logcnt)`` (no ``old_global_expert_indices``)."""
    import torch

    inner = getattr(policy, "rebalance_experts")  # noqa: B009 (a classmethod set by make_policy)

    def rebalance_experts(cls: type, weight: Any, num_replicas: int, num_groups: int, num_nodes: int,
                          num_ranks: int, old_global_expert_indices: Any = None) -> Any:
        from moebalance.core.cluster import Cluster
        from moebalance.core.plan import Placement

        phy2log = inner(weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices)
        tensors = Placement.from_eplb(phy2log, Cluster(num_nodes=1, gpus_per_node=num_ranks),
                                      num_experts=int(weight.shape[1])).to_eplb()
        return phy2log, torch.from_numpy(tensors.log2phy), torch.from_numpy(tensors.logcnt.astype(np.int64))

    return type(policy.__name__, (policy,), {"rebalance_experts": classmethod(rebalance_experts)})


def register() -> None:
    """The ``vllm.general_plugins`` entry point: replace vLLM's ``"default"`` EPLB policy by the variant
    ``$MOEBALANCE_VLLM_EPLB`` names, and log which (logger ``"moebalance"``); do nothing when it is unset, and warn
    that it is ignored when it is set but empty.

    The variant is checked before vLLM is looked at, so a wrong name is named whatever vLLM is installed; a vLLM
    without pluggable policies (no ``vllm.distributed.eplb.policy``, or no ``EPLB_POLICIES`` in it) is one
    :class:`InputError` line saying what is needed."""
    variant = os.environ.get(ENV)
    if variant == "":  # set but empty (an unfilled template, `export VAR=`): say so rather than run vLLM's own
        logger.warning("%s is set but empty, so it is ignored and vLLM's EPLB policy stays its own; set it to one of "
                       "%s, or unset it", ENV, ", ".join(VARIANTS))
        return
    if variant is None:
        return
    make_policy(variant)  # a wrong variant or tolerance fails here, with the valid choices
    need = (f"{ENV}={variant} needs a vLLM whose EPLB has pluggable policies (vllm.distributed.eplb.policy with "
            "EPLB_POLICIES); upgrade vLLM or unset the variable")
    try:  # only reached inside vLLM, with the variable set
        from vllm.distributed.eplb import policy as vllm_policy
    except ImportError as exc:  # no such module, or one that fails to import (a dependency missing)
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{need} (importing it failed: {first})") from None
    registry = getattr(vllm_policy, "EPLB_POLICIES", None)
    if not isinstance(registry, dict) or "default" not in registry:
        lacks = "no EPLB_POLICIES" if registry is None else "no 'default' entry in EPLB_POLICIES"
        raise InputError(f"{need} (this vLLM's policy module has {lacks})")
    default = registry["default"]
    cls = make_policy(variant, getattr(vllm_policy, "AbstractEplbPolicy", None))
    if returns_tuple(default):
        cls = _tuple_returning(cls)
    registry["default"] = cls
    logger.info("vLLM's EPLB policy 'default' (%s) replaced by moebalance's %s (%s=%s)",
                getattr(default, "__name__", repr(default)), variant, ENV, variant)


def skipped(environ: Mapping[str, str] | None = None) -> str | None:
    """Why vLLM will not load the plug-in although ``MOEBALANCE_VLLM_EPLB`` asks for it, or ``None``.

    vLLM loads only the plug-ins ``VLLM_PLUGINS`` (comma-separated entry-point names) lists, when it is set, and a
    plug-in it does not load runs no code: :func:`register` cannot say it was skipped. This check, for a launch
    script or ``make engines``, can."""
    env = os.environ if environ is None else environ
    variant, allowed = env.get(ENV), env.get("VLLM_PLUGINS")
    if not variant or allowed is None:
        return None
    names = [x.strip() for x in allowed.split(",") if x.strip()]
    if ENTRY_POINT in names:
        return None
    return (f"{ENV}={variant} asks for moebalance's EPLB policy, but VLLM_PLUGINS={allowed!r} does not name "
            f"{ENTRY_POINT!r}, so vLLM will not load the plug-in: add {ENTRY_POINT} to VLLM_PLUGINS")


def returns_tuple(default: Any) -> bool:
    """Whether vLLM's default policy returns ``(phy2log, log2phy, logcnt)`` rather than ``phy2log`` alone: from its
    return annotation (a release takes ``old_global_expert_indices`` and still returns the three), else from its
    parameters (releases without ``old_global_expert_indices`` return the three)."""
    sig = inspect.signature(default.rebalance_experts)
    ann = sig.return_annotation
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))
    if ann is not inspect.Signature.empty:
        if "tuple" in str(text).lower() or "Tuple" in repr(ann):
            return True
        if "Tensor" in str(text) or "Tensor" in repr(ann):
            return False
    return "old_global_expert_indices" not in sig.parameters
