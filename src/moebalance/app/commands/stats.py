"""``moebalance stats``: per-layer skew of a load, and token-level statistics of a trace."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
from rich.table import Table

from moebalance.app import options
from moebalance.app.console import out
from moebalance.core.io import dumps
from moebalance.core.load import LoadMatrix
from moebalance.workloads import stats
from moebalance.workloads.stats import LayerSkew, layer_skew

__all__ = ["add_parser", "run", "stats_table"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("stats", help="per-layer skew of a load or trace")
    p.add_argument("--load", action=options.OneLoad, required=True)
    p.add_argument("--json", action="store_true")
    options.add_format(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    load = options.read_load(args)
    skew = layer_skew(load.counts)
    if args.json:
        doc = {k: np.asarray(getattr(skew, k)).tolist() for k in ("peak_to_mean", "top2_share", "cv", "drift",
                                                                   "hot_experts", "high_skew")}
        dense = np.flatnonzero(load.counts.sum(axis=(0, 2)) == 0).tolist()
        ids = None if load.layer_ids is None else load.layer_ids.tolist()
        sys.stdout.write(dumps({"shape": list(load.counts.shape), "preset": load.preset, "dense_layers": dense,
                                "layer_ids": ids, **doc}))
        return
    out.print(stats_table(load, skew))
    _print_trace_stats(load)


def stats_table(load: LoadMatrix, skew: LayerSkew) -> Table:
    B, L, E = load.counts.shape
    title = (f"{load.preset or 'load'}: {B} batches x {L} layers x {E} experts; "
             f"{int(np.sum(skew.high_skew))} of {L} layers high-skew (peak/mean > 10, CRAFT)")
    table = Table(title=title, title_justify="left")
    for col in ("layer", "peak/mean", "top-2 share", "CV", "batch drift", "hot experts", ""):
        table.add_column(col, justify="right")
    ptm = np.asarray(skew.peak_to_mean)
    scale = max(float(np.nanmax(ptm)), 1.0)
    dense = load.counts.sum(axis=(0, 2)) == 0
    for layer in range(L):
        if dense[layer]:  # no token reached an expert: a dense layer in the model's numbering (scores skip it)
            table.add_row(str(layer), "-", "-", "-", "-", "-", "[dim]dense (no load)[/]")
            continue
        bar = "█" * max(1, round(20 * float(ptm[layer]) / scale))
        table.add_row(str(layer if load.layer_ids is None else int(load.layer_ids[layer])), f"{ptm[layer]:.1f}",
                      f"{100 * skew.top2_share[layer]:.1f}%", f"{skew.cv[layer]:.2f}", f"{skew.drift[layer]:.3f}",
                      str(int(skew.hot_experts[layer])), f"[red]{bar}[/]" if skew.high_skew[layer] else bar)
    return table


def _print_trace_stats(load: LoadMatrix) -> None:
    if load.trace is None:
        return
    tr = load.trace
    if tr.num_tokens == 0:
        out.print("token-level: the trace holds no tokens")
        return
    num_gpus = int(tr.src_gpu.max()) + 1
    loc = stats.locality(tr.topk_ids, tr.src_gpu, tr.num_experts)
    co = stats.coactivation_strength(tr.topk_ids, tr.num_experts)
    xl = stats.transition_strength(tr.topk_ids, tr.num_experts)
    out.print(f"token-level: {tr.num_tokens:,} tokens on {num_gpus} GPUs, top-{tr.top_k}; "
              f"per-GPU demand vs global (locality) {float(np.mean(loc)):.3f}; co-activation MI "
              f"{float(np.mean(co)):.3f} bits; cross-layer MI {float(np.mean(xl)) if np.size(xl) else 0.0:.3f} bits")
