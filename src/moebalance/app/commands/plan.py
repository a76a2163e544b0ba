"""``moebalance plan``: one placement plan for a load, cluster and budget."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.table import Table

from moebalance.algorithms.migration import MIGRATIONS, lay_onto
from moebalance.app import deployment, options
from moebalance.app.console import check_out, err, out, progress
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement, read_plan, write_plan
from moebalance.cost.memory import GIB
from moebalance.cost.time import EXPERT_WEIGHT_BYTES
from moebalance.cost.transfer import schedule_transfers
from moebalance.policies import POLICIES, get_policy, make_plan
from moebalance.pricing.auto import craft_by_goodput
from moebalance.routing.simulate import Score, evaluate

__all__ = ["add_parser", "eplb_variant", "migrate", "report_moves", "run", "warning_text", "workload_table"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="compute a placement plan")
    p.add_argument("--load", required=True, action="append",
                   help=".npy [L, E] / [B, L, E], .npz with counts, bundled:NAME, or an engine's dump (SGLang "
                        ".pt/.json, TensorRT-LLM statistics folder); repeatable: several workloads of one model, "
                        "planned for their sum, or with --set objective=worst (eplb, craft) for the worst of them, "
                        "and scored one by one")
    p.add_argument("--policy", required=True, help=f"one of: {', '.join(POLICIES)}")
    options.add_cluster(p)
    options.add_budget(p)
    options.add_set(p)
    options.add_auto_by(p)
    options.add_links(p)
    p.add_argument("--batches", help="plan on batches a:b only (of each --load)")
    p.add_argument("--out", required=True, help="output plan .json")
    options.add_model(p, "--auto-by goodput")
    p.add_argument("--seed", type=options.non_negative, default=0)
    p.add_argument("--previous", help="the plan in service (.json): re-plan moving few experts from it")
    p.add_argument("--migration", choices=MIGRATIONS,
                   help="with --previous: the fresh plan as planned, aligned onto the previous GPUs to keep the "
                        "most experts in place (default), or bounded by --max-moves")
    p.add_argument("--max-moves", type=options.non_negative,
                   help="with --migration bounded: expert copies one GPU may receive, summed over layers")
    deployment.add(p, gpu_required=False)
    options.add_format(p)
    p.set_defaults(func=run)


def eplb_variant(plan: Placement, load: LoadMatrix, params: dict[str, Any], model_flag: str | None) -> str:
    """Which of EPLB's policies ran and why: the groups' source and whether the nodes divide them."""
    groups, mode = plan.params.get("num_groups"), plan.params.get("mode")
    nodes = plan.cluster.num_nodes
    if "num_groups" in params:
        source = "as given"
    elif load.model is not None and load.model.num_groups > 1:
        source = f"{load.model.display_name}'s" + (" (--model)" if model_flag is not None else "")
    else:
        source = "the load names no model with expert groups: give --model or --groups"
    if groups == 1 and nodes == 1:  # EPLB's global policy is its hierarchical one on one group and one node
        if "num_groups" not in params and load.model is not None:
            source = f"{load.model.display_name} has no expert groups"
        return f"eplb: one expert group ({source}) on one node, so its hierarchical and global plans are the same"
    verdict = "divide" if mode == "hierarchical" else "do not divide"
    return f"eplb ran {mode}: {groups} expert group(s), {source}; {nodes} node(s) {verdict} them"


def warning_text(plan: Placement, warning: str) -> str:
    """``warning`` of ``plan``, naming for an EPLB plan with two copies of one expert on one GPU the option that
    swaps them apart (:mod:`moebalance.policies.eplb`, ``avoid_duplicates``)."""
    if plan.policy != "eplb" or "copies of one expert" not in warning:
        return warning
    if plan.params.get("avoid_duplicates"):
        return f"{warning}; avoid_duplicates found no GPU to swap them to"
    return f"{warning}; --set avoid_duplicates=true swaps them onto other GPUs"


def _check_migration_flags(args: argparse.Namespace) -> None:
    if args.previous is None:
        given = "--migration" if args.migration is not None else "--max-moves" if args.max_moves is not None else None
        if given:
            raise InputError(f"{given} needs --previous OLD.json, the plan in service")
    elif args.migration == "bounded" and args.max_moves is None:
        raise InputError("--migration bounded needs --max-moves M, the copies one GPU may receive per re-plan")
    elif args.max_moves is not None and args.migration != "bounded":
        raise InputError(f"--max-moves is used only by --migration bounded, not {args.migration or 'aligned'}; "
                         "drop it or add --migration bounded")


def migrate(plan: Placement, previous: Placement, args: argparse.Namespace, load: LoadMatrix) -> Placement:
    """``plan`` laid onto ``previous`` as ``--migration`` says (hierarchical EPLB keeps its node blocks)."""
    if previous.cluster.to_dict() != plan.cluster.to_dict() or (previous.num_layers, previous.num_experts) != (
            plan.num_layers, plan.num_experts):
        raise PlanError(f"--previous {args.previous} is a plan of {previous.num_layers} layers x "
                        f"{previous.num_experts} experts on {previous.cluster.num_nodes} x "
                        f"{previous.cluster.gpus_per_node} GPUs, but this plan is {plan.num_layers} x "
                        f"{plan.num_experts} on {plan.cluster.num_nodes} x {plan.cluster.gpus_per_node}; give the "
                        "plan in service for the same model and cluster")
    return lay_onto(previous, plan, args.migration or "aligned",
                    max_moves=None if args.max_moves is None else int(args.max_moves), load=load)


def report_moves(previous: Placement, plan: Placement, load: LoadMatrix, cluster: Cluster) -> str:
    """One line: experts moved, GiB and the transfer schedule (rounds, seconds) when the model is known, its experts
    as its checkpoint holds them (DeepSeek-V3's in FP8, gpt-oss's in MXFP4)."""
    model = load.model
    if model is None:
        moved = schedule_transfers(previous, plan, 0, cluster).moved_experts
        return f"migration: {moved} experts moved; give --model for their GiB and the transfer time"
    precision = model.served_precision
    s = schedule_transfers(previous, plan, int(model.expert_params() * EXPERT_WEIGHT_BYTES[precision]), cluster)
    return (f"migration: {s.moved_experts} experts moved, {s.moved_bytes / GIB:.2f} GiB of {model.display_name} "
            f"({precision}, as served), {s.rounds} transfer rounds, {1000 * s.seconds:.1f} ms on the cluster's links")


def take_migration_items(args: argparse.Namespace) -> None:
    """``--set migration=fresh|aligned|bounded`` and ``--set max_moves=M`` are the migration flags' other spelling
    (they are not a policy's options): moved onto ``args.migration`` / ``args.max_moves``, the rest left to the
    policy. A flag and an item that disagree are refused."""
    rest = []
    for item in args.set or ():
        key, sep, value = item.partition("=")
        if sep and key in ("migration", "max_moves"):
            dest = key
            parsed: object = value
            if key == "max_moves":
                try:
                    parsed = int(value)
                except ValueError:
                    raise InputError(f"--set max_moves={value}: give a whole number of expert copies") from None
                if parsed < 1:
                    raise InputError(f"--set max_moves={value} must be >= 1")
            elif value not in MIGRATIONS:
                raise InputError(f"--set migration={value}: choose one of {', '.join(MIGRATIONS)}")
            flag = getattr(args, dest)
            if flag is not None and flag != parsed:
                raise InputError(f"--set {item} and --{dest.replace('_', '-')} {flag} disagree; give one")
            setattr(args, dest, parsed)
        else:
            rest.append(item)
    args.set = rest


def workload_table(names: list[str], parts: list[LoadMatrix], scores: list[Score]) -> Table:
    """Each workload's in-sample balancedness and imbalance ratio under the plan, and the worst of them."""
    table = Table(title="per workload (in sample, uniform router)", title_justify="left")
    for column in ("workload", "batches", "balancedness", "imbalance ratio"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for name, part, score in zip(names, parts, scores, strict=True):
        table.add_row(name, str(part.num_batches), f"{score.balancedness:.4f}", f"{score.imbalance_ratio:.3f}")
    table.add_row("worst", "", f"{min(s.balancedness for s in scores):.4f}",
                  f"{max(s.imbalance_ratio for s in scores):.3f}")
    return table


def run(args: argparse.Namespace) -> None:
    dest = check_out(args.out, ".json")
    take_migration_items(args)
    _check_migration_flags(args)
    name, _ = get_policy(args.policy)  # an unknown or dynamic policy fails before any file is read
    goodput = args.auto_by == "goodput"
    if not goodput:  # the cost model's flags would be ignored
        why = "by plan only with --auto-by goodput (the cost model that picks craft's R)"
        deployment.refuse(args, why)
        given = [f for f, v in (("--gpu", args.gpu), ("--intra-link", args.intra_link),
                                ("--inter-link", args.inter_link)) if v is not None]
        if given:
            raise InputError(f"{given[0]} is used {why}; drop it")
    first = [] if args.groups is None else [("--groups", "num_groups", args.groups)]
    params = options.resolve_set(args.set, [name], first=first, policy_flag="--policy")[name]
    if "workload_batches" in params:
        raise InputError("--set workload_batches is filled from the --load files; give each workload as its own "
                         "--load")
    cluster = options.cluster(args)
    work = options.read_workloads(args)
    load, dense = work.load, work.dense
    several = len(work.names) > 1
    if several and "workload_batches" in (options.policy_keys(name) or ()):
        params["workload_batches"] = [part.num_batches for part in work.parts]
    dep = deployment.build(args, load) if goodput and args.gpu is not None else None
    by_goodput = deployment.auto_by_goodput(args, dep, [name])
    if by_goodput is not None:
        t0 = time.perf_counter()
        plan = craft_by_goodput(load, cluster, by_goodput, dense_layers=dense, **params)
        seconds = time.perf_counter() - t0
    else:
        plan, seconds = make_plan(name, load, cluster, options.budget(args), dense_layers=dense, **params)
    recorded: dict[str, Any] = {"planned_on_batches": work.ranges if several else work.ranges[0]}
    if several:
        recorded["workloads"] = work.names
        recorded["objective"] = plan.params.get("objective", "sum")
    if load.preset is not None:  # exports find the model's decoder layers (and MTP) from it
        recorded["model"] = load.preset
    plan = plan.with_params({**plan.params, **recorded})
    previous = None if args.previous is None else read_plan(args.previous)
    if previous is not None:
        plan = migrate(plan, previous, args, load)
    with progress() as bar:  # before writing: a load that cannot be scored leaves no plan behind
        task = bar.add_task("in-sample score", total=load.num_batches)
        score = evaluate(plan, load, on_batches=lambda n: bar.advance(task, n))
        per_workload = [evaluate(plan, part) for part in work.parts] if several else []
    write_plan(dest, plan)
    for w in plan.warnings:
        err.print(f"warning: {warning_text(plan, w)}")
    out.print(f"wrote {dest}: {plan.policy}, {plan.extra_replicas} extra replicas, "
              f"{plan.max_slots_per_gpu} max slots per GPU, planned in {1000 * seconds:.1f} ms; "
              f"in-sample balancedness {score.balancedness:.4f}")
    if several:
        out.print(workload_table(work.names, work.parts, per_workload))
    note = plan.params.get("budget_note")
    if isinstance(note, str):
        out.print(f"budget note: {note}")
    if plan.policy == "eplb" and "mode" in plan.params:
        out.print(eplb_variant(plan, load, params, args.model))
    if previous is not None:
        out.print(report_moves(previous, plan, load, cluster))
