"""``moebalance cost``: memory per GPU, KV cache, modelled layer time and goodput (``docs/design.md``, "Cost model")."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from rich.table import Table

from moebalance.app import options
from moebalance.app.commands.evaluate import engine_cluster
from moebalance.app.console import out
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.io import dumps
from moebalance.core.limits import check_count
from moebalance.core.load import parse_batch_range
from moebalance.cost.goodput import plan_cost
from moebalance.cost.hardware import get_gpu
from moebalance.cost.memory import memory_per_gpu
from moebalance.engines import read_any_plan
from moebalance.models import MODELS, get_model

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cost", help="memory per GPU, KV cache, concurrency; with a plan, modelled layer time and goodput")
    p.add_argument("--model", required=True, choices=sorted(n for n, m in MODELS.items() if m.has_architecture),
                   help="the model served")
    options.add_cluster(p, required=False, what=" (a deployment; with --plan only for an engine's placement file)")
    p.add_argument("--replicas-per-gpu", type=options.count(options.MAX_REPLICAS_PER_GPU, minimum=0), default=0,
                   help="extra expert slots per GPU over all layers")
    p.add_argument("--plan", help="a plan (moebalance, SGLang or TensorRT-LLM placement) to model on --load")
    p.add_argument("--load", action=options.OneLoad, help="the held-out load the plan is modelled on")
    p.add_argument("--batches", help="model batches a:b only")
    options.add_router(p)
    p.add_argument("--seed", type=options.non_negative, default=0)
    options.add_cost_options(p, gpu_required=True)
    options.add_links(p)
    p.add_argument("--json", action="store_true")
    options.add_format(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    spec, gpu = get_model(args.model), get_gpu(args.gpu)
    engine, workload = options.engine_from(args), options.workload_from(args)
    calibration = options.calibration_from(args)
    if args.plan is None:
        if args.nodes is None or args.gpus_per_node is None:
            raise InputError("give --nodes and --gpus-per-node (a deployment), or --plan and --load (a plan on a load)")
        if args.load is not None:
            raise InputError("--load is used with --plan; without a plan, give --replicas-per-gpu")
        num_gpus = check_count(args.nodes * args.gpus_per_node, "--nodes x --gpus-per-node", options.MAX_GPUS,
                               "give fewer nodes or GPUs per node")
        report = memory_per_gpu(spec, gpu, num_gpus=num_gpus, gpus_per_node=args.gpus_per_node,
                                replicas_per_gpu=args.replicas_per_gpu, engine=engine,
                                context_tokens=workload.context_tokens)
        result: dict[str, Any] = report.as_dict()
        title = (f"{spec.display_name} on {args.nodes} x {args.gpus_per_node} {gpu.display_name}, "
                 f"{args.replicas_per_gpu} replicas per GPU")
    else:
        if args.load is None:
            raise InputError("--plan needs --load: the held-out load the plan is modelled on")
        if args.replicas_per_gpu:
            raise InputError("--replicas-per-gpu is the plan's own with --plan; drop it")
        given = engine_cluster(args)
        load = options.read_load(args, model=False)
        plan = read_any_plan(args.plan, given, None, load)
        c = plan.cluster
        if given is not None and (c.num_nodes, c.gpus_per_node) != (args.nodes, args.gpus_per_node):
            raise InputError(f"the plan is for {c.num_nodes}x{c.gpus_per_node} GPUs but --nodes {args.nodes} "
                             f"--gpus-per-node {args.gpus_per_node} were given; drop them for a moebalance plan")
        plan = dataclasses.replace(plan, cluster=Cluster(num_nodes=c.num_nodes, gpus_per_node=c.gpus_per_node,
                                                         **options.links(args)))
        start, stop = parse_batch_range(args.batches, load.num_batches)
        router = options.with_context([options.router(args)], options.router_context(args, load))[0]
        cost = plan_cost(plan, load.select_batches(start, stop), spec, gpu, router=router,
                         engine=engine, calibration=calibration, workload=workload, seed=args.seed,
                         node_forwarding=args.dispatch == "node")
        result = {**cost.as_dict(), "batches": f"{start}:{stop}"}
        title = (f"{spec.display_name}: {plan.policy} plan on {c.num_nodes} x {c.gpus_per_node} "
                 f"{gpu.display_name}, batches {start}:{stop}")
    result.update({"model": spec.name, "gpu": gpu.name, "calibration": calibration.source})
    if args.json:
        sys.stdout.write(dumps(result))
        return
    table = Table(title=title, title_justify="left")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    out.print(table)
