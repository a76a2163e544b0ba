"""Tables and plots a person can read at a glance: terminal (rich), Markdown, JSON and PNG."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.table import Table

from moebalance.core.io import save_png
from moebalance.pricing.goodput import PlanPrice
from moebalance.routing.simulate import Score

__all__ = ["ComparisonRow", "budget_notes", "comparison_markdown", "comparison_table", "plot_per_layer",
           "plot_sweep", "score_table", "sweep_markdown", "sweep_table"]


@dataclass(frozen=True, slots=True)
class ComparisonRow:
    """One policy's line in a comparison."""

    policy: str
    score: Score
    plan_seconds: float
    warnings: tuple[str, ...] = ()
    #: The plan's modelled memory, time and goodput on the held-out batches (``compare --gpu``), if asked for.
    price: PlanPrice | None = None
    #: How the policy read the budget when it could not take it as given (the plan's ``budget_note``), or None.
    budget_note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = self.score.as_dict()
        d.pop("traffic_matrix", None)
        extra = {} if self.price is None else {"cost": self.price.as_dict()}
        note = {} if self.budget_note is None else {"budget_note": self.budget_note}
        return {"policy": self.policy, "plan_seconds": round(self.plan_seconds, 6), **d,
                "warnings": list(self.warnings), **note, **extra}


_COLUMNS = ("policy", "extra replicas", "balancedness", "imbalance ratio", "gap to bound", "routing gap", "plan time")


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _cells(row: ComparisonRow) -> list[str]:
    s = row.score
    cells = [row.policy, f"{s.extra_replicas}", f"{s.balancedness:.4f}", f"{s.imbalance_ratio:.3f}",
             _percent(s.lower_bound_gap), _percent(s.routing_gap), f"{1000 * row.plan_seconds:.1f} ms"]
    if s.traffic is not None:
        t = s.traffic
        cells += [f"{t.inter_node / 1e3:,.1f}k", f"{t.intra_node / 1e3:,.1f}k"]
        if t.a2a_seconds is not None:
            cells.append(f"{1e6 * float(t.a2a_seconds.mean()):.1f} us")
    if row.price is not None:
        c = row.price
        cells += [f"{c.memory.kv_cache_gb_per_gpu:.1f} GiB -{100 * c.memory.kv_cache_reduction:.0f}%",
                  f"{c.modelled_layer_ms:.3f} ms", f"{c.modelled_goodput:,.0f}"]
    return cells


def _columns(rows: Sequence[ComparisonRow]) -> list[str]:
    cols = list(_COLUMNS)
    if rows and rows[0].score.traffic is not None:
        cols += ["inter-node copies", "intra-node copies"]
        if rows[0].score.traffic.a2a_seconds is not None:
            cols.append("all-to-all per layer")
    if rows and rows[0].price is not None:
        cols += ["KV cache per GPU", "modelled layer", "modelled goodput tok/s"]
    return cols


def budget_notes(rows: Sequence[ComparisonRow]) -> tuple[list[int | None], list[str]]:
    """``(note number of each row or None, the notes)``: rows whose plan read the budget differently than given
    (``budget_note``) point to a numbered line under the table, so no budget changes silently."""
    numbers: list[int | None] = []
    lines: list[str] = []
    seen: dict[str, int] = {}
    for r in rows:
        if r.budget_note is None:
            numbers.append(None)
            continue
        if r.budget_note not in seen:
            seen[r.budget_note] = len(seen) + 1
            lines.append(f"budget note {seen[r.budget_note]} ({r.policy}): {r.budget_note}")
        numbers.append(seen[r.budget_note])
    return numbers, lines


def _noted(cells: list[str], number: int | None) -> list[str]:
    return cells if number is None else [f"{cells[0]} (budget note {number})", *cells[1:]]


def comparison_table(rows: Sequence[ComparisonRow], title: str) -> Table:
    """The rows as a terminal table; rows with a budget note name it, and the notes are the table's caption."""
    numbers, notes = budget_notes(rows)
    table = Table(title=title, title_justify="left", caption="\n".join(notes) or None, caption_justify="left")
    for i, col in enumerate(_columns(rows)):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=i == 0)
    best = max(r.score.balancedness for r in rows) if rows else 0.0
    for r, number in zip(rows, numbers, strict=True):
        cells = _noted(_cells(r), number)
        if r.score.balancedness == best:
            cells[2] = f"[bold green]{cells[2]}[/]"
        table.add_row(*cells)
    return table


