"""``moebalance online``'s table, Markdown and plot: one row or line per replayed policy, with the modelled prefetch
(``--model``) when it was asked for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from rich.table import Table

from moebalance.core.io import save_png
from moebalance.online.replay import OnlineResult

__all__ = ["online_label", "online_markdown", "online_table", "plot_online"]

_COLUMNS = ("policy", "router", "mean imbalance", "max imbalance", "balancedness", "experts moved / batch",
            "replica slots / GPU", "prediction accuracy")
_PREFETCH = ("prefetch GiB / batch", "prefetch ms / GPU and layer")


def online_label(r: OnlineResult) -> str:
    """A result's row label: the policy with its predictor or re-plan schedule."""
    p = r.params
    if r.policy == "libra":
        return f"libra ({p['predictor']}, n={p['n']}, alpha={p['alpha']})"
    if r.replans:
        return f"{r.policy} (every {p['replan_every']} on {p['window']})"
    return r.policy


def _cells(r: OnlineResult, prefetch: Mapping[str, float] | None) -> list[str]:
    acc = r.prediction_accuracy
    cells = [online_label(r), r.router, f"{r.mean_imbalance_ratio:.3f}", f"{float(np.max(r.per_batch_imbalance)):.3f}",
             f"{r.balancedness:.4f}", f"{r.experts_moved:.1f}", f"{r.replica_slots_per_gpu:g}",
             "-" if acc is None else f"{acc:.3f}"]
    if prefetch is not None:
        cells += [f"{prefetch['gb_per_batch']:.3f}", f"{prefetch['mean_ms_per_gpu_and_layer']:.3f}"]
    return cells


def _columns(prefetch: Sequence[Mapping[str, float] | None]) -> tuple[str, ...]:
    return _COLUMNS + (_PREFETCH if prefetch and prefetch[0] is not None else ())


def online_table(results: Sequence[OnlineResult], title: str,
                 prefetch: Sequence[Mapping[str, float] | None] | None = None) -> Table:
    """``prefetch[i]``: result ``i``'s modelled prefetch (``gb_per_batch``, ``mean_ms_per_gpu_and_layer``)."""
    costs = list(prefetch) if prefetch is not None else [None] * len(results)
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(_columns(costs)):
        table.add_column(col, justify="left" if i < 2 else "right", no_wrap=i == 0)
    for r, c in zip(results, costs, strict=True):
        table.add_row(*_cells(r, c))
    return table


def online_markdown(results: Sequence[OnlineResult], title: str,
                    prefetch: Sequence[Mapping[str, float] | None] | None = None) -> str:
    costs = list(prefetch) if prefetch is not None else [None] * len(results)
    cols = _columns(costs)
    lines = [f"# Online replay\n\n{title}.\n", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cells(r, c)) + " |" for r, c in zip(results, costs, strict=True)]
    lines += ["", "Imbalance ratio: the busiest GPU's load over the mean, per layer, averaged over a batch's layers "
              "(1 is perfect). Replica slots per GPU: extra expert slots summed over layers (a static plan), or the "
              "base's plus the prefetch buffer's 2n (libra)."]
    if costs and costs[0] is not None:
        lines += ["", "Prefetch: the expert weights each served batch loads (GiB, all GPUs), and the milliseconds a "
                  "GPU loading the mean share spends per layer over the intra-node link."]
    lines += ["", "![imbalance per batch](online.png)", ""]
    return "\n".join(lines)


def plot_online(results: Sequence[OnlineResult], path: Path, title: str) -> None:
    """One line per policy: the imbalance ratio of every served batch (Libra Figure 9's lower panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    for r in results:
        ax.plot(r.batches, r.per_batch_imbalance, linewidth=1.3, marker="o", markersize=2.5,
                label=f"{online_label(r)}, {r.router}: mean {r.mean_imbalance_ratio:.3f}, "
                      f"{r.replica_slots_per_gpu:g} slots/GPU")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("batch")
    ax.set_ylabel("imbalance ratio (max / mean GPU load)")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_png(fig, path)
