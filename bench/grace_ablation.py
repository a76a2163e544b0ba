"""GRACE-MoE's component analysis (paper 001, Section 5.3, Figure 5) on bundled token-level traces (issue 4).

Models: the bundled OLMoE-like (64 experts, top-8, 16 layers) and Qwen3-30B-A3B-like (128 experts, top-8,
48 layers) traces, 64 batches x 256 tokens on 8 data-parallel ranks (docs/synth.md). Clusters: 2 nodes x 2
GPUs (GRACE's setup; the 8 ranks are folded two per GPU: GPU g serves the tokens of ranks 2g and 2g + 1)
and 2 nodes x 4 GPUs (one rank per GPU). Links: PCIe 4.0 x16 inside a node (32 GB/s per direction) and one
25 Gb Ethernet NIC per node shared by its GPUs (GRACE Section 5.1); 2-byte activations of the model's hidden
size. Plans are made on the first half of the batches and scored on the held-out second half.

Configurations (GRACE Figure 5's abbreviations):

- Vanilla: average grouping, contiguous blocks of E / G experts (``contiguous``); no replicas.
- HG: hierarchical grouping (``grace``, ``replication=none``).
- HG+FR: one replica of the heaviest group's hot experts on the least-loaded GPU, routed by ``wrr``.
- HG+DR+WRR: Eq. 2's dynamic replica count, routed by ``wrr`` (Alg. 3).
- HG+DR+TAR: the full GRACE, routed by ``locality`` (Alg. 4).
- eplb: DeepSeek EPLB (global) with the same slots per GPU, routed uniformly at random as vLLM does.

Every configuration gets the same memory: ``S = ceil(E / G) + ceil(E / G / 4)`` expert slots per GPU in
every layer (GRACE's groups may be up to that large; EPLB fills them with replicas).

Writes docs/results/grace.md. Run: .venv/bin/python bench/grace_ablation.py
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from _common import ROOT, fold_ranks, machine

from moebalance.cluster import LINK_PRESETS, Cluster
from moebalance.load import LoadMatrix, read_load
from moebalance.policies import Budget, make_plan
from moebalance.simulate import Score, evaluate
from moebalance.synth import get_preset, synthesize

MODELS = ("olmoe-1b-7b", "qwen3-30b-a3b")
CLUSTERS = ((2, 2), (2, 4))
#: name -> (policy, params, router)
CONFIGS: dict[str, tuple[str, dict[str, object], str]] = {
    "Vanilla": ("contiguous", {}, "uniform"),
    "HG": ("grace", {"replication": "none"}, "uniform"),
    "HG+FR": ("grace", {"replication": "fixed"}, "wrr"),
    "HG+DR+WRR": ("grace", {"replication": "dynamic"}, "wrr"),
    "HG+DR+TAR": ("grace", {"replication": "dynamic"}, "locality"),
    "eplb": ("eplb", {"num_groups": 1}, "random"),
}


@dataclass
class Row:
    model: str
    cluster: str
    config: str
    score: Score
    plan_seconds: float


def cluster_for(nodes: int, gpn: int) -> Cluster:
    return Cluster(num_nodes=nodes, gpus_per_node=gpn, intra_node_bandwidth=LINK_PRESETS["pcie4"],
                   inter_node_bandwidth=LINK_PRESETS["eth25"] / gpn)


def run() -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    for model in MODELS:
        preset = get_preset(model)
        full = read_load(f"bundled:{model}-tokens")
        for nodes, gpn in CLUSTERS:
            cluster = cluster_for(nodes, gpn)
            G = cluster.num_gpus
            load = fold_ranks(full, G)
            train, test = load.split(0.5)
            q = math.ceil(load.num_experts / G)
            budget = Budget(slots_per_gpu=q + math.ceil(q / 4))
            for name, (policy, params, router) in CONFIGS.items():
                plan, seconds = make_plan(policy, train, cluster, budget, **params)
                score = evaluate(plan, test, router, seed=0, bytes_per_copy=2 * preset.hidden_size)
                rows.append(Row(preset.display_name, f"{nodes}x{gpn}", name, score, seconds))
                print(f"{model} {nodes}x{gpn} {name}: {seconds:.2f} s", flush=True)
    return rows, []


def timing() -> str:
    """Planning time for Qwen3-30B-A3B-like, 48 x 128, on 16 GPUs (issue 4: under 10 s)."""
    arrays = synthesize(get_preset("qwen3-30b-a3b"), num_batches=32, tokens_per_batch=512, num_gpus=16, seed=0,
                        token_level=True)
    load = LoadMatrix.from_arrays(arrays)
    out = []
    for nodes, gpn in ((2, 8), (4, 4)):
        cluster = Cluster(num_nodes=nodes, gpus_per_node=gpn)
        q = math.ceil(load.num_experts / cluster.num_gpus)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            make_plan("grace", load, cluster, Budget(slots_per_gpu=q + math.ceil(q / 4)))
            times.append(time.perf_counter() - t0)
        out.append(f"{nodes}x{gpn}: {float(np.median(times)):.2f} s")
    return ("Planning GRACE (hierarchical, dynamic) for a Qwen3-30B-A3B-like trace, 48 layers x 128 experts, "
            "32 batches x 512 tokens on 16 ranks, median of 3: " + ", ".join(out) + " (target: under 10 s).")


def _fmt(rows: list[Row]) -> list[str]:
    lines = ["| model | GPUs | config | cross-node copies | intra-node cross-GPU copies | all-to-all per layer (us) "
             "| std of GPU load | GPU idle (tokens) | balancedness | plan time |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r.score.traffic
        assert t is not None and t.a2a_seconds is not None
        lines.append(f"| {r.model} | {r.cluster} | {r.config} | {t.inter_node:,} | {t.intra_node:,} | "
                     f"{1e6 * float(t.a2a_seconds.mean()):.1f} | {r.score.load_std:.1f} | {r.score.gpu_idle:.1f} | "
                     f"{r.score.balancedness:.3f} | {r.plan_seconds:.2f} s |")
    return lines


def pct(new: float, old: float) -> str:
    return f"{100 * (new - old) / old:+.1f}%"


def _directions(rows: list[Row]) -> list[str]:
    """GRACE 5.3's three claims, checked per (model, cluster)."""
    out = ["| model | GPUs | HG cuts cross-node vs Vanilla | DR+WRR cuts load std vs HG | TAR cuts cross-node vs WRR "
           "| TAR's load-std cost vs WRR |", "|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r.model, r.cluster) for r in rows)
    for model, cl in keys:
        by = {r.config: r for r in rows if (r.model, r.cluster) == (model, cl)}

        def inter(name: str, by: dict[str, Row] = by) -> int:
            t = by[name].score.traffic
            assert t is not None
            return t.inter_node

        out.append(f"| {model} | {cl} | {pct(inter('HG'), inter('Vanilla'))} | "
                   f"{pct(by['HG+DR+WRR'].score.load_std, by['HG'].score.load_std)} | "
                   f"{pct(inter('HG+DR+TAR'), inter('HG+DR+WRR'))} | "
                   f"{pct(by['HG+DR+TAR'].score.load_std, by['HG+DR+WRR'].score.load_std)} |")
    return out


def main() -> None:
    rows, _ = run()
    text = "\n".join([
        "# GRACE-MoE component analysis (held-out)",
        "",
        "Bundled token-level traces (64 batches x 256 tokens, 8 ranks); planned on the first 32 batches, scored "
        "on the last 32. PCIe 4.0 inside a node, 25 Gb Ethernet per node (GRACE Section 5.1); copies counted once "
        "per destination GPU per token (GRACE, DeepEP), dispatch direction; all-to-all time is dispatch + "
        f"combine over the busiest link (docs in `moebalance.simulate`). Machine: {machine()}.",
        "Reproduce: `.venv/bin/python bench/grace_ablation.py`.",
        "",
        *_fmt(rows),
        "",
        "## Directions (GRACE Section 5.3)",
        "",
        *_directions(rows),
        "",
        "Read against GRACE's Figure 5 (2 x 2 RTX 4090, WikiText): HG cut cross-node traffic by 3-26% there and",
        "here (13-18%); DR+WRR cut the per-layer load deviation of HG by 45-58% there, 39-52% here; TAR cut",
        "cross-node traffic against WRR by 6-35% there (11-14% here) at +21% load deviation on average (+10-17%",
        "here). Two differences:",
        "",
        "- All-to-all *time* does not follow traffic for HG. GRACE measured HG 8-15% faster than Vanilla; our",
        "  bandwidth model (the busiest link of any GPU, dispatch + combine) makes HG slower, because grouping",
        "  co-activated experts also concentrates the copies on the GPUs that host the hot groups, and their",
        "  receive links become the bottleneck. Replication (DR) spreads those copies again, and TAR is the",
        "  fastest GRACE variant in every setting. The model has no per-message latency and assumes links run",
        "  in parallel, so it favours balanced receive volumes more than a real 25 GbE cluster may.",
        "- HG+FR equals HG+DR+WRR on OLMoE 2 x 2: Eq. 2 asks for one replica in 13 layers and two in 3, but the",
        "  20-slot budget fits only one there (`params['replicas_wanted']` against `params['replicas']`).",
        "",
        "EPLB (global, the same memory filled with replicas, random replica choice) balances far better than",
        "any GRACE variant and sends about as much as Vanilla: GRACE trades balance for traffic, as its paper",
        "says; which wins end to end depends on how communication-bound the deployment is.",
        "",
        timing(),
        "",
    ])
    print(text)
    (ROOT / "docs" / "results" / "grace.md").write_text(text)


if __name__ == "__main__":
    main()
