"""GRACE-MoE on real routing (DeepSeek's ESFT release) and on the Qwen3-like trace, against contiguous blocks.

Traces: ``bundled:esft-law`` -- real routing, not ours: ESFT's law task on a DeepSeek-V2-Lite-architecture model
(github.com/deepseek-ai/ESFT, commit 579a771, ``results/expert_scores/law/``; arXiv:2407.01906; how its tokens
are dealt to 8 ranks: docs/synth.md), 26 MoE layers x 64 experts, 16 batches x 512 tokens -- and the synthetic
``bundled:qwen3-30b-a3b-tokens`` (48 x 128, 64 batches x 256 tokens on 8 ranks). Both are planned on the first
half of the batches; balancedness is scored on that half (in-sample) and on the second (held out); copies and
modelled time on the held-out half.

Clusters: 1 node x 8 GPUs and 2 nodes x 4 GPUs (one rank per GPU), linked as GRACE's testbed (Section 5.1):
PCIe 4.0 x16 inside a node and one 25 Gb Ethernet NIC per node shared by its GPUs; copies are 2-byte
activations of the model's hidden size, counted once per destination GPU per token. Budgets: one slot per GPU
and layer beyond ``E / G`` (``slots_per_gpu = E / G + 1``: 9 for ESFT, 17 for Qwen3), and the same memory as
``replicas_per_gpu = L``. Modelled layer time: ``moebalance.pricing.goodput.price_plan`` for the trace's model on
RTX 4090s (the mean over held-out batches and layers of the straggler's expert time plus the all-to-all).

Rows: ``contiguous`` (Megatron blocks, no replicas, equal split), ``eplb`` (DeepSeek EPLB with the same memory,
a uniformly random replica per token as vLLM does), GRACE with weighted round-robin (``grace wrr``: Alg. 3) and
with locality-first routing (``grace locality``: Alg. 4, the full GRACE). "before" rows are GRACE as of commit
``BEFORE`` (below), run from that commit's sources in a subprocess: targets that had to hold the whole hot set,
node groups bounded only by memory.

Writes docs/results/grace_real.md. Run: .venv/bin/python bench/grace_real.py (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

from _common import ROOT, machine

from moebalance.app.compare import Scenario, run_comparison
from moebalance.core.cluster import LINK_PRESETS, Cluster
from moebalance.core.load import read_load
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import get_gpu
from moebalance.models import get_model
from moebalance.policies import Budget
from moebalance.pricing.goodput import price_plan
from moebalance.routing.simulate import evaluate

#: The commit whose GRACE the "before" rows run (the last one before the fixes of docs/results/grace_real.md).
BEFORE = "b33ead312bbf31b41594b5ce677ac7b161fd1a41"
TRACES = ("esft-law", "qwen3-30b-a3b-tokens")
CLUSTERS = ((1, 8), (2, 4))
GPU = "rtx4090"
#: label -> (policy, params, router)
ROWS: dict[str, tuple[str, dict[str, object], str]] = {
    "contiguous": ("contiguous", {}, "uniform"),
    "eplb": ("eplb", {}, "random"),
    "grace wrr": ("grace", {}, "wrr"),
    "grace locality": ("grace", {}, "locality"),
    "grace minmax": ("grace", {}, "minmax"),
}
GRACE_ROWS = ("grace wrr", "grace locality")
#: Rows that bound what routing can do with a plan, not a deployment: balance only.
BOUND_ROWS = ("grace minmax",)


@dataclass
class Row:
    trace: str
    cluster: str
    budget: str
    label: str
    in_sample: float
    held_out: float
    cross_node: int
    intra_node: int
    replicas: int
    allowed: int
    layer_ms: float
    a2a_ms: float
    plan_seconds: float
    #: The most experts one node's GPU groups hold in one layer (GRACE's node groups; 0 for other plans).
    largest_node: int


def _cluster(nodes: int, gpn: int) -> Cluster:
    return Cluster(num_nodes=nodes, gpus_per_node=gpn, intra_node_bandwidth=LINK_PRESETS["pcie4"],
                   inter_node_bandwidth=LINK_PRESETS["eth25"] / gpn)


def measure(labels: tuple[str, ...]) -> list[Row]:
    """Every (trace, cluster, budget) cell for the rows ``labels``, with the library as imported."""
    rows: list[Row] = []
    gpu = get_gpu(GPU)
    for name in TRACES:
        load = read_load(f"bundled:{name}")
        assert load.preset is not None
        arch = get_model(load.preset)
        deployment = Deployment(model=arch, gpu=gpu)
        hidden = arch.hidden_size
        train, _ = load.split(0.5)
        L, E = load.num_layers, load.num_experts
        for nodes, gpn in CLUSTERS:
            cluster = _cluster(nodes, gpn)
            G = cluster.num_gpus
            S = math.ceil(E / G) + 1
            for budget, allowed in ((Budget(slots_per_gpu=S), L * (S * G - E)), (Budget(replicas_per_gpu=L), L * G)):
                scenarios = [Scenario(ROWS[lab][0], budget, ROWS[lab][1], ROWS[lab][2], label=lab,
                                      plan_name=ROWS[lab][0]) for lab in labels]
                t0 = time.perf_counter()
                got, plans = run_comparison(load, cluster, scenarios, bytes_per_copy=2 * hidden,
                                            price=lambda plan, test, router, dep=deployment: price_plan(
                                                plan, test, dep, router=router))
                for sc, row in zip(scenarios, got.values(), strict=True):
                    plan = plans[ROWS[sc.label or ""][0]]
                    traffic = row.score.traffic
                    assert traffic is not None and row.price is not None
                    rows.append(Row(name, f"{nodes}x{gpn}", budget.describe(), sc.label or "",
                                    evaluate(plan, train, sc.router).balancedness, row.score.balancedness,
                                    int(traffic.inter_node), int(traffic.intra_node), plan.extra_replicas, allowed,
                                    row.price.modelled_layer_ms, row.price.modelled_a2a_ms, row.plan_seconds,
                                    max((max(n) for n in plan.params.get("node_experts") or []), default=0)))
                print(f"{name} {nodes}x{gpn} {budget.describe()}: {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr, flush=True)
    return rows


def before_rows() -> tuple[list[Row], str]:
    """GRACE's rows at commit :data:`BEFORE`, run from its sources; ``([], reason)`` where git cannot give them."""
    try:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", BEFORE, "src"], check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        return [], f"no 'before' rows: git could not give commit {BEFORE[:7]} ({exc})"
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=BytesIO(tar)) as archive:
            archive.extractall(tmp, filter="data")
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "PYTHONPATH": str(Path(tmp) / "src")}
        subprocess.run([sys.executable, __file__, "--rows-json", str(out), "--labels", *GRACE_ROWS], check=True,
                       env=env)
        rows = [Row(**r) for r in json.loads(out.read_text())]
    for r in rows:
        r.label += " (before)"
    return rows, f"'before' rows: GRACE at commit {BEFORE[:7]}, run from its sources"


