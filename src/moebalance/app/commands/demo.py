"""``moebalance demo``: every policy on bundled DeepSeek-V3-like data, then traffic on a token-level trace (the
comparisons are data in :mod:`moebalance.app.demo`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from moebalance.app.compare import comparison_title, emit_comparison, run_scenarios
from moebalance.app.console import out
from moebalance.app.demo import DEMO, intro
from moebalance.core.load import read_load
from moebalance.routing import get_router

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="compare every policy on bundled DeepSeek-V3-like data")
    p.add_argument("--out-dir", default="demo-out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    for heading, comparison, folder in DEMO:
        load = read_load(comparison.load)
        out.rule(f"[bold]{heading}[/]")
        for line in intro(comparison, load):
            out.print(line)
        rows, plans = run_scenarios(load, comparison.cluster, comparison.scenarios, comparison.train_frac,
                                    comparison.seed)
        shown = [rows[sc.key] for sc in comparison.scenarios if sc.shown]
        routers = {get_router(sc.router).label for sc in comparison.scenarios if sc.shown}
        title = comparison_title(load, comparison.load, comparison.cluster, comparison.scenarios[0].budget,
                                 comparison.train_frac, routers.pop() if len(routers) == 1 else "per row")
        out_dir = None if args.out_dir is None else str(Path(args.out_dir) / folder)
        emit_comparison(shown, plans, title, out_dir, False, comparison.notes(rows))
    out.print(f"Done in {time.perf_counter() - t0:.1f} s. Try: moebalance stats --load <file>, "
              "moebalance synth --help, moebalance compare --help.")