def comparison_markdown(rows: Sequence[ComparisonRow], title: str, notes: Sequence[str] = ()) -> str:
    cols = _columns(rows)
    numbers, budget = budget_notes(rows)
    lines = [f"# {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_noted(_cells(r), n)) + " |" for r, n in zip(rows, numbers, strict=True)]
    if budget:
        lines += ["", *(f"- {line}" for line in budget)]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def score_table(score: Score, title: str) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("balancedness (mean/max)", f"{score.balancedness:.4f}")
    table.add_row("imbalance ratio (max/mean)", f"{score.imbalance_ratio:.3f}")
    table.add_row("gap to lower bound", f"{100 * score.lower_bound_gap:.1f}%")
    table.add_row("routing gap (straggler vs the minmax router)", _percent(score.routing_gap))
    table.add_row("mean straggler load (tokens)", f"{score.mean_max_load:.1f}")
    table.add_row("GPU idle, sum over GPUs (tokens)", f"{score.gpu_idle:.1f}")
    table.add_row("std of GPU load (tokens)", f"{score.load_std:.1f}")
    table.add_row("extra replicas", f"{score.extra_replicas}")
    table.add_row("max slots per GPU", f"{score.max_slots_per_gpu}")
    worst = np.nanargmin(score.per_layer_balancedness) if np.any(np.isfinite(score.per_layer_balancedness)) else 0
    table.add_row("worst layer", f"{worst} ({score.per_layer_balancedness[worst]:.3f})")
    options = "".join(f" {k}={v}" for k, v in (score.router_params or {}).items())
    table.add_row("batches scored / router", f"{score.num_batches} / {score.router}{options}")
    if score.traffic is not None:
        t = score.traffic
        table.add_row("dispatch copies local", f"{t.local:,}")
        table.add_row("dispatch copies intra-node", f"{t.intra_node:,}")
        table.add_row("dispatch copies inter-node", f"{t.inter_node:,}")
        table.add_row("inter-node, once per node", f"{t.inter_node_dedup:,}")
        if t.a2a_seconds is not None and t.a2a_seconds.size:
            table.add_row("all-to-all per layer (dispatch + combine)", f"{1e6 * float(t.a2a_seconds.mean()):.1f} us")
    return table


def plot_per_layer(rows: Sequence[ComparisonRow], path: str | os.PathLike[str], title: str) -> None:
    """PNG of per-layer balancedness, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4), dpi=110)
    for r in rows:
        y = r.score.per_layer_balancedness
        ax.plot(np.arange(y.size), y, marker="o", markersize=2.5, linewidth=1.2,
                label=f"{r.policy} (mean {r.score.balancedness:.3f})")
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("balancedness (mean / max GPU load)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(textwrap.fill(title, 110), fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    save_png(fig, path)


def sweep_markdown(points: Sequence[Any], title: str) -> str:
    """Markdown table of sweep points (``moebalance.app.sweep.SweepPoint``)."""
    costed = bool(points) and points[0].goodput is not None
    lines = [f"# {title}", "", "| policy | R (extra slots per GPU) | extra replicas | balancedness | imbalance ratio | "
             "gain over placement only |" + (" KV cache GiB per GPU | modelled goodput tok/s |" if costed else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if costed else "")]
    lines += [f"| {p.policy} | {p.replicas_per_gpu} | {p.extra_replicas} | {p.balancedness:.4f} | "
              f"{p.imbalance_ratio:.3f} | {p.gain:+.4f} |" + (f" {p.kv_cache_gb:.2f} | {p.goodput:,.0f} |" if costed else "")
              for p in points]
    return "\n".join(lines) + "\n"


def sweep_table(points: Sequence[Any], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    costed = bool(points) and points[0].goodput is not None
    for col in ("policy", "R", "extra replicas", "balancedness", "imbalance ratio", "gain",
                *(("KV cache/GPU", "goodput tok/s") if costed else ())):
        table.add_column(col, justify="left" if col == "policy" else "right")
    best = max((p.goodput for p in points if p.goodput is not None), default=None)
    for p in points:
        cells = [p.policy, str(p.replicas_per_gpu), str(p.extra_replicas), f"{p.balancedness:.4f}",
                 f"{p.imbalance_ratio:.3f}", f"{p.gain:+.4f}"]
        if costed:
            cells += [f"{p.kv_cache_gb:.2f} GiB", f"[bold green]{p.goodput:,.0f}[/]" if p.goodput == best
                      else f"{p.goodput:,.0f}"]
        table.add_row(*cells)
    return table


def plot_sweep(points: Sequence[Any], path: str | os.PathLike[str], title: str, num_layers: int,
               num_gpus: int) -> None:
    """PNG: held-out balancedness against the extra replicas per GPU each plan uses, one line per policy
    (CRAFT Figures 1 and 8)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    markers = {"craft": "o", "craft-uniform": "s", "eplb": "^", "greedy": "x", "contiguous": "+"}
    for policy in dict.fromkeys(p.policy for p in points):
        pts = sorted({(p.extra_replicas / num_gpus, p.balancedness) for p in points if p.policy == policy})
        xs, ys = zip(*pts, strict=True)
        # EPLB's equal slots exist only at multiples of L replicas per GPU: points, not a line between them
        ax.plot(xs, ys, marker=markers.get(policy, "o"), linewidth=0 if policy == "eplb" else 1.4, label=policy)
    eplb_min = [p for p in points if p.policy == "eplb" and p.replicas_per_gpu == num_layers]
    if eplb_min:
        ax.scatter([eplb_min[0].extra_replicas / num_gpus], [eplb_min[0].balancedness], s=140, marker="x",
                   color="black", zorder=5, label=f"EPLB minimum uniform replication (R = L = {num_layers})")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("extra expert replicas per GPU used by the plan (symlog)")
    ax.set_ylabel("held-out balancedness (mean / max)")
    ax.grid(alpha=0.3)
    ax.set_title(textwrap.fill(title, 100), fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    save_png(fig, path)
