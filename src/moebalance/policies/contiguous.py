"""``contiguous``: Megatron-style expert parallelism, no replicas.

GPU ``g`` hosts a contiguous block of expert ids: with ``E = G * q + m`` the first ``m`` GPUs take
``q + 1`` experts and the rest ``q`` (Megatron-LM's ``num_local_experts = E / ep_size`` when ``G``
divides ``E``). It ignores the load: the baseline every other policy is measured against.
"""

from __future__ import annotations

import numpy as np

from moebalance.algorithms.packing import placement_from_assignment
from moebalance.core.budget import Capacity
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.policies.base import NoConfig, Planned, Policy

__all__ = ["CONTIGUOUS", "contiguous"]


def contiguous(load: LoadMatrix, cluster: Cluster, capacity: Capacity, config: NoConfig) -> Planned:
    """Blocks of consecutive experts per GPU, the same in every layer."""
    E, L, G = load.num_experts, load.num_layers, cluster.num_gpus
    q, m = divmod(E, G)
    sizes = np.where(np.arange(G) < m, q + 1, q)
    gpu = np.repeat(np.arange(G), sizes)  # [E]
    experts = np.arange(E)
    return Planned(placement_from_assignment(np.tile(gpu, (L, 1)), np.tile(experts, (L, 1)), cluster, E,
                                             "contiguous", {}))


CONTIGUOUS = Policy("contiguous", NoConfig, contiguous)
