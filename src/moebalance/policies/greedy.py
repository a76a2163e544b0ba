"""``greedy``: load-aware placement without replicas.

Per layer, experts are taken heaviest first (by load summed over the planning batches) and each goes to the
least-loaded GPU that still has a free slot, every GPU having ``ceil(E / G)`` slots: the longest-processing-
time rule that EPLB's packing and CRAFT's placement step (Section 4.2.2, step 5) use, here without
replication. It is CRAFT's "placement-only" baseline (Alg. 1, ``r = 0``). Ties go to the lower expert id
and the lower GPU id, so the plan is deterministic.
"""

from __future__ import annotations

import numpy as np

from moebalance.algorithms.packing import greedy_pack, placement_from_assignment
from moebalance.core.budget import Capacity
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.policies.base import NoConfig, Planned, Policy

__all__ = ["GREEDY", "greedy"]


def greedy(load: LoadMatrix, cluster: Cluster, capacity: Capacity, config: NoConfig) -> Planned:
    """Heaviest expert to the least-loaded GPU with a free slot, per layer."""
    E, L, G = load.num_experts, load.num_layers, cluster.num_gpus
    weight = load.total().astype(np.float64)
    room = np.full((L, G), capacity.placement_slots, dtype=np.int64)
    gpu = greedy_pack(weight, room)
    return Planned(placement_from_assignment(gpu, np.tile(np.arange(E), (L, 1)), cluster, E, "greedy", {}))


GREEDY = Policy("greedy", NoConfig, greedy)
