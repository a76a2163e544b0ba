"""The ``moebalance`` command line.

User mistakes (bad files, bad budgets, unknown names) print one line ``moebalance: error: ...`` and exit 2,
leaving no output file behind. Long steps show a progress bar on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moebalance.app.report import (
    ComparisonRow,
    atomic_write_text,
    comparison_markdown,
    comparison_table,
    dumps,
    plot_per_layer,
    score_table,
)
from moebalance.core.cluster import LINK_PRESETS, Cluster
from moebalance.core.errors import InputError, MoebalanceError
from moebalance.core.load import LoadMatrix, parse_batch_range, read_load, write_load
from moebalance.core.plan import read_plan, write_plan
from moebalance.policies import POLICIES, Budget, make_plan
from moebalance.routing import ROUTERS
from moebalance.routing.simulate import evaluate

__all__ = ["main"]

BUNDLED_DATA = "deepseek_v3_8x8.npz"

# Wide enough for the comparison table when stdout is a file or a pipe (rich would assume 80 columns).
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 140)
err = Console(stderr=True, highlight=False, soft_wrap=True)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"moebalance: error: {message} (see: {self.prog} --help)\n")
        raise SystemExit(2)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True, disable=not err.is_terminal)


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


def _parse_set(items: Sequence[str] | None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"--set {item!r} must look like key=value")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


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
    if hidden_size is None and load.preset is not None:
        from moebalance.workloads.synth import PRESETS

        preset = PRESETS.get(load.preset)
        hidden_size = None if preset is None else preset.hidden_size
    return None if hidden_size is None else hidden_size * dtype_bytes


def _check_out(path: str, suffix: str) -> Path:
    p = Path(path)
    if p.suffix != suffix:
        raise InputError(f"output {path!r} must end in {suffix}")
    if p.exists() and p.is_dir():
        raise InputError(f"output {path!r} is a folder; give a file name ending in {suffix}")
    return p


# ----- commands ------------------------------------------------------------------------------------------------

def cmd_synth(args: argparse.Namespace) -> None:
    from moebalance.workloads.synth import get_preset, synthesize

    dest = _check_out(args.out, ".npz")
    preset = get_preset(args.preset)
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
    load = read_load(args.load)
    start, stop = parse_batch_range(args.batches, load.num_batches)
    load = load.select_batches(start, stop)
    params = _parse_set(args.set)
    if args.groups is not None:
        params["num_groups"] = args.groups
    plan, seconds = make_plan(args.policy, load, _cluster(args), _budget(args), **params)
    plan = type(plan)(plan.gpu_experts, plan.num_experts, plan.cluster, policy=plan.policy,
                      params={**plan.params, "planned_on_batches": f"{start}:{stop}"}, weights=plan.weights)
    score = evaluate(plan, load)  # before writing: a load that cannot be scored leaves no plan behind
    write_plan(dest, plan)
    for w in plan.warnings:
        err.print(f"warning: {w}")
    out.print(f"wrote {dest}: {plan.policy}, {plan.extra_replicas} extra replicas, "
              f"{plan.max_slots_per_gpu} max slots per GPU, planned in {1000 * seconds:.1f} ms; "
              f"in-sample balancedness {score.balancedness:.4f}")


def cmd_evaluate(args: argparse.Namespace) -> None:
    plan = read_plan(args.plan)
    if _links(args):  # plan files record the topology, not the links: the time model takes them from here
        c = plan.cluster
        plan = dataclasses.replace(plan, cluster=Cluster(num_nodes=c.num_nodes, gpus_per_node=c.gpus_per_node,
                                                         **_links(args)))
    load = read_load(args.load)
    start, stop = parse_batch_range(args.batches, load.num_batches)
    load = load.select_batches(start, stop)
    score = evaluate(plan, load, args.router, seed=args.seed,
                     bytes_per_copy=_bytes_per_copy(load, args.hidden_size, args.dtype_bytes))
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
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise InputError("--policies is empty; give names like contiguous,greedy,eplb")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise InputError(f"unknown policy {unknown[0]!r}; choose from: {', '.join(POLICIES)}")
    load = read_load(args.load)
    params = _parse_set(args.set)
    per_policy: dict[str, dict[str, Any]] = {p: {} for p in policies}
    if args.groups is not None and "eplb" in per_policy:
        per_policy["eplb"]["num_groups"] = args.groups
    for key, value in params.items():  # --set policy.key=value, or key=value for every policy taking it
        pol, dot, name = key.partition(".")
        if dot:
            if pol not in per_policy:
                raise InputError(f"--set {key}: policy {pol!r} is not being compared")
            per_policy[pol][name] = value
        else:
            for p in policies:
                per_policy[p][key] = value
    rows, plans = _run_compare(load, policies, args, per_policy)
    _emit_comparison(rows, plans, load, args)


def _run_compare(load: LoadMatrix, policies: list[str], args: argparse.Namespace,
                 per_policy: dict[str, dict[str, Any]]) -> tuple[list[ComparisonRow], dict[str, Any]]:
    from moebalance.app.compare import compare_policies

    with _progress() as progress:
        task = progress.add_task("plan + score", total=len(policies))
        return compare_policies(load, policies, _cluster(args), _budget(args), train_frac=args.train_frac,
                                router=args.router, seed=args.seed, params=per_policy,
                                bytes_per_copy=_bytes_per_copy(load, None, 2),
                                on_done=lambda _: progress.advance(task))


def _title(load: LoadMatrix, args: argparse.Namespace) -> str:
    train, test = load.split(args.train_frac)
    what = load.preset or Path(args.load).name
    return (f"{what}: {load.num_layers} layers x {load.num_experts} experts on {args.nodes}x{args.gpus_per_node} GPUs, "
            f"{_budget(args).describe()}, planned on {train.num_batches} batches, scored on "
            f"{test.num_batches}{' held-out' if args.train_frac < 1 else ''} ({args.router} router)")


def _emit_comparison(rows: list[ComparisonRow], plans: dict[str, Any], load: LoadMatrix,
                     args: argparse.Namespace, notes: Sequence[str] = ()) -> None:
    title = _title(load, args)
    doc = {"title": title, "rows": [r.as_dict() for r in rows]}
    for r in rows:
        for w in r.warnings:
            err.print(f"warning: {r.policy}: {w}")
    if args.out_dir:
        d = Path(args.out_dir)
        atomic_write_text(d / "comparison.md", comparison_markdown(
            rows, title, [*notes, "", "![per-layer balancedness](per_layer_balancedness.png)"]))
        atomic_write_text(d / "comparison.json", dumps(doc))
        plot_per_layer(rows, d / "per_layer_balancedness.png", title)
        for name, plan in plans.items():
            write_plan(d / f"plan-{name}.json", plan)
    if args.json:
        sys.stdout.write(dumps(doc))
    else:
        out.print(comparison_table(rows, title))
        for note in notes:
            out.print(note)
        if args.out_dir:
            out.print(f"wrote {args.out_dir}/comparison.md, comparison.json, per_layer_balancedness.png and plans")


def cmd_sweep(args: argparse.Namespace) -> None:
    from moebalance.app.report import plot_sweep, sweep_markdown, sweep_table
    from moebalance.app.sweep import sweep, sweep_steps

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        replicas = [int(r) for r in args.replicas_per_gpu.split(",") if r.strip()]
    except ValueError:
        raise InputError(f"--replicas-per-gpu {args.replicas_per_gpu!r} must be integers like 0,1,2,4,8") from None
    load = read_load(args.load)
    cluster = _cluster(args)
    steps = sweep_steps(load, cluster, policies, replicas) if policies else 0
    with _progress() as progress:
        task = progress.add_task("sweep", total=steps)
        result = sweep(load, cluster, policies, replicas, train_frac=args.train_frac, num_groups=args.groups,
                       on_step=lambda: progress.advance(task))
    points = result.points
    train, test = load.split(args.train_frac)
    title = (f"{load.preset or Path(args.load).name}: {load.num_layers} layers x {load.num_experts} experts on "
             f"{args.nodes}x{args.gpus_per_node} GPUs, planned on {train.num_batches} batches, scored on "
             f"{test.num_batches}{' held-out' if args.train_frac < 1 else ''}; gain over placement-only greedy")
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

    load = read_load(args.load)
    skew = layer_skew(load.counts)
    if args.json:
        doc = {k: np.asarray(getattr(skew, k)).tolist() for k in ("peak_to_mean", "top2_share", "cv", "drift",
                                                                   "hot_experts", "high_skew")}
        sys.stdout.write(dumps({"shape": list(load.counts.shape), "preset": load.preset, **doc}))
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
    for layer in range(L):
        bar = "█" * max(1, round(20 * float(ptm[layer]) / scale))
        table.add_row(str(layer), f"{ptm[layer]:.1f}", f"{100 * skew.top2_share[layer]:.1f}%", f"{skew.cv[layer]:.2f}",
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
    t0 = time.perf_counter()
    data = resources.files("moebalance.workloads") / "data" / BUNDLED_DATA
    with resources.as_file(data) as path:
        load = read_load(path)
    from moebalance.workloads.stats import layer_skew

    skew = layer_skew(load.counts)
    out.rule("[bold]moebalance demo[/]")
    out.print(f"Bundled data: {load.preset} routing, {load.num_batches} batches x {load.num_layers} layers x "
              f"{load.num_experts} experts (synthetic, calibrated to CRAFT/MoETuner observations; docs/synth.md).")
    out.print(f"Skew: peak/mean expert load ranges {np.min(skew.peak_to_mean):.1f}x to "
              f"{np.max(skew.peak_to_mean):.1f}x; {int(np.sum(skew.high_skew))} of {load.num_layers} layers "
              "are high-skew (> 10x).")
    ns = argparse.Namespace(load=BUNDLED_DATA, nodes=8, gpus_per_node=8, slots_per_gpu=5, replicas_per_gpu=None,
                            train_frac=0.5, router="uniform", seed=0, json=False, out_dir=args.out_dir)
    # craft takes a replicas budget (below); grace and moetuner work from token-level statistics
    # (co-activation, cross-layer transitions), shown in part 2
    slot_policies = [p for p in POLICIES if p not in ("craft", "grace", "moetuner")]
    rows, plans = _run_compare(load, slot_policies, ns, {p: {} for p in slot_policies})
    # DeepSeek-V3 has 8 expert groups, so on 8 nodes EPLB runs its hierarchical policy; show the global too
    extra, extra_plans = _run_compare(load, ["eplb"], ns, {"eplb": {"num_groups": 1}})
    rows.append(dataclasses.replace(extra[0], policy="eplb (global)"))
    plans["eplb-global"] = extra_plans["eplb"]
    if "craft" in POLICIES:  # CRAFT with R = 8 extra slots per GPU: 1/7 of EPLB's 58 per GPU (one per layer)
        craft_ns = argparse.Namespace(**{**vars(ns), "slots_per_gpu": None, "replicas_per_gpu": 8})
        craft_rows, craft_plans = _run_compare(load, ["craft"], craft_ns, {"craft": {}})
        rows.append(dataclasses.replace(craft_rows[0], policy="craft (R=8)"))
        plans["craft"] = craft_plans["craft"]
    random_rows, _ = _run_compare(load, ["eplb"], argparse.Namespace(**{**vars(ns), "router": "random"}),
                                  {"eplb": {"num_groups": 1}})
    notes = [
        "- EPLB's hierarchical policy packs one expert group per node (DeepSeek-V3 has 8 groups, here 8 nodes), "
        "so node loads follow group loads; its global policy ignores groups.",
        f"- EPLB (global) under vLLM/SGLang-style random replica choice: balancedness "
        f"{random_rows[0].score.balancedness:.4f} (equal split: {extra[0].score.balancedness:.4f}).",
        "- craft (R=8) has a budget of 8 extra expert slots per GPU over all layers, 1/7 of EPLB's 58 here.",
        "- Gap to bound: how far the straggler is above max(total / G, max_e load_e / replicas_e).",
    ]
    _emit_comparison(rows, plans, load, ns, notes)
    if "grace" in POLICIES:
        _demo_traffic(args)
    out.print(f"Done in {time.perf_counter() - t0:.1f} s. Try: moebalance stats --load <file>, "
              "moebalance synth --help, moebalance compare --help.")


def _demo_traffic(args: argparse.Namespace) -> None:
    """Part 2 of the demo: traffic against balance on a token-level trace (GRACE-MoE Section 5.3)."""
    name = "bundled:olmoe-1b-7b-tokens"
    load = read_load(name)
    out.rule("[bold]part 2: all-to-all traffic (token-level trace)[/]")
    out.print(f"Bundled data: {load.preset} token-level routing, {load.trace.num_tokens if load.trace else 0:,} "
              f"tokens on 8 ranks, {load.num_layers} layers x {load.num_experts} experts, top-8; 2 nodes x 4 GPUs.")
    ns = argparse.Namespace(load=name, nodes=2, gpus_per_node=4, slots_per_gpu=10, replicas_per_gpu=None,
                            train_frac=0.5, router="uniform", seed=0, json=False,
                            out_dir=None if args.out_dir is None else str(Path(args.out_dir) / "traffic"))
    rows: list[ComparisonRow] = []
    plans: dict[str, Any] = {}
    for label, policy, params, router in (
            ("contiguous", "contiguous", {}, "uniform"),
            ("moetuner", "moetuner", {}, "uniform"),
            ("eplb (random router)", "eplb", {"num_groups": 1}, "random"),
            ("grace, no replicas", "grace", {"replication": "none"}, "uniform"),
            ("grace (wrr router)", "grace", {}, "wrr"),
            ("grace (locality router)", "grace", {}, "locality")):
        got, got_plans = _run_compare(load, [policy], argparse.Namespace(**{**vars(ns), "router": router}),
                                      {policy: params})
        rows.append(dataclasses.replace(got[0], policy=label))
        plans[label.split(" (")[0].replace(", ", "-").replace(" ", "-")] = got_plans[policy]
    notes = [
        "- All plans get 10 expert slots per GPU per layer (64 experts on 8 GPUs need 8): EPLB fills them with "
        "replicas; GRACE uses them for uneven affinity groups and a few replicas of hot experts.",
        "- GRACE co-locates experts that the same tokens pick, cutting inter-node copies at a cost in balance; "
        "its locality router keeps tokens on their own GPU or node when a replica is there.",
        "- MoETuner balances each layer's clusters of experts with an integer program (ILP 1, to the requested gap) "
        "and puts experts that pass tokens to each other in adjacent layers on the same GPU (ILP 2); results in "
        "its own traffic model are in docs/results/moetuner.md.",
        "- All-to-all time: dispatch + combine over the busiest link (450 GB/s NVLink, 50 GB/s per GPU across "
        "nodes), 2-byte activations of the model's hidden size.",
    ]
    ns.router = "per row"
    _emit_comparison(rows, plans, load, ns, notes)


def _model_tokens(args: argparse.Namespace) -> tuple[np.ndarray, str]:
    """The tokens ``capture`` / ``run`` read: a text file, or a domain's held-out split; and what they are."""
    from moebalance.model.data import domain_tokens, text_tokens

    budget = None if args.tokens is None else args.offset + args.tokens
    if args.text is not None:
        tokens, what = text_tokens(args.text, budget), f"{Path(args.text).name} tokens"
    else:
        tokens, what = domain_tokens(args.domain, "heldout", budget), f"held-out {args.domain} tokens"
    if budget is not None and tokens.size < budget:
        raise InputError(f"--offset {args.offset} + --tokens {args.tokens} exceeds the {tokens.size} {what} "
                         "available; give fewer")
    if args.offset:
        what += f" from token {args.offset}"
    return tokens[args.offset:], what


