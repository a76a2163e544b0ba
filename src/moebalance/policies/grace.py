"""``grace``: GRACE-MoE as a policy, a thin adapter over :mod:`moebalance.algorithms.grace`.

After "GRACE-MoE: Grouping and Replication with Locality-Aware Routing for Efficient Distributed MoE
Inference" (our readings of its open points: ``docs/papers/grace.md``). Per layer: affinity from the load's
token-level trace (Section 4), hierarchical grouping (Section 4.1: spectral node groups, Alg. 2 GPU groups at
the knee of Eq. 1), replication of the heaviest group's hot experts (Section 4.2, Eq. 2) and routing shares
from the predicted loads (Eq. 3), in :func:`moebalance.algorithms.grace.plan.grace_plan`.

Budgets: ``slots_per_gpu S`` caps every GPU in every layer; ``replicas_per_gpu R`` caps the replicas over all
layers (``auto`` is refused: GRACE does not choose ``R``).
"""

from __future__ import annotations

from dataclasses import dataclass

from moebalance.algorithms.grace.grouping import affinity as trace_affinity
from moebalance.algorithms.grace.plan import (
    Grouping,
    Replication,
    check_option,
    check_ratio,
    check_seed,
    grace_plan,
)
from moebalance.core.budget import Capacity
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.policies.base import Diagnostics, Planned, Policy, PolicyConfig

__all__ = ["GRACE", "GraceConfig", "GraceDiagnostics", "grace"]


@dataclass(kw_only=True, frozen=True, slots=True)
class GraceConfig(PolicyConfig):
    """``grouping``: ``"hierarchical"`` (Section 4.1; needs the token-level trace, ``topk_ids``, to measure
    affinity) or ``"uniform"`` (Vanilla, contiguous blocks; counts suffice). ``replication``: ``"dynamic"``
    (Eq. 2), ``"fixed"`` (one replica of the hot experts, Section 5.3) or ``"none"``. ``ratio``: Alg. 2's ``r``
    for the GPU level, or None for the knee of Eq. 1 per (layer, node). ``node_ratio``: None (fully
    non-uniform node groups, as the paper) or a ratio bounding them likewise. ``seed``: k-means restarts."""

    grouping: Grouping = "hierarchical"
    replication: Replication = "dynamic"
    ratio: float | None = None
    node_ratio: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_option("grouping", self.grouping, ("hierarchical", "uniform"))
        check_option("replication", self.replication, ("dynamic", "fixed", "none"))
        object.__setattr__(self, "ratio", check_ratio("ratio", self.ratio, "the knee of Eq. 1"))
        object.__setattr__(self, "node_ratio", check_ratio("node_ratio", self.node_ratio,
                                                           "fully non-uniform node groups"))
        object.__setattr__(self, "seed", check_seed(self.seed))


@dataclass(kw_only=True, frozen=True, slots=True)
class GraceDiagnostics(Diagnostics):
    """Per layer: Eq. 2's replica count ``n`` and the ``n`` the budget allowed (the rest of GRACE's record,
    hot experts, skew, predicted loads, chosen ratios, is in the plan's params)."""

    replicas_wanted: list[int]
    replicas: list[int]


def grace(load: LoadMatrix, cluster: Cluster, capacity: Capacity, config: GraceConfig) -> Planned:
    """GRACE-MoE on a token-level load: affinity grouping (Alg. 1-2), Eq. 2 replication, Eq. 3 weights."""
    aff = None
    if config.grouping == "hierarchical":
        if load.trace is None:
            raise InputError("policy 'grace' groups experts by co-activation and needs a token-level trace "
                             "(topk_ids, src_gpu, batch); this load has counts only (synthesize with "
                             "token_level=True, or use grouping='uniform')")
        aff = trace_affinity(load.trace)
    if capacity.layer_slots is not None:
        budget: dict[str, int] = {"slots_per_gpu": capacity.layer_slots}
    else:
        R, _ = capacity.replicas("grace")  # refuses auto
        budget = {"replicas_per_gpu": int(R or 0)}
    plan = grace_plan(weight=load.total(), affinity=aff, cluster=cluster, **budget, grouping=config.grouping,
                      replication=config.replication, ratio=config.ratio, node_ratio=config.node_ratio,
                      seed=config.seed)
    diagnostics = GraceDiagnostics(replicas_wanted=list(plan.params["replicas_wanted"]),
                                   replicas=list(plan.params["replicas"]))
    return Planned(plan, diagnostics)


GRACE = Policy("grace", GraceConfig, grace)
