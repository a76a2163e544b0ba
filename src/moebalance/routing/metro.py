"""The ``metro`` router: each pick to the copy that keeps the modelled MoE layer shortest, balancing the experts
each GPU reads, not only its tokens (METRO, arXiv 2512.09277; the algorithm: :mod:`moebalance.algorithms.metro`).

A GPU's expert time is the cost model's roofline over the picks it serves and the distinct experts they touch
(:func:`moebalance.cost.time.expert_seconds`), so the router needs the GPU and the model: options ``gpu`` and
``model`` (``--router-set gpu=h100-80gb --router-set model=deepseek-v3``; ``compare`` and ``online`` fill them
from ``--gpu`` and ``--model``), and, from a calibration, ``flops_efficiency``, ``bandwidth_efficiency`` and ``launch_us``
(default: the published peaks). In decode an expert's few picks go to few of its copies and the experts touched
spread over the GPUs; in prefill the picks spread as a token balancer spreads them.

Per ``(batch, layer)`` the router also computes what ``uniform`` and ``rebalance`` (default options) would do and
keeps the fastest of the three by the modelled layer time: the slowest GPU's grouped GEMM plus the all-to-all
(:func:`moebalance.cost.goodput.a2a_estimate` on counts; on tokens the picks' copies, one per destination GPU,
:func:`moebalance.routing.simulate.traffic`, on the plan's links). So ``metro`` is never slower than either in
modelled layer time: on counts against their ``split_counts`` (experts touched:
:func:`moebalance.routing.touched.hosted_touched` for both), on tokens against their picks (whole picks; experts
touched from the picks; ``uniform``'s round-robin deal). It is a :class:`~moebalance.routing.touched.TouchingRouter`:
on counts it says which experts each GPU's picks touch, which the simulator's expert time uses.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from moebalance.algorithms import metro as kernel
from moebalance.core.errors import InputError
from moebalance.routing.base import Router, RouterConfig
from moebalance.routing.basic import UNIFORM
from moebalance.routing.minmax import batch_starts
from moebalance.routing.rebalance import REBALANCE
from moebalance.routing.touched import TouchingRouter, hosted_touched, pick_tally

if TYPE_CHECKING:
    from moebalance.core.plan import Placement
    from moebalance.core.trace import RoutingTrace
    from moebalance.cost.hardware import GpuSpec
    from moebalance.cost.time import Calibration
    from moebalance.models import ModelSpec

__all__ = ["CALIBRATION_OPTIONS", "METRO", "MetroConfig", "check_ready", "fill", "make_metro"]

#: The calibration's options, as ``metro`` takes them (``None``: the published peaks).
CALIBRATION_OPTIONS = ("flops_efficiency", "bandwidth_efficiency", "launch_us")
#: Bytes of a weight and of an activation (bf16), as the cost model's defaults.
_BYTES = 2


@dataclass(kw_only=True, frozen=True, slots=True)
class MetroConfig(RouterConfig):
    """Options of the ``metro`` router: the GPU and model whose roofline it balances, and a calibration.

    Example: ``MetroConfig(gpu="h100-80gb", model="deepseek-v3")``.
    """

    #: A GPU of :data:`moebalance.cost.GPUS`.
    gpu: str | None = None
    #: A model of :data:`moebalance.models.MODELS` (its hidden and expert FFN sizes set the roofline).
    model: str | None = None
    #: Shares of the GPU's peaks and the fixed cost of a grouped GEMM (``moebalance calibrate``); None: peaks.
    flops_efficiency: float | None = None
    bandwidth_efficiency: float | None = None
    launch_us: float | None = None

    def __post_init__(self) -> None:
        # the cost model imports the routers, so it is imported here only to check a name or number given
        for name in ("gpu", "model"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise InputError(f"metro option {name} ({value!r}) must be a name, e.g. {name}="
                                 f"{'h100-80gb' if name == 'gpu' else 'deepseek-v3'}")
            if name == "gpu":
                from moebalance.cost.hardware import get_gpu

                get_gpu(value)  # an unknown name lists the known ones
            else:
                from moebalance.models import get_model

                get_model(value)
        calibrated = False
        for name in CALIBRATION_OPTIONS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise InputError(f"metro option {name} ({value!r}) must be a number")
            object.__setattr__(self, name, float(value))
            calibrated = True
        if calibrated:
            self.calibration()  # checks the ranges

    def calibration(self) -> Calibration:
        """The calibration of the options (the published peaks where none is given)."""
        from moebalance.cost.time import Calibration

        given = {name: getattr(self, name) for name in CALIBRATION_OPTIONS if getattr(self, name) is not None}
        try:
            return Calibration(**given, source="metro options") if given else Calibration()
        except InputError as exc:
            raise InputError(f"metro option {exc}") from None

    def specs(self) -> tuple[ModelSpec, GpuSpec, Calibration]:
        """``(model, GPU, calibration)``; a missing GPU or model is a one-line :class:`InputError`."""
        from moebalance.cost.hardware import get_gpu
        from moebalance.models import get_model

        if self.gpu is None or self.model is None:
            missing = " and ".join(n for n in ("gpu", "model") if getattr(self, n) is None)
            raise InputError(f"router 'metro' models each GPU's expert time and has no {missing}: give --router-set "
                             "gpu=GPU --router-set model=MODEL (e.g. gpu=h100-80gb, model=deepseek-v3); compare and "
                             "online take them from --gpu and --model")
        return get_model(self.model), get_gpu(self.gpu), self.calibration()

    def cost_vector(self, plan: Placement) -> np.ndarray:
        """``float64 [5]``: the kernel's ``[alpha, beta, gamma, launch, kappa]`` seconds on ``plan``'s cluster (the
        terms of :func:`moebalance.cost.time.expert_seconds` in bf16 weights and activations, and the all-to-all
        per pick of :func:`moebalance.cost.goodput.a2a_estimate`)."""
        model, gpu, cal = self.specs()
        H, F = model.hidden_size, model.moe_intermediate_size
        flops = gpu.bf16_tflops * 1e12 * cal.flops_efficiency
        bandwidth = gpu.memory_bandwidth * 1e9 * cal.bandwidth_efficiency
        c = plan.cluster
        G, gpn = c.num_gpus, c.gpus_per_node
        per_pick = max((gpn - 1) / G / c.intra_node_bandwidth, (G - gpn) / G / c.inter_node_bandwidth)
        return np.array([6.0 * H * F / flops, 3.0 * H * F * _BYTES / bandwidth, 2.0 * H * _BYTES / bandwidth,
                         cal.launch_us * 1e-6, 2.0 * H * _BYTES * per_pick / 1e9])


def _fastest(config: MetroConfig, options: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """``int64 [B, L]``: per ``(b, l)`` the first of ``options`` (``(picks, touched, a2a)``: ``[B, L, G]`` twice and
    the all-to-all seconds ``[B, L]``) whose modelled layer time is least: the slowest GPU's
    :func:`moebalance.cost.time.expert_seconds` plus the all-to-all."""
    from moebalance.cost.time import expert_seconds

    model, gpu, cal = config.specs()
    times = np.stack([expert_seconds(p, t, model, gpu, cal).max(axis=2) + a for p, t, a in options])
    return np.argmin(times, axis=0)


def _touched(config: MetroConfig, plan: Placement, counts: np.ndarray,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    from moebalance.cost.goodput import a2a_estimate

    counts = np.ascontiguousarray(counts, dtype=np.int64)
    own = kernel.split_counts(counts, plan.copies > 0, config.cost_vector(plan))
    hosted = hosted_touched(plan, counts)
    options = [own, (REBALANCE.split_counts(plan, counts, rng), hosted), (UNIFORM.split_counts(plan, counts, rng), hosted)]
    per_copy = config.specs()[0].hidden_size * _BYTES
    pick = _fastest(config, [(p, t, a2a_estimate(p, plan.cluster, per_copy)) for p, t in options])[None, :, :, None]
    picks = np.take_along_axis(np.stack([o[0] for o in options]), pick, axis=0)[0]
    touched = np.take_along_axis(np.stack([o[1] for o in options]), pick, axis=0)[0]
    return picks, touched


def _counts(config: MetroConfig, plan: Placement, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return _touched(config, plan, counts, rng)[0]


def _kept(config: MetroConfig, plan: Placement, trace: RoutingTrace, kept: np.ndarray,
          rng: np.random.Generator) -> np.ndarray:
    from moebalance.routing.simulate import traffic

    cost = config.cost_vector(plan)
    trace.check_gpus(plan.num_gpus)  # picks go to their own GPU's copy first
    starts = batch_starts(trace)
    has = plan.copies > 0
    src = np.asarray(trace.src_gpu, dtype=np.int64)
    kept = np.asarray(kept, dtype=bool)
    own = np.empty(trace.topk_ids.shape, dtype=np.int64)
    for layer in range(trace.num_layers):
        ids = np.ascontiguousarray(trace.topk_ids[:, layer, :], dtype=np.int64)
        own[:, layer, :] = kernel.route_tokens(ids, src, starts, np.ascontiguousarray(has[layer]),
                                               plan.cluster.gpus_per_node, np.ascontiguousarray(kept[:, layer, :]),
                                               cost)
    balance = REBALANCE.assign_kept
    if balance is None:  # rebalance balances load, so it always routes the kept picks alone
        raise RuntimeError("the rebalance router lost its assign_kept")
    options = [own, balance(plan, trace, kept, rng), np.where(kept, UNIFORM.assign_tokens(plan, trace, rng), -1)]
    B, E, G = trace.num_batches, plan.num_experts, plan.num_gpus
    per_copy = config.specs()[0].hidden_size * _BYTES
    scored = []
    for d in options:
        picks, touched = pick_tally(d, trace.topk_ids, trace.batch, B, E, G)
        sent = traffic(plan, trace, np.where(kept, d, src[:, None, None]), per_copy, seconds_only=True)  # a dropped
        if touched is None or sent.a2a_seconds is None:  # pick stays home, sending nothing; both are always given
            raise RuntimeError("the picks' tally or all-to-all time is missing")
        scored.append((picks, touched, sent.a2a_seconds))
    which = _fastest(config, scored)[np.asarray(trace.batch, dtype=np.int64)][:, :, None]  # [T, L, 1]
    return np.where(which == 0, options[0], np.where(which == 1, options[1], options[2]))


def _tokens(config: MetroConfig, plan: Placement, trace: RoutingTrace, rng: np.random.Generator) -> np.ndarray:
    return _kept(config, plan, trace, np.ones(trace.topk_ids.shape, dtype=bool), rng)


def make_metro(config: MetroConfig) -> Router:
    """The ``metro`` router with ``config``."""
    return TouchingRouter("metro", functools.partial(_counts, config), functools.partial(_tokens, config),
                          "METRO: the copies that keep the modelled layer shortest (decode: an expert on few copies, "
                          "the experts read spread over the GPUs)",
                          assign_kept=functools.partial(_kept, config), config=config, configure=make_metro,
                          split_touched=functools.partial(_touched, config))


def check_ready(router: Router) -> None:
    """Raise the one-line error of a ``metro`` router that lacks its GPU or model (a no-op for other routers)."""
    if isinstance(router.config, MetroConfig):
        router.config.specs()


def fill(router: Router, context: dict[str, Any]) -> Router:
    """``router`` with the options of ``context`` (e.g. a command's ``gpu`` and ``model``) that it has and that
    were not given (``None``); other routers unchanged."""
    if not isinstance(router.config, MetroConfig):
        return router
    given = router.params
    if given.get("model") is not None and context.get("model") is not None and given["model"] != context["model"]:
        from moebalance.models import get_model

        mine, theirs = get_model(given["model"]), get_model(context["model"])
        if (mine.num_experts, mine.num_layers) != (theirs.num_experts, theirs.num_layers):
            raise InputError(f"router 'metro' models {mine.display_name} ({mine.num_layers} MoE layers x "
                             f"{mine.num_experts} experts) but the load is {theirs.display_name}'s ({theirs.num_layers} "
                             f"x {theirs.num_experts}); drop --router-set model= or give the load's model")
    add = {k: v for k, v in context.items() if v is not None and k in given and given[k] is None}
    return router.with_params(**add)


METRO = make_metro(MetroConfig())
