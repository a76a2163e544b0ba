"""Plans as engines load them: the same number of slots on every GPU and in every layer.

Legend: ``L`` layers, ``E`` experts, ``G`` GPUs, ``S`` slots per GPU, ``P = G * S`` physical slots.

SGLang, vLLM and TensorRT-LLM describe a placement as a physical-to-logical map ``[L, P]``: slot ``p`` holds
expert ``map[l, p]``, and rank ``r`` owns the contiguous block of slots ``r * S .. (r + 1) * S - 1``. So every
GPU holds ``S`` experts in every layer. A plan with unequal slots (CRAFT spends its replicas where they help,
so its layers differ) cannot be written as it is: :func:`slot_table` refuses it with the reason, and
:func:`pad_plan` fills every GPU up to the largest count with the extra copies that buy the most balance
(each time, onto the least loaded GPU with a free slot, the copy that leaves the busiest GPU least loaded,
ties to the expert with the most load per copy), reporting what the padding costs. Loads are the plan's load
summed over batches and split evenly over copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.core.errors import PlanError
from moebalance.core.plan import Placement

__all__ = ["Padding", "SlotTable", "pad_plan", "slot_table"]


@dataclass(frozen=True, slots=True)
class SlotTable:
    """A plan as a physical-to-logical map. Example: 2 GPUs, 2 slots each, expert 0 replicated::

        phy2log = [[0, 1, 0, 2]]  (rank 0 holds experts 0 and 1, rank 1 experts 0 and 2)
    """

    #: ``int64 [L, P]``.
    phy2log: np.ndarray
    slots_per_gpu: int

    @property
    def num_slots(self) -> int:
        return int(self.phy2log.shape[1])


def slot_table(plan: Placement) -> SlotTable:
    """The plan's ``[L, P]`` map; a :class:`PlanError` naming the first GPU and layer whose slot count differs.

    A dense layer (no load when the plan was made, so no experts in the engine) has a row only to keep the
    model's numbering: it is written in the engines' default order, slot ``p`` holding expert ``p mod E``.
    """
    dense = plan.dense_layers
    moe = [layer for layer in range(plan.num_layers) if layer not in dense]
    if not moe:
        raise PlanError("every layer of the plan is dense (no load): there is no MoE layer to write")
    first = moe[0]
    S = len(plan.gpu_experts[first][0])
    for layer in moe:
        for g, experts in enumerate(plan.gpu_experts[layer]):
            if len(experts) != S:
                raise PlanError(f"engines need the same slots on every GPU and in every layer, but GPU {g} holds "
                                f"{len(experts)} experts in layer {layer} and GPU 0 holds {S} in layer {first} "
                                f"(policy {plan.policy!r}); give --pad (with --load) to fill every GPU up to "
                                f"{plan.max_slots_per_gpu} slots with the copies that balance best")
    if S == 0:
        raise PlanError("the plan holds no experts on GPU 0; there is nothing to write")
    default = np.arange(S * plan.num_gpus) % plan.num_experts
    phy2log = np.asarray([default if layer in dense else [e for experts in row for e in experts]
                          for layer, row in enumerate(plan.gpu_experts)], dtype=np.int64)
    return SlotTable(phy2log, S)


@dataclass(frozen=True, slots=True)
class Padding:
    """What :func:`pad_plan` added: ``slots`` copies in all, at most ``per_gpu_layer`` on one GPU in one layer."""

    plan: Placement
    slots: int
    slots_per_gpu: int

    def describe(self, plan: Placement) -> str:
        L, G = plan.num_layers - len(plan.dense_layers), plan.num_gpus
        return (f"padding added {self.slots} expert copies ({self.slots / (L * G):.2f} per GPU and layer, "
                f"{self.slots / G:.1f} per GPU over {L} MoE layers) to give every GPU {self.slots_per_gpu} slots in "
                "every MoE layer")


def pad_plan(plan: Placement, counts: np.ndarray) -> Padding:
    """Fill every GPU of every layer up to the plan's largest slot count, from ``counts [B, L, E]`` (the load the
    plan was made on; module docstring); ties to the lower id."""
    L, E, G = plan.num_layers, plan.num_experts, plan.num_gpus
    if counts.ndim != 3 or counts.shape[1:] != (L, E):
        raise PlanError(f"the load has shape {counts.shape[1:]} per batch but the plan [L, E] = [{L}, {E}]; pad with "
                        "the load the plan was made on")
    load = counts.sum(axis=0).astype(np.float64)  # [L, E]
    lists = [[list(x) for x in row] for row in plan.gpu_experts]
    added = 0
    dense = plan.dense_layers
    if len(dense) == L:
        raise PlanError("every layer of the plan is dense (no load): there is nothing to pad")
    S = max(len(experts) for layer in range(L) if layer not in dense for experts in plan.gpu_experts[layer])
    for layer in range(L):
        if layer in dense:  # no experts in the engine: its row is written in default order whatever it holds
            continue
        has = np.zeros((G, E), dtype=bool)
        for g in range(G):
            has[g, lists[layer][g]] = True
        copies = has.sum(axis=0).astype(np.float64)
        while True:
            free = [g for g in range(G) if len(lists[layer][g]) < S]
            if not free:
                break
            share = load[layer] / copies  # [E]
            gpu_load = (has * share[None, :]).sum(axis=1)
            g = min(free, key=lambda x: (gpu_load[x], x))
            candidates = np.flatnonzero(~has[g])
            if candidates.size == 0:  # the GPU already holds every expert: a second copy there adds nothing
                raise PlanError(f"GPU {g} already holds all {E} experts of layer {layer} and has room for more; "
                                f"a plan with {S} slots per GPU cannot be padded usefully (fewer slots than experts)")
            # the copy that leaves the busiest GPU least loaded: e's copies each lose to the new one
            new_share = load[layer][candidates] / (copies[candidates] + 1)
            peak = np.empty(candidates.size)
            for i, c in enumerate(candidates):
                after = gpu_load - has[:, c] * (share[c] - new_share[i])
                after[g] += new_share[i]
                peak[i] = after.max()
            e = int(candidates[np.lexsort((candidates, -share[candidates], peak))[0]])
            lists[layer][g].append(e)
            has[g, e] = True
            copies[e] += 1
            added += 1
    padded = Placement(lists, E, plan.cluster, policy=plan.policy,
                       params={**plan.params, "padded_slots": added}, weights=None)
    return Padding(padded, added, S)
