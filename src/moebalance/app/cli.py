"""The ``moebalance`` command line.

User mistakes (bad files, bad budgets, unknown names) print one line ``moebalance: error: ...`` and exit 2,
leaving no output file behind. Long steps show a progress bar on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from rich.table import Table

from moebalance.app.report import (
    ComparisonRow,
    comparison_markdown,
    comparison_table,
    plot_per_layer,
    score_table,
)
from moebalance.core.cluster import LINK_PRESETS, Cluster
from moebalance.core.errors import InputError, MoebalanceError
from moebalance.core.io import atomic_write_text, dumps
from moebalance.core.load import LoadMatrix, parse_batch_range, read_load, write_load
from moebalance.core.plan import write_plan
from moebalance.policies import DYNAMIC_POLICIES, POLICIES, Budget, make_plan
from moebalance.routing import get_router
from moebalance.routing.simulate import evaluate

__all__ = ["main"]

from moebalance.app import cost_commands, engine_commands, lm_commands, online_commands
from moebalance.app.console import check_out as _check_out
from moebalance.app.console import err, out
from moebalance.app.console import progress as _progress
from moebalance.app.options import add_router as _add_router
from moebalance.app.options import parse_set as _parse_set
from moebalance.app.options import router as _router
from moebalance.app.options import routers as _routers


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"moebalance: error: {message} (see: {self.prog} --help)\n")
        raise SystemExit(2)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("0 must be >= 1")
    return value


def _replicas(text: str) -> int | str:
    """An integer (the Budget checks its sign and names the value) or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor 'auto'") from None


def _read_load(args: argparse.Namespace) -> LoadMatrix:
    """``--load`` in its detected format, or ``--format``'s (moebalance, SGLang or TensorRT-LLM files)."""
    from moebalance.engines import read_any_load

    return read_any_load(args.load, getattr(args, "format", None))


def _budget(args: argparse.Namespace) -> Budget:
    return Budget(slots_per_gpu=args.slots_per_gpu, replicas_per_gpu=args.replicas_per_gpu)


def _link(value: str) -> float:
    """A link bandwidth in GB/s per GPU and direction: a preset name (LINK_PRESETS) or a number."""
    if value in LINK_PRESETS:
        return LINK_PRESETS[value]
    try:
        gbps = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a number of GB/s nor a link preset ({', '.join(LINK_PRESETS)})") from None
    if not (gbps > 0 and np.isfinite(gbps)):
        raise argparse.ArgumentTypeError(f"{value!r} must be a positive number of GB/s")
    return gbps


def _links(args: argparse.Namespace) -> dict[str, Any]:
    """The link bandwidths given on the command line (the Cluster defaults for the others)."""
    links: dict[str, Any] = {}
    if getattr(args, "intra_link", None) is not None:
        links["intra_node_bandwidth"] = args.intra_link
    if getattr(args, "inter_link", None) is not None:
        links["inter_node_bandwidth"] = args.inter_link
    return links


def _cluster(args: argparse.Namespace) -> Cluster:
    return Cluster(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node, **_links(args))


def _add_links(p: argparse.ArgumentParser) -> None:
    p.add_argument("--intra-link", type=_link, metavar="PRESET|GBPS",
                   help=f"GB/s per GPU and direction inside a node, for all-to-all time (default nvlink4; presets: "
                        f"{', '.join(LINK_PRESETS)})")
    p.add_argument("--inter-link", type=_link, metavar="PRESET|GBPS",
                   help="GB/s per GPU and direction across nodes (default ib-ndr400)")


def _bytes_per_copy(load: LoadMatrix, hidden_size: int | None, dtype_bytes: int) -> int | None:
    if hidden_size is None and load.model is not None:
        hidden_size = load.model.hidden_size
    return None if hidden_size is None else hidden_size * dtype_bytes


# ----- commands ------------------------------------------------------------------------------------------------

def cmd_synth(args: argparse.Namespace) -> None:
    from moebalance.models import get_model
    from moebalance.workloads.synth import synthesize

    dest = _check_out(args.out, ".npz")
    preset = get_model(args.preset)
    with _progress() as progress:
        task = progress.add_task(f"synth {preset.name}", total=args.batches)
        arrays = synthesize(preset, num_batches=args.batches, tokens_per_batch=args.tokens_per_batch,
                            num_gpus=args.gpus, seed=args.seed, token_level=args.token_level,
                            progress=lambda n: progress.advance(task, n))
    load = LoadMatrix.from_arrays(arrays, source="synth")
    write_load(dest, load)
    kind = "token-level trace" if load.trace is not None else "load matrix"
    out.print(f"wrote {dest}: {kind} of {preset.name}, [B, L, E] = {list(load.counts.shape)}, top-{preset.top_k}")


