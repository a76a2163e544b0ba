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
  (default 0.02, relative) of a fresh EPLB plan's; otherwise the fresh plan's per-GPU sets are matched to the ranks
  that already hold most of their experts (an assignment problem per layer: no more moves than the fresh plan
  as laid out, often far fewer) and an expert staying on a rank keeps its slot. The matching may move a GPU's set
  to another node, which leaves the balance as it is but not hierarchical EPLB's group-to-node packing. When the
  slot count changed (elastic EP), the fresh plan is taken as it is.

Balancedness here is vLLM's: ``mean / max`` of per-rank load, each expert's load split evenly over its copies.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import numpy as np

from moebalance.core.errors import InputError

__all__ = ["ENV", "TOLERANCE_ENV", "VARIANTS", "balancedness", "keep_slots", "make_policy", "move_aware", "plan_slots",
           "register", "returns_tuple"]

#: The environment variable that chooses the variant; unset, the plug-in does nothing.
ENV = "MOEBALANCE_VLLM_EPLB"
TOLERANCE_ENV = "MOEBALANCE_VLLM_EPLB_TOLERANCE"
VARIANTS = ("eplb", "eplb-no-duplicates", "move-aware")


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


def move_aware(old: np.ndarray, fresh: np.ndarray, weight: np.ndarray, num_ranks: int,
               tolerance: float) -> np.ndarray:
    """``int64 [L, P]``: per layer, ``old`` if its balancedness is within ``tolerance`` of ``fresh``'s, else
    ``fresh`` with its rank blocks matched to the ranks holding most of their experts and staying experts in
    their old slots (module docstring)."""
    from scipy.optimize import linear_sum_assignment

    if old.shape != fresh.shape or fresh.shape[1] % num_ranks:  # elastic EP changed the slots: nothing to keep
        return fresh
    P = fresh.shape[1]
    S = P // num_ranks
    keep = balancedness(old, weight, num_ranks) >= (1.0 - tolerance) * balancedness(fresh, weight, num_ranks)
    out = old.copy()
    E = weight.shape[1]
    for layer in np.flatnonzero(~keep):
        new_blocks = fresh[layer].reshape(num_ranks, S)
        old_blocks = old[layer].reshape(num_ranks, S)
        have = np.zeros((num_ranks, E))
        np.add.at(have, (np.repeat(np.arange(num_ranks), S), old_blocks.ravel()), 1.0)
        want = np.zeros((num_ranks, E))
        np.add.at(want, (np.repeat(np.arange(num_ranks), S), new_blocks.ravel()), 1.0)
        overlap = np.minimum(want[:, None, :], have[None, :, :]).sum(axis=2)  # [new block, rank]
        blocks, ranks = linear_sum_assignment(-overlap)
        for b, r in zip(blocks, ranks, strict=True):
            out[layer, r * S:(r + 1) * S] = _keep_slots(old_blocks[r], new_blocks[b])
    return out


def keep_slots(old: np.ndarray, fresh: np.ndarray, num_ranks: int) -> np.ndarray:
    """``fresh [L, P]`` with, in every rank block, the experts that were already there kept in their old slots."""
    S = fresh.shape[1] // num_ranks
    out = fresh.copy()
    for layer in range(fresh.shape[0]):
        for r in range(num_ranks):
            out[layer, r * S:(r + 1) * S] = _keep_slots(old[layer, r * S:(r + 1) * S], fresh[layer, r * S:(r + 1) * S])
    return out


def _keep_slots(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``new``'s experts in ``old``'s slot order where they were already there, the rest in the free slots."""
    slots = np.full(old.shape, -1, dtype=np.int64)
    todo = list(new)
    for i, e in enumerate(old):
        if e in todo:
            slots[i] = e
            todo.remove(e)
    free = np.flatnonzero(slots < 0)
    slots[free] = todo
    return slots


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
            if variant == "move-aware":
                fresh = move_aware(old_np, fresh, w, num_ranks, tolerance)
            elif old_np.shape == fresh.shape and fresh.shape[1] % num_ranks == 0:
                fresh = keep_slots(old_np, fresh, num_ranks)  # as vLLM's default: experts staying keep their slot
        return torch.from_numpy(np.ascontiguousarray(fresh))

    rebalance_experts.__doc__ = (f"moebalance {variant}: ``phy2log [L, num_replicas]`` for ``weight [L, E]`` "
                                 "(vLLM's EPLB policy interface)")
    return type(f"Moebalance{variant.title().replace('-', '')}Policy", (base,) if base is not None else (),
                {"rebalance_experts": classmethod(rebalance_experts), "variant": variant})


def _tuple_returning(policy: type) -> type:
    """For a vLLM whose policy returns ``(phy2log, log2phy, logcnt)`` (no ``old_global_expert_indices``)."""
    import torch

    inner = getattr(policy, "rebalance_experts")  # noqa: B009 (a classmethod set by make_policy)

    def rebalance_experts(cls: type, weight: Any, num_replicas: int, num_groups: int, num_nodes: int,
                          num_ranks: int, old_global_expert_indices: Any = None) -> Any:
        from moebalance.core.plan import _log2phy

        phy2log = inner(weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices)
        E = int(weight.shape[1])
        log2phy = _log2phy(phy2log.numpy(), E)
        logcnt = np.stack([np.bincount(row, minlength=E) for row in phy2log.numpy()])
        return phy2log, torch.from_numpy(log2phy), torch.from_numpy(logcnt.astype(np.int64))

    return type(policy.__name__, (policy,), {"rebalance_experts": classmethod(rebalance_experts)})


def register() -> None:
    """The ``vllm.general_plugins`` entry point: replace vLLM's ``"default"`` EPLB policy by the variant
    ``$MOEBALANCE_VLLM_EPLB`` names; do nothing when it is unset."""
    variant = os.environ.get(ENV)
    if not variant:
        return
    try:  # only reached inside vLLM, with the variable set
        from vllm.distributed.eplb import policy as vllm_policy
    except ImportError:
        raise ImportError(f"{ENV}={variant} needs a vLLM whose EPLB has pluggable policies "
                          "(vllm.distributed.eplb.policy, EPLB_POLICIES); upgrade vLLM or unset the variable") from None
    registry = vllm_policy.EPLB_POLICIES
    default = registry["default"]
    base = getattr(vllm_policy, "AbstractEplbPolicy", None)
    cls = make_policy(variant, base)
    if returns_tuple(default):
        cls = _tuple_returning(cls)
    registry["default"] = cls


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
