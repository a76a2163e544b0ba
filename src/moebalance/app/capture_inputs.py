"""What ``predict`` and ``online`` read besides the trace (a capture's hidden states, the model that made it, and
token-level build traces for the path predictor), and the text ``capture`` and ``run`` feed the bundled LM."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.app import options
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.trace import RoutingTrace
from moebalance.engines import read_any_load

__all__ = ["add_text", "build_traces", "capture_model", "concatenated", "hidden_states", "model_tokens"]


def hidden_states(path: str, load: LoadMatrix) -> np.ndarray | None:
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


def capture_model(checkpoint: str | None, load: LoadMatrix) -> Any:
    """The model a capture came from: ``checkpoint``, else the bundled one of the trace's shape."""
    from moebalance.lm.moe_lm import bundled_for, load_checkpoint  # torch: only for the lookahead predictor

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


def build_traces(paths: Sequence[str] | None) -> list[LoadMatrix]:
    """The ``--build`` traces, each token-level, all of one model's shape."""
    builds = [read_any_load(p) for p in paths or ()]
    for p, b in zip(paths or (), builds, strict=True):
        if b.trace is None:
            raise InputError(f"--build {p!r} has counts only; the path table needs a token-level trace")
    shapes = {(b.trace.num_layers, b.trace.num_experts, b.trace.top_k) for b in builds if b.trace is not None}
    if len(shapes) > 1:
        raise InputError(f"the --build traces disagree on [layers, experts, top-k]: {sorted(shapes)}; give traces "
                         "of one model")
    return builds


def concatenated(builds: Sequence[LoadMatrix]) -> LoadMatrix | None:
    """The build traces one after another as one load (batches renumbered), or None without any."""
    traces = [b.trace for b in builds if b.trace is not None]
    if not traces:
        return None
    offsets = np.cumsum([0, *(t.num_batches for t in traces[:-1])])
    return LoadMatrix(np.concatenate([b.counts for b in builds]), RoutingTrace(
        np.concatenate([t.topk_ids for t in traces]), np.concatenate([t.src_gpu for t in traces]),
        np.concatenate([t.batch + off for t, off in zip(traces, offsets, strict=True)]),
        num_experts=traces[0].num_experts))


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
