"""Follow a serving engine's routing records and re-plan when the move pays (``moebalance watch``; docs/design.md,
"Watching a running engine").

Legend: ``L`` MoE layers, ``E`` experts, ``G`` GPUs, ``W`` records in the window.

Each record is one engine dump (its counts ``[L, E]``, summed over the passes it holds). The :class:`Watcher` keeps
the last ``W`` records (a bounded deque: memory does not grow with the records seen) and, for each new one, measures
the placement in service on the window's load:

- per-layer balancedness (``mean_g / max_g`` of GPU load under the router), the hottest experts' shares of all
  picks, and the drift since the placement was made: per layer the total variation distance ``1/2 sum_e |p_e -
  q_e|`` between the window's expert shares ``p`` and those the placement was planned on ``q``, averaged over the
  layers with load;
- with a :class:`~moebalance.pricing.step.StepPricing`, the price of serving on: a step of the phase drawn from the
  window (:func:`moebalance.pricing.phase.phase_steps`), priced as ``online`` prices a served batch
  (:func:`moebalance.online.replay.score_batch`), for the placement in service and for the best re-plan (the policy
  planned on the window, laid onto the placement in service as ``Replanning.migration`` says).

**Decision.** The re-plan's moves land as ``online``'s do (:class:`moebalance.online.rearrange.Rearranger`: sync
stalls for the transfer and the host's overhead; async serves the old plan until the moves land). Over ``horizon``
seconds of serving, both futures serve steps like the window's: keeping serves ``horizon / t_keep`` steps; re-planning
serves the steps that fit once the stall and the slower steps before the moves land are paid. Re-plan when it serves
more tokens over the horizon by more than ``margin`` of what keeping serves (the model's uncertainty, ``advise``'s
margin); the record says why either way.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moebalance.algorithms.migration import lay_onto
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.cost.memory import GIB
from moebalance.online.rearrange import Rearranger, Replanning
from moebalance.online.replay import moved_copies, score_batch
from moebalance.policies import make_plan
from moebalance.pricing.phase import PhaseModel, phase_steps
from moebalance.pricing.step import StepPricing
from moebalance.routing import Router, get_router

__all__ = ["HOTTEST", "Observation", "WatchConfig", "Watcher", "drift"]

#: How many of the hottest experts an observation names.
HOTTEST = 5
#: Steps the horizon simulation serves at most (a horizon of many short steps is extrapolated past it).
_MAX_STEPS = 10_000


@dataclass(kw_only=True, frozen=True, slots=True)
class WatchConfig:
    """What a watcher plans and prices with (module docstring)."""

    cluster: Cluster
    budget: Budget
    #: The policy a re-plan runs (a static one: ``eplb``, ``craft``, ``greedy``, ...), and its options.
    policy: str = "eplb"
    params: Mapping[str, Any] = field(default_factory=dict)
    #: Records in the window.
    window: int = 8
    #: Seconds of serving a re-plan must pay back within.
    horizon_s: float = 600.0
    #: The share more tokens a re-plan must serve over the horizon than keeping the placement (the model's
    #: uncertainty: a gain inside it is noise).
    margin: float = 0.05
    #: How a re-plan is laid onto the placement in service and how its moves land (``every`` unused).
    replanning: Replanning = field(default_factory=Replanning)
    #: The deployment and phase the prices are for; ``None``: balance only, never a re-plan.
    pricing: StepPricing | None = None
    router: str | Router = "uniform"
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise InputError(f"window ({self.window!r}) must be a positive number of records")
        if not (isinstance(self.horizon_s, int | float) and math.isfinite(self.horizon_s) and self.horizon_s > 0):
            raise InputError(f"horizon ({self.horizon_s!r}) must be a positive number of seconds")
        if not (isinstance(self.margin, int | float) and math.isfinite(self.margin) and self.margin >= 0):
            raise InputError(f"margin ({self.margin!r}) must be a share >= 0")


@dataclass(frozen=True, slots=True)
class Observation:
    """What one record showed, and what the watcher decided (a line of ``watch --log``)."""

    record: str
    index: int
    #: ``float64 [L]``: balancedness of the placement in service on the window (NaN: a layer without load).
    balancedness: np.ndarray
    #: ``[(layer, expert, share)]``: the hottest (layer, expert) pairs' shares of their layer's picks.
    hottest: list[tuple[int, int, float]]
    #: Mean total variation distance between the window's expert shares and the placement's planning shares.
    drift: float
    #: ``"replan"``, ``"keep"`` or ``"measure"`` (no pricing: balance only).
    decision: str
    reason: str
    #: Priced figures (``None`` without pricing): tokens/s now and after the re-plan, the move's GiB and copies,
    #: its transfer and what it exposes, the tokens gained over the horizon.
    tokens_per_s_now: float | None = None
    tokens_per_s_replan: float | None = None
    balancedness_replan: float | None = None
    moved_gib: float | None = None
    moved_copies: int | None = None
    transfer_s: float | None = None
    exposed_s: float | None = None
    gain_tokens: float | None = None
    #: The plan the decision would serve (written when the decision is ``replan``); not logged.
    plan: Placement | None = dataclasses.field(default=None, compare=False)

    def as_dict(self) -> dict[str, Any]:
        bal = self.balancedness[np.isfinite(self.balancedness)]
        out: dict[str, Any] = {
            "record": self.record, "index": self.index, "decision": self.decision, "reason": self.reason,
            "balancedness_mean": round(float(bal.mean()), 6) if bal.size else None,
            "balancedness_min": round(float(bal.min()), 6) if bal.size else None,
            "balancedness": [None if not np.isfinite(b) else round(float(b), 6) for b in self.balancedness],
            "hottest": [{"layer": int(layer), "expert": int(e), "share": round(s, 6)} for layer, e, s in self.hottest],
            "drift": round(self.drift, 6)}
        for name in ("tokens_per_s_now", "tokens_per_s_replan", "balancedness_replan", "moved_gib", "moved_copies",
                     "transfer_s", "exposed_s", "gain_tokens"):
            value = getattr(self, name)
            out[name] = None if value is None else (value if isinstance(value, int) else round(float(value), 6))
        return out


def drift(window: np.ndarray, planned: np.ndarray) -> float:
    """Mean over layers with load in both of the total variation distance between the expert shares of ``window
    [L, E]`` and ``planned [L, E]`` (counts): 0 when the routing is as planned, 1 when no expert overlaps."""
    a = np.asarray(window, dtype=np.float64)
    b = np.asarray(planned, dtype=np.float64)
    sa, sb = a.sum(axis=1, keepdims=True), b.sum(axis=1, keepdims=True)
    live = (sa[:, 0] > 0) & (sb[:, 0] > 0)
    if not live.any():
        return 0.0
    tv = 0.5 * np.abs(a[live] / sa[live] - b[live] / sb[live]).sum(axis=1)
    return float(tv.mean())


class Watcher:
    """The rolling window, the placement in service and the decisions (module docstring).

    ``plan``: the placement in service (the engine's own file, or the plan last written); ``None``: contiguous
    blocks with no replicas, as an engine starts without a placement, planned on the first record's shape.
    ``planned_on``: the counts ``[L, E]`` the placement was made on (default: the first window it serves).
    """

    def __init__(self, config: WatchConfig, plan: Placement | None = None,
                 planned_on: np.ndarray | None = None) -> None:
        self.config = config
        self.plan = plan
        self.planned_on = planned_on
        self.router = get_router(config.router) if isinstance(config.router, str) else config.router
        self.window: deque[np.ndarray] = deque(maxlen=config.window)
        self.names: deque[str] = deque(maxlen=config.window)
        #: The records the placement's planning shares come from (logged, so that a restart finds them again).
        self.planned_records: list[str] = []
        self.seen = 0
        self.replans = 0
        self._shape: tuple[int, int] | None = None
        self._model = config.pricing.deployment.model if config.pricing is not None else None

    # ----- records -----------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """The engine restarted (its counters back to zero): the window starts again; the placement stays (an
        engine restarts with the placement it was given)."""
        self.window.clear()
        self.names.clear()

    def observe(self, counts: np.ndarray, record: str) -> Observation:
        """Take one record's counts ``[L, E]`` (whole numbers >= 0) and measure, price and decide."""
        c = np.asarray(counts)
        if c.ndim != 2 or c.dtype.kind not in "iu" or (c.size and c.min() < 0):
            raise InputError(f"record {record!r}: counts must be whole numbers >= 0 of shape [layers, experts], got "
                             f"{c.dtype} {c.shape}")
        if self._shape is None:
            self._shape = (int(c.shape[0]), int(c.shape[1]))
            if self._model is not None and (self._model.num_layers, self._model.num_experts) != self._shape:
                raise InputError(f"record {record!r} has {c.shape[0]} layers x {c.shape[1]} experts, not "
                                 f"{self._model.display_name}'s {self._model.num_layers} x {self._model.num_experts}; "
                                 "give the records' --model")
        elif tuple(c.shape) != self._shape:
            raise InputError(f"record {record!r} has shape {tuple(c.shape)}, the earlier ones {self._shape}: the "
                             "engine now serves another model; restart watch for it")
        self.push(c, record)
        self.seen += 1
        window = self.window_load()
        if self.plan is None:
            self.plan = make_plan("contiguous", window, self.config.cluster, Budget(replicas_per_gpu=0))[0]
        if self.planned_on is None:
            self.planned_on, self.planned_records = window.counts[0].copy(), list(self.names)
        bal = self._balancedness(self.plan, window)
        obs = Observation(record=record, index=self.seen - 1, balancedness=bal, hottest=_hottest(window.counts[0]),
                          drift=drift(window.counts[0], self.planned_on), decision="measure",
                          reason="no --gpu: balance is measured, re-plans are not priced")
        if self.config.pricing is None:
            return obs
        return self._priced(obs, window)

    def push(self, counts: np.ndarray, record: str) -> None:
        """Add a record to the window without measuring it (a restarted watcher refilling its window)."""
        self.window.append(np.asarray(counts, dtype=np.int64))
        self.names.append(record)

    def adopt(self, plan: Placement) -> None:
        """The engine now serves ``plan`` (a re-plan written and taken up): it was made on the current window."""
        self.plan = plan
        self.planned_on, self.planned_records = self.window_load().counts[0].copy(), list(self.names)
        self.replans += 1

    # ----- pricing -----------------------------------------------------------------------------------------------

    def window_load(self) -> LoadMatrix:
        """The window's records summed: one batch of counts ``[1, L, E]``."""
        total = np.sum(np.stack(self.window), axis=0)
        return LoadMatrix(total[None], preset=self._model.name if self._model is not None else None)

    def _balancedness(self, plan: Placement, window: LoadMatrix) -> np.ndarray:
        return score_batch(plan, window, self.router, self.config.seed, 0)[1]

    def step(self, window: LoadMatrix) -> LoadMatrix:
        """One step of the phase drawn from the window's shares (as ``online --phase`` draws a batch's step)."""
        pricing = self.config.pricing
        if pricing is None:  # unreachable: called only with pricing
            raise InputError("pricing needs --gpu")
        budget, cluster = self.config.budget, self.config.cluster
        spec = pricing.deployment.model
        hosted = budget.slots_per_gpu * spec.num_layers if budget.slots_per_gpu is not None else \
            spec.num_layers * math.ceil(spec.num_experts / cluster.num_gpus) + int(budget.replicas_per_gpu or 0)
        tokens = PhaseModel(pricing.phase, pricing.deployment, seed=self.config.seed).step_tokens(cluster, hosted)
        return phase_steps(window, tokens, spec.top_k, self.config.seed)

    def _priced(self, obs: Observation, window: LoadMatrix) -> Observation:
        cfg, pricing = self.config, self.config.pricing
        if pricing is None or self.plan is None:  # unreachable: observe prices only with both
            return obs
        step = self.step(window)
        fresh = make_plan(cfg.policy, window, cfg.cluster, cfg.budget, **cfg.params)[0]
        how = cfg.replanning
        new = fresh if how.migration == "fresh" else lay_onto(self.plan, fresh, how.migration,
                                                              max_moves=how.max_moves, load=window)
        prices: dict[int, tuple[Placement, float, float]] = {}  # by id, the plan kept so that its id is its own

        def seconds(plan: Placement) -> tuple[float, float]:
            if id(plan) not in prices:
                _, _, priced = score_batch(plan, step, self.router, cfg.seed, self.seen, pricing)
                st, tokens, router_s = priced
                prices[id(plan)] = (plan, st.seconds + router_s, tokens)
            return prices[id(plan)][1:]

        t_keep, tokens = seconds(self.plan)
        t_new, _ = seconds(new)
        copies = moved_copies(self.plan, new)
        bpe = pricing.deployment.bytes_per_expert
        served, exposed, transfer = self._horizon(new, seconds)
        keep_tokens = cfg.horizon_s / t_keep * tokens
        gain = served - keep_tokens
        decision = "replan" if copies > 0 and gain > cfg.margin * keep_tokens else "keep"
        if copies == 0:
            reason = "the best re-plan moves nothing: the placement in service is already the policy's plan"
        elif decision == "replan":
            reason = (f"re-planning serves {gain:,.0f} more tokens over {cfg.horizon_s:g} s ({t_keep * 1e3:.2f} -> "
                      f"{t_new * 1e3:.2f} ms a step) after {exposed:.3f} s exposed")
        elif gain > 0:
            reason = (f"re-planning would serve {gain / keep_tokens:.1%} more tokens over {cfg.horizon_s:g} s, inside "
                      f"the {cfg.margin:.0%} margin")
        else:
            reason = (f"re-planning would serve {-gain:,.0f} fewer tokens over {cfg.horizon_s:g} s: the step gains "
                      f"{(t_keep - t_new) * 1e3:.3f} ms but the move exposes {exposed:.3f} s")
        return dataclasses.replace(
            obs, decision=decision, reason=reason, tokens_per_s_now=tokens / t_keep, tokens_per_s_replan=tokens / t_new,
            balancedness_replan=float(np.nanmean(self._balancedness(new, window))), moved_gib=copies * bpe / GIB,
            moved_copies=copies, transfer_s=transfer, exposed_s=exposed, gain_tokens=gain, plan=new)

    def _horizon(self, new: Placement, seconds: Any) -> tuple[float, float, float]:
        """``(tokens served, seconds exposed, transfer seconds)`` over the horizon when ``new`` replaces the placement
        in service now, its moves landing as ``online``'s do (:class:`Rearranger`)."""
        cfg, pricing = self.config, self.config.pricing
        if pricing is None or self.plan is None:  # unreachable
            return 0.0, 0.0, 0.0
        moves = Rearranger(self.plan, cfg.replanning, pricing.deployment.bytes_per_expert)
        moves.replan(new)
        transfer = moves.transfer_seconds
        elapsed = served = exposed_total = 0.0
        for _ in range(_MAX_STEPS):
            serving, exposed = moves.before_step()
            t, tokens = seconds(serving)
            step = t + exposed
            exposed_total += exposed
            if elapsed + step >= cfg.horizon_s:  # the last step, in part
                served += tokens * max(cfg.horizon_s - elapsed - exposed, 0.0) / t
                return served, exposed_total, transfer
            elapsed += step
            served += tokens
            moves.after_step(step)
            if serving is new and not moves.moving:  # landed: the rest of the horizon is steady
                rest = cfg.horizon_s - elapsed
                return served + rest / t * tokens, exposed_total, transfer
        t, tokens = seconds(moves.serving)
        return served + (cfg.horizon_s - elapsed) / t * tokens, exposed_total, transfer


def _hottest(counts: np.ndarray, k: int = HOTTEST) -> list[tuple[int, int, float]]:
    """The ``k`` (layer, expert) pairs with the largest share of their layer's picks."""
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(total > 0, c / np.where(total > 0, total, 1.0), 0.0)
    flat = np.argsort(share, axis=None)[::-1][:k]
    return [(int(i // c.shape[1]), int(i % c.shape[1]), float(share.flat[i])) for i in flat if share.flat[i] > 0]
