"""``moebalance predict`` and ``moebalance online``: prediction accuracy and batch-by-batch replay."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from moebalance.app import options
from moebalance.app.console import err, out
from moebalance.app.console import progress as _progress
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.io import atomic_write_text, dumps
from moebalance.core.load import LoadMatrix, parse_batch_range
from moebalance.engines import read_any_load

__all__ = ["cmd_online", "cmd_predict", "plot_online", "policy_params"]


def _hidden(path: str, load: LoadMatrix) -> np.ndarray | None:
    """The ``hidden_states [N, L, D]`` of a capture file, or ``None`` if it has none."""
    if not path.endswith(".npz") or not Path(path).is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as f:
            if "hidden_states" not in f.files:
                return None
            hidden = f["hidden_states"]
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read hidden states from {path!r}: {exc}") from None
    n = 0 if load.trace is None else load.trace.num_tokens
    if hidden.ndim != 3 or hidden.shape[:2] != (n, load.num_layers):
        raise InputError(f"hidden_states in {path!r} has shape {hidden.shape}; it must be [N, L, D] = [{n}, "
                         f"{load.num_layers}, D], one row per token of the trace")
    return hidden


def _model(checkpoint: str | None, load: LoadMatrix) -> Any:
    """The model a capture came from: ``--checkpoint``, else the bundled one of the trace's shape."""
    from moebalance.lm.moe_lm import bundled_for, load_checkpoint

    if load.trace is None:
        raise InputError("the lookahead predictor needs a token-level capture of the model")
    path = checkpoint or bundled_for(load.num_layers, load.num_experts, load.trace.top_k)
    model = load_checkpoint(path)
    c = model.config
    if (c.num_layers, c.num_experts, c.top_k) != (load.num_layers, load.num_experts, load.trace.top_k):
        raise InputError(f"checkpoint {str(path)!r} has {c.num_layers} MoE layers of {c.num_experts} experts, top-"
                         f"{c.top_k}, but the capture has {load.num_layers} x {load.num_experts}, top-"
                         f"{load.trace.top_k}; give the checkpoint that made the capture")
    return model


def _builds(paths: Sequence[str] | None) -> list[LoadMatrix]:
    builds = [read_any_load(p) for p in paths or ()]
    for p, b in zip(paths or (), builds, strict=True):
        if b.trace is None:
            raise InputError(f"--build {p!r} has counts only; the path table needs a token-level trace")
    shapes = {(b.trace.num_layers, b.trace.num_experts, b.trace.top_k) for b in builds if b.trace is not None}
    if len(shapes) > 1:
        raise InputError(f"the --build traces disagree on [layers, experts, top-k]: {sorted(shapes)}; give traces "
                         "of one model")
    return builds


# ----- predict -------------------------------------------------------------------------------------------------

def cmd_predict(args: argparse.Namespace) -> None:
    from moebalance.online.predictors import PREDICTORS, AccuracyTally, make_predictor

    if args.predictor not in PREDICTORS:
        raise InputError(f"unknown predictor {args.predictor!r}; choose one of: {', '.join(PREDICTORS)}")
    params = options.parse_set(args.set)
    known = {"path": ("depth",), "history": ("window",)}.get(args.predictor, ())
    for key in params:
        if key not in known:
            hint = f"its options: {', '.join(known)}" if known else "it takes none"
            raise InputError(f"predictor {args.predictor!r} has no option {key!r}; {hint}")
    load = read_any_load(args.load, args.format)
    trace = load.trace
    if trace is None:
        raise InputError(f"{args.load!r} has counts only; accuracy is per token: give a token-level trace "
                         "(topk_ids, src_gpu, batch)")
    start, stop = parse_batch_range(args.batches, load.num_batches)
    builds = _builds(args.build)
    if args.predictor == "path" and not builds:
        raise InputError("the path predictor needs a build split to learn from: give --build TRACE (a token-level "
                         "trace of other text, e.g. a capture of both domains)")
    hidden = _hidden(args.load, load) if args.predictor == "lookahead" else None
    if args.predictor == "lookahead" and hidden is None:
        raise InputError(f"{args.load!r} has no hidden states; the lookahead predictor needs a capture made with "
                         "moebalance capture ... --hidden-states")
    model = _model(args.checkpoint, load) if args.predictor == "lookahead" else None
    predictor = make_predictor(args.predictor, build=[b.trace for b in builds if b.trace is not None], hidden=hidden,
                               model=model, **params)
    G = int(trace.src_gpu.max()) + 1 if trace.num_tokens else 1
    tally = AccuracyTally(load.num_layers)
    with _progress() as progress:
        task = progress.add_task(f"predict ({args.predictor})", total=stop - start)
        for b in range(start, stop):
            lo, hi = np.searchsorted(trace.batch, [b, b + 1], side="left")
            tally.add(predictor.predict(trace, b, G), trace.topk_ids[lo:hi])
            progress.advance(task)
    overall = tally.overall()
    if overall is None:
        raise InputError(f"the {args.predictor} predictor predicts nothing on batches {start}:{stop} (history needs "
                         "earlier batches; lookahead and path need two or more layers); give other --batches")
    per_layer = tally.per_layer()
    acc_n = tally.tokens
    doc: dict[str, Any] = {"predictor": args.predictor, **predictor.describe(), "accuracy": round(overall, 6),
                           "per_layer_accuracy": [None if not np.isfinite(v) else round(float(v), 6)
                                                  for v in per_layer],
                           "batches": f"{start}:{stop}", "tokens": int(acc_n.max()), "top_k": trace.top_k}
    if args.json:
        sys.stdout.write(dumps(doc))
        return
    table = Table(title=f"{args.load}: {args.predictor} predictor on batches {start}:{stop} "
                        f"({int(acc_n.max()):,} tokens, top-{trace.top_k})", title_justify="left")
    table.add_column("layer", justify="right")
    table.add_column("accuracy", justify="right")
    for layer, v in enumerate(per_layer):
        table.add_row(str(layer), "no prediction" if not np.isfinite(v) else f"{v:.3f}")
    out.print(table)
    out.print(f"accuracy {overall:.4f}: the fraction of each token's true top-{trace.top_k} experts found in its "
              f"predicted top-{trace.top_k}, over the {int(np.isfinite(per_layer).sum())} layers with a prediction")


