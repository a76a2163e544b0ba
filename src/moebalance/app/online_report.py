"""``moebalance online``'s table, Markdown and plots: one row or line per replayed policy, with the modelled prefetch
(``--model``) and the served batches' step time (``--gpu``, rows sorted by tokens per second) when they were asked
for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from moebalance.core.io import save_png
from moebalance.online.replay import OnlineResult

__all__ = ["failure_notes", "online_label", "online_markdown", "online_table", "plot_online", "plot_online_time"]

_COLUMNS = ("policy", "router", "mean imbalance", "max imbalance", "balancedness", "experts moved / batch",
            "replica slots / GPU", "prediction accuracy")
_PREFETCH = ("prefetch GiB / batch", "prefetch ms / GPU and layer")
_TIME = ("step ms mean", "step ms p99", "tokens / s", "moved GiB", "exposed ms")


def online_label(r: OnlineResult) -> str:
    """A result's row label: the policy with its predictor or re-plan schedule."""
    p = r.params
    if r.policy == "libra":
        return f"libra ({p['predictor']}, n={p['n']}, alpha={p['alpha']})"
    label = r.policy
    if "replan_every" in p:
        how = f", {p['migration']}" if "migration" in p else ""
        label = f"{r.policy} (every {p['replan_every']} on {p['window']}{how})"
    return label


def failure_notes(results: Sequence[OnlineResult]) -> list[str]:
    """One line per policy and ``--fail`` batch: the stall, the batches until balance is back, the balance after."""
    lines = []
    for r in results:
        for f in r.failures:
            stall = "not priced (give --gpu)" if f["stall_ms"] is None else f"{f['stall_ms']:,.1f} ms"
            back = ("never back within 2% of its level before" if f["recovery_batches"] is None and
                    f["imbalance_before"] is not None else "no batch before it to compare" if f["recovery_batches"]
                    is None else f"back within 2% of its level before after {f['recovery_batches']} batch(es)")
            gpus = ", ".join(str(g) for g in f["gpus"])
            lines.append(f"{online_label(r)}: GPU {gpus} lost at batch {f['batch']}: stall {stall}, "
                         f"{f['reloaded_experts']} experts reloaded, {back}; after it mean imbalance "
                         f"{f['mean_imbalance_after']:.3f}, balancedness {f['balancedness_after']:.4f}")
    return lines


def _cells(r: OnlineResult, prefetch: Mapping[str, float] | None) -> list[str]:
    acc = r.prediction_accuracy
    cells = [online_label(r), r.router, f"{r.mean_imbalance_ratio:.3f}", f"{float(np.max(r.per_batch_imbalance)):.3f}",
             f"{r.balancedness:.4f}", f"{r.experts_moved:.1f}", f"{r.replica_slots_per_gpu:g}",
             "-" if acc is None else f"{acc:.3f}"]
    if prefetch is not None:
        cells += [f"{prefetch['gb_per_batch']:.3f}", f"{prefetch['mean_ms_per_gpu_and_layer']:.3f}"]
    t = r.time
    if t is not None:
        cells += [f"{t['step_ms_mean']:.3f}", f"{t['step_ms_p99']:.3f}", f"{t['tokens_per_s']:,.0f}",
                  f"{t['moved_gib']:.3f}", f"{t['exposed_balancing_ms']:.3f}"]
    return cells


def _columns(results: Sequence[OnlineResult], prefetch: Sequence[Mapping[str, float] | None]) -> tuple[str, ...]:
    timed = bool(results) and results[0].time is not None
    return _COLUMNS + (_PREFETCH if prefetch and prefetch[0] is not None else ()) + (_TIME if timed else ())


def _rows(results: Sequence[OnlineResult],
          prefetch: Sequence[Mapping[str, float] | None] | None) -> list[tuple[OnlineResult, Mapping[str, float] | None]]:
    """``(result, its prefetch)`` in the table's order: fastest first when priced in time, else as given."""
    costs = list(prefetch) if prefetch is not None else [None] * len(results)
    rows = list(zip(results, costs, strict=True))
    if rows and all(r.time is not None for r, _ in rows):
        rows.sort(key=lambda rc: -float(rc[0].time["tokens_per_s"]) if rc[0].time is not None else 0.0)
    return rows


