"""Exact mode: Libra's prefetcher and rebalancer planned for each layer after its gate, on the batch's own routing
(docs/design.md, "Runtime").

Legend: ``G`` ranks = GPUs, ``E`` logical experts, ``T`` tokens of all ranks, ``K`` picks per token, ``N`` extra
experts a GPU may take in one layer (Libra's buffer), ``L = floor(N * alpha)`` of them for locality.

With a per-batch plan (:mod:`moebalance.runtime.prefetch`) the extras come from a prediction made before the batch.
In exact mode (``EPConfig(exact=ExactConfig(...))``, the ``libra`` policy with ``predictor=exact``) a layer plans
its own extras from the routing its gate just computed, which every rank holds after the routing gather:

1. **Plan** (:func:`plan_exact`): count the batch's kept picks by source rank and expert (``demand [G, E]``), run
   Libra's Hierarchical Expert Prefetcher (Alg. 1, phases 1 and 2) on the base plan's copies and the Adaptive
   Token Rebalancer's split (Alg. 2) on the base plan plus the extras in one compiled call
   (:func:`moebalance.algorithms.exact.plan_layer`), then hand the split out to the kept picks
   (:func:`moebalance.algorithms.exact.assign`: what the ``rebalance`` router routes on that per-batch plan). Every rank runs the same deterministic code on the same gathered arrays, so all compute the
   same plan without a message. With a router other than ``rebalance`` the extras are planned alike and that
   router then routes on the base plan plus the extras (:func:`moebalance.runtime.route.route_picks`).
2. **Copy**: each extra is copied from a holder in the base plan into this layer's prefetch buffer
   (:meth:`~moebalance.runtime.prefetch.ExpertPrefetcher.post`, the prefetcher's source rule); the copies are
   posted before the dispatch is planned and waited for after it.
3. **Route**: the tokens are dispatched by that routing, computed and combined as in any forward.

The results equal the simulator's ``libra`` with the batch's true routing (``predictor=exact``, alias
``oracle``): the extras are those of :func:`moebalance.policies.libra.batch_plan` on the per-source demand of the
batch's kept picks (a pick the capacity dropped is served nowhere, so it asks for no copy), and the picks go where
the ``rebalance`` router sends them on that per-batch plan. :class:`~moebalance.runtime.stats.ExactTiming`
reports each forward's time from the gate to the start of expert compute as planning, copying and routing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moebalance.algorithms.exact import assign, plan_layer
from moebalance.algorithms.prefetch import prefetch
from moebalance.core.errors import InputError
from moebalance.core.plan import Placement
from moebalance.routing import Router, get_router
from moebalance.routing.rebalance import RebalanceConfig

if TYPE_CHECKING:
    from moebalance.runtime.prefetch import ExpertPrefetcher

__all__ = ["ExactConfig", "ExactPlan", "check_exact", "exact_demand", "exact_layer_plan", "plan_exact", "warm_up"]


@dataclass(kw_only=True, frozen=True, slots=True)
class ExactConfig:
    """Libra's options in exact mode. Example: ``ExactConfig(n=4, alpha=0.5)`` lets every GPU take up to 4 extra
    experts per layer, 2 of them its own tokens' most requested remote experts."""

    #: Extra experts per GPU and layer: the prefetch buffer's slots (Libra's N; the paper's deployment uses 8).
    n: int = 8
    #: Phase 1's share of ``n``: ``floor(n * alpha)`` extras go to each GPU's most requested remote experts.
    alpha: float = 0.5

    def __post_init__(self) -> None:
        n = self.n
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
            raise InputError(f"exact mode's n ({n!r}) must be a non-negative integer (extra experts per GPU and layer)")
        object.__setattr__(self, "n", int(n))
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, int | float | np.integer | np.floating) \
                or not (math.isfinite(a) and 0.0 <= a <= 1.0):
            raise InputError(f"exact mode's alpha ({a!r}) must be a number in [0, 1] (phase 1's share of n)")
        object.__setattr__(self, "alpha", float(a))


@dataclass(frozen=True, slots=True)
class ExactPlan:
    """One layer's plan for one forward, the same on every rank."""

    #: ``[G]`` each GPU's extras, in the order the prefetcher added them (its buffer slots ``0 .. n-1``).
    extras: tuple[tuple[int, ...], ...]
    #: The one-layer plan the picks are routed on: each GPU's base list followed by its extras.
    layer_plan: Placement
    #: ``int64 [T, K]`` the rebalancer's GPU for every pick (-1 dropped); ``None`` when another router routes.
    dest: np.ndarray | None


