"""``moebalance compare``: plan with several policies on the first batches and score them on the held-out rest."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from moebalance.app import deployment, options
from moebalance.app.advise import margin_of
from moebalance.app.assumptions import assumption_rows, compare_assumptions
from moebalance.app.compare import (
    COMPARISON_FILES,
    Scenario,
    comparison_title,
    emit_comparison,
    run_scenarios,
)
from moebalance.app.console import out, step
from moebalance.app.html_report import compare_report
from moebalance.core.errors import InputError
from moebalance.core.io import atomic_dir, check_out_dir
from moebalance.core.load import LoadMatrix
from moebalance.engines import PLAN_FORMATS, read_any_plan
from moebalance.policies import POLICIES
from moebalance.pricing.auto import craft_by_goodput
from moebalance.pricing.phase import PhaseModel
from moebalance.routing import Router

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="plan with several policies and score them on held-out batches")
    p.add_argument("--load", action=options.OneLoad, required=True)
    p.add_argument("--policies", required=True, help=f"comma-separated, from: {', '.join(POLICIES)}")
    options.add_cluster(p)
    options.add_budget(p)
    options.add_set(p)
    options.add_auto_by(p)
    options.add_links(p)
    p.add_argument("--train-frac", type=float, default=0.5, help="fraction of batches to plan on (rest scored)")
    options.add_router(p, several=True)
    p.add_argument("--seed", type=options.non_negative, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out-dir", help="write comparison.md, comparison.json, a PNG and the plans here")
    p.add_argument("--baseline", action="append", metavar="FILE",
                   help="also score this placement as it is (a moebalance plan, SGLang's --init-expert-location "
                        "file, TensorRT-LLM's load-balancer YAML; repeatable): what the engine runs today")
    p.add_argument("--baseline-format", choices=PLAN_FORMATS, help="default: detected")
    options.add_model(p)
    deployment.add(p, gpu_required=False)
    deployment.add_phase(p)
    options.add_format(p)
    p.set_defaults(func=run)


def _baselines(args: argparse.Namespace, load: LoadMatrix, routers: list[Router],
               taken: list[Scenario]) -> list[Scenario]:
    """The ``--baseline`` placements as rows scored as they are (one per router)."""
    several = len(routers) > 1
    cluster = options.cluster(args)
    budget = options.budget(args)
    rows: list[Scenario] = []
    for path in args.baseline or ():
        fixed = read_any_plan(path, cluster, args.baseline_format, load)
        if (fixed.num_layers, fixed.num_experts) != (load.num_layers, load.num_experts):
            raise InputError(f"--baseline {path!r} has {fixed.num_layers} layers x {fixed.num_experts} experts but the "
                             f"load {load.num_layers} x {load.num_experts}; give the placement of this model")
        if fixed.num_gpus != cluster.num_gpus:
            raise InputError(f"--baseline {path!r} is for {fixed.num_gpus} GPUs but the comparison has "
                             f"{cluster.num_gpus} (--nodes x --gpus-per-node)")
        name = f"baseline {Path(path).name}"
        if any(sc.label in (name, f"{name} + {routers[0].label}") for sc in [*taken, *rows]):
            raise InputError(f"two --baseline files are named {Path(path).name!r}; rename one (rows are labelled by "
                             "file name)")
        rows += [Scenario(fixed.policy, budget, {}, r, label=f"{name} + {r.label}" if several else name,
                          plan_name=f"baseline-{Path(path).stem}", fixed=fixed) for r in routers]
    return rows


def run(args: argparse.Namespace) -> None:
    if args.out_dir:
        check_out_dir(args.out_dir)
    policies = list(dict.fromkeys(p.strip() for p in args.policies.split(",") if p.strip()))
    if not policies:
        raise InputError("--policies is empty; give names like contiguous,greedy,eplb")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise InputError(f"unknown policy {unknown[0]!r}; choose from: {', '.join(POLICIES)}")
    routers = options.routers(args)
    if args.phase is not None and args.gpu is None:
        raise InputError(f"--phase {args.phase} draws the steps of a deployment and times them with the cost model; "
                         "give --gpu (and --model when the load names none)")
    first = [] if args.groups is None else [("--groups", "num_groups", args.groups)]
    per_policy = options.resolve_set(args.set, policies, first=first)
    cluster = options.cluster(args)
    with step(f"read {Path(args.load).name}"):  # a large token-level trace is read and checked for a while
        raw = options.read_load(args, model=False)
    load = options.load_model(raw, args.model)
    dep = deployment.from_args(args, load)
    routers = deployment.bind_routers(routers, dep, load)
    budget = options.budget(args)
    several = len(routers) > 1
    scenarios = [Scenario(p, budget, per_policy[p], r, label=f"{p} + {r.label}" if several else None, plan_name=p)
                 for p in policies for r in routers]
    scenarios += _baselines(args, load, routers, scenarios)
    by_goodput = deployment.auto_by_goodput(args, dep, policies)
    if by_goodput is not None:  # craft's R chosen on the planning batches, then scored like every other plan
        t0 = time.perf_counter()
        chosen = craft_by_goodput(load.split(args.train_frac)[0], cluster, by_goodput, **per_policy["craft"])
        took = time.perf_counter() - t0
        scenarios = [dataclasses.replace(sc, fixed=chosen, fixed_seconds=took)
                     if sc.policy == "craft" and sc.fixed is None else sc for sc in scenarios]
    price = deployment.price_fn(dep, args.seed)
    phase = PhaseModel(args.phase, dep, seed=args.seed) if args.phase is not None and dep is not None else None
    rows, plans = run_scenarios(load, cluster, scenarios, args.train_frac, args.seed, price,
                                kernel="per-gpu" if dep is None else dep.a2a_kernel(args.phase), phase=phase)
    title = comparison_title(load, Path(args.load).name, cluster, budget, args.train_frac,
                             "per row" if several else routers[0].label)
    if dep is not None:
        title += f"; modelled on {args.gpu} ({dep.describe()})"
    if phase is not None:
        title += f"; scored on {phase.phase} steps"
    if not args.out_dir:
        emit_comparison(list(rows.values()), plans, title, None, args.json)
        return
    load_args = ["--load", args.load, *([] if args.format is None else ["--load-format", args.format])]
    fit_error = None if dep is None else deployment.calibration(args)[1]
    margin = None if dep is None else margin_of(None, fit_error)
    assumed = () if dep is None else assumption_rows(compare_assumptions(
        dep, cluster, fit_error=fit_error, phase=args.phase, train_frac=args.train_frac, margin=margin),
        baseline="the row without replicas")
    with atomic_dir(args.out_dir) as tmp:  # all of the folder or none of it (docs/design.md, "Errors")
        emit_comparison(list(rows.values()), plans, title, str(tmp), args.json, more=[(
            "report.html", lambda: compare_report(rows, plans, scenarios, load.split(args.train_frac)[1], title,
                                                  seed=args.seed, folder=args.out_dir, load_args=load_args,
                                                  assumptions=assumed, margin=margin).write(tmp / "report.html"))])
    if not args.json:
        out.print(f"wrote {args.out_dir}: {COMPARISON_FILES}", markup=False)