# ----- online --------------------------------------------------------------------------------------------------

def policy_params(params: dict[str, Any], policy: str, policies: Sequence[str]) -> dict[str, Any]:
    """The ``--set`` items for ``policy``: plain ``key=value`` go to every policy, ``policy.key=value`` to one (and
    win over a plain value of the same key)."""
    mine: dict[str, Any] = {}
    qualified: dict[str, Any] = {}
    for key, value in params.items():
        owner, dot, name = key.partition(".")
        if not dot:
            mine[key] = value
        elif owner not in policies:
            raise InputError(f"--set {key}: {owner!r} is not among --policy {','.join(policies)}")
        elif owner == policy:
            qualified[name] = value
    return {**mine, **qualified}  # a policy's own value wins over a plain one, whatever the order


def cmd_online(args: argparse.Namespace) -> None:
    from moebalance.online.replay import OnlineResult, replay
    from moebalance.policies import DYNAMIC_POLICIES, POLICIES

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not policies:
        raise InputError("--policy is empty; give a name like eplb or libra")
    for p in policies:
        if p not in POLICIES and p not in DYNAMIC_POLICIES:
            raise InputError(f"unknown policy {p!r}; choose from: {', '.join([*POLICIES, *DYNAMIC_POLICIES])}")
    router = None if args.router is None else options.router(args)
    if router is None and args.router_set:
        raise InputError("--router-set needs --router NAME")
    params = options.parse_set(args.set)
    if args.window is not None and args.replan_every is None:
        raise InputError("--window needs --replan-every K: the window is what a periodic re-plan looks at")
    out_dir = None if args.out_dir is None else Path(args.out_dir)
    if out_dir is not None and out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"--out-dir {args.out_dir!r} is a file; give a folder")
    load = read_any_load(args.load, args.format)
    warm = parse_batch_range(args.warmup, load.num_batches)
    served = (warm[1], load.num_batches) if args.batches is None else parse_batch_range(args.batches, load.num_batches)
    cluster = Cluster(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    budget = Budget(slots_per_gpu=args.slots_per_gpu, replicas_per_gpu=args.replicas_per_gpu)
    needs = {policy_params(params, p, policies).get("predictor", "lookahead") for p in policies
             if p in DYNAMIC_POLICIES}
    hidden = _hidden(args.load, load) if "lookahead" in needs else None
    model = _model(args.checkpoint, load) if "lookahead" in needs and hidden is not None else None
    builds = _builds(args.build)
    build = None
    if builds:
        from moebalance.core.trace import RoutingTrace

        traces = [b.trace for b in builds if b.trace is not None]
        build = LoadMatrix(np.concatenate([b.counts for b in builds]), RoutingTrace(
            np.concatenate([t.topk_ids for t in traces]), np.concatenate([t.src_gpu for t in traces]),
            np.concatenate([t.batch + sum(x.num_batches for x in traces[:i]) for i, t in enumerate(traces)]),
            num_experts=traces[0].num_experts))
    results: list[OnlineResult] = []
    with _progress() as progress:
        for p in policies:
            task = progress.add_task(f"online {p}", total=served[1] - served[0])

            def advance(n: int, task: Any = task) -> None:
                progress.advance(task, n)

            mine = policy_params(params, p, policies)
            if args.groups is not None and p == "eplb":
                mine["num_groups"] = args.groups
            # with several policies the re-plan knobs go to the static ones (a dynamic policy replans every batch)
            periodic = len(policies) == 1 or p not in DYNAMIC_POLICIES
            try:
                results.append(replay(load, cluster, budget, p, mine, warmup=warm, batches=served, router=router,
                                      replan_every=args.replan_every if periodic else None,
                                      window=args.window if periodic else None, seed=args.seed, hidden=hidden,
                                      model=model, build=build, progress=advance))
            except InputError as exc:
                if len(policies) > 1 and "has no parameter" in str(exc):
                    raise InputError(f"{exc} (with several policies, --set {p}.KEY=VALUE gives an option to {p} "
                                     "only)") from None
                raise
    title = (f"{args.load}: batches {served[0]}:{served[1]} served one at a time after warm-up {warm[0]}:{warm[1]}, "
             f"{cluster.num_nodes}x{cluster.gpus_per_node} GPUs, budget {budget.describe()}")
    docs = [r.as_dict() for r in results]
    if args.model is not None:  # the cost of the copies each batch loads (Libra's prefetch, a replan's moves)
        from moebalance.cost.architecture import get_arch
        from moebalance.cost.time import prefetch_seconds

        arch = get_arch(args.model)
        if (arch.spec.num_layers, arch.spec.num_experts) != (load.num_layers, load.num_experts):
            raise InputError(f"--model {args.model} has {arch.spec.num_layers} MoE layers x {arch.spec.num_experts} "
                             f"experts but the load {load.num_layers} x {load.num_experts}")
        intra = args.intra_link if args.intra_link is not None else cluster.intra_node_bandwidth  # the default link
        for r, d in zip(results, docs, strict=True):
            per_gpu_layer = r.experts_moved / (load.num_layers * cluster.num_gpus)
            d["modelled_prefetch"] = {  # GiB loaded per batch; ms per layer for a GPU loading the mean share
                "gb_per_batch": round(r.experts_moved * arch.expert_params() * 2 / (1 << 30), 6),
                "mean_ms_per_gpu_and_layer": round(float(prefetch_seconds(per_gpu_layer, arch, intra)) * 1e3, 6)}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / "online.json", dumps({"title": title, "results": docs}))
        atomic_write_text(out_dir / "online.md", online_markdown(results, title))
        plot_online(results, out_dir / "online.png", title)
    if args.json:
        sys.stdout.write(dumps(docs[0] if len(docs) == 1 else {"results": docs}))
        return
    out.print(online_table(results, title))
    if out_dir is not None:
        err.print(f"wrote {out_dir / 'online.md'}, online.json and online.png")


