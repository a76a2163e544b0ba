"""Memory budgets for plans, and the one rule that turns a budget into what policies consume.

Legend: ``L`` layers, ``E`` experts per layer, ``G`` GPUs, ``q = ceil(E / G)`` the slots a GPU needs without
replicas, ``S`` slots per GPU per layer, ``R`` extra replicas per GPU over all layers.

A :class:`Budget` is what the user gives: either ``slots_per_gpu`` ``S`` (every GPU hosts at most ``S``
experts in every layer, EPLB-style) or ``replicas_per_gpu`` ``R`` (CRAFT: ``R * G`` extra replicas in all,
spread over layers as the policy likes; a GPU then holds at most ``L * q + R`` expert slots over all layers).
A budget is a maximum: a policy may use less, never more.

:func:`resolve_budget` turns a budget, for one model shape and cluster, into a :class:`Capacity`: the per-layer
cap, the replicas a policy may spend, the per-GPU total. Policies read a capacity, never a budget. Each
policy asks for the form it plans in, and the capacity converts between the two kinds with a note that the
plan records (``docs/design.md``, "Budgets"):

- ``S`` slots per GPU is the memory of ``R = L * (S - E / G)`` extra replicas per GPU (rounded down when
  ``G`` does not divide ``L * (S * G - E)``; a budget is a ceiling): :meth:`Capacity.replicas` for policies
  that spread replicas over layers (CRAFT). The plan is then checked against what ``S`` slots hold: at most
  ``L * (S * G - E)`` extra replicas, at most ``L * S`` slots on a GPU over all layers; one layer may hold
  more than ``S`` on a GPU.
- ``R`` extra replicas per GPU fit ``S = floor((L * E + R * G) / (L * G))`` equal slots in every layer
  (at most ``E``): :meth:`Capacity.uniform_slots` for policies with the same slots everywhere (EPLB).

So any mix of policies can be compared under one budget.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from moebalance.core.errors import BudgetError, InputError
from moebalance.core.limits import check_alloc
from moebalance.core.plan import Placement

__all__ = ["Budget", "Capacity", "resolve_budget", "slots_to_replicas"]


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

    def describe(self) -> str:
        if self.slots_per_gpu is not None:
            return f"slots_per_gpu={self.slots_per_gpu}"
        return f"replicas_per_gpu={self.replicas_per_gpu}"

    def as_params(self) -> dict[str, int | str]:
        """The budget as the user gave it, for a plan's params."""
        if self.slots_per_gpu is not None:
            return {"slots_per_gpu": self.slots_per_gpu}
        return {"replicas_per_gpu": self.replicas_per_gpu}  # type: ignore[dict-item]

    def check(self, plan: Placement, *, chosen_replicas_per_gpu: int | None = None) -> None:
        """Raise :class:`BudgetError` if ``plan`` uses more memory than this budget allows (see
        :meth:`Capacity.check`)."""
        if chosen_replicas_per_gpu is None and self.replicas_per_gpu == "auto":
            # a plan read from a file has no typed diagnostics: its params record the R its policy chose
            chosen_replicas_per_gpu = plan.params.get("chosen_replicas_per_gpu")
        resolve_budget(self, plan.num_experts, plan.num_gpus, plan.num_layers).check(
            plan, chosen_replicas_per_gpu=chosen_replicas_per_gpu)


def slots_to_replicas(slots_per_gpu: int, num_experts: int, num_gpus: int, num_layers: int) -> int:
    """``R = L * (S - E / G)``, rounded down: the extra replicas per GPU that ``S`` equal slots pay for.

    Example: DeepSeek-V3 (58 layers x 256 experts) on 64 GPUs with ``S = 5``: ``R = 58 * (5 - 4) = 58``.
    Converting back (:meth:`Capacity.uniform_slots`) gives ``S`` again when ``G`` divides ``L * (S * G - E)``,
    else at most ``S``.
    """
    return (num_layers * (slots_per_gpu * num_gpus - num_experts)) // num_gpus


