"""``moebalance demo``: every policy on bundled DeepSeek-V3-like data, then traffic on a token-level trace (the
comparisons are data in :mod:`moebalance.app.demo`)."""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from moebalance.app.compare import (
    COMPARISON_FILES,
    Comparison,
    comparison_title,
    emit_comparison,
    run_scenarios,
)
from moebalance.app.console import out
from moebalance.app.demo import DEMO, intro
from moebalance.app.html_report import compare_report
from moebalance.core.io import atomic_dir, check_out_dir
from moebalance.core.load import read_load
from moebalance.routing import get_router

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="compare every policy on bundled DeepSeek-V3-like data")
    p.add_argument("--out-dir", default="demo-out")
    p.set_defaults(func=run)


def _part(heading: str, comparison: Comparison, dest: Path | None, final: Path | None) -> None:
    """Run one part of the demo and print it; with ``dest`` write its files there (``final``: the folder they are
    read from once the out-dir is in place, which the report's commands name)."""
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
    report = [] if dest is None else [("report.html", lambda: compare_report(
        rows, plans, comparison.scenarios, load.split(comparison.train_frac)[1], title, seed=comparison.seed,
        folder=final, load_args=["--load", comparison.load], heading="moebalance demo").write(dest / "report.html"))]
    emit_comparison(shown, plans, title, None if dest is None else str(dest), False, comparison.notes(rows), report)


def run(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    final = None if args.out_dir is None else Path(args.out_dir)
    if final is not None:
        check_out_dir(final)
    # every part into one temporary folder, put in place at the end: all of it or none (docs/design.md, "Errors")
    with nullcontext(None) if final is None else atomic_dir(final) as tmp:
        for heading, comparison, folder in DEMO:
            _part(heading, comparison, None if tmp is None else tmp / folder,
                  None if final is None else final / folder)
    if final is not None:
        folders = [str(final / folder) for _, _, folder in DEMO]
        out.print(f"wrote {', '.join(folders)}: {COMPARISON_FILES} in each", markup=False)
    out.print(f"Done in {time.perf_counter() - t0:.1f} s. Try: moebalance stats --load <file>, "
              "moebalance synth --help, moebalance compare --help.")