def online_table(results: Sequence[OnlineResult], title: str,
                 prefetch: Sequence[Mapping[str, float] | None] | None = None) -> Table:
    """``prefetch[i]``: result ``i``'s modelled prefetch (``gb_per_batch``, ``mean_ms_per_gpu_and_layer``)."""
    rows = _rows(results, prefetch)
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(_columns(results, [c for _, c in rows])):
        table.add_column(col, justify="left" if i < 2 else "right", no_wrap=i == 0)
    for r, c in rows:
        table.add_row(*_cells(r, c))
    return table


def online_markdown(results: Sequence[OnlineResult], title: str,
                    prefetch: Sequence[Mapping[str, float] | None] | None = None) -> str:
    rows = _rows(results, prefetch)
    costs = [c for _, c in rows]
    cols = _columns(results, costs)
    lines = [f"# Online replay\n\n{title}.\n", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cells(r, c)) + " |" for r, c in rows]
    lines += ["", "Imbalance ratio: the busiest GPU's load over the mean, per layer, averaged over a batch's layers "
              "(1 is perfect). Replica slots per GPU: extra expert slots summed over layers (a static plan), or the "
              "base's plus the prefetch buffer's 2n (libra)."]
    if costs and costs[0] is not None:
        lines += ["", "Prefetch: the expert weights each served batch loads (GiB, all GPUs), and the milliseconds a "
                  "GPU loading the mean share spends per layer over the intra-node link."]
    timed = bool(results) and results[0].time is not None
    if timed:
        lines += ["", "Step time: each served batch modelled as a forward step on the GPU given (the slowest GPU's "
                  "experts and the all-to-all per layer, the rest of the model, and what balancing exposes: a "
                  "re-plan's stall, a prefetch that does not fit under the layer before); rows by tokens per second. "
                  "Moved GiB: expert weights received, all GPUs and batches."]
    notes = failure_notes(results)
    if notes:
        lines += ["", "Failures (balance over the surviving GPUs):", ""] + [f"- {n}" for n in notes]
    lines += ["", "![imbalance per batch](online.png)", ""]
    if timed:
        lines += ["![step time per batch](online_time.png)", ""]
    return "\n".join(lines)


def plot_online(results: Sequence[OnlineResult], path: Path, title: str) -> None:
    """One line per policy: the imbalance ratio of every served batch (Libra Figure 9's lower panel)."""
    lines = [(r.batches, r.per_batch_imbalance, f"{online_label(r)}, {r.router}: mean {r.mean_imbalance_ratio:.3f}, "
              f"{r.replica_slots_per_gpu:g} slots/GPU") for r in results]
    _plot_per_batch(lines, path, title, "imbalance ratio (max / mean GPU load)", reference=1.0)


def plot_online_time(results: Sequence[OnlineResult], path: Path, title: str) -> None:
    """One line per policy priced in time: the modelled step time of every served batch."""
    lines = [(r.batches, r.time["per_batch_step_ms"], f"{online_label(r)}, {r.router}: "
              f"{r.time['tokens_per_s']:,.0f} tokens/s, exposed {r.time['exposed_balancing_ms']:.1f} ms")
             for r in results if r.time is not None]
    _plot_per_batch(lines, path, title, "modelled step time (ms)")


def _plot_per_batch(lines: Sequence[tuple[Any, Any, str]], path: Path, title: str, ylabel: str,
                    reference: float | None = None) -> None:
    """One line per ``(batches, values, label)`` against the served batch, saved as PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    for x, y, label in lines:
        ax.plot(x, y, linewidth=1.3, marker="o", markersize=2.5, label=label)
    if reference is not None:
        ax.axhline(reference, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("batch")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_png(fig, path)