def cmd_plan(args: argparse.Namespace) -> None:
    dest = _check_out(args.out, ".json")
    load = _read_load(args)
    # dense layers: no load in the whole file, not merely in the planning window (engine exports leave them out)
    dense = [int(x) for x in np.flatnonzero(load.counts.sum(axis=(0, 2)) == 0)]
    start, stop = parse_batch_range(args.batches, load.num_batches)
    load = load.select_batches(start, stop)
    params = _parse_set(args.set)
    if args.groups is not None:
        params["num_groups"] = args.groups
    costing = _auto_by_goodput(args, load, [args.policy])
    if costing is not None:
        from moebalance.cost.auto import craft_by_goodput

        t0 = time.perf_counter()
        plan = craft_by_goodput(load, _cluster(args), costing, dense_layers=dense, **params)
        seconds = time.perf_counter() - t0
    else:
        plan, seconds = make_plan(args.policy, load, _cluster(args), _budget(args), dense_layers=dense, **params)
    plan = plan.with_params({**plan.params, "planned_on_batches": f"{start}:{stop}"})
    with _progress() as progress:  # before writing: a load that cannot be scored leaves no plan behind
        task = progress.add_task("in-sample score", total=load.num_batches)
        score = evaluate(plan, load, on_batches=lambda n: progress.advance(task, n))
    write_plan(dest, plan)
    for w in plan.warnings:
        err.print(f"warning: {w}")
    out.print(f"wrote {dest}: {plan.policy}, {plan.extra_replicas} extra replicas, "
              f"{plan.max_slots_per_gpu} max slots per GPU, planned in {1000 * seconds:.1f} ms; "
              f"in-sample balancedness {score.balancedness:.4f}")


