"""The ``metro`` router: each pick to the copy that keeps the modelled MoE layer shortest, balancing the experts
each GPU reads, not only its tokens (METRO, arXiv 2512.09277; the algorithm: :mod:`moebalance.algorithms.metro`).

A GPU's expert time is the cost model's roofline over the picks it serves and the distinct experts they touch
(:func:`moebalance.cost.time.gemm_seconds`), so the router prices on a :class:`~moebalance.cost.Deployment`: the one a
command builds from ``--gpu``, ``--model`` and ``--calibration`` (:func:`with_deployment`; ``cost``, ``compare``,
``online``), or one named by its options ``gpu`` and ``model`` (``--router-set gpu=h100-80gb --router-set
model=deepseek-v3``) with, from a calibration, ``flops_efficiency``, ``bandwidth_efficiency`` and ``launch_us``
(default: the published peaks); options given win over the command's deployment. In decode an expert's few picks go to few of its copies and the experts touched
spread over the GPUs; in prefill the picks spread as a token balancer spreads them.

Per ``(batch, layer)`` the router also computes what ``uniform`` and ``rebalance`` (default options) would do and
keeps the fastest of the three by the modelled layer time: the slowest GPU's grouped GEMM plus the all-to-all
(:func:`moebalance.cost.a2a.a2a_estimate` on counts; on tokens the picks' copies, one per destination GPU,
:func:`moebalance.routing.copies.traffic`, on the plan's links). So ``metro`` is never slower than either in
modelled layer time: on counts against their ``split_counts`` (experts touched:
:func:`moebalance.routing.touched.hosted_touched` for both), on tokens against their picks (whole picks; experts
touched from the picks; ``uniform``'s round-robin deal). It is a :class:`~moebalance.routing.touched.TouchingRouter`:
on counts it says which experts each GPU's picks touch, which the simulator's expert time uses.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from moebalance.algorithms import metro as kernel
from moebalance.core.errors import InputError
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import get_gpu
from moebalance.cost.memory import EngineMemory
from moebalance.cost.time import Calibration
from moebalance.models import get_model
from moebalance.routing.base import Router, RouterConfig
from moebalance.routing.basic import UNIFORM
from moebalance.routing.copies import traffic
from moebalance.routing.minmax import batch_starts
from moebalance.routing.rebalance import REBALANCE
from moebalance.routing.touched import TouchingRouter, hosted_touched, pick_tally

if TYPE_CHECKING:
    from moebalance.core.plan import Placement
    from moebalance.core.trace import RoutingTrace

__all__ = ["CALIBRATION_OPTIONS", "METRO", "MetroConfig", "check_ready", "make_metro", "with_deployment"]

#: The calibration's options, as ``metro`` takes them (``None``: the published peaks).
CALIBRATION_OPTIONS = ("flops_efficiency", "bandwidth_efficiency", "launch_us")


@dataclass(kw_only=True, frozen=True, slots=True)
class MetroConfig(RouterConfig):
    """Options of the ``metro`` router as ``--router-set`` gives them: the GPU and model whose roofline it balances,
    by name, and a calibration; a command's :class:`~moebalance.cost.Deployment` fills what is not given
    (:func:`with_deployment`).

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
        for name in ("gpu", "model"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise InputError(f"metro option {name} ({value!r}) must be a name, e.g. {name}="
                                 f"{'h100-80gb' if name == 'gpu' else 'deepseek-v3'}")
            (get_gpu if name == "gpu" else get_model)(value)  # an unknown name lists the known ones
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
            self.calibration(Calibration())  # checks the ranges

    def calibration(self, base: Calibration) -> Calibration:
        """``base`` with the calibration options given."""
        given = {name: getattr(self, name) for name in CALIBRATION_OPTIONS if getattr(self, name) is not None}
        if all(getattr(base, name) == value for name, value in given.items()):
            return base
        try:
            return dataclasses.replace(base, **given, source="metro options")
        except InputError as exc:
            raise InputError(f"metro option {exc}") from None

    def deployment(self, base: Deployment | None = None) -> Deployment:
        """The deployment the router prices with: ``base`` (a command's) with the options given in its place; a
        missing GPU or model is a one-line :class:`InputError`."""
        if base is None and (self.gpu is None or self.model is None):
            missing = " and ".join(n for n in ("gpu", "model") if getattr(self, n) is None)
            raise InputError(f"router 'metro' models each GPU's expert time and has no {missing}: give --router-set "
                             "gpu=GPU --router-set model=MODEL (e.g. gpu=h100-80gb, model=deepseek-v3); compare and "
                             "online take them from --gpu and --model")
        if base is None:
            return Deployment(model=get_model(str(self.model)), gpu=get_gpu(str(self.gpu)),
                              calibration=self.calibration(Calibration()))
        model = base.model if self.model in (None, base.model.name) else get_model(str(self.model))
        gpu = base.gpu if self.gpu in (None, base.gpu.name) else get_gpu(str(self.gpu))
        if model is base.model and gpu is base.gpu:
            return dataclasses.replace(base, calibration=self.calibration(base.calibration))
        # the base's precision where the other model's checkpoint and GPU run it, else what they serve (an FP8 or
        # MXFP4 precision resolved for the base's checkpoint may not apply)
        engine = dataclasses.replace(base.engine, weight_bytes=EngineMemory().weight_bytes, expert_weight_bytes=None)
        moved = dataclasses.replace(base, calibration=self.calibration(base.calibration))
        try:
            return dataclasses.replace(moved, model=model, gpu=gpu, engine=engine)
        except InputError:
            return dataclasses.replace(moved, model=model, gpu=gpu, engine=engine, precision="served")


def _fastest(d: Deployment, options: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """``int64 [B, L]``: per ``(b, l)`` the first of ``options`` (``(picks, touched, a2a)``: ``[B, L, G]`` twice and
    the all-to-all seconds ``[B, L]``) whose modelled layer time (:meth:`~moebalance.cost.Deployment.layer_seconds`)
    is least."""
    times = np.stack([d.layer_seconds(d.gemm_seconds(p, t), a) for p, t, a in options])
    return np.argmin(times, axis=0)


def _touched(d: Deployment, plan: Placement, counts: np.ndarray,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    own = kernel.split_counts(counts, plan.copies > 0, d.cost_vector(plan.cluster))
    hosted = hosted_touched(plan, counts)
    options = [own, (REBALANCE.split_counts(plan, counts, rng), hosted), (UNIFORM.split_counts(plan, counts, rng), hosted)]
    pick = _fastest(d, [(p, t, d.a2a_estimate(p, plan.cluster)) for p, t in options])[None, :, :, None]
    picks = np.take_along_axis(np.stack([o[0] for o in options]), pick, axis=0)[0]
    touched = np.take_along_axis(np.stack([o[1] for o in options]), pick, axis=0)[0]
    return picks, touched


def _counts(d: Deployment, plan: Placement, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return _touched(d, plan, counts, rng)[0]


def _kept(d: Deployment, plan: Placement, trace: RoutingTrace, kept: np.ndarray,
          rng: np.random.Generator) -> np.ndarray:
    cost = d.cost_vector(plan.cluster)
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
    scored = []
    for dest in options:
        picks, touched = pick_tally(dest, trace.topk_ids, trace.batch, B, E, G)
        sent = traffic(plan, trace, np.where(kept, dest, src[:, None, None]), d.bytes_per_copy,
                       seconds_only=True)  # a dropped pick stays home, sending nothing
        if touched is None or sent.a2a_seconds is None:  # both are always given
            raise RuntimeError("the picks' tally or all-to-all time is missing")
        scored.append((picks, touched, sent.a2a_seconds))
    which = _fastest(d, scored)[np.asarray(trace.batch, dtype=np.int64)][:, :, None]  # [T, L, 1]
    return np.where(which == 0, options[0], np.where(which == 1, options[1], options[2]))


def _tokens(d: Deployment, plan: Placement, trace: RoutingTrace, rng: np.random.Generator) -> np.ndarray:
    return _kept(d, plan, trace, np.ones(trace.topk_ids.shape, dtype=bool), rng)


def _unready(config: MetroConfig, *args: object) -> np.ndarray:
    config.deployment()  # raises the one-line error of a missing GPU or model
    raise RuntimeError("unreachable: a metro router without a deployment")


def make_metro(config: MetroConfig, deployment: Deployment | None = None) -> Router:
    """The ``metro`` router with ``config``, pricing on ``deployment`` (a command's) with the options given in its
    place (:meth:`MetroConfig.deployment`); without either a GPU or a model it refuses to route, in one line."""
    ready = deployment is not None or (config.gpu is not None and config.model is not None)
    d = config.deployment(deployment) if ready else None

    def bind(fn: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(fn, d) if d is not None else functools.partial(_unready, config)

    return TouchingRouter("metro", bind(_counts), bind(_tokens),
                          "METRO: the copies that keep the modelled layer shortest (decode: an expert on few copies, "
                          "the experts read spread over the GPUs)",
                          assign_kept=bind(_kept), config=config,
                          configure=functools.partial(make_metro, deployment=deployment),
                          split_touched=bind(_touched))


def check_ready(router: Router) -> None:
    """Raise the one-line error of a ``metro`` router that lacks its GPU or model (a no-op for other routers)."""
    if isinstance(router.config, MetroConfig) and router.name == "metro":
        bound = getattr(router.configure, "keywords", {}).get("deployment")
        router.config.deployment(bound)


def with_deployment(router: Router, deployment: Deployment | None = None, model: str | None = None) -> Router:
    """``router`` pricing on ``deployment`` where it is ``metro`` (its ``--router-set`` options win), or, without a
    deployment, with the load's ``model`` name where none was given; other routers unchanged. A ``--router-set
    model=`` of another shape than the deployment's model is a one-line error."""
    config = router.config
    if not isinstance(config, MetroConfig):
        return router
    theirs = deployment.model if deployment is not None else (get_model(model) if model is not None else None)
    if config.model is not None and theirs is not None and config.model != theirs.name:
        mine = get_model(config.model)
        if (mine.num_experts, mine.num_layers) != (theirs.num_experts, theirs.num_layers):
            raise InputError(f"router 'metro' models {mine.display_name} ({mine.num_layers} MoE layers x "
                             f"{mine.num_experts} experts) but the load is {theirs.display_name}'s ({theirs.num_layers} "
                             f"x {theirs.num_experts}); drop --router-set model= or give the load's model")
    if deployment is not None:  # the options (its params) show what it prices with; its label, what the user gave
        named: dict[str, Any] = {"gpu": deployment.gpu.name, "model": deployment.model.name}
        if deployment.calibration != Calibration():
            named.update({name: getattr(deployment.calibration, name) for name in CALIBRATION_OPTIONS})
        unset = {k: v for k, v in named.items() if getattr(config, k) is None}
        given = tuple(f.name for f in dataclasses.fields(config) if getattr(config, f.name) is not None)
        return dataclasses.replace(make_metro(dataclasses.replace(config, **unset) if unset else config, deployment),
                                   label_keys=given)
    if model is not None and config.model is None:
        return router.with_params(model=model)
    return router


METRO = make_metro(MetroConfig())
