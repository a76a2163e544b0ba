"""``moebalance sweep``: held-out balancedness against extra replicas per GPU (CRAFT Figures 1 and 8)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from moebalance.app import deployment, options
from moebalance.app.console import out, progress
from moebalance.app.report import plot_sweep, sweep_markdown, sweep_table
from moebalance.app.sweep import SWEEP_ALIASES, SWEEP_POLICIES, canonical, sweep, sweep_keys, sweep_steps
from moebalance.core.errors import InputError
from moebalance.core.io import atomic_dir, atomic_write_text, check_out_dir, dumps

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("sweep", help="balancedness against extra replicas per GPU (CRAFT Figures 1 and 8)")
    p.add_argument("--load", action=options.OneLoad, required=True)
    aliases = ", ".join(f"{a} is read as {n}" for a, n in SWEEP_ALIASES.items())
    p.add_argument("--policies", default="eplb,craft",
                   help=f"from {', '.join(SWEEP_POLICIES)} (craft-uniform: the same replicas in every layer, CRAFT's "
                        f"uniform-replication baseline; {aliases})")
    p.add_argument("--replicas-per-gpu", default="0,1,2,4,8,16,32", help="comma-separated R values")
    options.add_cluster(p)
    options.add_set(p)
    p.add_argument("--train-frac", type=float, default=0.5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out-dir", help="write sweep.md, sweep.json and sweep.png here")
    options.add_model(p)
    p.add_argument("--seed", type=options.non_negative, default=0)
    deployment.add(p, gpu_required=False)
    options.add_links(p)
    options.add_format(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    if args.out_dir:
        check_out_dir(args.out_dir)
    policies = canonical([p.strip() for p in args.policies.split(",") if p.strip()])
    try:
        replicas = [int(r) for r in args.replicas_per_gpu.split(",") if r.strip()]
    except ValueError:
        raise InputError(f"--replicas-per-gpu {args.replicas_per_gpu!r} must be integers like 0,1,2,4,8") from None
    first = [] if args.groups is None else [("--groups", "num_groups", args.groups)]
    params = options.resolve_set(args.set, policies, first=first, keys=sweep_keys)
    cluster = options.cluster(args)
    raw = options.read_load(args, model=False)
    load = options.load_model(raw, args.model)
    if args.gpu is None and options.links(args):  # a sweep scores balance only, unless the cost model runs
        raise InputError("--intra-link and --inter-link are used by sweep only with --gpu (the cost model); drop them")
    priced = deployment.price_fn(deployment.from_args(args, load), args.seed)
    with progress() as bar:
        task = bar.add_task("sweep", total=sweep_steps(load, cluster, policies, replicas, params))
        result = sweep(load, cluster, policies, replicas, train_frac=args.train_frac, params=params,
                       on_step=lambda: bar.advance(task),
                       price=None if priced is None else (lambda plan, test: priced(plan, test, "uniform")))
    points = result.points
    train, test = load.split(args.train_frac)
    title = (f"{load.preset or Path(args.load).name}: {load.num_layers} layers x {load.num_experts} experts on "
             f"{args.nodes}x{args.gpus_per_node} GPUs, planned on {train.num_batches} batches, scored on "
             f"{test.num_batches}{' held-out' if args.train_frac < 1 else ''}; gain over placement-only greedy"
             + ("" if args.gpu is None else f"; modelled on {args.gpu}"))
    doc = {"title": title, "points": [p.as_dict() for p in points], "skipped": result.skipped}
    skipped_md = "".join(f"\nSkipped: {note}\n" for note in result.skipped)
    if args.out_dir:
        with atomic_dir(args.out_dir) as d:  # all of the folder or none of it (docs/design.md, "Errors")
            atomic_write_text(d / "sweep.md", sweep_markdown(points, title) + skipped_md + "\n![sweep](sweep.png)\n")
            atomic_write_text(d / "sweep.json", dumps(doc))
            plot_sweep(points, d / "sweep.png", title, load.num_layers, cluster.num_gpus)
    if args.json:
        sys.stdout.write(dumps(doc))
        return
    out.print(sweep_table(points, title))
    for note in result.skipped:
        out.print(f"skipped {note}")
    if args.out_dir:
        out.print(f"wrote {args.out_dir}/sweep.md, sweep.json and sweep.png")
