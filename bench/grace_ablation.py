"""GRACE-MoE's component analysis (Section 5.3, Figure 5; docs/papers/grace.md) on bundled token-level traces.

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

Every configuration gets the same memory: ``S = ceil(E / G) + ceil(E / G / 2)`` expert slots per GPU in
every layer, room for GRACE's uneven groups and for the replicas Eq. 2 asks for; EPLB fills them with
replicas.

Writes docs/results/grace.md. Run: .venv/bin/python bench/grace_ablation.py
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from _common import ROOT, fold_ranks, machine

from moebalance.core.cluster import LINK_PRESETS, Cluster
from moebalance.core.load import LoadMatrix, read_load
from moebalance.models import get_model
from moebalance.policies import Budget, make_plan
from moebalance.routing.copies import Traffic
from moebalance.routing.simulate import Score, evaluate
from moebalance.workloads.synth import synthesize

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
        preset = get_model(model)
        full = read_load(f"bundled:{model}-tokens")
        for nodes, gpn in CLUSTERS:
            cluster = cluster_for(nodes, gpn)
            G = cluster.num_gpus
            load = fold_ranks(full, G)
            train, test = load.split(0.5)
            q = math.ceil(load.num_experts / G)
            budget = Budget(slots_per_gpu=q + math.ceil(q / 2))
            for name, (policy, params, router) in CONFIGS.items():
                plan, seconds = make_plan(policy, train, cluster, budget, **params)
                score = evaluate(plan, test, router, seed=0, bytes_per_copy=2 * preset.hidden_size)
                rows.append(Row(preset.display_name, f"{nodes}x{gpn}", name, score, seconds))
                print(f"{model} {nodes}x{gpn} {name}: {seconds:.2f} s", flush=True)
    return rows, []


def timing() -> str:
    """Planning time for Qwen3-30B-A3B-like, 48 x 128, on 16 GPUs (target: under 10 s)."""
    arrays = synthesize(get_model("qwen3-30b-a3b"), num_batches=32, tokens_per_batch=512, num_gpus=16, seed=0,
                        token_level=True)
    load = LoadMatrix.from_arrays(arrays)
    out = []
    for nodes, gpn in ((2, 8), (4, 4)):
        cluster = Cluster(num_nodes=nodes, gpus_per_node=gpn)
        q = math.ceil(load.num_experts / cluster.num_gpus)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            make_plan("grace", load, cluster, Budget(slots_per_gpu=q + math.ceil(q / 2)))
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
    """GRACE 5.3's claims, checked per (model, cluster): changes in percent."""
    out = ["| model | GPUs | HG vs Vanilla: cross-node | HG vs Vanilla: intra-node | HG vs Vanilla: all-to-all time "
           "| DR+WRR vs HG: load std | DR+WRR vs HG: idle | DR+WRR vs FR: load std | TAR vs WRR: cross-node "
           "| TAR vs WRR: intra-node | TAR vs WRR: all-to-all time | TAR vs WRR: load std |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r.model, r.cluster) for r in rows)
    for model, cl in keys:
        by = {r.config: r.score for r in rows if (r.model, r.cluster) == (model, cl)}

        def t(name: str, by: dict[str, Score] = by) -> Traffic:
            traffic = by[name].traffic
            assert traffic is not None and traffic.a2a_seconds is not None
            return traffic

        cells = [
            pct(t("HG").inter_node, t("Vanilla").inter_node),
            pct(t("HG").intra_node, t("Vanilla").intra_node),
            pct(float(t("HG").a2a_seconds.mean()), float(t("Vanilla").a2a_seconds.mean())),  # type: ignore[union-attr]
            pct(by["HG+DR+WRR"].load_std, by["HG"].load_std),
            pct(by["HG+DR+WRR"].gpu_idle, by["HG"].gpu_idle),
            pct(by["HG+DR+WRR"].load_std, by["HG+FR"].load_std),
            pct(t("HG+DR+TAR").inter_node, t("HG+DR+WRR").inter_node),
            pct(t("HG+DR+TAR").intra_node, t("HG+DR+WRR").intra_node),
            pct(float(t("HG+DR+TAR").a2a_seconds.mean()), float(t("HG+DR+WRR").a2a_seconds.mean())),  # type: ignore[union-attr]
            pct(by["HG+DR+TAR"].load_std, by["HG+DR+WRR"].load_std),
        ]
        out.append(f"| {model} | {cl} | " + " | ".join(cells) + " |")
    out += ["", "GRACE's Figure 5 (2 x 2, three models): HG vs Vanilla -3 to -26% cross-node, -10 to -36% intra-node, "
            "-8 to -15% all-to-all time; DR+WRR vs HG -45 to -58% load std, -32 to -43% idle; TAR vs WRR -6 to -35% "
            "cross-node, -6.7% intra-node on average, -3 to -10% all-to-all time, +21% load std on average."]
    return out


def _metric(score: Score, name: str) -> float:
    t = score.traffic
    assert t is not None and t.a2a_seconds is not None
    values = {"cross": t.inter_node, "intra": t.intra_node, "a2a": float(t.a2a_seconds.mean()),
              "std": score.load_std, "idle": score.gpu_idle}
    return float(values[name])


def _changes(rows: list[Row], new: str, old: str, metric: str, cluster: str | None = None) -> list[float]:
    """Percent change of ``metric`` from config ``old`` to ``new`` in every (model, cluster) (or one cluster)."""
    by = {(r.model, r.cluster, r.config): r.score for r in rows}
    cells = dict.fromkeys((r.model, r.cluster) for r in rows if cluster is None or r.cluster == cluster)
    return [100 * (_metric(by[(*c, new)], metric) / _metric(by[(*c, old)], metric) - 1) for c in cells]


def _span(values: list[float], sign: bool = False) -> str:
    """``lo to hi`` in percent (magnitudes unless ``sign``), or one number if both round alike."""
    vals = values if sign else [abs(v) for v in values]
    fmt = "{:+.0f}%" if sign else "{:.0f}%"
    lo, hi = fmt.format(min(vals)), fmt.format(max(vals))
    return lo if lo == hi else f"{lo} to {hi}"


def _claims(rows: list[Row]) -> list[str]:
    """The comparison with GRACE's Figure 5, from the rows."""
    def c(new: str, old: str, metric: str, cluster: str | None = None, sign: bool = False) -> str:
        return _span(_changes(rows, new, old, metric, cluster), sign)

    return [
        f"Against GRACE's Figure 5: grouping (HG) cuts cross-node copies by {c('HG', 'Vanilla', 'cross')} and "
        f"intra-node cross-GPU copies by {c('HG', 'Vanilla', 'intra')} (paper: 3-26% and 10-36%); dynamic "
        f"replication with WRR cuts HG's load deviation by {c('HG+DR+WRR', 'HG', 'std')} and its GPU idle time by "
        f"{c('HG+DR+WRR', 'HG', 'idle')} (paper: 45-58% and 32-43%) and beats fixed replication (FR) by "
        f"{c('HG+DR+WRR', 'HG+FR', 'std')} in load deviation; the locality router (TAR) cuts cross-node copies "
        f"against WRR by {c('HG+DR+TAR', 'HG+DR+WRR', 'cross')} and changes all-to-all time by "
        f"{c('HG+DR+TAR', 'HG+DR+WRR', 'a2a', sign=True)} (paper: -6 to -35% and -3 to -10%) at a cost in load "
        "deviation. Three differences:",
        "",
        f"- All-to-all *time* does not follow traffic for HG: {c('HG', 'Vanilla', 'a2a', sign=True)} here, -8 to "
        "-15% in the paper. Our bandwidth model (the busiest link of any GPU, dispatch + combine) makes HG slower "
        "because grouping co-activated experts also concentrates the copies on the GPUs and the node that host "
        "the hot groups, whose receive links become the bottleneck. Replication spreads those copies again. The "
        "model has no per-message latency and assumes links run in parallel, so it weighs balanced receive "
        "volumes more than a real 25 GbE cluster may.",
        f"- TAR's intra-node copies against WRR: {c('HG+DR+TAR', 'HG+DR+WRR', 'intra', '2x2', True)} on 2 x 2 "
        f"(paper: -6.7% on average), but {c('HG+DR+TAR', 'HG+DR+WRR', 'intra', '2x4', True)} on 2 x 4: with four "
        "GPUs per node, the tokens that WRR sent to a replica on the other node now go to a replica on their own "
        "node, which adds intra-node copies about as fast as own-GPU hits remove them.",
        f"- TAR's cost in load deviation against the paper's average +21%: "
        f"{c('HG+DR+TAR', 'HG+DR+WRR', 'std', '2x4', True)} on 2 x 4, "
        f"{c('HG+DR+TAR', 'HG+DR+WRR', 'std', '2x2', True)} on 2 x 2, where a token's own GPU holds a quarter of "
        "the experts and locality overrides the weights most.",
    ]


def main() -> None:
    rows, _ = run()
    text = "\n".join([
        "# GRACE-MoE component analysis (held-out)",
        "",
        "Bundled token-level traces (64 batches x 256 tokens, 8 ranks); planned on the first 32 batches, scored "
        "on the last 32. PCIe 4.0 inside a node, 25 Gb Ethernet per node (GRACE Section 5.1); copies counted once "
        "per destination GPU per token (GRACE, DeepEP), dispatch direction; all-to-all time is dispatch + "
        f"combine over the busiest link (docs in `moebalance.routing.simulate`). Machine: {machine()}.",
        "Reproduce: `.venv/bin/python bench/grace_ablation.py`.",
        "",
        *_fmt(rows),
        "",
        "## Directions (GRACE Section 5.3)",
        "",
        *_directions(rows),
        "",
        *_claims(rows),
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
