"""The ``rebalance`` router: Libra's Adaptive Token Rebalancer (Libra Section 3.3 and Appendix C, Alg. 2).

A pick whose expert has a copy on the token's own GPU stays there (Libra's MoE_local: it is computed before
any token moves, so the rebalancer cannot touch it); the other picks start split as ``uniform`` splits them and
Alg. 2 moves them, most loaded GPU and hottest expert first, to the least loaded GPU holding a copy, until
every GPU is within ``(1 + eps)`` of the mean load. On counts no pick has a source GPU, so every pick is
remote. Tokens move whole, on counts too. The algorithm and our readings of its pseudocode:
:mod:`moebalance.algorithms.rebalance` and docs/papers/libra.md.

Options (``--router-set``): ``eps`` (default 0: run until no beneficial move is left; docs/papers/libra.md
gives the measurements behind the default) and ``strict`` (default false; true follows the printed
``cap = B - G[g_d] > 0`` test to the letter, which gives up on an expert whose copies all sit on GPUs at or
above the mean).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moebalance.algorithms import rebalance as kernel
from moebalance.core.errors import InputError
from moebalance.routing.base import Router, RouterConfig
from moebalance.routing.minmax import batch_starts

if TYPE_CHECKING:
    from moebalance.core.plan import Placement
    from moebalance.core.trace import RoutingTrace

__all__ = ["REBALANCE", "RebalanceConfig", "make_rebalance"]


@dataclass(kw_only=True, frozen=True, slots=True)
class RebalanceConfig(RouterConfig):
    """Options of the ``rebalance`` router.

    Example: ``RebalanceConfig(eps=0.02)`` stops once the busiest GPU is within 2% of the mean load.
    """

    #: Libra's imbalance tolerance: stop when ``max_g load <= (1 + eps) * mean``; 0 runs until no move helps.
    eps: float = 0.0
    #: Follow the printed pseudocode's ``cap = B - G[g_d] > 0`` to the letter (see the module docstring).
    strict: bool = False

    def __post_init__(self) -> None:
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, int | float | np.integer | np.floating) \
                or not (math.isfinite(eps) and 0 <= eps < 1):
            raise InputError(f"rebalance option eps ({eps!r}) must be a number in [0, 1), the tolerance over the "
                             f"mean GPU load (e.g. eps=0.02)")
        object.__setattr__(self, "eps", float(eps))
        if not isinstance(self.strict, bool | np.bool_):
            raise InputError(f"rebalance option strict ({self.strict!r}) must be true or false")
        object.__setattr__(self, "strict", bool(self.strict))


def _counts(config: RebalanceConfig, plan: Placement, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return kernel.split_counts(np.ascontiguousarray(counts, dtype=np.int64), plan.copies, config.eps, config.strict)


def _kept(config: RebalanceConfig, plan: Placement, trace: RoutingTrace, kept: np.ndarray,
          rng: np.random.Generator) -> np.ndarray:
    trace.check_gpus(plan.num_gpus)  # a pick is local when its expert has a copy on the token's GPU
    starts = batch_starts(trace)
    dest = np.empty(trace.topk_ids.shape, dtype=np.int64)
    for layer in range(trace.num_layers):
        ids = np.ascontiguousarray(trace.topk_ids[:, layer, :], dtype=np.int64)
        dest[:, layer, :] = kernel.route_tokens(ids, trace.src_gpu,
                                                starts, plan.copies[layer], plan.cluster.gpus_per_node, config.eps,
                                                config.strict, np.ascontiguousarray(kept[:, layer, :]))
    return dest


def _tokens(config: RebalanceConfig, plan: Placement, trace: RoutingTrace, rng: np.random.Generator) -> np.ndarray:
    return _kept(config, plan, trace, np.ones(trace.topk_ids.shape, dtype=bool), rng)


def make_rebalance(config: RebalanceConfig) -> Router:
    """The ``rebalance`` router with ``config``."""
    return Router("rebalance", functools.partial(_counts, config), functools.partial(_tokens, config),
                  "Libra Alg. 2: own-GPU picks stay, remote picks move from the busiest GPU to the least loaded copy",
                  assign_kept=functools.partial(_kept, config), config=config, configure=make_rebalance)


REBALANCE = make_rebalance(RebalanceConfig())
