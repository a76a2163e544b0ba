"""``moebalance cost``: memory per GPU, KV cache, modelled layer time and goodput (``docs/design.md``, "Cost model")."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.table import Table

from moebalance.app import deployment, options
from moebalance.app.console import out
from moebalance.core.errors import InputError
from moebalance.core.io import dumps
from moebalance.core.limits import check_count
from moebalance.core.load import parse_batch_range
from moebalance.cost.memory import memory_per_gpu
from moebalance.models import MODELS
from moebalance.pricing.goodput import price_plan

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
    deployment.add(p, gpu_required=True)
    options.add_links(p)
    p.add_argument("--json", action="store_true")
    options.add_format(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    dep = deployment.build(args)
    spec, gpu, calibration = dep.model, dep.gpu, dep.calibration
    if args.plan is None:
        deployment.refuse(args, "by cost with --plan and --load (a time); without them cost prices memory alone",
                          deployment.TIME_FLAGS)
        if args.nodes is None or args.gpus_per_node is None:
            raise InputError("give --nodes and --gpus-per-node (a deployment), or --plan and --load (a plan on a load)")
        if args.load is not None:
            raise InputError("--load is used with --plan; without a plan, give --replicas-per-gpu")
        num_gpus = check_count(args.nodes * args.gpus_per_node, "--nodes x --gpus-per-node", options.MAX_GPUS,
                               "give fewer nodes or GPUs per node")
        report = memory_per_gpu(spec, gpu, num_gpus=num_gpus, gpus_per_node=args.gpus_per_node,
                                replicas_per_gpu=args.replicas_per_gpu, engine=dep.engine,
                                context_tokens=dep.workload.context_tokens)
        result: dict[str, Any] = report.as_dict()
        title = (f"{spec.display_name} on {args.nodes} x {args.gpus_per_node} {gpu.display_name}, "
                 f"{args.replicas_per_gpu} replicas per GPU")
    else:
        if args.load is None:
            raise InputError("--plan needs --load: the held-out load the plan is modelled on")
        if args.replicas_per_gpu:
            raise InputError("--replicas-per-gpu is the plan's own with --plan; drop it")
        load = options.read_load(args, model=False)
        plan = options.read_plan(args, load)
        c = plan.cluster
        start, stop = parse_batch_range(args.batches, load.num_batches)
        router = deployment.bind_routers([options.router(args)], dep, load)[0]
        cost = price_plan(plan, load.select_batches(start, stop), dep, router=router, seed=args.seed)
        result = {**cost.as_dict(), "batches": f"{start}:{stop}"}
        title = (f"{spec.display_name}: {plan.policy} plan on {c.num_nodes} x {c.gpus_per_node} "
                 f"{gpu.display_name}, batches {start}:{stop}")
    result.update({"model": spec.name, "gpu": gpu.name, "calibration": calibration.source, "precision": dep.precision})
    if args.json:
        sys.stdout.write(dumps(result))
        return
    table = Table(title=title, title_justify="left")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    out.print(table)
