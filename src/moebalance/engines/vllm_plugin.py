"""A vLLM plug-in that puts moebalance behind vLLM's EPLB policy (``pip install moebalance[vllm]``).

Legend: ``L`` MoE layers, ``E`` logical experts, ``P`` = ``num_replicas`` physical slots, ``R`` = ``num_ranks``.

vLLM loads every entry point of the ``vllm.general_plugins`` group in every process
(``vllm/plugins/__init__.py``, ``load_general_plugins``). Its EPLB picks the policy class
``EPLB_POLICIES[eplb_config.policy]`` (``vllm/distributed/eplb/policy/__init__.py``; only ``"default"`` exists)
and calls the classmethod ``rebalance_experts(weight [L, E], num_replicas, num_groups, num_nodes, num_ranks)``,
which returns the physical-to-logical map ``[L, P]`` (rank ``r`` owning slots ``r * P / R ..``). Releases differ:
older ones call it with five arguments and unpack ``(phy2log, log2phy, logcnt)``; newer ones add
``old_global_expert_indices`` (the current ``[L, P]`` map, or ``None``) and take ``phy2log`` alone. No public hook
registers another policy, so :func:`register` replaces the ``"default"`` entry, and only when
``MOEBALANCE_VLLM_EPLB`` names a variant:

- ``eplb``: DeepSeek's EPLB, bit-identical to the reference (:func:`moebalance.eplb.rebalance_experts`);
- ``eplb-no-duplicates``: the same, with two copies of one expert on one GPU swapped apart
  (:func:`moebalance.algorithms.packing.repair_duplicates`): a second copy on the same GPU takes a slot and
  balances nothing;
- ``move-aware``: honours ``old_global_expert_indices`` (vLLM RFC #31671 asks for migration-aware placement):
  the current placement is kept, no expert moved, while its balancedness is within ``MOEBALANCE_VLLM_EPLB_TOLERANCE``
  (default 0.02, relative) of a fresh EPLB plan's; otherwise the fresh plan is laid out to move as little as it
  can: its per-GPU sets are matched to the ranks that already hold most of them (an assignment problem per layer),
  and an expert staying on a rank keeps its slot.

Balancedness here is vLLM's: ``mean / max`` of per-rank load, each expert's load split evenly over its copies.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import numpy as np

from moebalance.core.errors import InputError

__all__ = ["ENV", "TOLERANCE_ENV", "VARIANTS", "balancedness", "make_policy", "move_aware", "plan_slots", "register"]

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

    if old.shape != fresh.shape:
        raise InputError(f"old_global_expert_indices has shape {old.shape} but the plan {fresh.shape}; give the "
                         "current physical-to-logical map [layers, num_replicas]")
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
        if variant == "move-aware" and old_global_expert_indices is not None:
            old = old_global_expert_indices
            old_np = old.detach().cpu().numpy() if isinstance(old, torch.Tensor) else np.asarray(old)
            fresh = move_aware(old_np.astype(np.int64), fresh, w, num_ranks, tolerance)
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
                          num_ranks: int, *old: Any) -> Any:
        from moebalance.core.plan import _log2phy

        phy2log = inner(weight, num_replicas, num_groups, num_nodes, num_ranks, *old[:1])
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
    from vllm.distributed.eplb import policy as vllm_policy  # only reached inside vLLM, with the variable set

    registry = vllm_policy.EPLB_POLICIES
    default = registry["default"]
    base = getattr(vllm_policy, "AbstractEplbPolicy", None)
    cls = make_policy(variant, base)
    if "old_global_expert_indices" not in inspect.signature(default.rebalance_experts).parameters:
        cls = _tuple_returning(cls)
    registry["default"] = cls
