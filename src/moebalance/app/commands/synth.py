"""``moebalance synth``: a synthetic routing trace for a real model (docs/synth.md)."""

from __future__ import annotations

import argparse
from typing import Any

from moebalance.app import options
from moebalance.app.console import check_out, out, progress, step
from moebalance.core.load import LoadMatrix, write_load
from moebalance.models import get_model
from moebalance.workloads.synth import synthesize

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("synth", help="generate a synthetic routing trace for a real model")
    p.add_argument("--preset", required=True, help="model preset, e.g. deepseek-v3, kimi-k2, qwen3-30b-a3b")
    p.add_argument("--batches", type=options.positive, required=True)
    p.add_argument("--tokens-per-batch", type=options.positive, required=True)
    p.add_argument("--gpus", type=options.count(options.MAX_GPUS), required=True,
                   help="data-parallel ranks the tokens live on")
    p.add_argument("--seed", type=options.non_negative, default=0)
    p.add_argument("--token-level", action="store_true", help="also write topk_ids, src_gpu and batch")
    p.add_argument("--out", required=True, help="output .npz")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    dest = check_out(args.out, ".npz")
    preset = get_model(args.preset)
    with progress() as bar:
        task = bar.add_task(f"synth {preset.name}", total=args.batches)
        arrays = synthesize(preset, num_batches=args.batches, tokens_per_batch=args.tokens_per_batch,
                            num_gpus=args.gpus, seed=args.seed, token_level=args.token_level,
                            progress=lambda n: bar.advance(task, n))
    with step(f"write {dest.name}"):  # checking and compressing a large token-level trace takes a while
        load = LoadMatrix.from_arrays(arrays, source="synth")
        write_load(dest, load)
    kind = "token-level trace" if load.trace is not None else "load matrix"
    out.print(f"wrote {dest}: {kind} of {preset.name}, [B, L, E] = {list(load.counts.shape)}, top-{preset.top_k}")
