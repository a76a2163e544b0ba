"""Losing a GPU in ``moebalance online`` (``--fail G@BATCH``; docs/design.md, "Online replay and prediction").

Legend: ``L`` layers, ``E`` experts per layer, ``G`` GPUs, ``S`` survivors, ``s`` slots per GPU and layer.

Reading: the cluster keeps its shape and a failed GPU stays in it with no experts and no tokens. From the batch
it fails in, its tokens are served by the survivors' data-parallel ranks, spread evenly (token ``k`` of the lost
GPU's goes to survivor ``k mod S``); balance is measured over the survivors only (a GPU that serves nothing is
not idle capacity). The step's other layers run on the survivors' ranks.

- **Static policies** re-plan on the survivors: the policy plans on a cluster of one node of ``S`` GPUs (so
  hierarchical EPLB plans globally; the survivors no longer form whole nodes) under ``s`` slots per GPU, ``s``
  the most experts the plan in service holds on one GPU in one layer (the memory a GPU has), on the planning
  window (the last ``W`` batches with ``--replan-every``, else the warm-up); the survivors' plan is then laid
  onto the plan in service with :func:`moebalance.algorithms.migration.align`, keeping the most experts in
  place. Later periodic re-plans plan on the survivors the same way, laid on as ``--migration`` says.
- **libra** re-plans its base the same way; its prefetcher then never adds experts on a failed GPU.
- **What it costs** (:func:`recovery_cost`): serving stops (the old plan cannot serve: its lost copies are gone)
  for the host's overhead, the experts whose only copies were on the failed GPUs reloaded from host memory over
  each survivor's own host link (``--reload-link``, default PCIe 5 x16, 64 GB/s per direction:
  :data:`moebalance.core.cluster.LINK_PRESETS`), each reloaded once, on the survivor that hosts it in the new plan
  and has reloaded the fewest so far, and then the other moves scheduled among survivors
  (:func:`moebalance.cost.transfer.schedule_transfers`, the reloaded copies counted as held where they landed).
- When ``S * s < E`` the survivors cannot hold every expert: a one-line refusal names the slots each would need,
  ``ceil(E / S)``.

Per failure the result reports the stall (ms exposed before the failure batch, with ``--gpu``), the served batches
until the batch imbalance ratio is back within 2% of its mean over the batches served before the failure (since
the previous one), and the balance after (the mean over the batches until the next failure or the end).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moebalance.core.budget import Budget
from moebalance.core.cluster import LINK_PRESETS, Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.cost.transfer import schedule_transfers
from moebalance.policies import make_plan

__all__ = ["DEFAULT_RELOAD_GBPS", "RECOVERED_WITHIN", "Failures", "check_capacity", "check_failures", "failure_report", "lift",
           "parse_failure", "plan_on_survivors", "recovery_cost", "survivor_load"]

#: The host link experts are reloaded over: PCIe 5.0 x16 per direction (the ``pcie5`` link preset).
DEFAULT_RELOAD_GBPS = LINK_PRESETS["pcie5"]
#: A batch imbalance ratio at most this factor over the level before a failure counts as recovered.
RECOVERED_WITHIN = 1.02


def parse_failure(value: str) -> tuple[int, int]:
    """``"G@BATCH"`` -> ``(G, BATCH)``; one-line :class:`InputError` otherwise. ``parse_failure("3@12") == (3, 12)``."""
    gpu, sep, batch = value.partition("@")
    try:
        if not sep:
            raise ValueError
        g, b = int(gpu), int(batch)
    except ValueError:
        raise InputError(f"--fail {value!r}: give GPU@BATCH, e.g. --fail 3@120 (GPU 3 is gone from batch 120)") from None
    return g, b


@dataclass(frozen=True, slots=True)
class Failures:
    """GPUs lost while serving: ``(GPU, batch)`` pairs, the GPU gone from that served batch on, and the link the
    experts only it held are reloaded over (GB/s). Example: ``Failures(((3, 120),))``."""

    events: tuple[tuple[int, int], ...] = ()
    reload_gbps: float = DEFAULT_RELOAD_GBPS

    def __post_init__(self) -> None:
        events = []
        for event in self.events:
            pair = tuple(event) if isinstance(event, tuple | list) else (event,)
            if len(pair) != 2 or not all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in pair):
                raise InputError(f"a failure ({event!r}) must be a (GPU, batch) pair of integers, e.g. (3, 120)")
            events.append((int(pair[0]), int(pair[1])))
        object.__setattr__(self, "events", tuple(events))
        r = self.reload_gbps
        if not (isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(r) and r > 0):
            raise InputError(f"the reload link ({r!r} GB/s) must be a positive number")


def check_failures(failures: Sequence[tuple[int, int]], num_gpus: int,
                   served: tuple[int, int]) -> dict[int, tuple[int, ...]]:
    """``{batch: GPUs lost from it}`` in batch order; refuses a GPU out of range, a batch outside the served range,
    a GPU failed twice, and every GPU failed (one line each)."""
    c, d = served
    seen: set[int] = set()
    out: dict[int, list[int]] = {}
    for g, b in failures:
        if not 0 <= g < num_gpus:
            raise InputError(f"--fail {g}@{b}: GPU {g} is not one of the cluster's {num_gpus} GPUs (0 to {num_gpus - 1})")
        if not c <= b < d:
            raise InputError(f"--fail {g}@{b}: batch {b} is not served; give a batch in {c}:{d} (the served range)")
        if g in seen:
            raise InputError(f"--fail names GPU {g} twice; a GPU fails once")
        seen.add(g)
        out.setdefault(b, []).append(g)
    if len(seen) >= num_gpus:
        raise InputError(f"--fail takes all {num_gpus} GPUs; at least one must survive to serve")
    return {b: tuple(sorted(out[b])) for b in sorted(out)}


def check_capacity(slots: int, survivors: int, num_experts: int, what: str) -> None:
    """Refuse ``survivors`` GPUs of ``slots`` slots each that cannot hold ``num_experts`` experts."""
    if slots * survivors < num_experts:
        raise InputError(f"{what}: the {survivors} surviving GPUs hold {slots} expert slots each, fewer than the "
                         f"{num_experts} experts; each would need {math.ceil(num_experts / survivors)} slots "
                         "(give a larger --slots-per-gpu or fail fewer GPUs)")


def survivor_load(load: LoadMatrix, lost: Sequence[int], num_gpus: int, *, renumber: bool) -> LoadMatrix:
    """``load`` with the lost GPUs' tokens spread evenly over the survivors (token ``k`` of theirs to survivor
    ``k mod S``); ``renumber``: survivors renumbered ``0..S-1`` (a plan on the survivors' cluster). Counts only:
    ``load`` itself (its picks name no GPU)."""
    trace = load.trace
    if trace is None or (not lost and not renumber):
        return load
    alive = np.setdiff1d(np.arange(num_gpus), np.asarray(lost, dtype=np.int64))
    src = trace.src_gpu.copy()
    gone = np.isin(src, np.asarray(lost, dtype=np.int64))
    src[gone] = alive[np.arange(int(gone.sum())) % alive.size]
    if renumber:
        src = np.searchsorted(alive, src)
    new = RoutingTrace(topk_ids=trace.topk_ids, src_gpu=src, batch=trace.batch, num_experts=trace.num_experts,
                       num_batches=trace.num_batches)
    return LoadMatrix(load.counts, new, load.preset, load.layer_ids)


def lift(plan: Placement, cluster: Cluster, alive: Sequence[int]) -> Placement:
    """A plan on the survivors' cluster (GPU ``k`` is survivor ``alive[k]``) on the whole ``cluster``, the failed
    GPUs empty."""
    where = {int(g): k for k, g in enumerate(alive)}
    G = cluster.num_gpus
    rows = [[list(layer[where[g]]) if g in where else [] for g in range(G)] for layer in plan.gpu_experts]
    weights = None if plan.weights is None else [
        [list(layer[where[g]]) if g in where else [] for g in range(G)] for layer in plan.weights]
    return Placement(rows, plan.num_experts, cluster, policy=plan.policy, params=plan.params, weights=weights)


def plan_on_survivors(policy: str, load: LoadMatrix, cluster: Cluster, lost: Sequence[int], slots: int,
                      params: Mapping[str, Any]) -> Placement:
    """``policy``'s plan of ``load`` on the survivors (one node of ``S`` GPUs, ``slots`` per GPU and layer), lifted
    onto ``cluster`` (module docstring)."""
    G = cluster.num_gpus
    alive = [g for g in range(G) if g not in set(lost)]
    small = Cluster(num_nodes=1, gpus_per_node=len(alive), intra_node_bandwidth=cluster.intra_node_bandwidth,
                    inter_node_bandwidth=cluster.inter_node_bandwidth)
    plan = make_plan(policy, survivor_load(load, lost, G, renumber=True), small, Budget(slots_per_gpu=slots),
                     **dict(params))[0]
    return lift(plan, cluster, alive)


def recovery_cost(previous: Placement, new: Placement, lost: Sequence[int], bytes_per_expert: int,
                  reload_gbps: float) -> tuple[float, int, int]:
    """``(seconds, bytes moved, experts reloaded)`` to go from ``previous`` to ``new`` once ``lost`` GPUs are gone:
    the reloads over each survivor's host link of ``reload_gbps`` GB/s, then the schedule among survivors."""
    G = new.num_gpus
    alive = np.ones(G, dtype=bool)
    alive[list(lost)] = False
    orphan = ~(previous.copies[:, :, alive] > 0).any(axis=2)  # [L, E]: every copy was on a lost GPU
    reloads = np.zeros(G, dtype=np.int64)
    rows = [[list(r) for r in layer] for layer in previous.gpu_experts]
    for li, e in zip(*np.nonzero(orphan), strict=True):
        hosts = np.flatnonzero(new.copies[li, e] > 0)
        g = int(hosts[np.argmin(reloads[hosts])])  # the host that reloaded the fewest so far (lowest id on ties)
        reloads[g] += 1
        rows[li][g].append(int(e))  # held there from now on: a source for the schedule
    held = Placement(rows, previous.num_experts, previous.cluster)
    sched = schedule_transfers(held, new, bytes_per_expert, new.cluster, lost=[int(g) for g in lost])
    reload_s = float(reloads.max()) * bytes_per_expert / (reload_gbps * 1e9) if G else 0.0
    total = int(reloads.sum())
    return reload_s + sched.seconds, (total + sched.moved_experts) * int(bytes_per_expert), total


def failure_report(events: Sequence[Mapping[str, Any]], imbalance: np.ndarray, balancedness: np.ndarray,
                   first: int) -> list[dict[str, Any]]:
    """Per failure event (``batch``, ``gpus``, ``stall_s`` or None, ``reloaded``): the JSON object of
    ``online --fail``. ``imbalance`` / ``balancedness`` ``[B']`` per served batch, the first served being ``first``."""
    out = []
    starts = [int(ev["batch"]) - first for ev in events]
    for k, ev in enumerate(events):
        i = starts[k]
        lo = starts[k - 1] if k else 0
        hi = starts[k + 1] if k + 1 < len(events) else imbalance.size
        before = imbalance[lo:i]
        before = before[np.isfinite(before)]
        level = float(before.mean()) if before.size else None
        after = imbalance[i:hi]
        back = None
        if level is not None:
            ok = np.flatnonzero(after <= level * RECOVERED_WITHIN)
            back = int(ok[0]) if ok.size else None
        stall = ev.get("stall_s")
        out.append({"gpus": list(ev["gpus"]), "batch": int(ev["batch"]),
                    "stall_ms": None if stall is None else round(float(stall) * 1e3, 6),
                    "reloaded_experts": int(ev.get("reloaded", 0)),
                    "imbalance_before": None if level is None else round(level, 6),
                    "recovery_batches": back,
                    "mean_imbalance_after": round(float(np.nanmean(after)), 6),
                    "balancedness_after": round(float(np.nanmean(balancedness[i:hi])), 6)})
    return out