def cmd_evaluate(args: argparse.Namespace) -> None:
    from moebalance.engines import read_any_plan

    router = _router(args)  # a bad name or option fails before any file is read
    if (args.nodes is None) != (args.gpus_per_node is None):
        raise InputError("give both --nodes and --gpus-per-node (the cluster an engine's placement file is laid out on)")
    load = _read_load(args)
    given = None if args.nodes is None else Cluster(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    plan = read_any_plan(args.plan, given, args.plan_format, load)
    if given is not None and (plan.cluster.num_nodes, plan.cluster.gpus_per_node) != (args.nodes, args.gpus_per_node):
        raise InputError(f"the plan is for {plan.cluster.num_nodes}x{plan.cluster.gpus_per_node} GPUs but --nodes "
                         f"{args.nodes} --gpus-per-node {args.gpus_per_node} were given; drop them for a moebalance plan")
    if _links(args):  # plan files record the topology, not the links: the time model takes them from here
        c = plan.cluster
        plan = dataclasses.replace(plan, cluster=Cluster(num_nodes=c.num_nodes, gpus_per_node=c.gpus_per_node,
                                                         **_links(args)))
    start, stop = parse_batch_range(args.batches, load.num_batches)
    load = load.select_batches(start, stop)
    with _progress() as progress:
        task = progress.add_task("replay", total=load.num_batches)
        score = evaluate(plan, load, router, seed=args.seed,
                         bytes_per_copy=_bytes_per_copy(load, args.hidden_size, args.dtype_bytes), routing_gap=True,
                         on_batches=lambda n: progress.advance(task, n))
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


def cmd_compare(args: argparse.Namespace) -> None:
    from moebalance.app.compare import Scenario

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise InputError("--policies is empty; give names like contiguous,greedy,eplb")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise InputError(f"unknown policy {unknown[0]!r}; choose from: {', '.join(POLICIES)}")
    routers = _routers(args)
    load = _read_load(args)
    params = _parse_set(args.set)
    per_policy: dict[str, dict[str, Any]] = {p: {} for p in policies}
    if args.groups is not None and "eplb" in per_policy:
        per_policy["eplb"]["num_groups"] = args.groups
    for key, value in params.items():  # --set policy.key=value, or key=value for every compared policy
        pol, dot, name = key.partition(".")
        if dot:
            if pol not in per_policy:
                raise InputError(f"--set {key}: policy {pol!r} is not being compared")
            per_policy[pol][name] = value
        else:
            for p in policies:
                per_policy[p][key] = value
    budget = _budget(args)
    several = len(routers) > 1
    scenarios = [Scenario(p, budget, per_policy[p], r, label=f"{p} + {r.label}" if several else None,
                          plan_name=p) for p in policies for r in routers]
    for path in args.baseline or ():  # what an engine runs today, scored on the same held-out batches
        from moebalance.engines import read_any_plan

        fixed = read_any_plan(path, _cluster(args), args.baseline_format, load)
        if (fixed.num_layers, fixed.num_experts) != (load.num_layers, load.num_experts):
            raise InputError(f"--baseline {path!r} has {fixed.num_layers} layers x {fixed.num_experts} experts but the "
                             f"load {load.num_layers} x {load.num_experts}; give the placement of this model")
        if fixed.num_gpus != _cluster(args).num_gpus:
            raise InputError(f"--baseline {path!r} is for {fixed.num_gpus} GPUs but the comparison has "
                             f"{_cluster(args).num_gpus} (--nodes x --gpus-per-node)")
        name = f"baseline {Path(path).name}"
        if any(sc.label == name or sc.label == f"{name} + {routers[0].label}" for sc in scenarios):
            raise InputError(f"two --baseline files are named {Path(path).name!r}; rename one (rows are labelled by "
                             "file name)")
        scenarios += [Scenario(fixed.policy, budget, {}, r, label=f"{name} + {r.label}" if several else name,
                               plan_name=f"baseline-{Path(path).stem}", fixed=fixed) for r in routers]
    by_goodput = _auto_by_goodput(args, load, policies)
    if by_goodput is not None:  # craft's R chosen on the planning batches, then scored like every other plan
        from moebalance.cost.auto import craft_by_goodput

        t0 = time.perf_counter()
        chosen = craft_by_goodput(load.split(args.train_frac)[0], _cluster(args), by_goodput, **per_policy["craft"])
        took = time.perf_counter() - t0
        scenarios = [dataclasses.replace(sc, fixed=chosen, fixed_seconds=took)
                     if sc.policy == "craft" and sc.fixed is None else sc for sc in scenarios]
    rows, plans = _run_scenarios(load, _cluster(args), scenarios, args.train_frac, args.seed, _cost_fn(args, load),
                                 node_forwarding=args.dispatch == "node")
    title = _title(load, Path(args.load).name, _cluster(args), budget, args.train_frac,
                   "per row" if several else routers[0].label)
    if args.gpu is not None:
        title += f"; modelled on {args.gpu} ({cost_commands.calibration_from(args).source})"
    _emit_comparison(list(rows.values()), plans, title, args.out_dir, args.json)


def _auto_by_goodput(args: argparse.Namespace, load: LoadMatrix, policies: Sequence[str]) -> Any:
    """``(plan, load) -> PlanCost`` when ``--auto-by goodput`` asks for it (checked), else None."""
    if args.auto_by != "goodput":
        return None
    if args.replicas_per_gpu != "auto" or "craft" not in policies:
        raise InputError("--auto-by goodput chooses craft's R: give --policy craft (or craft in --policies) with "
                         "--replicas-per-gpu auto")
    if args.gpu is None:
        raise InputError("--auto-by goodput needs --gpu (and --model when the load names none): the cost model")
    costing = _cost_fn(args, load)
    return lambda plan, part: costing(plan, part, "uniform")


def _cost_fn(args: argparse.Namespace, load: LoadMatrix) -> Any:
    """``(plan, held-out load, router) -> PlanCost`` for ``--gpu`` (with ``--model`` or the load's own), else None."""
    if getattr(args, "gpu", None) is None:
        if getattr(args, "model", None) is not None:
            raise InputError("--model is used with --gpu (the cost model); give --gpu too")
        return None
    from moebalance.cost.architecture import get_arch
    from moebalance.cost.goodput import plan_cost
    from moebalance.cost.hardware import get_gpu

    name = args.model or load.preset
    if name is None:
        raise InputError("the load names no model; give --model with --gpu (e.g. --model deepseek-v3)")
    arch, gpu = get_arch(name), get_gpu(args.gpu)
    spec = arch.spec
    if spec.num_experts != load.num_experts or load.num_layers not in (spec.num_layers,
                                                                        spec.num_layers + spec.num_dense_layers):
        raise InputError(f"{spec.display_name} has {spec.num_layers} MoE layers ({spec.num_layers + spec.num_dense_layers}"
                         f" with its dense ones) x {spec.num_experts} experts but the load {load.num_layers} x "
                         f"{load.num_experts}; give the load's --model")
    engine, workload = cost_commands.engine_from(args), cost_commands.workload_from(args)
    calibration = cost_commands.calibration_from(args)
    forwarding = args.dispatch == "node"
    return lambda plan, test, router: plan_cost(plan, test, arch, gpu, router=router, engine=engine,
                                                calibration=calibration, workload=workload, seed=args.seed,
                                                node_forwarding=forwarding)


def _run_scenarios(load: LoadMatrix, cluster: Cluster, scenarios: Sequence[Any], train_frac: float,
                   seed: int, cost: Any = None, node_forwarding: bool = False,
                   ) -> tuple[dict[str, ComparisonRow], dict[str, Any]]:
    from moebalance.app.compare import run_comparison

    with _progress() as progress:
        task = progress.add_task("plan + score", total=len(scenarios))
        return run_comparison(load, cluster, scenarios, train_frac=train_frac, seed=seed,
                              bytes_per_copy=_bytes_per_copy(load, None, 2), on_done=lambda _: progress.advance(task),
                              cost=cost, node_forwarding=node_forwarding)


def _title(load: LoadMatrix, source: str, cluster: Cluster, budget: Budget, train_frac: float, router: str) -> str:
    train, test = load.split(train_frac)
    return (f"{load.preset or source}: {load.num_layers} layers x {load.num_experts} experts on "
            f"{cluster.num_nodes}x{cluster.gpus_per_node} GPUs, {budget.describe()}, planned on {train.num_batches} "
            f"batches, scored on {test.num_batches}{' held-out' if train_frac < 1 else ''} ({router} router)")


def _emit_comparison(rows: list[ComparisonRow], plans: dict[str, Any], title: str, out_dir: str | None,
                     as_json: bool, notes: Sequence[str] = ()) -> None:
    doc = {"title": title, "rows": [r.as_dict() for r in rows]}
    warned: set[str] = set()
    for r in rows:  # rows of one plan under several routers share its warnings: each is printed once
        for w in r.warnings:
            if w not in warned:
                warned.add(w)
                err.print(f"warning: {r.policy}: {w}")
    if out_dir:
        d = Path(out_dir)
        atomic_write_text(d / "comparison.md", comparison_markdown(
            rows, title, [*notes, "", "![per-layer balancedness](per_layer_balancedness.png)"]))
        atomic_write_text(d / "comparison.json", dumps(doc))
        plot_per_layer(rows, d / "per_layer_balancedness.png", title)
        for name, plan in plans.items():
            write_plan(d / f"plan-{name}.json", plan)
    if as_json:
        sys.stdout.write(dumps(doc))
    else:
        out.print(comparison_table(rows, title))
        for note in notes:
            out.print(note)
        if out_dir:
            out.print(f"wrote {out_dir}/comparison.md, comparison.json, per_layer_balancedness.png and plans")


def cmd_sweep(args: argparse.Namespace) -> None:
    from moebalance.app.report import plot_sweep, sweep_markdown, sweep_table
    from moebalance.app.sweep import sweep, sweep_steps

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        replicas = [int(r) for r in args.replicas_per_gpu.split(",") if r.strip()]
    except ValueError:
        raise InputError(f"--replicas-per-gpu {args.replicas_per_gpu!r} must be integers like 0,1,2,4,8") from None
    load = _read_load(args)
    cluster = _cluster(args)
    steps = sweep_steps(load, cluster, policies, replicas) if policies else 0
    with _progress() as progress:
        task = progress.add_task("sweep", total=steps)
        costing = _cost_fn(args, load)
        result = sweep(load, cluster, policies, replicas, train_frac=args.train_frac, num_groups=args.groups,
                       on_step=lambda: progress.advance(task),
                       cost=None if costing is None else (lambda plan, test: costing(plan, test, "uniform")))
    points = result.points
    train, test = load.split(args.train_frac)
    title = (f"{load.preset or Path(args.load).name}: {load.num_layers} layers x {load.num_experts} experts on "
             f"{args.nodes}x{args.gpus_per_node} GPUs, planned on {train.num_batches} batches, scored on "
             f"{test.num_batches}{' held-out' if args.train_frac < 1 else ''}; gain over placement-only greedy"
             + ("" if args.gpu is None else f"; modelled on {args.gpu}"))
    doc = {"title": title, "points": [p.as_dict() for p in points], "skipped": result.skipped}
    skipped_md = "".join(f"\nSkipped: {note}\n" for note in result.skipped)
    if args.out_dir:
        d = Path(args.out_dir)
        atomic_write_text(d / "sweep.md", sweep_markdown(points, title) + skipped_md + "\n![sweep](sweep.png)\n")
        atomic_write_text(d / "sweep.json", dumps(doc))
        plot_sweep(points, d / "sweep.png", title, load.num_layers, cluster.num_gpus)
    if args.json:
        sys.stdout.write(dumps(doc))
    else:
        out.print(sweep_table(points, title))
        for note in result.skipped:
            out.print(f"skipped {note}")
        if args.out_dir:
            out.print(f"wrote {args.out_dir}/sweep.md, sweep.json and sweep.png")


def cmd_stats(args: argparse.Namespace) -> None:
    from moebalance.workloads.stats import layer_skew

    load = _read_load(args)
    skew = layer_skew(load.counts)
    if args.json:
        doc = {k: np.asarray(getattr(skew, k)).tolist() for k in ("peak_to_mean", "top2_share", "cv", "drift",
                                                                   "hot_experts", "high_skew")}
        dense = np.flatnonzero(load.counts.sum(axis=(0, 2)) == 0).tolist()
        ids = None if load.layer_ids is None else load.layer_ids.tolist()
        sys.stdout.write(dumps({"shape": list(load.counts.shape), "preset": load.preset, "dense_layers": dense,
                                "layer_ids": ids, **doc}))
        return
    out.print(_stats_table(load, skew))
    _print_trace_stats(load)


def _stats_table(load: LoadMatrix, skew: Any) -> Table:
    B, L, E = load.counts.shape
    title = (f"{load.preset or 'load'}: {B} batches x {L} layers x {E} experts; "
             f"{int(np.sum(skew.high_skew))} of {L} layers high-skew (peak/mean > 10, CRAFT)")
    table = Table(title=title, title_justify="left")
    for col in ("layer", "peak/mean", "top-2 share", "CV", "batch drift", "hot experts", ""):
        table.add_column(col, justify="right")
    ptm = np.asarray(skew.peak_to_mean)
    scale = max(float(np.nanmax(ptm)), 1.0)
    dense = load.counts.sum(axis=(0, 2)) == 0
    for layer in range(L):
        if dense[layer]:  # no token reached an expert: a dense layer in the model's numbering (scores skip it)
            table.add_row(str(layer), "-", "-", "-", "-", "-", "[dim]dense (no load)[/]")
            continue
        bar = "█" * max(1, round(20 * float(ptm[layer]) / scale))
        table.add_row(str(layer if load.layer_ids is None else int(load.layer_ids[layer])), f"{ptm[layer]:.1f}", f"{100 * skew.top2_share[layer]:.1f}%", f"{skew.cv[layer]:.2f}",
                      f"{skew.drift[layer]:.3f}", str(int(skew.hot_experts[layer])),
                      f"[red]{bar}[/]" if skew.high_skew[layer] else bar)
    return table


def _print_trace_stats(load: LoadMatrix) -> None:
    if load.trace is None:
        return
    from moebalance.workloads import stats

    tr = load.trace
    if tr.num_tokens == 0:
        out.print("token-level: the trace holds no tokens")
        return
    num_gpus = int(tr.src_gpu.max()) + 1
    loc = stats.locality(tr.topk_ids, tr.src_gpu, tr.num_experts)
    co = stats.coactivation_strength(tr.topk_ids, tr.num_experts)
    xl = stats.transition_strength(tr.topk_ids, tr.num_experts)
    out.print(f"token-level: {tr.num_tokens:,} tokens on {num_gpus} GPUs, top-{tr.top_k}; "
              f"per-GPU demand vs global (locality) {float(np.mean(loc)):.3f}; co-activation MI "
              f"{float(np.mean(co)):.3f} bits; cross-layer MI {float(np.mean(xl)) if np.size(xl) else 0.0:.3f} bits")


def cmd_demo(args: argparse.Namespace) -> None:
    from moebalance.app.demo import DEMO, intro

    t0 = time.perf_counter()
    for heading, comparison, folder in DEMO:
        load = read_load(comparison.load)
        out.rule(f"[bold]{heading}[/]")
        for line in intro(comparison, load):
            out.print(line)
        rows, plans = _run_scenarios(load, comparison.cluster, comparison.scenarios, comparison.train_frac,
                                     comparison.seed)
        shown = [rows[sc.name] for sc in comparison.scenarios if sc.shown]
        routers = {get_router(sc.router).label for sc in comparison.scenarios if sc.shown}
        title = _title(load, comparison.load, comparison.cluster, comparison.scenarios[0].budget, comparison.train_frac,
                       routers.pop() if len(routers) == 1 else "per row")
        out_dir = None if args.out_dir is None else str(Path(args.out_dir) / folder)
        _emit_comparison(shown, plans, title, out_dir, False, comparison.notes(rows))
    out.print(f"Done in {time.perf_counter() - t0:.1f} s. Try: moebalance stats --load <file>, "
              "moebalance synth --help, moebalance compare --help.")


def _add_cluster(p: argparse.ArgumentParser, budget_required: bool = True) -> None:
    p.add_argument("--nodes", type=int, required=True, help="number of nodes N")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node M (G = N * M)")
    g = p.add_mutually_exclusive_group(required=budget_required)
    g.add_argument("--slots-per-gpu", type=int, help="experts per GPU per layer, the same in every layer (EPLB)")
    g.add_argument("--replicas-per-gpu", type=_replicas, metavar="R|auto",
                   help="extra expert slots per GPU over all layers (CRAFT's R; craft accepts auto)")
    p.add_argument("--groups", type=int, help="expert groups for eplb's hierarchical policy (default: the preset's)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="policy parameter (repeatable)")
    p.add_argument("--auto-by", choices=("gain", "goodput"), default="gain",
                   help="craft with --replicas-per-gpu auto: choose R by CRAFT's balancedness curve (gain) or by "
                        "modelled goodput (needs --gpu)")
    _add_links(p)


def _add_format(p: argparse.ArgumentParser) -> None:
    from moebalance.engines import LOAD_FORMATS

    p.add_argument("--format", choices=LOAD_FORMATS,
                   help="the --load file's format (default: detected; SGLang .pt/.json dumps, TensorRT-LLM "
                        "statistics folders, vLLM routed experts, moebalance .npy/.npz)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moebalance", description="Plan, score and compare expert placements for MoE inference.")
    parser.add_argument("--version", action="version", version="moebalance 0.1.0")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("synth", help="generate a synthetic routing trace for a real model")
    p.add_argument("--preset", required=True, help="model preset, e.g. deepseek-v3, kimi-k2, qwen3-30b-a3b")
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--tokens-per-batch", type=int, required=True)
    p.add_argument("--gpus", type=int, required=True, help="data-parallel ranks the tokens live on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-level", action="store_true", help="also write topk_ids, src_gpu and batch")
    p.add_argument("--out", required=True, help="output .npz")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("plan", help="compute a placement plan")
    p.add_argument("--load", required=True, help=".npy [L, E] / [B, L, E], .npz with counts, bundled:NAME, or an "
                                                 "engine's dump (SGLang .pt/.json, TensorRT-LLM statistics folder)")
    p.add_argument("--policy", required=True, help=f"one of: {', '.join(POLICIES)}")
    _add_cluster(p)
    p.add_argument("--batches", help="plan on batches a:b only")
    p.add_argument("--out", required=True, help="output plan .json")
    p.add_argument("--model", help="with --gpu: the model served (default: the load's preset)")
    p.add_argument("--seed", type=_non_negative, default=0)
    cost_commands.add_cost_options(p, gpu_required=False)
    _add_format(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("evaluate", help="score a plan by replaying a load through it")
    p.add_argument("--plan", required=True, help="a moebalance plan, or an engine's placement: SGLang "
                                                 "(physical_to_logical_map .json/.pt), TensorRT-LLM load-balancer YAML")
    p.add_argument("--plan-format", choices=("moebalance", "sglang", "trtllm"), help="default: detected")
    p.add_argument("--nodes", type=int, help="nodes the engine's placement is laid out on (engine files only)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (engine files only)")
    p.add_argument("--load", required=True)
    _add_router(p)
    p.add_argument("--batches", help="score batches a:b only (e.g. the held-out ones)")
    p.add_argument("--seed", type=_non_negative, default=0, help="seed of the random router")
    p.add_argument("--hidden-size", type=_positive, help="bytes of traffic per copy = hidden size x dtype bytes")
    p.add_argument("--dtype-bytes", type=_positive, default=2)
    _add_links(p)
    p.add_argument("--json", action="store_true")
    _add_format(p)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("compare", help="plan with several policies and score them on held-out batches")
    p.add_argument("--load", required=True)
    p.add_argument("--policies", required=True, help="comma-separated, e.g. contiguous,greedy,eplb")
    _add_cluster(p)
    p.add_argument("--train-frac", type=float, default=0.5, help="fraction of batches to plan on (rest scored)")
    _add_router(p, several=True)
    p.add_argument("--seed", type=_non_negative, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out-dir", help="write comparison.md, comparison.json, a PNG and the plans here")
    p.add_argument("--baseline", action="append", metavar="FILE",
                   help="also score this placement as it is (a moebalance plan, SGLang's --init-expert-location "
                        "file, TensorRT-LLM's load-balancer YAML; repeatable): what the engine runs today")
    p.add_argument("--baseline-format", choices=("moebalance", "sglang", "trtllm"), help="default: detected")
    p.add_argument("--model", help="with --gpu: the model served (default: the load's preset)")
    cost_commands.add_cost_options(p, gpu_required=False)
    _add_format(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("sweep", help="balancedness against extra replicas per GPU (CRAFT Figures 1 and 8)")
    p.add_argument("--load", required=True)
    p.add_argument("--policies", default="eplb,craft", help="from craft, uniform, eplb, greedy, contiguous")
    p.add_argument("--replicas-per-gpu", default="0,1,2,4,8,16,32", help="comma-separated R values")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--groups", type=int, help="expert groups for eplb (default: the preset's)")
    p.add_argument("--train-frac", type=float, default=0.5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out-dir", help="write sweep.md, sweep.json and sweep.png here")
    p.add_argument("--model", help="with --gpu: the model served (default: the load's preset)")
    p.add_argument("--seed", type=_non_negative, default=0)
    cost_commands.add_cost_options(p, gpu_required=False)
    _add_links(p)
    _add_format(p)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("stats", help="per-layer skew of a load or trace")
    p.add_argument("--load", required=True)
    p.add_argument("--json", action="store_true")
    _add_format(p)
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("demo", help="compare every policy on bundled DeepSeek-V3-like data")
    p.add_argument("--out-dir", default="demo-out")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("import", help="convert an engine's routing dump into a moebalance load (.npz), once")
    p.add_argument("--load", required=True, help="SGLang dump (.pt/.json, or a folder of per-rank dumps), TensorRT-LLM "
                                                 "statistics folder, vLLM routed experts (JSON responses, .npy, folder)")
    p.add_argument("--out", required=True, help="output .npz")
    p.add_argument("--gpus", type=_positive, default=1, help="vLLM: data-parallel ranks the requests go to")
    p.add_argument("--batch-tokens", type=_positive, default=4096, help="vLLM: tokens per batch (whole requests)")
    p.add_argument("--experts", type=_positive, help="vLLM: experts per layer (default: the largest id seen + 1)")
    _add_format(p)
    p.set_defaults(func=engine_commands.cmd_import)

    p = sub.add_parser("export", help="write a plan in the form an engine loads (SGLang, TensorRT-LLM, vLLM)")
    p.add_argument("--plan", required=True)
    p.add_argument("--format", required=True, choices=tuple(engine_commands.EXPORT_FORMATS),
                   help="sglang: --init-expert-location JSON; trtllm: load-balancer YAML; vllm: per-MoE-layer "
                        "physical-to-logical JSON")
    p.add_argument("--out", required=True, help="output file (.json, or .yaml for trtllm)")
    p.add_argument("--pad", action="store_true",
                   help="fill GPUs up to the plan's largest slot count with the copies that balance best (needs --load)")
    p.add_argument("--load", help="the load the plan was made on (for --pad)")
    p.add_argument("--load-format", choices=("moebalance", "sglang", "trtllm"), help="--load's format (default: detected)")
    p.add_argument("--dense-layers", metavar="L1,L2,...",
                   help="layers to leave out of trtllm and vllm files (default: those the plan's load had no load in)")
    p.add_argument("--layer-updates-per-iter", type=_non_negative, default=0,
                   help="trtllm: layers updated online per iteration (0: static)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=engine_commands.cmd_export)

    cost_commands.add_cost_parser(sub)
    cost_commands.add_calibrate_parser(sub)

    p = sub.add_parser("predict", help="how much of each token's routing a predictor foresees (Libra's accuracy)")
    p.add_argument("--load", required=True, help="token-level trace to predict (a capture, for lookahead with "
                                                 "--hidden-states)")
    p.add_argument("--predictor", required=True, help="lookahead, path, history or oracle")
    p.add_argument("--build", action="append", metavar="TRACE",
                   help="token-level trace the path table is built on (repeatable; not the evaluated text)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="predictor option: depth=2 (path: previous layers in a key), window=1 (history: batches)")
    p.add_argument("--batches", help="predict batches a:b only")
    p.add_argument("--checkpoint", help="the model that made the capture (lookahead; default: the bundled model of "
                                        "the capture's shape)")
    p.add_argument("--json", action="store_true")
    _add_format(p)
    p.set_defaults(func=online_commands.cmd_predict)

    p = sub.add_parser("online", help="replay a trace batch by batch as a server would: static, periodic and "
                                      "dynamic (libra) planning")
    p.add_argument("--load", required=True)
    p.add_argument("--policy", required=True, metavar="NAME[,NAME...]",
                   help=f"one or more of: {', '.join([*POLICIES, *DYNAMIC_POLICIES])}")
    _add_cluster(p)
    p.add_argument("--router", help="router for every policy (default: uniform for static policies, rebalance for "
                                    "libra)")
    p.add_argument("--router-set", action="append", metavar="KEY=VALUE", help="router option (repeatable)")
    p.add_argument("--warmup", required=True, metavar="A:B", help="batches the first plan is made on")
    p.add_argument("--batches", metavar="C:D", help="batches served (default: every batch after the warm-up)")
    p.add_argument("--replan-every", type=_positive, metavar="K",
                   help="static policies re-plan before every K-th served batch (vLLM's step interval)")
    p.add_argument("--window", type=_positive, metavar="W",
                   help="batches a re-plan looks back on (vLLM's window size; default K)")
    p.add_argument("--build", action="append", metavar="TRACE",
                   help="token-level trace for libra's path table (default: the warm-up batches)")
    p.add_argument("--checkpoint", help="the model that made the capture (libra with lookahead)")
    p.add_argument("--seed", type=_non_negative, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out-dir", help="write online.md, online.json and online.png (imbalance per batch) here")
    p.add_argument("--model", help="also model the copies each batch loads (prefetch GB, ms per GPU and layer over "
                                   "--intra-link), for this model")
    _add_format(p)
    p.set_defaults(func=online_commands.cmd_online)

    p = sub.add_parser("capture", help="run the bundled MoE LM on text and write its token-level routing trace")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--domain", choices=("code", "prose"), help="the held-out split of a training domain")
    src.add_argument("--text", help="a text file (read as bytes)")
    p.add_argument("--tokens", type=_positive, required=True, help="tokens to capture (whole sequences)")
    p.add_argument("--offset", type=_non_negative, default=0, help="skip this many tokens of the text first")
    p.add_argument("--gpus", type=_positive, required=True, help="data-parallel ranks the sequences go to")
    p.add_argument("--batch-tokens", type=_positive, required=True, help="tokens per batch (a multiple of seq len)")
    p.add_argument("--seq-len", type=_positive, help="tokens per sequence (default: the model's context)")
    p.add_argument("--hidden-states", action="store_true", help="also store each MoE layer's input (float16)")
    p.add_argument("--checkpoint", help="model .safetensors (default: the bundled 8-layer, 32-expert, top-4 model)")
    p.add_argument("--out", required=True, help="output .npz")
    p.set_defaults(func=lm_commands.cmd_capture)

    p = sub.add_parser("run", help="run the MoE LM expert-parallel on local gloo ranks (or under torchrun) under a "
                                   "plan, and check it")
    p.add_argument("--world-size", type=_positive,
                   help="local ranks, one per GPU of the plan (under torchrun: WORLD_SIZE, the default)")
    p.add_argument("--plan", required=True)
    _add_router(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--domain", choices=("code", "prose"), help="the held-out split of a training domain")
    src.add_argument("--text", help="a text file (read as bytes)")
    p.add_argument("--tokens", type=_positive, default=4096, help="tokens to run (whole sequences)")
    p.add_argument("--offset", type=_non_negative, default=0, help="skip this many tokens of the text first")
    p.add_argument("--batch-tokens", type=_positive, default=2048, help="tokens per forward step")
    p.add_argument("--seed", type=_non_negative, default=0, help="router seed")
    p.add_argument("--checkpoint", help="model .safetensors (default: the bundled model of the plan's layers and "
                                        "experts)")
    p.add_argument("--two-stage", action="store_true",
                   help="Libra's two-stage execution: the router runs in a CPU thread while the local picks compute "
                        "(rebalance or locality); reports whether it finished inside the local phase")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lm_commands.cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except MoebalanceError as exc:
        sys.stderr.write(f"moebalance: error: {exc}\n")
        return 2
    except OSError as exc:  # unwritable output folder, disk full, ...
        sys.stderr.write(f"moebalance: error: {exc.strerror or exc}: {exc.filename or ''}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
