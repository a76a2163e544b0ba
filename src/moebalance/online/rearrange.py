"""When a static policy plans again while it serves, how its new plan lands, and what that exposes (``moebalance
online --replan-every``; docs/design.md, "Online replay and prediction").

Legend: ``L`` MoE layers, ``C`` layers moved per step.

A static policy with ``Replanning.every = K`` plans again before every ``K``-th served batch on the ``window``
batches just served (vLLM's EPLB ``step_interval`` and ``window_size``); ``migration`` lays the new plan onto the one
in service (:func:`moebalance.algorithms.migration.lay_onto`; ``bounded`` with ``max_moves``).

**A re-plan** moves the experts each GPU must receive by a transfer schedule
(:func:`moebalance.cost.transfer.schedule_transfers`), layers in chunks of ``C`` (all at once by default), chunk
``k`` in the ``k``-th step after the re-plan; a layer serves the new plan from the step its chunk lands in.

- ``sync``: serving stops for each chunk's transfer; the first chunk also pays the host's fixed overhead (planning,
  metadata, synchronisation). A re-plan that moves nothing exposes nothing.
- ``async``: serving goes on with the old plan while the chunks move one after another in the background; a chunk's
  layers switch at the first step that starts after the steps served since the re-plan add up to the chunk's
  finish time (with one chunk: ``ceil(transfer / step)`` steps later). Nothing is exposed; the host's overhead is
  taken to run beside serving, and the transfer's share of the links beside the all-to-all's is not modelled.

A re-plan that arrives while an earlier one is still moving abandons the rest of it: the new moves start from what
the GPUs hold.

The ``time`` summary counts as ``rearrangements`` the re-plans that moved experts (static policies) or the served
batches whose prefetch loaded any (``libra``), and as ``moved_gib`` the expert weights received over all GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moebalance.algorithms.migration import MIGRATIONS
from moebalance.core.errors import InputError
from moebalance.core.plan import Placement
from moebalance.cost.memory import GIB
from moebalance.cost.transfer import schedule_transfers

__all__ = ["DEFAULT_OVERHEAD_MS", "REARRANGE_MODES", "Rearranger", "Replanning", "hybrid", "time_summary"]

#: The host's fixed cost of one synchronous rearrangement, ms: SGLang's measured host time per rearrangement
#: (docs/design.md, "Online replay and prediction", gives the source and the numbers); the transfer is modelled on
#: its own, so only the host's time is charged here.
DEFAULT_OVERHEAD_MS = 1000.0
REARRANGE_MODES = ("sync", "async")


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(kw_only=True, frozen=True, slots=True)
class Replanning:
    """A static policy's periodic re-plans: when, on what, how laid on, and how their moves land (module docstring).

    Example: ``Replanning(every=100, window=200, migration="bounded", max_moves=2, rearrange="async")``. The
    default plans once.
    """

    #: Plan again before every ``every``-th served batch (``None``: plan once).
    every: int | None = None
    #: Batches the re-plan sees (default: ``every``).
    window: int | None = None
    #: ``fresh``, ``aligned`` or ``bounded`` (:data:`moebalance.algorithms.migration.MIGRATIONS`).
    migration: str = "fresh"
    #: Copies one GPU may receive per re-plan (``bounded`` only).
    max_moves: int | None = None
    #: ``sync`` or ``async`` (module docstring).
    rearrange: str = "sync"
    #: Host time a synchronous rearrangement (or a recovery) exposes besides its transfer, ms.
    overhead_ms: float = DEFAULT_OVERHEAD_MS
    #: Layers a re-plan moves per step (``None``: all at once).
    layers_per_step: int | None = None

    def __post_init__(self) -> None:
        if self.every is not None and not _positive(self.every):
            raise InputError(f"replan_every ({self.every!r}) must be a positive number of batches")
        if self.window is not None and not _positive(self.window):
            raise InputError(f"window ({self.window!r}) must be a positive number of batches")
        if self.migration not in MIGRATIONS:
            raise InputError(f"migration {self.migration!r} is unknown; choose one of: {', '.join(MIGRATIONS)}")
        if (self.migration == "bounded") != (self.max_moves is not None):
            raise InputError("max_moves goes with migration bounded (the copies one GPU may receive per re-plan): "
                             "give both or neither")
        if self.rearrange not in REARRANGE_MODES:
            raise InputError(f"rearrange mode {self.rearrange!r} is unknown; choose one of: "
                             f"{', '.join(REARRANGE_MODES)}")
        if not (isinstance(self.overhead_ms, int | float) and math.isfinite(self.overhead_ms) and self.overhead_ms >= 0):
            raise InputError(f"the rearrangement overhead ({self.overhead_ms} ms) must be a finite number >= 0")
        if self.layers_per_step is not None and not _positive(self.layers_per_step):
            raise InputError(f"layers per step ({self.layers_per_step!r}) must be a positive number of layers")

    @property
    def periodic(self) -> bool:
        return self.every is not None

    @property
    def window_batches(self) -> int | None:
        """The batches a re-plan sees: ``window``, else ``every``."""
        return self.window if self.window is not None else self.every


def hybrid(old: Placement, new: Placement, layers: Sequence[int]) -> Placement:
    """``old`` with ``layers`` taken from ``new`` (a re-plan's chunks landed so far)."""
    take = set(layers)
    lists = [new.gpu_experts[li] if li in take else old.gpu_experts[li] for li in range(old.num_layers)]
    weights = None
    if old.weights is not None and new.weights is not None:
        weights = [new.weights[li] if li in take else old.weights[li] for li in range(old.num_layers)]
    return Placement(gpu_experts=lists, num_experts=old.num_experts, cluster=old.cluster, policy=new.policy,
                     params=new.params, weights=weights)


@dataclass
class _Move:
    """A re-plan in flight: the target plan, its chunks' layers and seconds, the chunks landed."""

    target: Placement
    chunks: list[list[int]]
    seconds: list[float]
    bytes: list[int]
    landed: int = 0
    elapsed: float = 0.0


class Rearranger:
    """Which plan serves each step while re-plans move experts, and what that exposes (module docstring).

    Per served step: :meth:`replan` when a new plan is made, then :meth:`before_step` (the serving plan and the
    seconds exposed before the step), then :meth:`after_step` with the step's seconds. Without ``bytes_per_expert`` a new plan
    serves at once and exposes nothing (the replay's imbalance-only mode).
    """

    def __init__(self, plan: Placement, how: Replanning, bytes_per_expert: int | None) -> None:
        self.serving = plan
        self.how = how
        #: ``None``: moves are not priced (a new plan serves at once).
        self.bytes_per_expert = bytes_per_expert
        self.rearrangements = 0
        self.moved_bytes = 0
        self._move: _Move | None = None
        self._pending = 0.0

    @property
    def moving(self) -> bool:
        """Whether a re-plan's moves are still landing."""
        return self._move is not None

    @property
    def transfer_seconds(self) -> float:
        """Seconds the re-plan in flight takes to move, all its chunks (0 when none moves)."""
        return float(sum(self._move.seconds)) if self._move is not None else 0.0

    def recover(self, new: Placement, seconds: float = 0.0, moved_bytes: int = 0) -> None:
        """GPUs were lost: ``new`` serves the next step, which waits ``seconds`` (the moves and reloads,
        :func:`moebalance.online.failure.recovery_cost`) and the host's overhead; a re-plan in flight is abandoned."""
        self.serving, self._move = new, None
        if self.bytes_per_expert is not None:
            self._pending = seconds + self.how.overhead_ms * 1e-3
            self.moved_bytes += moved_bytes
            self.rearrangements += 1

    def replan(self, new: Placement) -> None:
        bpe = self.bytes_per_expert
        if bpe is None:
            self.serving, self._move = new, None
            return
        L = new.num_layers
        C = self.how.layers_per_step or L
        chunks = [list(range(lo, min(lo + C, L))) for lo in range(0, L, C)]
        plans = [schedule_transfers(self.serving, new, bpe, new.cluster, layers=c) for c in chunks]
        if sum(s.moved_experts for s in plans) == 0:  # nothing to move: the new plan serves at once, for free
            self.serving, self._move = new, None
            return
        self._move = _Move(new, chunks, [s.seconds for s in plans], [s.moved_bytes for s in plans])

    def before_step(self) -> tuple[Placement, float]:
        """``(plan serving the next step, seconds exposed before it)``."""
        m = self._move
        if self._pending:
            pending, self._pending = self._pending, 0.0
            return self.serving, pending
        if m is None or self.bytes_per_expert is None:
            return self.serving, 0.0
        exposed, before = 0.0, m.landed
        if self.how.rearrange == "sync":  # this step's chunk moves while serving waits
            exposed = m.seconds[before] + (self.how.overhead_ms * 1e-3 if before == 0 else 0.0)
            m.landed += 1
        else:  # the chunks that finished during the steps served since the re-plan
            finish = np.cumsum(m.seconds)
            while m.landed < len(m.chunks) and finish[m.landed] <= m.elapsed * (1 + 1e-12):
                m.landed += 1
        self.moved_bytes += sum(m.bytes[before:m.landed])
        if before == 0 and m.landed > 0:  # a rearrangement counts once its first chunk lands (not if abandoned)
            self.rearrangements += 1
        landed = [li for c in m.chunks[:m.landed] for li in c]
        if m.landed == len(m.chunks):
            self.serving, self._move = m.target, None
        elif landed:
            self.serving = hybrid(self.serving, m.target, landed)
        return self.serving, exposed

    def after_step(self, seconds: float) -> None:
        if self._move is not None:
            self._move.elapsed += seconds


def time_summary(step_s: np.ndarray, exposed_s: np.ndarray, tokens: np.ndarray, moved_bytes: float,
                 rearrangements: int, router_s: np.ndarray | None = None,
                 moe_layer_s: np.ndarray | None = None) -> dict[str, Any]:
    """The ``time`` object of ``online --json``: ``step_s``, ``exposed_s`` and ``tokens`` per served batch ``[B']``;
    ``router_s [B']``, the router's share of ``exposed_s``, is also given on its own (``exposed_router_ms``), and
    ``moe_layer_s [B']``, each batch's mean MoE layer (slowest GPU's experts and the all-to-all, over the layers
    with load), as their mean (``moe_layer_ms_mean``)."""
    ms = step_s * 1e3
    total = float(step_s.sum())
    return {"step_ms_mean": round(float(ms.mean()), 6), "step_ms_p50": round(float(np.percentile(ms, 50)), 6),
            "step_ms_p99": round(float(np.percentile(ms, 99)), 6),
            "tokens_per_s": round(float(tokens.sum()) / total, 3) if total > 0 else 0.0,
            "exposed_balancing_ms": round(float(exposed_s.sum()) * 1e3, 6),
            "exposed_router_ms": round(float(router_s.sum()) * 1e3 if router_s is not None else 0.0, 6),
            "moe_layer_ms_mean": round(float(moe_layer_s.mean()) * 1e3 if moe_layer_s is not None and
                                       moe_layer_s.size else 0.0, 6),
            "moved_gib": round(moved_bytes / GIB, 6), "rearrangements": int(rearrangements),
            "per_batch_step_ms": [round(float(v), 6) for v in ms]}
