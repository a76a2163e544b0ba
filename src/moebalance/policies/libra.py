"""Policy ``libra`` (dynamic): a static base placement plus, per batch and layer, the prefetcher's extra copies.

Legend: ``L`` layers, ``G`` GPUs, ``E`` experts, ``N`` extra experts per GPU and layer.

Libra ("Libra: Effective yet Efficient Load Balancing for Large-Scale MoE Inference") keeps every expert at a
home GPU and, for every batch, prefetches up to ``N`` experts per GPU into a buffer before each MoE layer runs
(:mod:`moebalance.algorithms.prefetch`, Alg. 1), planned from a prediction of the batch's routing
(:mod:`moebalance.prediction.predictors`); tokens are then sharded by the Adaptive Token Rebalancer (router
``rebalance``). With ``predictor=exact`` the plan is made after the gate, from the batch's own routing: the
after-the-gate policy, whose per-layer planning (prefetcher and rebalancer in one call) is
:func:`moebalance.algorithms.exact.plan_layer`. The buffer is reused by every layer, double-buffered so that one layer's copies arrive while
the previous layer computes, so its memory is ``2 N`` expert slots per GPU whatever ``L`` is; a static plan
with one extra slot per GPU and layer (EPLB's usual budget) spends ``L``.

A dynamic policy has no single plan: ``moebalance online`` replays it batch by batch, and asking
``plan`` or ``compare`` for it is an error that says so. Options (``--set``): ``predictor``
(``lookahead``, ``path``, ``history``, ``exact``; ``oracle`` is an alias of ``exact``), ``n``, ``alpha`` (phase 1's share of ``n``), ``base`` (the
static policy that places the homes, planned once on the warm-up batches under the given budget), ``depth``
(the path predictor's key length) and ``window`` (the history predictor's batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.algorithms.exact import LayerPlan, base_layer, plan_layer
from moebalance.algorithms.prefetch import phase1_count, prefetch_layers
from moebalance.core.errors import InputError
from moebalance.core.options import check_choice, check_int
from moebalance.core.plan import Placement
from moebalance.policies.base import PolicyConfig
from moebalance.prediction.predictors import EXACT, PREDICTORS

__all__ = ["LIBRA", "DynamicPolicy", "LibraConfig", "batch_plan", "buffer_slots", "exact_plan"]
#: Static policies that may place the homes (dynamic ones cannot).
_BASES = ("contiguous", "greedy", "eplb", "craft", "grace", "moetuner")


@dataclass(kw_only=True, frozen=True, slots=True)
class LibraConfig(PolicyConfig):
    """Libra's options. Example: ``LibraConfig(predictor="exact", n=4)`` prefetches up to 4 experts per GPU and
    layer, 2 of them for locality, from the batch's routing as the gate computes it (``oracle`` names the same)."""

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
        check_choice("predictor", self.predictor, PREDICTORS)
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
    def exact(self) -> bool:
        """Whether the plan is made from the batch's own routing (``exact`` or its alias ``oracle``)."""
        return self.predictor in EXACT

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
    return _with_extras(base, extras, config), extras


def exact_plan(base: Placement, counts: np.ndarray, config: LibraConfig, *, eps: float = 0.0,
               strict: bool = False) -> tuple[Placement, np.ndarray, list[LayerPlan]]:
    """``(plan of one batch, extras [L, G, N], each layer's LayerPlan)`` planned after the gate: ``counts [L, G, E]``
    the batch's own picks by source GPU and expert (whole numbers), every layer planned by
    :func:`moebalance.algorithms.exact.plan_layer` (the prefetcher, then the rebalancer with ``eps`` and
    ``strict``). The extras are :func:`batch_plan`'s on the same counts, and each layer's routing split is the
    one the ``rebalance`` router gives on the per-batch plan."""
    L, G, E = base.num_layers, base.num_gpus, base.num_experts
    if np.shape(counts) != (L, G, E):
        raise InputError(f"counts have shape {np.shape(counts)}; the base plan needs [L, G, E] = [{L}, {G}, {E}]")
    layers = [plan_layer(counts[layer], base_layer(base.copies[layer]), config.n, config.alpha, eps=eps,
                         strict=strict) for layer in range(L)]
    extras = np.stack([p.extras for p in layers]) if L else np.full((0, G, config.n), -1, dtype=np.int64)
    return _with_extras(base, extras, config), extras, layers


def _with_extras(base: Placement, extras: np.ndarray, config: LibraConfig) -> Placement:
    """``base`` with ``extras [L, G, N]`` appended to every GPU's list, layer by layer."""
    G = base.num_gpus
    lists = [[list(base.gpu_experts[layer][g]) + [int(e) for e in extras[layer, g] if e >= 0] for g in range(G)]
             for layer in range(base.num_layers)]
    return Placement(gpu_experts=lists, num_experts=base.num_experts, cluster=base.cluster, policy="libra",
                     params={"base": base.policy, "n": config.n, "alpha": config.alpha})
