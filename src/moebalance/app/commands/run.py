"""``moebalance run``: the MoE language model expert-parallel on local gloo ranks (or under torchrun) under a plan,
checked against the dense single-process model and the simulator.

``--policy libra`` runs libra's exact mode on the plan as its base placement (:mod:`moebalance.runtime.exact`):
every MoE layer plans its extra experts and routing after its gate, from the batch's routing, copies the extras
into a prefetch buffer, then dispatches. ``--set`` takes libra's ``predictor`` (``exact``, the default, or its
alias ``oracle``: the runtime plans after the gate only), ``n`` and ``alpha``; the router defaults to
``rebalance``. The report adds, per layer, the time from the gate to the start of expert compute, split into
planning, copying and routing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.table import Table

from moebalance.app import deployment, options
from moebalance.app.capture_inputs import add_text, model_tokens
from moebalance.app.console import err, out, progress
from moebalance.core.errors import InputError
from moebalance.core.io import dumps
from moebalance.core.plan import Placement, read_plan
from moebalance.routing import ROUTERS

if TYPE_CHECKING:
    from moebalance.lm.run import RunReport
    from moebalance.runtime import ExactConfig

__all__ = ["EXACT_KEYS", "add_parser", "bundled_for_plan", "exact_from", "run"]

#: The ``--set`` keys of libra that ``run`` uses (the plan file is the base placement).
EXACT_KEYS = ("predictor", "n", "alpha")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="run the MoE LM expert-parallel on local gloo ranks (or under torchrun) under a "
                                   "plan, and check it")
    p.add_argument("--world-size", type=options.count(options.MAX_GPUS),
                   help="local ranks, one per GPU of the plan (under torchrun: WORLD_SIZE, the default)")
    p.add_argument("--plan", required=True)
    p.add_argument("--policy", metavar="libra",
                   help="libra: Libra's exact mode on the plan as base placement (each layer plans its extra experts "
                        "and routing after its gate); default: the plan as it is")
    options.add_set(p, groups=False)
    options.add_router(p, default=None, help=f"router: {', '.join(sorted(ROUTERS))} (default uniform; rebalance with "
                                             "--policy libra)")
    add_text(p, tokens_default=4096)
    p.add_argument("--batch-tokens", type=options.positive, default=2048, help="tokens per forward step")
    p.add_argument("--seed", type=options.non_negative, default=0, help="router seed")
    p.add_argument("--checkpoint", help="model .safetensors (default: the bundled model of the plan's layers and "
                                        "experts)")
    p.add_argument("--two-stage", action="store_true",
                   help="Libra's two-stage execution: the router runs in a CPU thread while the local picks compute "
                        "(rebalance or locality); reports whether it finished inside the local phase")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def bundled_for_plan(plan: Placement) -> Path:
    """The bundled checkpoint of the plan's layers and experts."""
    from moebalance.lm.moe_lm import BUNDLED_CHECKPOINTS, bundled_checkpoint, checkpoint_config

    shapes = []
    for name in BUNDLED_CHECKPOINTS:
        c = checkpoint_config(bundled_checkpoint(name))
        if (c.num_layers, c.num_experts) == (plan.num_layers, plan.num_experts):
            return bundled_checkpoint(name)
        shapes.append(f"{c.num_layers} x {c.num_experts}")
    raise InputError(f"the plan has {plan.num_layers} layers x {plan.num_experts} experts but no bundled model does "
                     f"({', '.join(shapes)}); plan on a capture of a bundled model, or give --checkpoint")


def exact_from(args: argparse.Namespace) -> ExactConfig | None:
    """Libra's exact mode from ``--policy libra`` and ``--set``; ``None`` without ``--policy``."""
    from moebalance.runtime import ExactConfig

    if args.policy is None:
        if args.set:
            raise InputError("--set configures --policy libra; give --policy libra or drop --set")
        return None
    if args.policy != "libra":
        raise InputError(f"--policy {args.policy!r}: run takes libra (exact mode on the --plan file as base "
                         "placement); without --policy it runs the plan as it is")
    params = options.resolve_set(args.set, ["libra"], policy_flag="--policy")["libra"]
    predictor = params.pop("predictor", "exact")
    if predictor not in ("exact", "oracle"):
        raise InputError(f"--set predictor={predictor}: run plans libra after each layer's gate, from the batch's own "
                         "routing; use predictor=exact (or its alias oracle)")
    other = [k for k in params if k not in EXACT_KEYS]
    if other:
        raise InputError(f"--set {other[0]}: run takes only {', '.join(EXACT_KEYS)} for libra (the --plan file is the "
                         "base placement)")
    return ExactConfig(**params)


