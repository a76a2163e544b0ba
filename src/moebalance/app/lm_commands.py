"""``moebalance capture`` and ``moebalance run``: the bundled MoE language model on real text."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from moebalance.app import options
from moebalance.app.console import check_out as _check_out
from moebalance.app.console import err, out
from moebalance.app.console import progress as _progress
from moebalance.core.errors import InputError
from moebalance.core.io import dumps
from moebalance.core.plan import read_plan

__all__ = ["cmd_capture", "cmd_run"]


def _model_tokens(args: argparse.Namespace) -> tuple[np.ndarray, str]:
    """The tokens ``capture`` / ``run`` read: a text file, or a domain's held-out split; and what they are."""
    from moebalance.lm.data import domain_tokens, text_tokens

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


def _bundled_for_plan(plan: Any) -> Path:
    from moebalance.lm.moe_lm import BUNDLED_CHECKPOINTS, bundled_checkpoint, checkpoint_config

    shapes = []
    for name in BUNDLED_CHECKPOINTS:
        c = checkpoint_config(bundled_checkpoint(name))
        if (c.num_layers, c.num_experts) == (plan.num_layers, plan.num_experts):
            return bundled_checkpoint(name)
        shapes.append(f"{c.num_layers} x {c.num_experts}")
    raise InputError(f"the plan has {plan.num_layers} layers x {plan.num_experts} experts but no bundled model does "
                     f"({', '.join(shapes)}); plan on a capture of a bundled model, or give --checkpoint")


def cmd_capture(args: argparse.Namespace) -> None:
    from moebalance.lm.capture import capture, write_capture
    from moebalance.lm.moe_lm import CAPTURE_CHECKPOINT, bundled_checkpoint, load_checkpoint
    from moebalance.workloads.stats import layer_skew

    dest = _check_out(args.out, ".npz")
    model = load_checkpoint(args.checkpoint or bundled_checkpoint(CAPTURE_CHECKPOINT))
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
    """Local gloo ranks (``--world-size``), or this process's rank of a torchrun launch; rank 0 reports."""
    from moebalance.lm.capture import make_layout
    from moebalance.lm.moe_lm import load_checkpoint
    from moebalance.lm.run import LOGIT_TOLERANCE, RunReport, check_plan, run_model, run_torchrun
    from moebalance.runtime import KEEPS_LOCAL, torchrun_env

    torchrun = torchrun_env()
    world_size = args.world_size
    if torchrun:
        started = int(os.environ["WORLD_SIZE"])
        if world_size is not None and world_size != started:
            raise InputError(f"--world-size {world_size} but torchrun started {started} ranks (WORLD_SIZE); drop "
                             "--world-size under torchrun or make them equal")
        world_size = started
    elif world_size is None:
        raise InputError("--world-size is required unless torchrun starts the ranks (RANK, WORLD_SIZE, MASTER_ADDR "
                         "and MASTER_PORT set)")
    rank0 = not torchrun or os.environ["RANK"] == "0"
    router = options.router(args)
    if args.two_stage and router.name not in KEEPS_LOCAL:
        raise InputError(f"--two-stage needs a router that never moves a pick with a copy on its own GPU "
                         f"({' or '.join(KEEPS_LOCAL)}), not {router.name}: the local phase must not wait for it")
    plan = read_plan(args.plan)
    if args.checkpoint is None:  # the bundled model the plan was made for
        args.checkpoint = str(_bundled_for_plan(plan))
    model = load_checkpoint(args.checkpoint)
    check_plan(plan, model, world_size)
    if rank0:
        for w in plan.warnings:
            err.print(f"warning: {w}")
    tokens, what = _model_tokens(args)
    seq_len = model.config.max_seq_len
    layout = make_layout(tokens.size, seq_len=seq_len, batch_tokens=args.batch_tokens, num_gpus=world_size)

    def run(progress: Callable[[int], None] | None) -> RunReport | None:
        if torchrun:  # this process is one rank; the same per-rank body as the local launcher's
            return run_torchrun(args.checkpoint, plan, tokens, router=router, router_seed=args.seed,
                                two_stage=args.two_stage,
                                batch_tokens=args.batch_tokens, progress=progress)
        return run_model(args.checkpoint, plan, tokens, world_size=world_size, router=router, two_stage=args.two_stage,
                         router_seed=args.seed, batch_tokens=args.batch_tokens, progress=progress)

    if not rank0:
        run(None)  # results go to rank 0, which reports
        return
    with _progress() as bar:
        task = bar.add_task("dense reference", total=layout.num_batches)
        report = run(lambda n: bar.advance(task, n))
    assert report is not None  # rank 0 and the local launcher always report
    if args.json:
        sys.stdout.write(dumps(report.as_dict()))
    else:
        c = plan.cluster
        table = Table(title=f"{args.plan}: {plan.policy} on {c.num_nodes}x{c.gpus_per_node} GPUs, {router.label} "
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
        out.print(f"picks per rank, batch and layer == simulator ({router.label} router's assign_tokens on the "
                  f"trace the run saw): {'yes' if report.counts_match else 'NO'}; runtime balancedness "
                  f"{report.balancedness:.4f}; {report.seconds:.1f} s")
        per_batch = report.hidden_per_batch()
        if per_batch is not None:
            out.print("two-stage: the rebalancer finished inside the local phase in "
                      f"{100 * float(np.mean(per_batch)):.0f}% of (batch, layer, rank) forwards; per batch "
                      + " ".join(f"{100 * v:.0f}%" for v in per_batch))
    if not (report.counts_match and report.logits_agree):
        sys.stderr.write("moebalance: run: the expert-parallel run disagrees with the dense reference or the "
                         "simulator\n")
        raise SystemExit(1)


# ----- parser --------------------------------------------------------------------------------------------------
