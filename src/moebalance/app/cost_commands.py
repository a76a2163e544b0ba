"""``moebalance cost``: memory per GPU, KV cache, modelled layer time and goodput (``docs/design.md``, "Cost model")."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from rich.table import Table

from moebalance.app.console import err, out
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.io import dumps
from moebalance.core.load import parse_batch_range
from moebalance.cost.architecture import ARCHS, get_arch
from moebalance.cost.goodput import Workload, plan_cost
from moebalance.cost.hardware import GPUS, get_gpu
from moebalance.cost.memory import EngineMemory, memory_per_gpu
from moebalance.cost.time import Calibration

__all__ = ["add_cost_options", "add_cost_parser", "calibration_from", "cmd_calibrate", "cmd_cost", "engine_from",
           "workload_from"]

_ENGINE, _WORK = EngineMemory(), Workload()  # the defaults the options show


def add_cost_options(p: argparse.ArgumentParser, *, gpu_required: bool) -> None:
    """The GPU, engine and workload options of ``cost`` (and of ``compare``/``sweep`` with ``--gpu``)."""
    p.add_argument("--gpu", required=gpu_required, choices=sorted(GPUS), help="GPU model of every GPU")
    p.add_argument("--memory-fraction", type=float, default=_ENGINE.memory_fraction,
                   help="share of GPU memory for weights and KV cache (SGLang mem_fraction_static; default 0.79)")
    p.add_argument("--reserve-gib", type=float, default=_ENGINE.reserve_gib,
                   help="GiB per GPU the engine keeps besides weights and KV cache (default fitted, docs/design.md)")
    p.add_argument("--attention-tp", type=int, help="GPUs splitting attention weights (default: a node)")
    p.add_argument("--dense-tp", type=int, default=1, help="GPUs splitting the other non-expert weights (default 1)")
    p.add_argument("--prompt-tokens", type=int, default=_WORK.prompt_tokens)
    p.add_argument("--output-tokens", type=int, default=_WORK.output_tokens)
    p.add_argument("--prefill-chunk", type=int, default=_WORK.prefill_chunk,
                   help="prompt tokens a data-parallel rank prefills per step")
    p.add_argument("--calibration", help="JSON from 'moebalance calibrate' (default: published peaks)")
    p.add_argument("--dispatch", choices=("gpu", "node"), default="gpu",
                   help="all-to-all of token-level loads: a copy per destination GPU (gpu), or one per destination "
                        "node forwarded inside it, as DeepEP and GRACE do (node)")


def engine_from(args: argparse.Namespace) -> EngineMemory:
    return EngineMemory(memory_fraction=args.memory_fraction, reserve_gib=args.reserve_gib,
                        attention_tp=args.attention_tp, dense_tp=args.dense_tp)


def workload_from(args: argparse.Namespace) -> Workload:
    return Workload(prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                    prefill_chunk=args.prefill_chunk)


def calibration_from(args: argparse.Namespace) -> Calibration:
    if args.calibration is None:
        return Calibration()
    path = Path(args.calibration)
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read calibration {str(path)!r}: {exc}") from None
    fields = {f.name for f in dataclasses.fields(Calibration)}
    if not isinstance(doc, dict) or doc.get("format") != "moebalance.calibration" or not set(doc) - {"format"} <= fields:
        raise InputError(f"{str(path)!r} is not a calibration written by 'moebalance calibrate' (keys: "
                         f"format, {', '.join(sorted(fields))})")
    try:
        return Calibration(**{k: v for k, v in doc.items() if k != "format"})
    except TypeError as exc:
        raise InputError(f"{str(path)!r}: {exc}") from None


def cmd_cost(args: argparse.Namespace) -> None:
    from moebalance.app.cli import _links, _read_load  # the shared --load and link options
    from moebalance.app.options import router as _router

    arch, gpu = get_arch(args.model), get_gpu(args.gpu)
    engine, workload, calibration = engine_from(args), workload_from(args), calibration_from(args)
    if args.plan is None:
        if args.nodes is None or args.gpus_per_node is None:
            raise InputError("give --nodes and --gpus-per-node (a deployment), or --plan and --load (a plan on a load)")
        if args.load is not None:
            raise InputError("--load is used with --plan; without a plan, give --replicas-per-gpu")
        report = memory_per_gpu(arch, gpu, num_gpus=args.nodes * args.gpus_per_node, gpus_per_node=args.gpus_per_node,
                                replicas_per_gpu=args.replicas_per_gpu, engine=engine,
                                context_tokens=workload.context_tokens)
        result: dict[str, Any] = report.as_dict()
        title = (f"{arch.spec.display_name} on {args.nodes} x {args.gpus_per_node} {gpu.display_name}, "
                 f"{args.replicas_per_gpu} replicas per GPU")
    else:
        from moebalance.engines import read_any_plan

        if args.load is None:
            raise InputError("--plan needs --load: the held-out load the plan is modelled on")
        if args.replicas_per_gpu:
            raise InputError("--replicas-per-gpu is the plan's own with --plan; drop it")
        if (args.nodes is None) != (args.gpus_per_node is None):
            raise InputError("give both --nodes and --gpus-per-node (the cluster an engine's placement file is laid "
                             "out on), or neither for a moebalance plan")
        load = _read_load(args)
        given = None if args.nodes is None else Cluster(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node)
        plan = read_any_plan(args.plan, given, None, load)
        c = plan.cluster
        if given is not None and (c.num_nodes, c.gpus_per_node) != (args.nodes, args.gpus_per_node):
            raise InputError(f"the plan is for {c.num_nodes}x{c.gpus_per_node} GPUs but --nodes {args.nodes} "
                             f"--gpus-per-node {args.gpus_per_node} were given; drop them for a moebalance plan")
        plan = dataclasses.replace(plan, cluster=Cluster(num_nodes=c.num_nodes, gpus_per_node=c.gpus_per_node,
                                                         **_links(args)))
        start, stop = parse_batch_range(args.batches, load.num_batches)
        cost = plan_cost(plan, load.select_batches(start, stop), arch, gpu, router=_router(args), engine=engine,
                         calibration=calibration, workload=workload, seed=args.seed,
                         node_forwarding=args.dispatch == "node")
        result = {**cost.as_dict(), "batches": f"{start}:{stop}"}
        title = (f"{arch.spec.display_name}: {plan.policy} plan on {c.num_nodes} x {c.gpus_per_node} "
                 f"{gpu.display_name}, batches {start}:{stop}")
    result.update({"model": arch.spec.name, "gpu": gpu.name, "calibration": calibration.source})
    if args.json:
        sys.stdout.write(dumps(result))
        return
    table = Table(title=title, title_justify="left")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    out.print(table)


def add_cost_parser(sub: Any) -> None:
    """``moebalance cost`` (``docs/design.md``, "Cost model")."""
    from moebalance.app.cli import _add_format, _add_links, _non_negative
    from moebalance.app.options import add_router

    p = sub.add_parser("cost", help="memory per GPU, KV cache, concurrency; with a plan, modelled layer time and goodput")
    p.add_argument("--model", required=True, choices=sorted(ARCHS), help="the model served")
    p.add_argument("--nodes", type=int, help="nodes (a deployment; with --plan only for an engine's placement file)")
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--replicas-per-gpu", type=_non_negative, default=0, help="extra expert slots per GPU over all layers")
    p.add_argument("--plan", help="a plan (moebalance, SGLang or TensorRT-LLM placement) to model on --load")
    p.add_argument("--load", help="the held-out load the plan is modelled on")
    p.add_argument("--batches", help="model batches a:b only")
    add_router(p)
    p.add_argument("--seed", type=_non_negative, default=0)
    add_cost_options(p, gpu_required=True)
    _add_links(p)
    p.add_argument("--json", action="store_true")
    _add_format(p)
    p.set_defaults(func=cmd_cost)


def cmd_calibrate(args: argparse.Namespace) -> None:
    """Fit the compute model's constants to measured grouped-GEMM times and write them as JSON."""
    from moebalance.app.console import check_out
    from moebalance.core.io import atomic_write_text
    from moebalance.cost.calibrate import fit, read_measurements

    dest = check_out(args.out, ".json")
    gpu = get_gpu(args.gpu)
    measured = read_measurements(args.measurements)
    calibration, error, (by_flops, by_memory) = fit(measured, gpu,
                                                    source=f"fitted to {Path(args.measurements).name} on {gpu.name}")
    doc = {"format": "moebalance.calibration", **{f.name: getattr(calibration, f.name)
                                                  for f in dataclasses.fields(calibration)}}
    atomic_write_text(dest, dumps(doc))
    out.print(f"wrote {dest}: {100 * calibration.flops_efficiency:.1f}% of {gpu.display_name}'s BF16 peak, "
              f"{100 * calibration.bandwidth_efficiency:.1f}% of its memory bandwidth, "
              f"{calibration.launch_us:.1f} us per grouped GEMM; mean |log error| {error:.3f} over "
              f"{measured.seconds.size} runs ({by_flops} bound by FLOPs, {by_memory} by memory). "
              f"Use: moebalance cost ... --calibration {dest}")
    if not by_flops or not by_memory:
        err.print(f"warning: every run is bound by {'memory' if not by_flops else 'FLOPs'}: the "
                  f"{'FLOP/s' if not by_flops else 'bandwidth'} efficiency is not determined (kept at the largest value "
                  "that fits); measure more tokens per expert" + (" (prefill sizes)" if not by_flops else " (fewer)"))


def add_calibrate_parser(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="fit the cost model's compute constants to measured grouped-GEMM times")
    p.add_argument("--measurements", required=True, help="CSV from bench/bench_gemm.py")
    p.add_argument("--gpu", required=True, choices=sorted(GPUS), help="the GPU that was measured")
    p.add_argument("--out", required=True, help="calibration .json for cost/compare --calibration")
    p.set_defaults(func=cmd_calibrate)
