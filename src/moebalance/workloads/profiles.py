"""Knobs of the synthetic routing model (:mod:`moebalance.workloads.synth`) and their values per model.

The routing profiles are our modelling choices, not published per-model numbers; ``docs/synth.md`` says which
published number each knob reproduces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.core.errors import InputError
from moebalance.models import ModelSpec

__all__ = ["PROFILES", "RoutingProfile", "routing_profile"]


@dataclass(kw_only=True, frozen=True, slots=True)
class RoutingProfile:
    """Knobs of the generative routing model (:mod:`moebalance.workloads.synth`); defaults suit large MoE models.

    Inclusion probabilities (``pinned_hot``, ``high_hot_range``) are the fraction of a batch's tokens that
    pick an expert: an expert picked by a fraction ``p`` of the tokens has ``p * E / K`` times the mean load.
    """

    #: Fraction of layers that are high-skew (at least one layer when positive).
    high_skew_fraction: float = 0.15
    #: Fraction of layers that are balanced (at least one layer when positive); the rest are moderate.
    balanced_fraction: float = 0.2
    #: Inclusion probabilities of the two hottest experts of the most skewed layer.
    pinned_hot: tuple[float, float] = (0.93, 0.68)
    #: Range of the hottest expert's inclusion probability in the other high-skew layers.
    high_hot_range: tuple[float, float] = (0.4, 0.9)
    #: Peak/mean range of the warm expert of moderate layers.
    moderate_peak_range: tuple[float, float] = (3.0, 8.0)
    #: Log-normal sigma of the other experts' popularity in balanced layers.
    balanced_sigma: float = 0.3
    #: Log-normal sigma of the other experts' popularity in moderate and high-skew layers.
    skewed_sigma: float = 0.6
    #: ``C``: latent topics.
    num_topics: int = 16
    #: Logit boost of a topic's expert cluster.
    topic_strength: float = 2.0
    #: ``S``: latent route states.
    num_route_states: int = 8
    #: Logit boost of a route state's expert cluster.
    route_strength: float = 1.5
    #: Probability that the route state follows the layer's fixed permutation rather than resetting.
    route_persistence: float = 0.8
    #: Dirichlet concentration (per topic) of a rank's topic mixture; small means specialised ranks.
    gpu_topic_concentration: float = 0.5
    #: Dirichlet concentration (per topic) of a batch's new requests around their rank's home mixture.
    request_concentration: float = 2.0
    #: Fraction of a rank's topic mixture renewed each batch.
    request_turnover: float = 0.05
    #: Stationary standard deviation of the log-popularity drift.
    drift_sigma: float = 0.3
    #: Correlation time of the drift, in batches.
    drift_timescale: float = 400.0

    def __post_init__(self) -> None:
        for field in ("high_skew_fraction", "balanced_fraction", "route_persistence", "request_turnover"):
            value = getattr(self, field)
            if not 0.0 <= value <= 1.0:
                raise InputError(f"RoutingProfile.{field} ({value}) must lie in [0, 1]")
        if self.high_skew_fraction + self.balanced_fraction > 1.0:
            raise InputError(f"RoutingProfile.high_skew_fraction + balanced_fraction "
                             f"({self.high_skew_fraction + self.balanced_fraction}) must be at most 1")
        for field in ("pinned_hot", "high_hot_range"):
            lo_hi = getattr(self, field)
            if len(lo_hi) != 2 or not all(0.0 < v <= 0.93 for v in lo_hi):
                raise InputError(f"RoutingProfile.{field} ({lo_hi}) must be two probabilities in (0, 0.93]")
        if self.high_hot_range[0] > self.high_hot_range[1]:
            raise InputError(f"RoutingProfile.high_hot_range ({self.high_hot_range}) must be (low, high)")
        lo, hi = self.moderate_peak_range
        if not 1.0 <= lo <= hi:
            raise InputError(f"RoutingProfile.moderate_peak_range ({self.moderate_peak_range}) must be "
                             "(low, high) with 1 <= low <= high")
        for field in ("num_topics", "num_route_states"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                raise InputError(f"RoutingProfile.{field} ({value!r}) must be a positive integer")
        for field in ("balanced_sigma", "skewed_sigma", "topic_strength", "route_strength", "drift_sigma"):
            if getattr(self, field) < 0:
                raise InputError(f"RoutingProfile.{field} ({getattr(self, field)}) must be >= 0")
        for field in ("gpu_topic_concentration", "request_concentration", "drift_timescale"):
            if not getattr(self, field) > 0:
                raise InputError(f"RoutingProfile.{field} ({getattr(self, field)}) must be positive")


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


# Routing profiles are our modelling choices, not published per-model numbers (docs/synth.md says which
# published number each knob reproduces). Models trained with strong load balancing get fewer skewed layers.
PROFILES: dict[str, RoutingProfile] = {
    "deepseek-v3": RoutingProfile(),
    "deepseek-r1": RoutingProfile(),
    "kimi-k2": RoutingProfile(),
    "qwen3-235b-a22b": RoutingProfile(high_skew_fraction=0.1, balanced_fraction=0.3),
    "qwen3-30b-a3b": RoutingProfile(high_skew_fraction=0.1, balanced_fraction=0.3),
    "glm-4.5": RoutingProfile(high_skew_fraction=0.1, balanced_fraction=0.3),
    # MoETuner Fig. 4: in Mixtral's skewed layers two experts take ~64% of the load.
    # MoETuner Fig. 6: tokens of one expert in layer 14 go predominantly to one expert in layer 15.
    "mixtral-8x7b": RoutingProfile(high_skew_fraction=0.25, balanced_fraction=0.25, pinned_hot=(0.72, 0.56),
                                   high_hot_range=(0.45, 0.72), num_topics=8, num_route_states=4,
                                   route_strength=3.5, route_persistence=0.9),
    "olmoe-1b-7b": RoutingProfile(high_skew_fraction=0.1, balanced_fraction=0.4),
    "deepseek-v2-lite": RoutingProfile(high_skew_fraction=0.1, balanced_fraction=0.3),
}


def routing_profile(model: ModelSpec) -> RoutingProfile:
    """The routing profile of ``model``: its entry in :data:`PROFILES`, else the defaults."""
    return PROFILES.get(model.name, RoutingProfile())