def _table(rows: list[Row]) -> list[str]:
    out = ["| trace | GPUs | budget | plan | balancedness in-sample | held out | cross-node copies | "
           "intra-node cross-GPU copies | replicas (allowed) | largest node group | modelled layer time (ms) | "
           "of which all-to-all | plan time |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        node = str(r.largest_node) if r.largest_node else "-"
        out.append(f"| {r.trace} | {r.cluster} | {r.budget} | {r.label} | {r.in_sample:.3f} | {r.held_out:.3f} | "
                   f"{r.cross_node:,} | {r.intra_node:,} | {r.replicas} ({r.allowed}) | {node} | {r.layer_ms:.3f} | "
                   f"{r.a2a_ms:.3f} | {r.plan_seconds:.1f} s |")
    return out


def _span(values: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo} to {hi}"


def _cells(rows: list[Row]) -> list[tuple[str, str, str]]:
    return list(dict.fromkeys((r.trace, r.cluster, r.budget) for r in rows))


def _summary(rows: list[Row]) -> list[str]:
    """Per (trace, cluster, budget): GRACE (locality) against contiguous and against its 'before'."""
    by = {(r.trace, r.cluster, r.budget, r.label): r for r in rows}
    out = ["| trace | GPUs | budget | balancedness held out: GRACE / contiguous | GRACE vs contiguous: "
           "cross-node copies | intra-node copies | modelled layer time | GRACE before -> now: balancedness "
           "held out | replicas | largest node group |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for cell in _cells(rows):
        g, c = by[(*cell, "grace locality")], by[(*cell, "contiguous")]
        b = by.get((*cell, "grace locality (before)"))
        cross = "-" if c.cross_node == 0 else f"{g.cross_node / c.cross_node - 1:+.1%}"
        change = ("-", "-", "-") if b is None else (f"{b.held_out:.3f} -> {g.held_out:.3f}",
                                                    f"{b.replicas} -> {g.replicas} of {g.allowed}",
                                                    f"{b.largest_node} -> {g.largest_node}")
        out.append(f"| {cell[0]} | {cell[1]} | {cell[2]} | {g.held_out:.3f} / {c.held_out:.3f} | {cross} | "
                   f"{g.intra_node / c.intra_node - 1:+.1%} | {g.layer_ms / c.layer_ms - 1:+.1%} | "
                   f"{' | '.join(change)} |")
    return out


def _findings(rows: list[Row]) -> list[str]:
    by = {(r.trace, r.cluster, r.budget, r.label): r for r in rows}
    cells = _cells(rows)

    def rel(label: str, field: str, base: str = "contiguous") -> list[float]:
        return [getattr(by[(*c, label)], field) / getattr(by[(*c, base)], field) - 1 for c in cells
                if getattr(by[(*c, base)], field) > 0]

    gap = [by[(*c, "contiguous")].held_out - by[(*c, "grace locality")].held_out for c in cells]
    below = sum(x > 0 for x in gap)
    best = [by[(*c, "contiguous")].held_out - by[(*c, "grace minmax")].held_out for c in cells]
    gap_to_best = [by[(*c, "grace minmax")].held_out - by[(*c, "grace locality")].held_out for c in cells]
    lines = [f"- Balance: GRACE with locality routing is below contiguous blocks in {below} of {len(cells)} cells, by "
             f"{_span(gap)} in held-out balancedness (weighted round-robin: {_span(rel('grace wrr', 'held_out'), '{:+.0%}')}"
             f" against contiguous). The best routing of GRACE's plans (`minmax`, a bound, not a router GRACE has) is "
             f"below contiguous blocks in {sum(x > 0 for x in best)} of {len(cells)} cells (contiguous minus it: "
             f"{_span(best)}): the routing weights (Eq. 3) cost GRACE {_span(gap_to_best)} against it.",
             f"- Traffic: cross-node copies {_span(rel('grace locality', 'cross_node'), '{:+.0%}')} and intra-node "
             f"cross-GPU copies {_span(rel('grace locality', 'intra_node'), '{:+.0%}')} against contiguous blocks.",
             f"- Modelled layer time against contiguous blocks: {_span(rel('grace locality', 'layer_ms'), '{:+.0%}')} "
             f"with locality routing, {_span(rel('grace wrr', 'layer_ms'), '{:+.0%}')} with weighted round-robin "
             f"(EPLB: {_span(rel('eplb', 'layer_ms'), '{:+.0%}')})."]
    if any(r.label.endswith("(before)") for r in rows):
        now = [by[(*c, "grace locality")] for c in cells]
        old = [by[(*c, "grace locality (before)")] for c in cells]
        lines.append(f"- Against GRACE before the fixes: held-out balancedness "
                     f"{_span([n.held_out - o.held_out for n, o in zip(now, old, strict=True)], '{:+.3f}')}, "
                     f"modelled layer time {_span([n.layer_ms / o.layer_ms - 1 for n, o in zip(now, old, strict=True)], '{:+.0%}')}; "
                     f"replicas used {sum(o.replicas for o in old):,} -> {sum(n.replicas for n in now):,} of "
                     f"{sum(n.allowed for n in now):,} allowed; the largest node group on 2 x 4 GPUs "
                     f"{max(o.largest_node for o in old if o.cluster == '2x4')} -> "
                     f"{max(n.largest_node for n in now if n.cluster == '2x4')} experts.")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-json", help="write the rows as JSON here instead of the report (the 'before' run)")
    ap.add_argument("--labels", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--no-before", action="store_true", help="skip the 'before' rows")
    args = ap.parse_args()
    if args.rows_json:
        Path(args.rows_json).write_text(json.dumps([r.__dict__ for r in measure(tuple(args.labels))]))
        return
    rows = measure(tuple(ROWS))
    old, note = ([], "no 'before' rows (--no-before)") if args.no_before else before_rows()
    order = {lab: i for i, lab in enumerate([*ROWS, *(f"{g} (before)" for g in GRACE_ROWS)])}
    key = {(r.trace, r.cluster, r.budget): i for i, r in enumerate(rows)}
    rows = sorted([*rows, *old], key=lambda r: (key[(r.trace, r.cluster, r.budget)], order[r.label]))
    text = "\n".join([
        "# GRACE-MoE on real routing",
        "",
        "`bundled:esft-law` is real routing, not ours: DeepSeek's ESFT release (github.com/deepseek-ai/ESFT, "
        "commit 579a771, `results/expert_scores/law/`; arXiv:2407.01906), the law task on a "
        "DeepSeek-V2-Lite-architecture model, 26 MoE layers x 64 experts, top-6, 16 batches x 512 tokens on 8 "
        "ranks (docs/synth.md). `bundled:qwen3-30b-a3b-tokens` is our synthetic Qwen3-30B-A3B-like trace "
        "(48 x 128, top-8, 64 x 256 tokens). Planned on the first half of the batches; balancedness in-sample "
        "(that half) and held out (the second half); copies and modelled times on the held-out half. PCIe 4.0 "
        "inside a node, one 25 Gb Ethernet NIC per node (GRACE Section 5.1); modelled on RTX 4090s "
        "(`moebalance.pricing.goodput.price_plan`). Budgets: `slots_per_gpu = E / G + 1` and the same memory as "
        f"`replicas_per_gpu = L`. {note}. Machine: {machine()}.",
        "Reproduce: `.venv/bin/python bench/grace_real.py`.",
        "",
        *_table(rows),
        "",
        "## GRACE against contiguous blocks, and against itself before",
        "",
        *_summary(rows),
        "",
        *_findings(rows),
        "",
        "What changed (docs/papers/grace.md): each hot expert's copies take one free slot each on the",
        "least-loaded GPUs, instead of needing GPUs with room for the whole hot set (with one free slot per GPU,",
        "that fitted a replica only in layers where a single expert was hot); and Section 4.1's bound on",
        "GPU-group sizes uses the layer's experts per GPU in every node, so that a node holds what its GPUs may",
        "hold (before, under a replicas budget, only memory bounded a node's group). What did not change:",
        "grouping by co-activation puts experts that are hot together on one GPU, and GRACE replicates the",
        "heaviest group's hot experts only (Eq. 2), so the next-heaviest group stays the straggler.",
        "",
    ])
    print(text)
    (ROOT / "docs" / "results" / "grace_real.md").write_text(text)


if __name__ == "__main__":
    main()