@dataclass(frozen=True, slots=True)
class Capacity:
    """What a budget allows for ``L`` layers of ``E`` experts on ``G`` GPUs; made by :func:`resolve_budget`.

    Example: ``resolve_budget(Budget(slots_per_gpu=5), 256, 64, 58)`` has ``placement_slots == 4``,
    ``layer_slots == 5``, ``uniform_slots("eplb")[0] == 5`` and ``replicas("craft")[0] == 58`` (with a note).
    """

    budget: Budget
    num_experts: int
    num_gpus: int
    num_layers: int
    #: ``q = ceil(E / G)``: slots per GPU of a placement without replicas (always within the budget).
    placement_slots: int
    #: ``S``: the most experts a GPU may host in one layer, or None (a replicas budget caps only totals).
    layer_slots: int | None
    #: A note on how the budget was converted for the policy, or None (stored in the plan's params).
    note: str | None = None
    #: Exact limits of a converted slots budget: extra replicas over all layers, and slots of one GPU over all
    #: layers (None: those of ``replicas_per_gpu``, ``R * G`` and ``L * q + R``).
    max_extra_replicas: int | None = None
    max_slots_total: int | None = None

    @property
    def auto(self) -> bool:
        """True for ``replicas_per_gpu="auto"``: the policy chooses ``R`` (CRAFT Step 2)."""
        return self.budget.replicas_per_gpu == "auto"

    def replicas(self, policy: str, *, auto_ok: bool = False) -> tuple[int | None, Capacity]:
        """``R`` for a policy that spreads replicas over layers, and the capacity to check its plan against.

        A slots budget converts to ``R = L * (S - E / G)`` with a note. ``auto`` gives ``None`` where the policy
        chooses (``auto_ok``), else a :class:`BudgetError`.
        """
        R = self.budget.replicas_per_gpu
        if R == "auto":
            if not auto_ok:
                raise BudgetError(f"policy {policy!r} cannot choose replicas_per_gpu itself; give a number "
                                  "(craft can: auto)")
            return None, self
        if R is not None:
            return int(R), self
        S = self.budget.slots_per_gpu
        if S is None:  # unreachable: a Budget holds exactly one of the two
            raise BudgetError("a budget needs slots_per_gpu or replicas_per_gpu")
        L, E, G = self.num_layers, self.num_experts, self.num_gpus
        R = slots_to_replicas(S, E, G, L)
        note = (f"slots_per_gpu {S} read as replicas_per_gpu {R} = L * (S - E / G) for {policy}: at most the "
                f"memory of {S} slots per GPU, spread over layers, so one layer may hold more than {S} on a GPU")
        converted = Capacity(Budget(replicas_per_gpu=R), E, G, L, self.placement_slots, None, note,
                             max_extra_replicas=L * (S * G - E), max_slots_total=L * S)
        return R, converted

    def uniform_slots(self, policy: str) -> tuple[int, Capacity]:
        """Equal slots per GPU in every layer (EPLB), and the capacity to check the plan against.

        With ``replicas_per_gpu R`` each layer gets the most equal slots that ``R * G`` extra replicas pay for
        (never beyond ``E``: a GPU would hold some expert twice), with a note when that is more than ``q``.
        """
        if self.layer_slots is not None:
            return self.layer_slots, self
        R, _ = self.replicas(policy)
        if R is None:  # unreachable: replicas() refuses auto here
            raise BudgetError(f"policy {policy!r} cannot choose replicas_per_gpu itself; give a number")
        L, E, G, q = self.num_layers, self.num_experts, self.num_gpus, self.placement_slots
        slots = min((L * E + R * G) // (L * G), E)
        if slots < q:
            extra = L * (q * G - E)
            raise BudgetError(
                f"equal slots per GPU put {E} experts into {q * G} slots per layer, {extra} extra replicas in all, "
                f"but replicas_per_gpu {R} allows {R * G}; raise it to at least {math.ceil(extra / G)}")
        if slots == q:
            if R == 0 or q >= E:  # nothing to spend, or nothing more to hold
                return slots, self
            need = math.ceil((L * G * (q + 1) - L * E) / G)
            note = (f"replicas_per_gpu {R} read as slots_per_gpu {q} in every layer for {policy}: "
                    f"{L * (q * G - E)} of the {R * G} extra replicas allowed are used (one more slot per GPU in every "
                    f"layer needs replicas_per_gpu >= {need}; craft spends replicas layer by layer)")
            return slots, dataclasses.replace(self, note=note)
        note = (f"replicas_per_gpu {R} read as slots_per_gpu {slots} in every layer for {policy}: "
                f"{L * (slots * G - E)} of the {R * G} extra replicas allowed")
        return slots, dataclasses.replace(self, note=note)

    def check(self, plan: Placement, *, chosen_replicas_per_gpu: int | None = None) -> None:
        """Raise :class:`BudgetError` if ``plan`` uses more memory than this capacity allows.

        ``chosen_replicas_per_gpu`` is the ``R`` a policy chose under an ``auto`` budget.
        """
        S = self.budget.slots_per_gpu
        if S is not None:
            if plan.max_slots_per_gpu > S:
                raise BudgetError(f"plan {plan.policy!r} puts {plan.max_slots_per_gpu} experts on one GPU in one "
                                  f"layer but slots_per_gpu is {S}")
            return
        R = self.budget.replicas_per_gpu
        if R == "auto":
            if chosen_replicas_per_gpu is None:
                raise BudgetError(f"policy {plan.policy!r} cannot choose replicas_per_gpu itself; give a number "
                                  "(craft can: auto)")
            R = chosen_replicas_per_gpu
        if isinstance(R, bool) or not isinstance(R, int | np.integer) or R < 0:
            raise BudgetError(f"policy {plan.policy!r} reports replicas_per_gpu {R!r}; it must be an integer >= 0")
        R = int(R)
        G = plan.num_gpus
        allowed = R * G if self.max_extra_replicas is None else self.max_extra_replicas
        if plan.extra_replicas > allowed:
            raise BudgetError(f"plan {plan.policy!r} uses {plan.extra_replicas} extra replicas but replicas_per_gpu "
                              f"{R} allows {allowed}")
        # per-GPU memory: at most what equal slots of ceil(E / G) per layer take, plus R (or what S slots hold)
        per_gpu = int(plan.slots().sum(axis=0).max())
        limit = plan.num_layers * math.ceil(plan.num_experts / G) + R
        if self.max_slots_total is not None:
            limit = min(limit, self.max_slots_total)
        if per_gpu > limit:
            raise BudgetError(f"plan {plan.policy!r} puts {per_gpu} experts on one GPU over all layers but "
                              f"replicas_per_gpu {R} allows {limit}")


def resolve_budget(budget: Budget, num_experts: int, num_gpus: int, num_layers: int) -> Capacity:
    """The :class:`Capacity` of ``budget`` for ``L`` layers of ``E`` experts on ``G`` GPUs.

    Refuses a slots budget below ``q = ceil(E / G)``: no plan could place every expert.
    """
    if not isinstance(budget, Budget):
        raise BudgetError(f"budget must be a Budget(slots_per_gpu=S) or Budget(replicas_per_gpu=R), not "
                          f"{type(budget).__name__}")
    q = math.ceil(num_experts / num_gpus)
    S = budget.slots_per_gpu
    if S is not None and S < q:
        raise BudgetError(f"slots_per_gpu ({S}) cannot hold {num_experts} experts on {num_gpus} GPUs; "
                          f"it must be at least {q}")
    if S is not None:  # a plan with S slots on every GPU (EPLB's phy2log) holds [L, G * S] slot ids
        try:
            check_alloc((num_layers, num_gpus * S), 8, f"the physical slots [L, G * S] of slots_per_gpu {S:,} on "
                        f"{num_gpus} GPUs", f"lower slots_per_gpu (a GPU holds at most the {num_experts} experts "
                        "of a layer once each)")
        except InputError as exc:
            raise BudgetError(str(exc)) from None
    return Capacity(budget, num_experts, num_gpus, num_layers, q, S)
