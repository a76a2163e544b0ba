"""``moebalance import``: an engine's routing dump converted, once, into a moebalance load (``.npz``).

SGLang's folders of per-rank dumps and vLLM's routed experts are read one file at a time and their token-level
arrays written as they come (:mod:`moebalance.engines.stream`), so a dump larger than memory imports; the other
commands read dumps whole. (The module is ``import_``: ``import`` is a Python keyword.)
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from moebalance.app import options
from moebalance.app.console import check_out, note, out
from moebalance.engines.detect import import_load

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("import", help="convert an engine's routing dump into a moebalance load (.npz), once")
    p.add_argument("--load", action=options.OneLoad, required=True, help="SGLang dump (.pt/.json, or a folder of per-rank dumps), TensorRT-LLM "
                                                 "statistics folder, vLLM routed experts (JSON responses, .npy, folder)")
    p.add_argument("--out", required=True, help="output .npz")
    p.add_argument("--gpus", type=options.count(options.MAX_GPUS), default=1,
                   help="vLLM: data-parallel ranks the requests go to")
    p.add_argument("--batch-tokens", type=options.positive, default=4096, help="vLLM: tokens per batch (whole requests)")
    p.add_argument("--experts", type=options.positive,
                   help="vLLM: experts per layer (default: --model's, else the largest id seen + 1)")
    p.add_argument("--model", help="the model the dump was recorded for (default: the one model whose shape fits, "
                                   "with a note); stored in the .npz")
    options.add_format(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    dest = check_out(args.out, ".npz")
    imported = import_load(args.load, dest, args.format, model=args.model, gpus=args.gpus,
                           batch_tokens=args.batch_tokens, num_experts=args.experts)
    load = imported.load  # counts, model and layer ids: a token-level trace stays in the file
    for text in imported.notes:
        note(text)
    B, L, E = load.counts.shape
    dense = np.flatnonzero(load.counts.sum(axis=(0, 2)) == 0)
    out.print(f"wrote {dest}: [B, L, E] = [{B}, {L}, {E}]"
              + (f", token-level ({imported.num_tokens:,} tokens)" if imported.num_tokens is not None else "")
              + (f"; dense layers (no load, kept as zero rows): {', '.join(map(str, dense))}" if dense.size else "")
              + ("" if load.layer_ids is None else "; dense layers left out, the model's layer ids kept: "
                 + ",".join(map(str, load.layer_ids.tolist()))))
