"""Shared fixtures and hypothesis settings."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def random_replica_layers(rng: object, num_layers: int, num_experts: int, num_gpus: int) -> list[list[list[int]]]:
    """``[L][G]`` expert lists where every expert sits on a random non-empty set of distinct GPUs."""
    import numpy as np

    assert isinstance(rng, np.random.Generator)
    layers = []
    for _ in range(num_layers):
        gpus: list[list[int]] = [[] for _ in range(num_gpus)]
        for e in range(num_experts):
            for g in rng.choice(num_gpus, size=int(rng.integers(1, num_gpus + 1)), replace=False):
                gpus[int(g)].append(e)
        layers.append(gpus)
    return layers
