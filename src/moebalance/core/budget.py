"""Memory budgets for plans (DESIGN §4).

A budget is either ``slots_per_gpu`` ``S`` (every GPU hosts at most ``S`` experts in every layer, EPLB-style)
or ``replicas_per_gpu`` ``R`` (CRAFT: ``R * G`` extra replicas in all, spread over layers as the policy
likes; a GPU then holds at most ``L * ceil(E / G) + R`` expert slots over all layers). A budget is a
maximum: a policy may use less, never more, and never changes it silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from moebalance.core.errors import BudgetError
from moebalance.core.plan import Placement

__all__ = ["Budget"]


@dataclass(kw_only=True, frozen=True, slots=True)
class Budget:
    """Exactly one of ``slots_per_gpu`` and ``replicas_per_gpu``.

    Example: for 256 experts on 64 GPUs, ``Budget(slots_per_gpu=5)`` allows 64 extra replicas per layer;
    ``Budget(replicas_per_gpu=8)`` allows 512 extra replicas over all layers.
    """

    slots_per_gpu: int | None = None
    #: ``R``, or ``"auto"`` for a policy that chooses it (CRAFT Step 2).
    replicas_per_gpu: int | Literal["auto"] | None = None

    def __post_init__(self) -> None:
        if (self.slots_per_gpu is None) == (self.replicas_per_gpu is None):
            raise BudgetError("give exactly one budget: --slots-per-gpu S or --replicas-per-gpu R")
        if self.slots_per_gpu is not None and (
                isinstance(self.slots_per_gpu, bool) or not isinstance(self.slots_per_gpu, int) or self.slots_per_gpu < 1):
            raise BudgetError(f"slots_per_gpu ({self.slots_per_gpu!r}) must be a positive integer")
        r = self.replicas_per_gpu
        if r is not None and r != "auto" and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise BudgetError(f"replicas_per_gpu ({r!r}) must be a non-negative integer or 'auto'")

    def fixed_replicas(self, policy: str) -> int:
        """``R`` as a number; ``auto`` is only for policies that choose it themselves."""
        if self.replicas_per_gpu == "auto":
            raise BudgetError(f"policy {policy!r} cannot choose replicas_per_gpu itself; give a number (craft can: auto)")
        assert isinstance(self.replicas_per_gpu, int)
        return self.replicas_per_gpu

    def describe(self) -> str:
        if self.slots_per_gpu is not None:
            return f"slots_per_gpu={self.slots_per_gpu}"
        return f"replicas_per_gpu={self.replicas_per_gpu}"

    def as_params(self) -> dict[str, int | str]:
        if self.slots_per_gpu is not None:
            return {"slots_per_gpu": self.slots_per_gpu}
        assert self.replicas_per_gpu is not None
        return {"replicas_per_gpu": self.replicas_per_gpu}

    def placement_slots(self, num_experts: int, num_gpus: int) -> int:
        """Slots per GPU of a placement without replicas: ``ceil(E / G)``, if the budget allows it."""
        need = math.ceil(num_experts / num_gpus)
        if self.slots_per_gpu is not None and self.slots_per_gpu < need:
            raise BudgetError(
                f"slots_per_gpu ({self.slots_per_gpu}) cannot hold {num_experts} experts on {num_gpus} GPUs; "
                f"it must be at least {need}"
            )
        return need

    def uniform_slots(self, num_experts: int, num_gpus: int, num_layers: int) -> int:
        """Slots per GPU in every layer for an equal-slot policy (EPLB).

        With ``replicas_per_gpu R`` each layer gets ``floor(R / L)`` extra slots per GPU, the most a uniform
        per-layer replication fits in ``R * G`` extra replicas (CRAFT Section 2.3: EPLB's minimum uniform
        replication costs ``L`` replicas per GPU).
        """
        need = self.placement_slots(num_experts, num_gpus)
        if self.slots_per_gpu is not None:
            return self.slots_per_gpu
        R = self.fixed_replicas("eplb")
        # the most equal slots S with L * (S * G - E) <= R * G extra replicas; beyond E slots a GPU would
        # hold some expert twice, so a larger R is not spent (a budget is a maximum)
        slots = min((num_layers * num_experts + R * num_gpus) // (num_layers * num_gpus), num_experts)
        if slots < need:
            extra = num_layers * (need * num_gpus - num_experts)
            raise BudgetError(
                f"equal slots per GPU put {num_experts} experts into {need * num_gpus} slots per layer, "
                f"{extra} extra replicas in all, but replicas_per_gpu {R} allows "
                f"{R * num_gpus}; raise it to at least {math.ceil(extra / num_gpus)}"
            )
        return slots

    def check(self, plan: Placement) -> None:
        """Raise :class:`BudgetError` if ``plan`` uses more memory than this budget allows."""
        if self.slots_per_gpu is not None:
            if plan.max_slots_per_gpu > self.slots_per_gpu:
                raise BudgetError(
                    f"plan {plan.policy!r} puts {plan.max_slots_per_gpu} experts on one GPU in one layer "
                    f"but slots_per_gpu is {self.slots_per_gpu}"
                )
            return
        R = self.replicas_per_gpu
        if R == "auto":  # the policy chose R and must say which
            if "chosen_replicas_per_gpu" not in plan.params:
                self.fixed_replicas(plan.policy)
            R = int(plan.params["chosen_replicas_per_gpu"])
        assert isinstance(R, int)
        G = plan.num_gpus
        if plan.extra_replicas > R * G:
            raise BudgetError(
                f"plan {plan.policy!r} uses {plan.extra_replicas} extra replicas but replicas_per_gpu "
                f"{R} allows {R * G}"
            )
        # per-GPU memory: at most what equal slots of ceil(E / G) per layer take, plus R
        per_gpu = int(plan.slots().sum(axis=0).max())
        limit = plan.num_layers * math.ceil(plan.num_experts / G) + R
        if per_gpu > limit:
            raise BudgetError(
                f"plan {plan.policy!r} puts {per_gpu} experts on one GPU over all layers but "
                f"replicas_per_gpu {R} allows {limit}"
            )