def run(args: argparse.Namespace) -> None:
    """Local gloo ranks (``--world-size``), or this process's rank of a torchrun launch; rank 0 reports."""
    from moebalance.lm.capture import make_layout  # torch: loaded by the commands that run the model
    from moebalance.lm.moe_lm import load_checkpoint
    from moebalance.lm.run import LOGIT_TOLERANCE, check_plan, run_model, run_torchrun
    from moebalance.runtime import KEEPS_LOCAL, agreed_inputs, check_exact, torchrun_env

    torchrun = torchrun_env()
    # under torchrun every rank checks its inputs and the ranks agree on the outcome before any joins the group:
    # one node's bad plan is every node's one line, not a wait (outside torchrun the block just runs)
    with agreed_inputs(None, "check the run's inputs"):
        world_size = args.world_size
        if torchrun:
            started = int(os.environ["WORLD_SIZE"])
            if world_size is not None and world_size != started:
                raise InputError(f"--world-size {world_size} but torchrun started {started} ranks (WORLD_SIZE); drop "
                                 "--world-size under torchrun or make them equal")
            world_size = started
        elif world_size is None:
            raise InputError("--world-size is required unless torchrun starts the ranks (RANK, WORLD_SIZE, "
                             "MASTER_ADDR and MASTER_PORT set)")
        exact = exact_from(args)
        if args.router is None:
            args.router = "uniform" if exact is None else "rebalance"
        router = deployment.bind_routers([options.router(args)], None)[0]  # metro: its --router-set, checked here
        if args.two_stage and exact is not None:
            raise InputError("--two-stage runs the router beside the local phase, but with --policy libra each layer "
                             "plans its extras and routing before its experts compute; drop one of them")
        if args.two_stage and router.name not in KEEPS_LOCAL:
            raise InputError(f"--two-stage needs a router that never moves a pick with a copy on its own GPU "
                             f"({' or '.join(KEEPS_LOCAL)}), not {router.name}: the local phase must not wait for it")
        plan = read_plan(args.plan)
        if args.checkpoint is None:  # the bundled model the plan was made for
            args.checkpoint = str(bundled_for_plan(plan))
        model = load_checkpoint(args.checkpoint)
        check_plan(plan, model, world_size)
        check_exact(exact, plan.num_experts, buffer=False)
        tokens, what = model_tokens(args)
        layout = make_layout(tokens.size, seq_len=model.config.max_seq_len, batch_tokens=args.batch_tokens,
                             num_gpus=world_size)
    rank0 = not torchrun or os.environ["RANK"] == "0"
    if rank0:
        for w in plan.warnings:
            err.print(f"warning: {w}")

    def execute(advance: Callable[[int], None] | None) -> RunReport | None:
        if torchrun:  # this process is one rank; the same per-rank body as the local launcher's
            return run_torchrun(args.checkpoint, plan, tokens, router=router, router_seed=args.seed,
                                two_stage=args.two_stage, exact=exact, batch_tokens=args.batch_tokens,
                                progress=advance)
        return run_model(args.checkpoint, plan, tokens, world_size=world_size, router=router, two_stage=args.two_stage,
                         exact=exact, router_seed=args.seed, batch_tokens=args.batch_tokens, progress=advance)

    if not rank0:
        execute(None)  # results go to rank 0, which reports
        return
    with progress() as bar:
        task = bar.add_task("dense reference", total=layout.num_batches)
        report = execute(lambda n: bar.advance(task, n))
    assert report is not None  # rank 0 and the local launcher always report
    if args.json:
        sys.stdout.write(dumps(report.as_dict()))
    else:
        c = plan.cluster
        base = plan.policy if exact is None else f"libra exact (n={exact.n}, alpha={exact.alpha:g}) on {plan.policy}"
        table = Table(title=f"{args.plan}: {base} on {c.num_nodes}x{c.gpus_per_node} GPUs, {router.label} "
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
        on = "the trace the run saw" if exact is None else "libra's per-batch plans of the trace the run saw"
        out.print(f"picks per rank, batch and layer == simulator ({router.label} router's assign_tokens on {on}): "
                  f"{'yes' if report.counts_match else 'NO'}; runtime balancedness "
                  f"{report.balancedness:.4f}; {report.seconds:.1f} s")
        per_batch = report.hidden_per_batch()
        if per_batch is not None:
            out.print("two-stage: the rebalancer finished inside the local phase in "
                      f"{100 * float(np.mean(per_batch)):.0f}% of (batch, layer, rank) forwards; per batch "
                      + " ".join(f"{100 * v:.0f}%" for v in per_batch))
        per_layer = report.exact_per_layer()
        if per_layer is not None:
            _print_exact(per_layer, report)
    if not (report.counts_match and report.logits_agree):
        sys.stderr.write("moebalance: run: the expert-parallel run disagrees with the dense reference or the "
                         "simulator\n")
        raise SystemExit(1)


def _print_exact(per_layer: list[dict[str, Any]], report: RunReport) -> None:
    """Exact mode's table: per layer, the mean time from the gate to the start of expert compute and its parts."""
    table = Table(title="exact mode: gate to expert compute per layer (mean over batches and ranks)",
                  title_justify="left")
    for col in ("layer", "total ms", "planning ms", "copying ms", "routing ms"):
        table.add_column(col, justify="right")
    for row in per_layer:
        table.add_row(str(row["layer"]), f"{row['gate_to_expert_ms']:.3f}", f"{row['plan_ms']:.3f}",
                      f"{row['copy_ms']:.3f}", f"{row['route_ms']:.3f}")
    out.print(table)
    received = 0 if report.extras_received is None else int(report.extras_received.sum())
    out.print(f"extra experts copied into the prefetch buffers: {received:,}")
