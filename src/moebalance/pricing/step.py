"""Served batches priced in time: each a forward step, with what balancing exposes (``moebalance online --gpu``,
``advise``; docs/design.md, "Online replay and prediction" and "Cost model").

Legend: ``L`` MoE layers, ``G`` GPUs.

**A step.** Each served batch is one forward step of its tokens::

    step = sum_l layer[l] + rest + exposed

with each layer priced by :func:`moebalance.pricing.layer.price_layers` (the slowest GPU's grouped GEMM, then the
all-to-all) and the rest of the model (:meth:`moebalance.cost.Deployment.rest_seconds`) on each data-parallel rank's
share of the batch, in the step's phase: a prefill computes one next-token logit per prompt and reads no KV cache;
a decode step a logit per token and each request's KV cache. What re-plans expose is
:mod:`moebalance.online.rearrange`'s.

**Per-batch balancing** (``libra``): the extras of layer ``l`` are copied over the intra-node link during layer
``l - 1``'s expert phase (Libra's double buffer, Section 3.3): a GPU's copy of ``n`` experts takes
:func:`moebalance.cost.time.prefetch_seconds`, and the layer exposes ``max(0, max_g copy[l, g] - max_g
t_expert[l - 1, g])`` (the all-to-all shares the links, so it hides nothing). Layer 0's copies hide under the
previous step's last layer (nothing before the first served step). With the batch's true routing (the ``oracle``
predictor) the copies cannot start before the gate: every layer's copy is exposed in full.

**Router time.** A router whose choice depends on the batch's load (``rebalance``, ``minmax``: those that decide on
the host after the gate) costs its CPU time, measured on the replay's own routing of the batch (after one untimed
warm-up call, so compilation is not charged) and taken per MoE layer with load, or fixed with
``StepPricing.router_ms``. It runs beside each GPU's local phase (Libra's two-stage execution, Section 3: the picks
whose expert the token's own GPU holds are computed first, the rest wait for the router's decision), so a layer
exposes ``max_g(max(local[g], r) + remote[g]) - max_g(local[g] + remote[g])``, with ``local[g]`` the roofline of
GPU ``g``'s local picks and ``remote[g]`` the rest of its expert time. A router that ignores loads (``uniform``,
``random``) picks copies on the GPU as tokens are dispatched and exposes nothing.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.cost.deployment import PHASES, Deployment
from moebalance.cost.time import prefetch_seconds
from moebalance.models import ModelSpec
from moebalance.pricing.layer import LayerPrice
from moebalance.routing.base import Router

__all__ = ["RouterTimer", "StepPricing", "StepTime", "exposed_prefetch", "exposed_router", "local_seconds",
           "step_time"]


@dataclass(kw_only=True, frozen=True, slots=True)
class StepPricing:
    """What prices a served batch: the deployment, the phase its steps are, and a load-dependent router's host time.

    Example: ``StepPricing(deployment=Deployment(model=MODELS["olmoe-1b-7b"], gpu=GPUS["h100-80gb"]), phase="decode")``.
    """

    deployment: Deployment
    #: ``prefill`` or ``decode`` (:meth:`moebalance.cost.Deployment.rest_seconds`).
    phase: str = "prefill"
    #: A load-dependent router's CPU time per MoE layer, ms (``None``: measured on the replay's routing).
    router_ms: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.deployment, Deployment):
            raise InputError(f"StepPricing.deployment ({self.deployment!r}) must be a Deployment")
        if self.phase not in PHASES:
            raise InputError(f"phase {self.phase!r} is unknown; choose one of: {', '.join(PHASES)}")
        if self.router_ms is not None and not (math.isfinite(self.router_ms) and self.router_ms >= 0):
            raise InputError(f"the router time ({self.router_ms} ms per layer) must be a finite number >= 0")


@dataclass(frozen=True, slots=True)
class StepTime:
    """One served batch's modelled step, seconds."""

    #: ``float64 [L]``: the slowest GPU's grouped GEMM per layer.
    expert: np.ndarray
    #: ``float64 [L]``: the all-to-all per layer (dispatch and combine).
    a2a: np.ndarray
    #: ``float64 [L]``: each layer, the two with the deployment's overlap (:meth:`moebalance.cost.Deployment.layer_seconds`).
    layer: np.ndarray
    #: Everything but the routed experts.
    rest: float
    #: The step without what balancing exposes (:meth:`moebalance.cost.Deployment.step_seconds`).
    seconds: float
    #: ``float64 [L, G]``: each GPU's grouped GEMM per layer.
    expert_gpu: np.ndarray | None = None

    @property
    def moe_layer_seconds(self) -> float:
        """The mean MoE layer over the layers with load (0 without any)."""
        busy = self.expert > 0
        return float(self.layer[busy].mean()) if busy.any() else 0.0