def check_exact(config: ExactConfig | None, num_experts: int, prefetcher: ExpertPrefetcher | None = None, *,
                buffer: bool = True) -> None:
    """Raise a one-line error if a layer of ``num_experts`` experts cannot run exact mode with ``prefetcher``
    (``buffer=False``: check ``n`` only, before the layers are built)."""
    if config is None:
        return
    if config.n > num_experts:
        raise InputError(f"exact mode's n ({config.n}) exceeds the layer's {num_experts} experts: a GPU cannot take "
                         "more extra experts than there are; give a smaller n")
    if not buffer:
        return
    if config.n > 0 and prefetcher is None:
        raise InputError(f"exact mode with n={config.n} copies extra experts into a prefetch buffer; build the layers "
                         f"with prefetcher=ExpertPrefetcher({config.n}), or use n=0")
    if prefetcher is not None and prefetcher.num_slots < config.n:
        raise InputError(f"exact mode's n ({config.n}) is more than the prefetch buffer's {prefetcher.num_slots} slots; "
                         f"build the layers with ExpertPrefetcher({config.n}) or give a smaller n")


def warm_up() -> None:
    """Load the planner's compiled kernels once in this process (on a toy layer of the same array types), so that
    the first forward's planning time is the planner's, not the loading's."""
    ids = np.zeros((1, 1), dtype=np.int64)
    plan_exact(np.eye(2, dtype=np.int64), ids, np.ones((1, 1), dtype=bool), [1, 0], ExactConfig(n=1), 2,
               RebalanceConfig())


def exact_demand(ids_TK: np.ndarray, kept_TK: np.ndarray, tokens_per_rank: Sequence[int],
                 num_experts: int) -> np.ndarray:
    """``float64 [G, E]``: the kept picks of every expert by the rank their token lives on (ranks' tokens in order)."""
    G = len(tokens_per_rank)
    src = np.repeat(np.arange(G, dtype=np.int64), tokens_per_rank)[:, None]
    flat = (src * num_experts + ids_TK)[kept_TK]
    return np.bincount(flat, minlength=G * num_experts).reshape(G, num_experts).astype(np.float64)


def plan_exact(copies_EG: np.ndarray, ids_TK: np.ndarray, kept_TK: np.ndarray, tokens_per_rank: Sequence[int],
               config: ExactConfig, gpus_per_node: int,
               rebalance: RebalanceConfig | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The planner of one layer: ``(extras int64 [G, N], dest int64 [T, K] | None)``.

    ``copies_EG [E, G]`` the base plan's copies of the layer; ``ids_TK``, ``kept_TK`` every rank's picks, tokens
    in rank order. ``extras[g]`` lists GPU ``g``'s extras, phase 1 first, padded with -1; ``dest`` is the
    rebalancer's routing on the base copies plus the extras (``rebalance`` its options), ``None`` without it.
    """
    E, G = copies_EG.shape
    demand = exact_demand(ids_TK, kept_TK, tokens_per_rank, E)
    if rebalance is None:
        extras, _ = prefetch(demand, (copies_EG > 0).T, config.n, config.alpha)
        return extras, None
    # the prefetcher and the rebalancer's split in one compiled call, then the split handed out to the picks
    plan = plan_layer(demand.astype(np.int64), copies_EG, config.n, config.alpha, eps=rebalance.eps,
                      strict=rebalance.strict)
    src = np.repeat(np.arange(G, dtype=np.int64), tokens_per_rank)
    dest = assign(plan, copies_EG, np.ascontiguousarray(ids_TK, dtype=np.int64), src,
                  np.ascontiguousarray(kept_TK, dtype=np.bool_), gpus_per_node)
    return plan.extras, dest


def exact_layer_plan(base_layer: Placement, ids_TK: np.ndarray, kept_TK: np.ndarray, tokens_per_rank: Sequence[int],
                     config: ExactConfig, router: str | Router) -> ExactPlan:
    """:func:`plan_exact` on the one-layer base plan ``base_layer``; the rebalancer routes when ``router`` is
    ``rebalance`` (with its options), else the caller routes on the result's ``layer_plan``."""
    r = get_router(router)
    rebalance = r.config if r.name == "rebalance" and isinstance(r.config, RebalanceConfig) else None
    extras_GN, dest = plan_exact(base_layer.copies[0], ids_TK, kept_TK, tokens_per_rank, config,
                                 base_layer.cluster.gpus_per_node, rebalance)
    extras = tuple(tuple(int(e) for e in row if e >= 0) for row in extras_GN)
    lists = [[*base, *extra] for base, extra in zip(base_layer.gpu_experts[0], extras, strict=True)]
    plan = Placement([lists], base_layer.num_experts, base_layer.cluster, policy="libra")
    return ExactPlan(extras, plan, dest)
