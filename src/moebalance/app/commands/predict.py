"""``moebalance predict``: how much of each token's routing a predictor foresees (Libra's accuracy)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
from rich.table import Table

from moebalance.app import options
from moebalance.app.capture_inputs import build_traces, capture_model, hidden_states
from moebalance.app.console import out, progress
from moebalance.core.errors import InputError
from moebalance.core.io import dumps
from moebalance.core.load import parse_batch_range
from moebalance.engines import read_any_load
from moebalance.prediction.predictors import PREDICTORS, AccuracyTally, make_predictor

__all__ = ["PREDICTOR_OPTIONS", "add_parser", "run"]

#: The ``--set`` options of each predictor.
PREDICTOR_OPTIONS: dict[str, tuple[str, ...]] = {"path": ("depth",), "history": ("window",)}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("predict", help="how much of each token's routing a predictor foresees (Libra's accuracy)")
    p.add_argument("--load", action=options.OneLoad, required=True, help="token-level trace to predict (a capture, for lookahead with "
                                                 "--hidden-states)")
    p.add_argument("--predictor", required=True, help=f"{', '.join(PREDICTORS)}")
    p.add_argument("--build", action="append", metavar="TRACE",
                   help="token-level trace the path table is built on (repeatable; not the evaluated text)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="predictor option: depth=2 (path: previous layers in a key), window=1 (history: batches); "
                        "later items win")
    p.add_argument("--batches", help="predict batches a:b only")
    p.add_argument("--checkpoint", help="the model that made the capture (lookahead; default: the bundled model of "
                                        "the capture's shape)")
    p.add_argument("--json", action="store_true")
    options.add_format(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    name = args.predictor
    if name not in PREDICTORS:
        raise InputError(f"unknown predictor {name!r}; choose one of: {', '.join(PREDICTORS)}")
    params = options.resolve_set(args.set, [name], keys=lambda p: PREDICTOR_OPTIONS.get(p, ()),
                                 policy_flag="--predictor", owner="predictor", word="option")[name]
    load = read_any_load(args.load, args.format)
    trace = load.trace
    if trace is None:
        raise InputError(f"{args.load!r} has counts only; accuracy is per token: give a token-level trace "
                         "(topk_ids, src_gpu, batch)")
    start, stop = parse_batch_range(args.batches, load.num_batches)
    builds = build_traces(args.build)
    if name == "path" and not builds:
        raise InputError("the path predictor needs a build split to learn from: give --build TRACE (a token-level "
                         "trace of other text, e.g. a capture of both domains)")
    hidden = hidden_states(args.load, load) if name == "lookahead" else None
    if name == "lookahead" and hidden is None:
        raise InputError(f"{args.load!r} has no hidden states; the lookahead predictor needs a capture made with "
                         "moebalance capture ... --hidden-states")
    model = capture_model(args.checkpoint, load) if name == "lookahead" else None
    with progress() as bar:  # the path table is built layer by layer before the first prediction
        building = bar.add_task(f"predict ({name}): build the predictor", total=None, visible=False)

        def built(done: int, total: int) -> None:
            bar.update(building, completed=done, total=total, visible=True, refresh=True)

        predictor = make_predictor(name, build=[b.trace for b in builds if b.trace is not None], hidden=hidden,
                                   model=model, progress=built, **params)
    G = int(trace.src_gpu.max()) + 1 if trace.num_tokens else 1
    tally = AccuracyTally(load.num_layers)
    with progress() as bar:
        task = bar.add_task(f"predict ({name})", total=stop - start)
        for b in range(start, stop):
            lo, hi = np.searchsorted(trace.batch, [b, b + 1], side="left")
            tally.add(predictor.predict(trace, b, G), trace.topk_ids[lo:hi])
            bar.advance(task)
    overall = tally.overall()
    if overall is None:
        raise InputError(f"the {name} predictor predicts nothing on batches {start}:{stop} (history needs "
                         "earlier batches; lookahead and path need two or more layers); give other --batches")
    per_layer = tally.per_layer()
    tokens = int(tally.tokens.max())
    doc: dict[str, Any] = {"predictor": name, **predictor.describe(), "accuracy": round(overall, 6),
                           "per_layer_accuracy": [None if not np.isfinite(v) else round(float(v), 6)
                                                  for v in per_layer],
                           "batches": f"{start}:{stop}", "tokens": tokens, "top_k": trace.top_k}
    if args.json:
        sys.stdout.write(dumps(doc))
        return
    table = Table(title=f"{args.load}: {name} predictor on batches {start}:{stop} ({tokens:,} tokens, "
                        f"top-{trace.top_k})", title_justify="left")
    table.add_column("layer", justify="right")
    table.add_column("accuracy", justify="right")
    for layer, v in enumerate(per_layer):
        table.add_row(str(layer), "no prediction" if not np.isfinite(v) else f"{v:.3f}")
    out.print(table)
    out.print(f"accuracy {overall:.4f}: the fraction of each token's true top-{trace.top_k} experts found in its "
              f"predicted top-{trace.top_k}, over the {int(np.isfinite(per_layer).sum())} layers with a prediction")
