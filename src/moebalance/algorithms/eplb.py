"""DeepSeek's Expert-Parallelism Load Balancer (EPLB), re-implemented with vectorised numpy.

:func:`rebalance_experts` is a drop-in for ``eplb.rebalance_experts`` of DeepSeek EPLB
(https://github.com/deepseek-ai/EPLB), the planner behind the redundant-experts scheme of the DeepSeek-V3
technical report (arXiv 2412.19437, Section 3.4): same arguments, same ``(phy2log, log2phy, logcnt)``,
bit-identical values. Torch tensors in give int64 CPU tensors out; anything else gives numpy int64 arrays.

Shapes: ``L`` layers, ``E`` logical experts, ``P = num_replicas`` physical slots per layer, ``N`` nodes,
``G`` GPUs; slot ``p`` lives on GPU ``p // (P // G)``.

Algorithm (all arithmetic in float32, as the reference converts the load to float32 first)
----------------------------------------------------------------------------------------
*Balanced packing* splits the ``n`` items of each row into ``m`` packs of exactly ``n / m`` items: items
are taken heaviest first, and each goes to the lightest pack that still has room (lowest pack index on
equal loads); pack loads are float32 running sums.

*Replication* starts every expert with one slot and hands out each remaining slot to the expert with the
largest ``load / replicas`` (lowest expert index on ties). A slot's rank is the expert's replica count
before it was added.

*Hierarchical policy* (used when ``num_nodes`` divides ``num_groups``):

1. Sum the load of each group of ``E / num_groups`` consecutive experts and pack the groups onto the
   nodes. Experts are renumbered node by node ("middle" ids), keeping each group contiguous.
2. Within each node, replicate its ``E / N`` experts into ``P / N`` slots.
3. Within each node, pack its slots, each carrying its expert's load divided by the expert's replica
   count, onto the node's ``G / N`` GPUs; a slot's position on its GPU is its rank in the pack.

*Global policy* (otherwise): the hierarchical policy with one group and one node.

How this stays bit-identical while being vectorised
---------------------------------------------------
* The two sequential loops, packing (over items) and replication (over extra slots), are compiled with numba
  (``eplb_loops.pack_rows``, ``replicate_rows``), row by row, with the reference's float32 operations: numba keeps
  ``float32 + float32`` and ``float32 / float32`` in float32, and its strict comparisons keep the lowest index
  on ties, as the reference's ``argmin`` / ``max`` do.
* Item order comes from ``torch.sort(descending=True)`` itself, called once per packing on the same
  float32 values. Its default (unstable) CPU sort does not order ties by index: with torch 2.13 rows of
  up to 16 items come out in index order (insertion sort), longer rows in the order of an introsort
  (for 17 alternating 0/1 values the ones come out as 1, 3, 15, 5, 7, 13, ...). Ties are everywhere
  (the replicas of one expert carry equal loads), so no numpy sort can reproduce it; calling torch keeps
  the two in step for every torch version.
* Group sums (step 1) use ``torch.sum`` too: numpy's pairwise summation rounds differently from
  torch's for non-integer float32 loads.
* ``torch.max(dim)`` on CPU returns the first maximal index, as ``numpy.argmax`` does (checked on rows of
  up to 5,000 heavily tied values), and float32 division rounds identically in both.
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, overload

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

from moebalance.algorithms.eplb_loops import pack_rows, replicate_rows
from moebalance.core.errors import BudgetError, InputError

__all__ = ["EplbArgumentError", "EplbResult", "balanced_packing", "eplb_plan", "rebalance_experts",
           "rebalance_experts_hierarchical", "replicate_experts"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True, kw_only=True)
class EplbResult:
    """An EPLB plan for ``L`` layers, ``E`` logical experts and ``P`` physical slots.

    For DeepSeek's README example (layer 0, 16 slots on 8 GPUs) ``physical_to_logical[0]`` is
    ``[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1]``: GPU 0 hosts experts 5 and 6, expert 5 has
    replicas in slots 0 and 2, so ``logical_count[0, 5] == 2``, ``replica_rank[0, [0, 2]] == [0, 1]`` and
    ``logical_to_physical[0, 5] == [0, 2]``; expert 2 has one replica, so ``logical_to_physical[0, 2]``
    is ``[11, -1]``.
    """

    physical_to_logical: IntArray
    """``[L, P]`` int64: the logical expert held by each physical slot (DeepSeek's ``phy2log``)."""
    replica_rank: IntArray
    """``[L, P]`` int64: the replica index of each slot among its expert's replicas (``phyrank``)."""
    logical_to_physical: IntArray
    """``[L, E, max_count]`` int64: the slots of each expert by replica index, padded with -1
    (``log2phy``); ``max_count = logical_count.max()``."""
    logical_count: IntArray
    """``[L, E]`` int64: the number of replicas of each expert (``logcnt``); each row sums to ``P``."""


# ---------------------------------------------------------------------------------------------------
# Vectorised kernels (no validation; float32 in, int64 out)
# ---------------------------------------------------------------------------------------------------


def _is_tensor(x: object) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch (a caller holding a tensor has imported it)."""
    t = sys.modules.get("torch")
    return t is not None and isinstance(x, t.Tensor)


def _descending_order(weight: FloatArray) -> IntArray:
    """Per-row item order of ``torch.sort(descending=True)``, ties included (see the module docstring)."""
    if not weight.flags.writeable:
        weight = weight.copy()
    import torch  # imported on first use: a command's --help need not load it

    order: IntArray = torch.from_numpy(weight).sort(dim=-1, descending=True).indices.numpy()
    return order


def _inverse_permutation(perm: IntArray) -> IntArray:
    """Row-wise inverse: ``out[r, perm[r, i]] = i``."""
    num_rows, n = perm.shape
    out = np.empty_like(perm)
    out[np.arange(num_rows)[:, None], perm] = np.arange(n, dtype=np.int64)
    return out


def _pack(weight: FloatArray, num_packs: int) -> tuple[IntArray, IntArray]:
    """Balanced packing of ``weight [X, n]``: ``(pack_index [X, n], rank_in_pack [X, n])``, the items in torch's
    order, the packing loop compiled (:func:`moebalance.algorithms.eplb_loops.pack_rows`)."""
    num_rows, num_items = weight.shape
    per_pack = num_items // num_packs
    if per_pack == 1:
        pack_index = np.broadcast_to(np.arange(num_items, dtype=np.int64), (num_rows, num_items)).copy()
        return pack_index, np.zeros((num_rows, num_items), dtype=np.int64)

    order = _descending_order(weight)
    sorted_weight = np.ascontiguousarray(np.take_along_axis(weight, order, axis=1))  # [X, n]: heaviest first
    chosen, rank = pack_rows(sorted_weight, num_packs, per_pack)  # [X, n], in the sorted order
    pack_index = np.empty((num_rows, num_items), dtype=np.int64)
    rank_in_pack = np.empty((num_rows, num_items), dtype=np.int64)
    row_ix = np.arange(num_rows)[:, None]
    pack_index[row_ix, order] = chosen
    rank_in_pack[row_ix, order] = rank
    return pack_index, rank_in_pack


def _replicate(weight: FloatArray, num_phy: int) -> tuple[IntArray, IntArray, IntArray]:
    """Replication of ``weight [X, num_log]``: ``(phy2log [X, num_phy], rank [X, num_phy], logcnt [X, num_log])``,
    compiled (:func:`moebalance.algorithms.eplb_loops.replicate_rows`)."""
    return replicate_rows(np.ascontiguousarray(weight, dtype=np.float32), num_phy)


def _hierarchical(
    weight_t: torch.Tensor,
    weight: FloatArray,
    num_physical: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> tuple[IntArray, IntArray, IntArray]:
    """``(phy2log [L, P], phyrank [L, P], logcnt [L, E])``; ``weight_t`` is ``weight`` as a torch tensor."""
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_logical // num_nodes
    phy_per_node = num_physical // num_nodes
    phy_per_gpu = num_physical // num_gpus

    # Step 1: groups to nodes; log2mlog gives each expert its node-major "middle" id (one group a node: the ids).
    identity = groups_per_node == 1
    if identity:
        tokens_per_mlog = weight.reshape(-1, experts_per_node)
    else:
        tokens_per_group = np.asarray(
            weight_t.unflatten(-1, (num_groups, group_size)).sum(-1).numpy(), dtype=np.float32
        )
        group_pack, group_rank = _pack(tokens_per_group, num_nodes)
        group_slot = group_pack * groups_per_node + group_rank
        log2mlog = (group_slot[:, :, None] * group_size + np.arange(group_size)).reshape(weight.shape)
        mlog2log = _inverse_permutation(log2mlog)
        tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, experts_per_node)

    # Step 2: replicate within each node (rows are (layer, node) pairs).
    phy2mlog, phyrank, mlogcnt = _replicate(tokens_per_mlog, phy_per_node)

    # Step 3: slots to the node's GPUs, each slot carrying an equal share of its expert's load.
    share = np.divide(tokens_per_mlog, mlogcnt.astype(np.float32), dtype=np.float32)
    tokens_per_phy = np.take_along_axis(share, phy2mlog, axis=1)
    pack_index, rank_in_pack = _pack(tokens_per_phy, num_gpus // num_nodes)
    pphy2phy = _inverse_permutation(pack_index * phy_per_gpu + rank_in_pack)

    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(num_layers, num_nodes, phy_per_node)
    pphy2mlog = pphy2mlog + (np.arange(num_nodes, dtype=np.int64) * experts_per_node)[:, None]
    pphy2mlog = pphy2mlog.reshape(num_layers, num_physical)
    phy2log = pphy2mlog if identity else np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(num_layers, num_physical)
    logcnt = mlogcnt.reshape(num_layers, num_logical)
    if not identity:
        logcnt = np.take_along_axis(logcnt, log2mlog, axis=1)
    return phy2log, pphyrank, logcnt


def _logical_to_physical(phy2log: IntArray, phyrank: IntArray, logcnt: IntArray) -> IntArray:
    num_layers, num_logical = logcnt.shape
    max_count = int(logcnt.max())
    log2phy = np.full((num_layers, num_logical * max_count), -1, dtype=np.int64)
    log2phy[np.arange(num_layers)[:, None], phy2log * max_count + phyrank] = np.arange(
        phy2log.shape[1], dtype=np.int64
    )
    return log2phy.reshape(num_layers, num_logical, max_count)


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------


class EplbArgumentError(InputError, BudgetError, AssertionError):
    """A layout the reference refuses with an ``assert`` (groups, nodes, GPUs, replicas that do not divide):
    catchable as our :class:`InputError` / :class:`BudgetError` and, for drop-in callers and tests written
    against the reference, as ``AssertionError``."""


def _count(value: object, name: str) -> int:
    """A positive integer argument."""
    if isinstance(value, bool):
        raise InputError(f"{name} must be a positive integer, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InputError(f"{name} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise InputError(f"{name} ({number}) must be a positive integer")
    return number


def _load_as_float32(weight: object, name: str = "weight") -> tuple[torch.Tensor, FloatArray]:
    """Convert a 2-D load to float32 as the reference does; returns it as a CPU tensor and a numpy view."""
    import torch

    if isinstance(weight, torch.Tensor):
        if weight.is_complex():
            raise InputError(f"{name} must be real, got dtype {weight.dtype}")
        weight_t = weight.detach().float().cpu()
        weight_np: FloatArray = weight_t.numpy()
    else:
        array = np.asarray(weight)
        if array.dtype.kind not in "biuf":
            raise InputError(f"{name} must hold real numbers, got dtype {array.dtype}")
        weight_np = array.astype(np.float32)  # a fresh, writable copy
        weight_t = torch.from_numpy(weight_np)
    if weight_np.ndim != 2:
        raise InputError(
            f"{name} must be 2-D [num_layers, num_logical_experts], got shape {tuple(weight_np.shape)}"
        )
    if weight_np.shape[0] == 0 or weight_np.shape[1] == 0:
        raise InputError(f"{name} must have at least one layer and one expert, got shape {weight_np.shape}")
    finite = np.isfinite(weight_np)
    if not finite.all():
        layer, expert = np.argwhere(~finite)[0]
        raise InputError(
            f"{name}[{layer}, {expert}] is {weight_np[layer, expert]}; loads must be finite (replace NaN/inf)"
        )
    negative = weight_np < 0
    if negative.any():
        layer, expert = np.argwhere(negative)[0]
        raise InputError(
            f"{name}[{layer}, {expert}] is {weight_np[layer, expert]}; loads must be non-negative token counts"
        )
    return weight_t, weight_np


def _check_layout(
    num_logical: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> bool:
    """Check the reference's preconditions; returns True for the hierarchical policy."""
    hierarchical = num_groups % num_nodes == 0
    if hierarchical:
        if num_logical % num_groups != 0:
            raise EplbArgumentError(
                f"num_logical_experts ({num_logical}) must be divisible by num_groups ({num_groups}) "
                f"for the hierarchical policy; use a num_groups that divides {num_logical}"
            )
        if num_gpus % num_nodes != 0:
            raise EplbArgumentError(
                f"num_gpus ({num_gpus}) must be divisible by num_nodes ({num_nodes}); "
                "give every node the same number of GPUs"
            )
    if num_replicas % num_gpus != 0:
        suggestion = -(-max(num_replicas, num_logical) // num_gpus) * num_gpus
        raise EplbArgumentError(
            f"num_replicas ({num_replicas}) must be divisible by num_gpus ({num_gpus}); "
            f"use a multiple of {num_gpus} such as {suggestion}"
        )
    if num_replicas < num_logical:
        raise EplbArgumentError(
            f"num_replicas ({num_replicas}) must be at least num_logical_experts ({num_logical}); "
            "every expert needs a slot"
        )
    return hierarchical


def _plan(
    weight: object, num_replicas: object, num_groups: object, num_nodes: object, num_gpus: object
) -> tuple[IntArray, IntArray, IntArray]:
    weight_t, weight_np = _load_as_float32(weight)
    replicas = _count(num_replicas, "num_replicas")
    groups = _count(num_groups, "num_groups")
    nodes = _count(num_nodes, "num_nodes")
    gpus = _count(num_gpus, "num_gpus")
    if _check_layout(weight_np.shape[1], replicas, groups, nodes, gpus):
        return _hierarchical(weight_t, weight_np, replicas, groups, nodes, gpus)
    return _hierarchical(weight_t, weight_np, replicas, 1, 1, gpus)


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------


@overload
def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def rebalance_experts(
    weight: npt.ArrayLike, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[IntArray, IntArray, IntArray]: ...
def rebalance_experts(
    weight: torch.Tensor | npt.ArrayLike,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[IntArray, IntArray, IntArray]:
    """Plan expert replication and placement exactly as DeepSeek EPLB's ``rebalance_experts``.

    Args:
        weight: ``[num_layers, num_logical_experts]`` load of each expert (any real dtype; it is
            converted to float32 first, as in the reference).
        num_replicas: physical slots per layer, a multiple of ``num_gpus`` and at least the number of
            logical experts.
        num_groups: expert groups (DeepSeek-V3's node-limited routing groups).
        num_nodes: server nodes. The hierarchical policy runs when ``num_nodes`` divides ``num_groups``,
            the global policy otherwise.
        num_gpus: GPUs in total.

    Returns:
        ``(phy2log [L, num_replicas], log2phy [L, E, max_count], logcnt [L, E])``, int64: the logical expert
        of each slot (slot ``p`` is on GPU ``p // (num_replicas // num_gpus)``), each expert's slots padded
        with -1, and each expert's replica count. CPU torch tensors when ``weight`` is a torch tensor,
        numpy arrays otherwise.

    Raises:
        InputError: malformed load (not 2-D, NaN, inf, negative) or groups/GPUs not divisible.
        BudgetError: ``num_replicas`` not a multiple of ``num_gpus`` or smaller than the expert count.
    """
    phy2log, phyrank, logcnt = _plan(weight, num_replicas, num_groups, num_nodes, num_gpus)
    log2phy = _logical_to_physical(phy2log, phyrank, logcnt)
    if _is_tensor(weight):
        import torch

        return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt)
    return phy2log, log2phy, logcnt


def eplb_plan(
    weight: npt.ArrayLike | torch.Tensor, *, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> EplbResult:
    """:func:`rebalance_experts` returning numpy arrays in an :class:`EplbResult`, ``replica_rank`` included.

    weight: ``[num_layers, num_logical_experts]`` load.
    """
    phy2log, phyrank, logcnt = _plan(weight, num_replicas, num_groups, num_nodes, num_gpus)
    return EplbResult(
        physical_to_logical=phy2log,
        replica_rank=phyrank,
        logical_to_physical=_logical_to_physical(phy2log, phyrank, logcnt),
        logical_count=logcnt,
    )


@overload
def rebalance_experts_hierarchical(
    weight: torch.Tensor, num_physical_experts: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def rebalance_experts_hierarchical(
    weight: npt.ArrayLike, num_physical_experts: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[IntArray, IntArray, IntArray]: ...
def rebalance_experts_hierarchical(
    weight: torch.Tensor | npt.ArrayLike, num_physical_experts: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[IntArray, IntArray, IntArray]:
    """The hierarchical policy alone (module docstring), as the reference module exposes it.

    weight: ``[L, E]`` load (converted to float32). ``num_nodes`` must divide ``num_groups`` (the reference asserts
    it; :func:`rebalance_experts` falls back to the global policy instead, which is this function with one group and
    one node). Returns ``(phy2log [L, P], phyrank [L, P], logcnt [L, E])``, int64: each slot's logical expert, its
    replica index among that expert's slots, and each expert's replica count. Torch in, torch out; numpy otherwise.
    """
    weight_t, weight_np = _load_as_float32(weight)
    replicas = _count(num_physical_experts, "num_physical_experts")
    groups, nodes, gpus = _count(num_groups, "num_groups"), _count(num_nodes, "num_nodes"), _count(num_gpus, "num_gpus")
    if groups % nodes:
        raise EplbArgumentError(f"num_groups ({groups}) must be divisible by num_nodes ({nodes}) for the hierarchical "
                                "policy; rebalance_experts runs the global policy for such layouts")
    _check_layout(weight_np.shape[1], replicas, groups, nodes, gpus)
    out = _hierarchical(weight_t, weight_np, replicas, groups, nodes, gpus)
    if _is_tensor(weight):
        import torch

        return torch.from_numpy(out[0]), torch.from_numpy(out[1]), torch.from_numpy(out[2])
    return out


@overload
def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def balanced_packing(weight: npt.NDArray[np.generic], num_packs: int) -> tuple[IntArray, IntArray]: ...
def balanced_packing(
    weight: torch.Tensor | npt.NDArray[np.generic], num_packs: int
) -> tuple[torch.Tensor, torch.Tensor] | tuple[IntArray, IntArray]:
    """Pack the ``n`` items of each row into ``num_packs`` packs of exactly ``n // num_packs`` items.

    weight: ``[X, n]`` item weights, converted to float32. Items are taken in the order of
    ``torch.sort(descending=True)``; each goes to the open pack with the smallest float32 load (lowest
    index on ties). Returns ``(pack_index [X, n], rank_in_pack [X, n])``, int64, where ``rank_in_pack``
    is how many items the pack held before this one. Torch in, torch out; numpy otherwise.
    """
    _, weight_np = _load_as_float32(weight)
    packs = _count(num_packs, "num_packs")
    num_items = weight_np.shape[1]
    if num_items % packs != 0:
        raise EplbArgumentError(f"the number of items ({num_items}) must be divisible by num_packs ({packs})")
    pack_index, rank_in_pack = _pack(weight_np, packs)
    if _is_tensor(weight):
        import torch

        return torch.from_numpy(pack_index), torch.from_numpy(rank_in_pack)
    return pack_index, rank_in_pack


@overload
def replicate_experts(
    weight: torch.Tensor, num_phy: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def replicate_experts(
    weight: npt.NDArray[np.generic], num_phy: int
) -> tuple[IntArray, IntArray, IntArray]: ...
def replicate_experts(
    weight: torch.Tensor | npt.NDArray[np.generic], num_phy: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[IntArray, IntArray, IntArray]:
    """Spread ``num_phy`` slots over the ``num_log`` experts of each row, heaviest per-replica load first.

    weight: ``[X, num_log]`` loads, converted to float32. Every expert gets one slot; each further slot
    goes to the expert with the largest ``weight / count`` (lowest index on ties). Returns
    ``(phy2log [X, num_phy], rank [X, num_phy], logcnt [X, num_log])``, int64; ``rank`` is the expert's
    replica count before the slot was added. Torch in, torch out; numpy otherwise.
    """
    _, weight_np = _load_as_float32(weight)
    slots = _count(num_phy, "num_phy")
    num_log = weight_np.shape[1]
    if slots < num_log:
        raise EplbArgumentError(f"num_phy ({slots}) must be at least the number of experts ({num_log})")
    phy2log, rank, logcnt = _replicate(weight_np, slots)
    if _is_tensor(weight):
        import torch

        return torch.from_numpy(phy2log), torch.from_numpy(rank), torch.from_numpy(logcnt)
    return phy2log, rank, logcnt
