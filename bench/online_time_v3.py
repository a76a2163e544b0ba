"""The DeepSeek-V3 part of docs/results/online_time.md: a synthetic trace whose workload drifts, on 8 x 8 H100.

A counts-level trace from ``moebalance synth``'s routing model for DeepSeek-V3 (58 MoE layers of 256 experts,
top-8; :mod:`moebalance.workloads.synth`) with the preset's skew but a popularity drift much faster than the
preset's (``drift_sigma`` = 0.6, ``drift_timescale`` = 10 batches instead of 0.3 and 400), so that a plan made on the
warm-up ages within the replay. 8 nodes x 8 H100s, NVLink 4 inside a node, the default inter-node link; batches of
256 and 2,048 tokens per GPU (16,384 and 131,072 tokens per batch), 8 warm-up batches and 32 served ones.

Policies, all with the rebalance router but the contiguous floor: contiguous homes (4 experts per GPU); static EPLB
(hierarchical, 8 groups as DeepSeek-V3 has, 5 slots per GPU and layer: 64 redundant experts); periodic EPLB every
``K`` on the last ``W`` (sync and async; fresh, aligned, bounded with ``M`` = 58, one copy per layer on average);
Libra on 4 homes per GPU with ``n`` = 2 and 4 extras from the history predictor (a counts-level trace has no token
paths) or the batch's true routing. Then losing a GPU: GPU 5 gone at served batch 16, for static EPLB, periodic
EPLB (aligned, async) and Libra (oracle, n = 2; its base EPLB on 5 slots per GPU, since 63 GPUs of 4 slots cannot
hold 256 experts).

Imported by bench/online_time.py, which writes the report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import get_gpu
from moebalance.models import get_model
from moebalance.online.failure import Failures
from moebalance.online.rearrange import Replanning
from moebalance.online.replay import OnlineResult, replay
from moebalance.pricing.step import StepPricing
from moebalance.workloads.profiles import routing_profile
from moebalance.workloads.synth import synthesize

NODES, PER_NODE = 8, 8
G = NODES * PER_NODE
WARM, SERVED = 8, 32
PER_GPU = (256, 2048)
K, W, M = 4, 4, 58
DRIFT_SIGMA, DRIFT_TIMESCALE = 0.6, 10.0
FAIL_GPU, FAIL_AT = 5, 16  # served batch index of the failure
SEED = 0
MODEL = "deepseek-v3"


def trace(per_gpu: int) -> LoadMatrix:
    """The drifting DeepSeek-V3-like trace at ``per_gpu`` tokens per GPU and batch (module docstring)."""
    model = get_model(MODEL)
    prof = dataclasses.replace(routing_profile(model), drift_sigma=DRIFT_SIGMA, drift_timescale=DRIFT_TIMESCALE)
    arrays = synthesize(MODEL, num_batches=WARM + SERVED, tokens_per_batch=per_gpu * G, num_gpus=G, seed=SEED,
                        profile=prof)
    return LoadMatrix(arrays["counts"], preset=MODEL)


def specs() -> list[tuple[str, dict[str, Any]]]:
    """``(label, replay arguments)`` of every policy (module docstring)."""
    homes, eplb = Budget(slots_per_gpu=4), Budget(slots_per_gpu=5)
    out: list[tuple[str, dict[str, Any]]] = [
        ("contiguous (no replicas)", {"policy": "contiguous", "budget": homes, "router": "uniform"}),
        ("static EPLB", {"policy": "eplb", "budget": eplb}),
    ]
    for mode in ("sync", "async"):
        for mig in ("fresh", "aligned", "bounded"):
            how = f"bounded M = {M}" if mig == "bounded" else mig
            out.append((f"periodic EPLB {mode}, {how} (every {K} on {W})",
                        {"policy": "eplb", "budget": eplb, "replan_every": K, "window": W, "rearrange": mode,
                         "migration": mig, "max_moves": M if mig == "bounded" else None}))
    out += [(f"Libra ({pred}, n = {n})", {"policy": "libra", "budget": homes,
                                          "params": {"n": n, "alpha": 0.5, "predictor": pred}})
            for pred in ("history", "oracle") for n in (2, 4)]
    return out


FAILING = ("static EPLB", f"periodic EPLB async, aligned (every {K} on {W})", "Libra (oracle, n = 2)")


def run(load: LoadMatrix, *, fail: bool = False) -> list[tuple[str, OnlineResult]]:
    """Every policy of :func:`specs` on ``load`` (with ``fail``: those in ``FAILING``, GPU 5 lost)."""
    cluster = Cluster(num_nodes=NODES, gpus_per_node=PER_NODE)
    pricing = StepPricing(deployment=Deployment(model=get_model(MODEL), gpu=get_gpu("h100-80gb"), precision="bf16"))
    out = []
    for label, spec in specs():
        if fail and label not in FAILING:
            continue
        if fail and spec["policy"] == "libra":  # 4 homes on 63 GPUs cannot hold 256 experts: an EPLB base of 5 slots
            spec = {**spec, "budget": Budget(slots_per_gpu=5), "params": {**spec["params"], "base": "eplb"}}
            label = f"{label}, EPLB base of 5 slots per GPU"
        replanning = Replanning(every=spec.get("replan_every"), window=spec.get("window"),
                                migration=spec.get("migration", "fresh"), max_moves=spec.get("max_moves"),
                                rearrange=spec.get("rearrange", "sync"))
        r = replay(load, cluster, spec["budget"], spec["policy"], spec.get("params", {}), warmup=(0, WARM),
                   router=spec.get("router", "rebalance"), replanning=replanning, pricing=pricing,
                   failures=Failures(((FAIL_GPU, WARM + FAIL_AT),)) if fail else None)
        out.append((label, r))
    return out


def failure_table(runs: list[tuple[str, OnlineResult]]) -> list[str]:
    """One row per policy: the failure's stall, reloads, recovery and balance after."""
    lines = ["| policy | stall ms | experts reloaded | mean imbalance before | batches until within 2% | "
             "mean imbalance after | tokens/s over the whole replay |", "|---|---|---|---|---|---|---|"]
    for label, r in runs:
        f = r.failures[0]
        back = "not within the replay" if f["recovery_batches"] is None else str(f["recovery_batches"])
        stall = "-" if f["stall_ms"] is None else f"{f['stall_ms']:,.1f}"
        assert r.time is not None
        lines.append(f"| {label} | {stall} | {f['reloaded_experts']} | {f['imbalance_before']:.3f} | {back} | "
                     f"{f['mean_imbalance_after']:.3f} | {r.time['tokens_per_s']:,.0f} |")
    return lines