def _label(r: Any) -> str:
    p = r.params
    if r.policy == "libra":
        return f"libra ({p['predictor']}, n={p['n']}, alpha={p['alpha']})"
    if r.replans:
        return f"{r.policy} (every {p['replan_every']} on {p['window']})"
    return r.policy


_COLUMNS = ("policy", "router", "mean imbalance", "max imbalance", "balancedness", "experts moved / batch",
            "replica slots / GPU", "prediction accuracy")


def _cells(r: Any) -> list[str]:
    acc = r.prediction_accuracy
    return [_label(r), r.router, f"{r.mean_imbalance_ratio:.3f}", f"{float(np.max(r.per_batch_imbalance)):.3f}",
            f"{r.balancedness:.4f}", f"{r.experts_moved:.1f}", f"{r.replica_slots_per_gpu:g}",
            "-" if acc is None else f"{acc:.3f}"]


def online_table(results: Sequence[Any], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(_COLUMNS):
        table.add_column(col, justify="left" if i < 2 else "right", no_wrap=i == 0)
    for r in results:
        table.add_row(*_cells(r))
    return table


def online_markdown(results: Sequence[Any], title: str) -> str:
    lines = [f"# Online replay\n\n{title}.\n", "| " + " | ".join(_COLUMNS) + " |",
             "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in results]
    lines += ["", "Imbalance ratio: the busiest GPU's load over the mean, per layer, averaged over a batch's layers "
              "(1 is perfect). Replica slots per GPU: extra expert slots summed over layers (a static plan), or the "
              "base's plus the prefetch buffer's 2n (libra).", "", "![imbalance per batch](online.png)", ""]
    return "\n".join(lines)


def plot_online(results: Sequence[Any], path: Path, title: str) -> None:
    """One line per policy: the imbalance ratio of every served batch (Libra Figure 9's lower panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moebalance.core.io import save_png

    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    for r in results:
        ax.plot(r.batches, r.per_batch_imbalance, linewidth=1.3, marker="o", markersize=2.5,
                label=f"{_label(r)}, {r.router}: mean {r.mean_imbalance_ratio:.3f}, "
                      f"{r.replica_slots_per_gpu:g} slots/GPU")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("batch")
    ax.set_ylabel("imbalance ratio (max / mean GPU load)")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_png(fig, path)
