"""``moebalance capture``: run the bundled MoE language model on text and write its token-level routing trace."""

from __future__ import annotations

import argparse
from typing import Any

from moebalance.app import options
from moebalance.app.capture_inputs import add_text, model_tokens
from moebalance.app.console import check_out, out, progress
from moebalance.workloads.stats import layer_skew

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("capture", help="run the bundled MoE LM on text and write its token-level routing trace")
    add_text(p, tokens_default=None)
    p.add_argument("--gpus", type=options.count(options.MAX_GPUS), required=True,
                   help="data-parallel ranks the sequences go to")
    p.add_argument("--batch-tokens", type=options.positive, required=True,
                   help="tokens per batch (a multiple of seq len)")
    p.add_argument("--seq-len", type=options.positive, help="tokens per sequence (default: the model's context)")
    p.add_argument("--hidden-states", action="store_true", help="also store each MoE layer's input (float16)")
    p.add_argument("--checkpoint", help="model .safetensors (default: the bundled 8-layer, 32-expert, top-4 model)")
    p.add_argument("--out", required=True, help="output .npz")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from moebalance.lm.capture import (  # torch: loaded by the commands that run the model
        capture,
        write_capture,
    )
    from moebalance.lm.moe_lm import CAPTURE_CHECKPOINT, bundled_checkpoint, load_checkpoint

    dest = check_out(args.out, ".npz")
    model = load_checkpoint(args.checkpoint or bundled_checkpoint(CAPTURE_CHECKPOINT))
    tokens, what = model_tokens(args)
    seq_len = args.seq_len or model.config.max_seq_len
    with progress() as bar:
        task = bar.add_task("capture", total=tokens.size // seq_len * seq_len)
        cap = capture(model, tokens, num_gpus=args.gpus, batch_tokens=args.batch_tokens, seq_len=seq_len,
                      hidden_states=args.hidden_states, progress=lambda n: bar.advance(task, n))
    write_capture(dest, cap)
    load = cap.load
    ptm = layer_skew(load.counts).peak_to_mean
    out.print(f"wrote {dest}: token-level trace of {cap.token_ids.size:,} {what} on {args.gpus} ranks, "
              f"[B, L, E] = {list(load.counts.shape)}, top-{model.config.top_k}"
              f"{', with hidden states' if args.hidden_states else ''}; peak/mean expert load per layer "
              + " ".join(f"{v:.2f}" for v in ptm))
