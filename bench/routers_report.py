"""What each router costs and gains on the bundled traces: balancedness, routing gap, traffic, time per layer.

For every bundled trace, a plan is made on the first half of the batches (EPLB; on token-level traces also
GRACE, whose weights ``wrr`` and ``locality`` use) and scored on the held-out half with every router. Then
Libra's rebalancer: its tolerance ``eps`` (the default's justification) and the printed pseudocode's strict
``cap > 0`` test against our reading. Checks, printed with the tables: ``rebalance`` is never below ``uniform``
and within 3% of ``minmax``'s balancedness on every trace.

Writes docs/results/routers.md and docs/results/routers.png. Run: .venv/bin/python bench/routers_report.py
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from _common import ROOT, machine

from moebalance.core.cluster import Cluster
from moebalance.core.io import save_png
from moebalance.core.load import LoadMatrix, read_load
from moebalance.core.plan import Placement
from moebalance.policies import Budget, make_plan
from moebalance.routing import ROUTERS, Router, get_router
from moebalance.routing.simulate import evaluate


@dataclass(frozen=True)
class Case:
    trace: str
    nodes: int
    gpus_per_node: int
    slots: int
    policy: str
    params: dict[str, Any]

    @property
    def label(self) -> str:
        extra = "" if not self.params else " (" + ", ".join(f"{k}={v}" for k, v in self.params.items()) + ")"
        return f"{self.trace}, {self.nodes}x{self.gpus_per_node} GPUs, {self.policy}{extra}, {self.slots} slots/GPU"


CASES = [
    Case("deepseek-v3-8x8", 8, 8, 5, "eplb", {}),
    Case("deepseek-v3-8x8", 8, 8, 5, "eplb", {"num_groups": 1}),
    Case("olmoe-1b-7b-tokens", 2, 4, 9, "eplb", {"num_groups": 1}),
    Case("olmoe-1b-7b-tokens", 2, 4, 10, "grace", {}),
    Case("qwen3-30b-a3b-tokens", 2, 4, 18, "eplb", {"num_groups": 1}),
    Case("qwen3-30b-a3b-tokens", 2, 4, 18, "grace", {}),
    Case("mixtral-8x7b-tokens", 1, 8, 2, "eplb", {"num_groups": 1}),
]
ROUTER_ORDER = ["uniform", "random", "wrr", "locality", "rebalance", "rebalance(strict=True)", "minmax"]
EPS = [0.0, 0.01, 0.02, 0.05, 0.1]


def _routers(token_level: bool) -> list[Router]:
    out = []
    for name in ROUTER_ORDER:
        if name == "locality" and not token_level:
            continue  # it needs each token's GPU
        out.append(get_router("rebalance", {"strict": True}) if name.startswith("rebalance(") else get_router(name))
    # every router but metro, which prices on a GPU and a model (its report: docs/results/decode.md)
    assert {r.name for r in out} | ({"locality"} if not token_level else set()) == set(ROUTERS) - {"metro"}
    return out


def _route_seconds(router: Router, plan: Placement, test: LoadMatrix) -> float:
    """Median seconds per (batch, layer) of the router alone (tokens when the trace has them, else counts)."""
    B, L = test.num_batches, test.num_layers
    rng = np.random.default_rng(0)
    if test.trace is not None:
        def call() -> object:
            return router.assign_tokens(plan, test.trace, rng)  # type: ignore[arg-type]
    else:
        def call() -> object:
            return router.split_counts(plan, test.counts, rng)
    call()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / (B * L)


def _fmt_us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:,.1f} us" if us < 1000 else f"{us / 1000:,.2f} ms"


def main() -> None:
    lines = [
        "# Routers on the bundled traces",
        "",
        f"Machine: {machine()}. Command: `.venv/bin/python bench/routers_report.py`.",
        "",
        "Plans are made on the first half of each trace's batches and scored on the held-out half. Balancedness is",
        "mean / max GPU load (1 is perfect); the routing gap is how far the mean straggler load exceeds what the",
        "`minmax` router achieves with the same plan and batches (0 for `minmax`); copies are the all-to-all",
        "dispatch copies of token-level traces (a token goes once to each GPU serving any of its picks). Time is",
        "the router alone per (batch, layer): on counts for `deepseek-v3-8x8` (count-level, no source GPUs: every",
        "pick is remote for `rebalance`), on tokens for the others (which also decides which token goes where).",
        "`rebalance(strict=True)` follows Libra's printed `cap = B - G[g_d] > 0` test to the letter.",
        "",
    ]
    intro = len(lines)  # the summary table goes here, once every case has run
    summary: list[tuple[str, dict[str, float]]] = []
    cells: dict[tuple[int, str], tuple[float, float, int | None, float]] = {}  # (case, router) -> numbers
    checks: list[str] = []
    eps_rows: list[str] = []
    for case in CASES:
        load = read_load(f"bundled:{case.trace}")
        train, test = load.split(0.5)
        cluster = Cluster(num_nodes=case.nodes, gpus_per_node=case.gpus_per_node)
        plan, _ = make_plan(case.policy, train, cluster, Budget(slots_per_gpu=case.slots), **case.params)
        bpc = None if load.model is None else 2 * load.model.hidden_size
        token_level = test.trace is not None
        lines += [f"## {case.label}", "", f"{plan.extra_replicas} extra replicas; held-out {test.num_batches} batches "
                  f"x {test.num_layers} layers.", ""]
        head = "| router | balancedness | routing gap | imbalance ratio |"
        if token_level:
            head += " local copies | intra-node copies | inter-node copies | all-to-all per layer |"
        head += " time per layer |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        bal: dict[str, float] = {}
        for router in _routers(token_level):
            s = evaluate(plan, test, router, bytes_per_copy=bpc, routing_gap=True)
            bal[router.label] = s.balancedness
            seconds = _route_seconds(router, plan, test)
            cells[CASES.index(case), router.label] = (s.balancedness, s.routing_gap or 0.0,
                                                       None if s.traffic is None else s.traffic.inter_node, seconds)
            row = f"| {router.label} | {s.balancedness:.4f} | {100 * (s.routing_gap or 0.0):.2f}% | {s.imbalance_ratio:.3f} |"
            if s.traffic is not None:
                t = s.traffic
                a2a = "" if t.a2a_seconds is None else f"{1e6 * float(t.a2a_seconds.mean()):.1f} us"
                row += f" {t.local:,} | {t.intra_node:,} | {t.inter_node:,} | {a2a} |"
            row += f" {_fmt_us(seconds)} |"
            lines.append(row)
        lines.append("")
        summary.append((case.label, bal))
        ok_uniform = bal["rebalance"] >= bal["uniform"]
        ok_minmax = bal["rebalance"] >= 0.97 * bal["minmax"]
        checks.append(f"| {case.label} | {bal['uniform']:.4f} | {bal['rebalance']:.4f} | {bal['minmax']:.4f} | "
                      f"{100 * (bal['rebalance'] / bal['minmax'] - 1):+.2f}% | "
                      f"{'yes' if ok_uniform and ok_minmax else 'NO'} |")
        if case.policy == "eplb":
            for eps in EPS:
                r = get_router("rebalance", {"eps": eps})
                s = evaluate(plan, test, r)
                eps_rows.append(f"| {case.label} | {eps:g} | {s.balancedness:.4f} | {s.imbalance_ratio:.3f} | "
                                f"{_fmt_us(_route_seconds(r, plan, test))} |")

    lines[intro:intro] = _summary(cells)
    lines += [
        "## Acceptance: `rebalance` against `uniform` and `minmax`",
        "",
        "| setting | uniform | rebalance | minmax | rebalance vs minmax | never below uniform, within 3% of minmax |",
        "|---|---|---|---|---|---|",
        *checks,
        "",
        "## Libra's tolerance `eps`",
        "",
        "Alg. 2 stops once the busiest GPU is within `(1 + eps)` of the mean. A positive `eps` gives up balance for",
        "little time: the loop usually ends because no move is left, not because the tolerance is met. Hence the",
        "default `eps = 0` (run until no beneficial move is left).",
        "",
        "| setting | eps | balancedness | imbalance ratio | time per layer |",
        "|---|---|---|---|---|",
        *eps_rows,
        "",
        "![balancedness per router](routers.png)",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "docs" / "results" / "routers.md"
    out.write_text(text)
    _plot(summary, ROOT / "docs" / "results" / "routers.png")


#: The two settings of the summary table (README): counts on 64 GPUs, tokens on 2 x 4 GPUs.
SUMMARY = (1, 4)


def _summary(cells: dict[tuple[int, str], tuple[float, float, int | None, float]]) -> list[str]:
    """A short table of both summary settings, router by router (the README quotes it)."""
    a, b = SUMMARY
    out = [
        "## Summary",
        "",
        f"Counts: {CASES[a].label}. Tokens: {CASES[b].label}.",
        "",
        "| router | counts: balancedness | routing gap | time per layer | tokens: balancedness | routing gap | "
        "inter-node copies | time per layer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ROUTER_ORDER:
        row = f"| {name} |"
        for case in (a, b):
            if (case, name) not in cells:
                row += " - | - | - |" if case == a else " - | - | - | - |"
                continue
            bal, gap, inter, sec = cells[case, name]
            row += f" {bal:.4f} | {100 * gap:.1f}% |"
            if case == b:
                row += f" {inter:,} |"
            row += f" {_fmt_us(sec)} |"
        out.append(row)
    return [*out, ""]


def _plot(summary: list[tuple[str, dict[str, float]]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.2), dpi=110)
    width = 0.8 / len(ROUTER_ORDER)
    for j, name in enumerate(ROUTER_ORDER):
        xs = [i + (j - len(ROUTER_ORDER) / 2 + 0.5) * width for i, (_, bal) in enumerate(summary) if name in bal]
        ys = [bal[name] for _, bal in summary if name in bal]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(summary)))
    ax.set_xticklabels([label.replace(", ", "\n", 2) for label, _ in summary], fontsize=7)
    lo = min(min(b.values()) for _, b in summary)
    ax.set_ylim(max(0.0, lo - 0.05), 1.0)
    ax.set_ylabel("balancedness (mean / max GPU load)")
    ax.set_title("Routers on the bundled traces, held-out batches (higher is better)")
    ax.legend(ncol=4, fontsize=8, loc="lower right")
    save_png(fig, path)


if __name__ == "__main__":
    main()
