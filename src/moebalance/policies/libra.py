"""Policy ``libra`` (dynamic): a static base placement plus, per batch and layer, the prefetcher's extra copies.

Legend: ``L`` layers, ``G`` GPUs, ``E`` experts, ``N`` extra experts per GPU and layer.

Libra ("Libra: Effective yet Efficient Load Balancing for Large-Scale MoE Inference") keeps every expert at a
home GPU and, for every batch, prefetches up to ``N`` experts per GPU into a buffer before each MoE layer runs
(:mod:`moebalance.algorithms.prefetch`, Alg. 1), planned from a prediction of the batch's routing
(:mod:`moebalance.online.predictors`); tokens are then sharded by the Adaptive Token Rebalancer (router
``rebalance``). The buffer is reused by every layer, double-buffered so that one layer's copies arrive while
the previous layer computes, so its memory is ``2 N`` expert slots per GPU whatever ``L`` is; a static plan
with one extra slot per GPU and layer (EPLB's usual budget) spends ``L``.

A dynamic policy has no single plan: ``moebalance online`` replays it batch by batch, and asking
``plan`` or ``compare`` for it is an error that says so. Options (``--set``): ``predictor``
(``lookahead``, ``path``, ``history``, ``oracle``), ``n``, ``alpha`` (phase 1's share of ``n``), ``base`` (the
static policy that places the homes, planned once on the warm-up batches under the given budget), ``depth``
(the path predictor's key length) and ``window`` (the history predictor's batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.algorithms.prefetch import phase1_count, prefetch_layers
from moebalance.core.errors import InputError
from moebalance.core.options import check_choice, check_int
from moebalance.core.plan import Placement
from moebalance.policies.base import PolicyConfig

__all__ = ["LIBRA", "DynamicPolicy", "LibraConfig", "batch_plan", "buffer_slots"]

#: The predictors ``libra`` accepts (:data:`moebalance.online.predictors.PREDICTORS`).
_PREDICTORS = ("lookahead", "path", "history", "oracle")
#: Static policies that may place the homes (dynamic ones cannot).
_BASES = ("contiguous", "greedy", "eplb", "craft", "grace", "moetuner")


@dataclass(kw_only=True, frozen=True, slots=True)
class LibraConfig(PolicyConfig):
    """Libra's options. Example: ``LibraConfig(predictor="oracle", n=4)`` prefetches up to 4 experts per GPU and
    layer, 2 of them for locality, from the batch's true routing."""

    predictor: str = "lookahead"
    #: Extra experts per GPU for one layer (the prefetch buffer); the paper's deployment uses 8.
    n: int = 8
    #: Phase 1's share: ``floor(n * alpha)`` extras go to each GPU's most requested remote experts.
    alpha: float = 0.5
    base: str = "contiguous"
    #: Path predictor: previous layers in a path key.
    depth: int = 2
    #: History predictor: batches of history.
    window: int = 1

    def __post_init__(self) -> None:
        check_choice("predictor", self.predictor, _PREDICTORS)
        check_int("n", self.n, minimum=0)
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, int | float) or not 0.0 <= a <= 1.0:
            raise InputError(f"alpha ({a!r}) must be a number in [0, 1] (phase 1's share of n)")
        check_choice("base", self.base, _BASES)
        check_int("depth", self.depth, minimum=1)
        if self.depth > 4:
            raise InputError(f"depth ({self.depth}) must be at most 4 (previous layers in a path key)")
        check_int("window", self.window, minimum=1)

    @property
    def phase1(self) -> int:
        """``L = floor(n * alpha)``."""
        return phase1_count(self.n, self.alpha)


@dataclass(frozen=True, slots=True)
class DynamicPolicy:
    """A registered policy that plans per batch (``moebalance online``), not once."""

    name: str
    config: type[LibraConfig]


LIBRA = DynamicPolicy("libra", LibraConfig)


def buffer_slots(config: LibraConfig) -> int:
    """Replica memory of the prefetch buffer in expert slots per GPU: ``2 N`` (double-buffered, any ``L``)."""
    return 2 * config.n


def batch_plan(base: Placement, demand: np.ndarray, config: LibraConfig) -> tuple[Placement, np.ndarray]:
    """``(plan of one batch, extras [L, G, N])``: ``base`` with the prefetcher's extras appended to every GPU's
    list, layer by layer, planned from ``demand [L, G, E]`` (predicted picks by source GPU and expert)."""
    L, G, E = base.num_layers, base.num_gpus, base.num_experts
    if demand.shape != (L, G, E):
        raise InputError(f"demand has shape {demand.shape}; the base plan needs [L, G, E] = [{L}, {G}, {E}]")
    hosted = base.copies.transpose(0, 2, 1) > 0  # copies [L, E, G] -> [L, G, E]
    extras = prefetch_layers(demand, hosted, config.n, config.alpha)
    lists = [[list(base.gpu_experts[layer][g]) + [int(e) for e in extras[layer, g] if e >= 0] for g in range(G)]
             for layer in range(L)]
    plan = Placement(gpu_experts=lists, num_experts=E, cluster=base.cluster, policy="libra",
                     params={"base": base.policy, "n": config.n, "alpha": config.alpha})
    return plan, extras