def cmd_capture(args: argparse.Namespace) -> None:
    from moebalance.model.capture import capture, write_capture
    from moebalance.model.moe_lm import load_checkpoint
    from moebalance.workloads.stats import layer_skew

    dest = _check_out(args.out, ".npz")
    model = load_checkpoint(args.checkpoint)
    tokens, what = _model_tokens(args)
    seq_len = args.seq_len or model.config.max_seq_len
    with _progress() as progress:
        task = progress.add_task("capture", total=tokens.size // seq_len * seq_len)
        cap = capture(model, tokens, num_gpus=args.gpus, batch_tokens=args.batch_tokens, seq_len=seq_len,
                      hidden_states=args.hidden_states, progress=lambda n: progress.advance(task, n))
    write_capture(dest, cap)
    load = cap.load
    ptm = layer_skew(load.counts).peak_to_mean
    out.print(f"wrote {dest}: token-level trace of {cap.token_ids.size:,} {what} on {args.gpus} ranks, "
              f"[B, L, E] = {list(load.counts.shape)}, top-{model.config.top_k}"
              f"{', with hidden states' if args.hidden_states else ''}; peak/mean expert load per layer "
              + " ".join(f"{v:.2f}" for v in ptm))


def cmd_run(args: argparse.Namespace) -> None:
    from moebalance.model.capture import make_layout
    from moebalance.model.moe_lm import load_checkpoint
    from moebalance.model.run import LOGIT_TOLERANCE, check_plan, run_model

    plan = read_plan(args.plan)
    model = load_checkpoint(args.checkpoint)
    check_plan(plan, model, args.world_size)
    for w in plan.warnings:
        err.print(f"warning: {w}")
    tokens, what = _model_tokens(args)
    seq_len = model.config.max_seq_len
    layout = make_layout(tokens.size, seq_len=seq_len, batch_tokens=args.batch_tokens, num_gpus=args.world_size)
    with _progress() as progress:
        task = progress.add_task("dense reference", total=layout.num_batches)
        report = run_model(args.checkpoint, plan, tokens, world_size=args.world_size, router=args.router,
                           router_seed=args.seed, batch_tokens=args.batch_tokens,
                           progress=lambda n: progress.advance(task, n))
    if args.json:
        sys.stdout.write(dumps(report.as_dict()))
    else:
        c = plan.cluster
        table = Table(title=f"{args.plan}: {plan.policy} on {c.num_nodes}x{c.gpus_per_node} GPUs, {args.router} "
                            f"router; {report.num_tokens:,} {what} in {report.num_batches} batches",
                      title_justify="left")
        for col in ("rank", "tokens", "picks computed", "simulator", "expert s", "intra-node MB", "inter-node MB"):
            table.add_column(col, justify="right")
        for r in report.ranks:
            table.add_row(str(r.rank), f"{r.tokens:,}", f"{r.picks_computed:,}", f"{r.picks_predicted:,}",
                          f"{r.expert_seconds:.3f}", f"{r.intra_node_bytes / 1e6:.2f}", f"{r.inter_node_bytes / 1e6:.2f}")
        out.print(table)
        out.print(f"logits vs the dense single-process model: max abs diff {report.max_abs_logit_diff:.2e} "
                  f"({'agree' if report.logits_agree else 'DIFFER'}, tolerance {LOGIT_TOLERANCE:g}); "
                  f"routing differs in {report.routing_mismatches} picks")
        out.print(f"picks per rank, batch and layer == simulator ({args.router} router's assign_tokens on the "
                  f"trace the run saw): {'yes' if report.counts_match else 'NO'}; runtime balancedness "
                  f"{report.balancedness:.4f}; {report.seconds:.1f} s")
    if not (report.counts_match and report.logits_agree):
        sys.stderr.write("moebalance: run: the expert-parallel run disagrees with the dense reference or the "
                         "simulator\n")
        raise SystemExit(1)


# ----- parser --------------------------------------------------------------------------------------------------

def _add_cluster(p: argparse.ArgumentParser, budget_required: bool = True) -> None:
    p.add_argument("--nodes", type=int, required=True, help="number of nodes N")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node M (G = N * M)")
    g = p.add_mutually_exclusive_group(required=budget_required)
    g.add_argument("--slots-per-gpu", type=int, help="experts per GPU per layer, the same in every layer (EPLB)")
    g.add_argument("--replicas-per-gpu", type=_replicas, metavar="R|auto",
                   help="extra expert slots per GPU over all layers (CRAFT's R; craft accepts auto)")
    p.add_argument("--groups", type=int, help="expert groups for eplb's hierarchical policy (default: the preset's)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="policy parameter (repeatable)")
    _add_links(p)


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
    p.add_argument("--load", required=True, help=".npy [L, E] / [B, L, E], .npz with counts, or bundled:NAME")
    p.add_argument("--policy", required=True, help=f"one of: {', '.join(POLICIES)}")
    _add_cluster(p)
    p.add_argument("--batches", help="plan on batches a:b only")
    p.add_argument("--out", required=True, help="output plan .json")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("evaluate", help="score a plan by replaying a load through it")
    p.add_argument("--plan", required=True)
    p.add_argument("--load", required=True)
    p.add_argument("--router", default="uniform", choices=sorted(ROUTERS))
    p.add_argument("--batches", help="score batches a:b only (e.g. the held-out ones)")
    p.add_argument("--seed", type=_non_negative, default=0, help="seed of the random router")
    p.add_argument("--hidden-size", type=_positive, help="bytes of traffic per copy = hidden size x dtype bytes")
    p.add_argument("--dtype-bytes", type=_positive, default=2)
    _add_links(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("compare", help="plan with several policies and score them on held-out batches")
    p.add_argument("--load", required=True)
    p.add_argument("--policies", required=True, help="comma-separated, e.g. contiguous,greedy,eplb")
    _add_cluster(p)
    p.add_argument("--train-frac", type=float, default=0.5, help="fraction of batches to plan on (rest scored)")
    p.add_argument("--router", default="uniform", choices=sorted(ROUTERS))
    p.add_argument("--seed", type=_non_negative, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out-dir", help="write comparison.md, comparison.json, a PNG and the plans here")
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
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("stats", help="per-layer skew of a load or trace")
    p.add_argument("--load", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("demo", help="compare every policy on bundled DeepSeek-V3-like data")
    p.add_argument("--out-dir", default="demo-out")
    p.set_defaults(func=cmd_demo)

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
    p.add_argument("--checkpoint", help="model .safetensors (default: the bundled one)")
    p.add_argument("--out", required=True, help="output .npz")
    p.set_defaults(func=cmd_capture)

    p = sub.add_parser("run", help="run the MoE LM expert-parallel on local gloo ranks under a plan, and check it")
    p.add_argument("--world-size", type=_positive, required=True, help="ranks, one per GPU of the plan")
    p.add_argument("--plan", required=True)
    p.add_argument("--router", default="uniform", choices=sorted(ROUTERS))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--domain", choices=("code", "prose"), help="the held-out split of a training domain")
    src.add_argument("--text", help="a text file (read as bytes)")
    p.add_argument("--tokens", type=_positive, default=4096, help="tokens to run (whole sequences)")
    p.add_argument("--offset", type=_non_negative, default=0, help="skip this many tokens of the text first")
    p.add_argument("--batch-tokens", type=_positive, default=2048, help="tokens per forward step")
    p.add_argument("--seed", type=_non_negative, default=0, help="router seed")
    p.add_argument("--checkpoint", help="model .safetensors (default: the bundled one)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_run)
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
