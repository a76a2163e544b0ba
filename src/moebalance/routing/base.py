"""The router interface."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from moebalance.core.plan import Placement
    from moebalance.core.trace import RoutingTrace

__all__ = ["Router"]


@dataclass(frozen=True, slots=True)
class Router:
    """A named replica-selection rule, usable on counts and on tokens."""

    name: str
    #: ``(plan, counts [B, L, E], rng) -> float64 [B, L, G]`` tokens served per GPU.
    split_counts: Callable[[Placement, np.ndarray, np.random.Generator], np.ndarray]
    #: ``(plan, trace, rng) -> int64 [T, L, K]`` the GPU serving each token's each pick.
    assign_tokens: Callable[[Placement, RoutingTrace, np.random.Generator], np.ndarray]
    #: One line for help texts.
    summary: str = ""
