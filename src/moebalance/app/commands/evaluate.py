"""``moebalance evaluate``: score a plan (moebalance's or an engine's placement file) by replaying a load."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from moebalance.app import deployment, options
from moebalance.app.console import err, out, progress
from moebalance.app.report import score_table
from moebalance.core.io import dumps
from moebalance.core.load import parse_batch_range
from moebalance.engines import PLAN_FORMATS
from moebalance.routing.simulate import evaluate

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("evaluate", help="score a plan by replaying a load through it")
    p.add_argument("--plan", required=True, help="a moebalance plan, or an engine's placement: SGLang "
                                                 "(physical_to_logical_map .json/.pt), TensorRT-LLM load-balancer YAML")
    p.add_argument("--plan-format", choices=PLAN_FORMATS, help="default: detected")
    options.add_cluster(p, required=False, what=" (an engine's placement file only)")
    p.add_argument("--load", action=options.OneLoad, required=True)
    options.add_router(p)
    p.add_argument("--batches", help="score batches a:b only (e.g. the held-out ones)")
    p.add_argument("--seed", type=options.non_negative, default=0, help="seed of the random router")
    p.add_argument("--hidden-size", type=options.positive, help="bytes of traffic per copy = hidden size x dtype bytes")
    p.add_argument("--dtype-bytes", type=options.positive, default=2)
    options.add_links(p)
    p.add_argument("--json", action="store_true")
    options.add_format(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    router = options.router(args)  # a bad name or option fails before any file is read
    load = options.read_load(args)
    router = deployment.bind_routers([router], None, load)[0]  # metro: the load's model
    plan = options.read_plan(args, load, args.plan_format)
    start, stop = parse_batch_range(args.batches, load.num_batches)
    load = load.select_batches(start, stop)
    with progress() as bar:
        task = bar.add_task("replay", total=load.num_batches)
        score = evaluate(plan, load, router, seed=args.seed,
                         bytes_per_copy=options.bytes_per_copy(load, args.hidden_size, args.dtype_bytes), routing_gap=True,
                         on_batches=lambda n: bar.advance(task, n))
    for w in plan.warnings:
        err.print(f"warning: {w}")
    if args.json:
        d = score.as_dict()
        d["policy"] = plan.policy
        d["batches"] = f"{start}:{stop}"
        d["warnings"] = list(plan.warnings)
        sys.stdout.write(dumps(d))
    else:
        out.print(score_table(score, f"{args.plan}: {plan.policy} on batches {start}:{stop}"))
