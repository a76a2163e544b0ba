"""``moebalance capture``: run the bundled MoE language model on text and write its token-level routing trace."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.app import options
from moebalance.app.console import check_out, out, progress
from moebalance.core.errors import InputError
from moebalance.workloads.stats import layer_skew

__all__ = ["add_parser", "add_text", "model_tokens", "run"]


def add_text(p: argparse.ArgumentParser, *, tokens_default: int | None) -> None:
    """The text the model reads (``--domain`` or ``--text``), ``--tokens`` of it after ``--offset``."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--domain", choices=("code", "prose"), help="the held-out split of a training domain")
    src.add_argument("--text", help="a text file (read as bytes)")
    p.add_argument("--tokens", type=options.positive, required=tokens_default is None, default=tokens_default,
                   help="tokens to " + ("capture" if tokens_default is None else "run") + " (whole sequences)")
    p.add_argument("--offset", type=options.non_negative, default=0, help="skip this many tokens of the text first")


def model_tokens(args: argparse.Namespace) -> tuple[np.ndarray, str]:
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
