"""``moebalance evaluate``: score a plan (moebalance's or an engine's placement file) by replaying a load."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from moebalance.app import options
from moebalance.app.console import err, out, progress
from moebalance.app.costing import bytes_per_copy
from moebalance.app.report import score_table
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.io import dumps
from moebalance.core.load import parse_batch_range
from moebalance.engines import PLAN_FORMATS, read_any_plan
from moebalance.routing.simulate import evaluate

__all__ = ["add_parser", "engine_cluster", "run"]


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


def engine_cluster(args: argparse.Namespace) -> Cluster | None:
    """The cluster ``--nodes`` and ``--gpus-per-node`` give an engine's placement file (both or neither)."""
    if (args.nodes is None) != (args.gpus_per_node is None):
        raise InputError("give both --nodes and --gpus-per-node (the cluster an engine's placement file is laid out "
                         "on), or neither for a moebalance plan")
    return None if args.nodes is None else options.cluster(args)


def run(args: argparse.Namespace) -> None:
    router = options.router(args)  # a bad name or option fails before any file is read
    given = engine_cluster(args)
    load = options.read_load(args)
    router = options.with_context([router], options.router_context(args, load))[0]  # metro: the load's model
    plan = read_any_plan(args.plan, given, args.plan_format, load)
    c = plan.cluster
    if given is not None and (c.num_nodes, c.gpus_per_node) != (args.nodes, args.gpus_per_node):
        raise InputError(f"the plan is for {c.num_nodes}x{c.gpus_per_node} GPUs but --nodes {args.nodes} "
                         f"--gpus-per-node {args.gpus_per_node} were given; drop them for a moebalance plan")
    if options.links(args):  # plan files record the topology, not the links: the time model takes them from here
        plan = dataclasses.replace(plan, cluster=Cluster(num_nodes=c.num_nodes, gpus_per_node=c.gpus_per_node,
                                                         **options.links(args)))
    start, stop = parse_batch_range(args.batches, load.num_batches)
    load = load.select_batches(start, stop)
    with progress() as bar:
        task = bar.add_task("replay", total=load.num_batches)
        score = evaluate(plan, load, router, seed=args.seed,
                         bytes_per_copy=bytes_per_copy(load, args.hidden_size, args.dtype_bytes), routing_gap=True,
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