def step_time(plan: Placement, priced: LayerPrice, tokens: float, pricing: StepPricing, *, lost: int = 0) -> StepTime:
    """The step of one served batch through ``plan``: ``priced`` its layers (a one-batch
    :func:`~moebalance.pricing.layer.price_layers`), ``tokens`` its tokens; ``lost`` failed GPUs leave their
    data-parallel share to the survivors' ranks (module docstring)."""
    d = pricing.deployment
    cluster = plan.cluster
    per_rank = tokens / d.ranks(cluster, lost)
    return StepTime(expert=priced.expert[0].max(axis=1), a2a=priced.a2a[0], layer=priced.seconds[0],
                    rest=d.rest_seconds(per_rank, cluster.gpus_per_node, pricing.phase),
                    seconds=d.step_seconds(priced.seconds[0], per_rank, cluster.gpus_per_node, pricing.phase),
                    expert_gpu=priced.expert[0])


def local_seconds(plan: Placement, batch: LoadMatrix, deployment: Deployment) -> np.ndarray:
    """``float64 [L, G]``: the roofline of each GPU's local picks in a one-batch ``batch`` (picks whose expert the
    token's own GPU holds; for counts, each GPU's even share of every expert it holds)."""
    has = plan.copies > 0  # [L, E, G]
    L, E, G = has.shape
    trace = batch.trace
    if trace is not None:  # layer by layer: [T, K] at a time, not [T, L, K]
        src = trace.src_gpu[:, None]
        picks, touched = np.zeros((L, G)), np.zeros((L, G))
        for li in range(L):
            ids = trace.topk_ids[:, li, :]
            local = has[li, ids, src]
            hits = np.bincount((src * E + ids)[local], minlength=G * E).reshape(G, E)
            picks[li], touched[li] = hits.sum(axis=1), (hits > 0).sum(axis=1)
    else:
        share = batch.counts[0].astype(np.float64) / G  # [L, E]: each GPU's even share
        picks = np.einsum("le,leg->lg", share, has.astype(np.float64))
        touched = np.einsum("le,leg->lg", (share > 0).astype(np.float64), has.astype(np.float64))
    return deployment.gemm_seconds(picks, touched)


def exposed_router(router_s: float, expert: np.ndarray, local: np.ndarray) -> float:
    """Seconds a router's ``router_s`` per layer exposes beside the local phase, summed over the layers with load:
    ``expert, local [L, G]`` each GPU's expert time and its local picks' share (module docstring)."""
    local = np.minimum(local, expert)
    remote = expert - local
    busy = expert.max(axis=1) > 0
    after = (np.maximum(local, router_s) + remote).max(axis=1)
    before = expert.max(axis=1)
    return float(np.where(busy, after - before, 0.0).sum())


class RouterTimer:
    """``router`` with its host time measured: :attr:`router` calls the same functions and adds their seconds to
    :attr:`seconds`. The first call of each of a router's functions in a process runs once untimed first (numba
    compiles then)."""

    _warm: ClassVar[set[str]] = set()

    def __init__(self, router: Router) -> None:
        self.seconds = 0.0
        timed: dict[str, Any] = {}
        for name in ("split_counts", "assign_tokens", "assign_kept", "split_touched"):  # the last two optional
            fn = getattr(router, name, None)
            if fn is not None:  # each function warms up on its own: each compiles its own kernels
                timed[name] = self._timed(f"{router.name}.{name}", fn)
        self.router = dataclasses.replace(router, **timed)

    def _timed(self, name: str, fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        def call(*args: Any) -> np.ndarray:
            if name not in RouterTimer._warm:  # compile outside the clock, on a throw-away generator
                fn(*args[:-1], np.random.default_rng(0))
                RouterTimer._warm.add(name)
            t0 = time.perf_counter()
            out = fn(*args)
            self.seconds += time.perf_counter() - t0
            return out
        return call


def exposed_prefetch(copies: np.ndarray, expert: np.ndarray, previous_last: float, model: ModelSpec,
                     bandwidth: float, *, oracle: bool, weight_bytes: float = 2) -> float:
    """Seconds a step's prefetch exposes: ``copies [L, G]`` experts each GPU loads per layer over ``bandwidth`` GB/s,
    hidden under the expert phase ``expert [L]`` of the last layer with load before it (``previous_last``, the
    previous step's last, before the first) where it fits; all of it with ``oracle`` (module docstring)."""
    copy = prefetch_seconds(copies, model, bandwidth, weight_bytes=weight_bytes).max(axis=1)  # [L]
    if oracle:
        return float(copy.sum())
    L = expert.shape[0]
    last = np.maximum.accumulate(np.where(expert > 0, np.arange(L), -1))  # the last layer with load up to l
    before = np.concatenate([[-1], last[:-1]])
    window = np.where(before >= 0, expert[np.maximum(before, 0)], previous_last)
    return float(np.maximum(copy - window, 0.0).sum())


