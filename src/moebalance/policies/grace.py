"""``grace``: GRACE-MoE as a policy, a thin adapter over :mod:`moebalance.algorithms.grace`.

After "GRACE-MoE: Grouping and Replication with Locality-Aware Routing for Efficient Distributed MoE
Inference" (our readings of its open points: ``docs/papers/grace.md``). Per layer: affinity from the load's
token-level trace (Section 4), hierarchical grouping (Section 4.1: spectral node groups, Alg. 2 GPU groups at
the knee of Eq. 1), replication of the heaviest group's hot experts (Section 4.2, Eq. 2) and routing shares
from the predicted loads (Eq. 3), in :func:`moebalance.algorithms.grace.plan.grace_plan`.

Budgets: ``slots_per_gpu S`` caps every GPU in every layer; ``replicas_per_gpu R`` caps the replicas over all
layers (``auto`` is refused: GRACE does not choose ``R``). The capacity is passed to the algorithm as resolved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moebalance.algorithms.grace.grouping import affinity as trace_affinity
from moebalance.algorithms.grace.grouping import check_ratio
from moebalance.algorithms.grace.plan import (
    GROUPINGS,
    REPLICATIONS,
    GraceRecord,
    Grouping,
    Replication,
    grace_plan,
)
from moebalance.core.budget import Capacity
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.options import check_choice, check_int
from moebalance.policies.base import Diagnostics, Planned, Policy, PolicyConfig

__all__ = ["GRACE", "GraceConfig", "GraceDiagnostics", "grace"]


@dataclass(kw_only=True, frozen=True, slots=True)
class GraceConfig(PolicyConfig):
    """``grouping``: ``"hierarchical"`` (Section 4.1; needs the token-level trace, ``topk_ids``, to measure
    affinity) or ``"uniform"`` (Vanilla, contiguous blocks; counts suffice). ``replication``: ``"dynamic"``
    (Eq. 2), ``"fixed"`` (one replica of the hot experts, Section 5.3) or ``"none"``. ``ratio``: Alg. 2's ``r``,
    or None for the knee of Eq. 1 per layer. ``node_ratio``: None (node groups bounded only by what their GPU
    groups may hold) or a ratio bounding them by Alg. 2 for ``N`` groups as well (beyond the paper).
    ``seed``: k-means restarts."""

    grouping: Grouping = "hierarchical"
    replication: Replication = "dynamic"
    ratio: float | None = None
    node_ratio: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("grouping", self.grouping, GROUPINGS)
        check_choice("replication", self.replication, REPLICATIONS)
        object.__setattr__(self, "ratio", check_ratio("ratio", self.ratio, "the knee of Eq. 1"))
        object.__setattr__(self, "node_ratio", check_ratio("node_ratio", self.node_ratio,
                                                           "node groups bounded only by their GPUs'"))
        object.__setattr__(self, "seed", check_int("seed", self.seed, minimum=0))


@dataclass(kw_only=True, frozen=True, slots=True)
class GraceDiagnostics(GraceRecord, Diagnostics):
    """GRACE's record (:class:`~moebalance.algorithms.grace.plan.GraceRecord`: Eq. 2's replica counts, hot
    experts, skew, Eq. 3's predicted loads, the chosen ratios), typed; the plan's params hold it field by field."""

    @classmethod
    def of(cls, record: GraceRecord) -> GraceDiagnostics:
        return cls(**{f.name: getattr(record, f.name) for f in dataclasses.fields(record)})


def grace(load: LoadMatrix, cluster: Cluster, capacity: Capacity, config: GraceConfig) -> Planned:
    """GRACE-MoE on a token-level load: affinity grouping (Alg. 1-2), Eq. 2 replication, Eq. 3 weights."""
    aff = None
    if config.grouping == "hierarchical":
        if load.trace is None:
            raise InputError("policy 'grace' groups experts by co-activation and needs a token-level trace "
                             "(topk_ids, src_gpu, batch); this load has counts only (synthesize with "
                             "token_level=True, or use grouping='uniform')")
        aff = trace_affinity(load.trace)
    result = grace_plan(weight=load.total(), affinity=aff, cluster=cluster, capacity=capacity,
                        grouping=config.grouping, replication=config.replication, ratio=config.ratio,
                        node_ratio=config.node_ratio, seed=config.seed)
    return Planned(result.placement, GraceDiagnostics.of(result.record))


GRACE = Policy("grace", GraceConfig, grace)
