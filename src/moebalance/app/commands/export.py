"""``moebalance export``: a plan written in the form an engine loads (SGLang, TensorRT-LLM, vLLM).

``--to`` names the engine (``--format``, its older name, still works; everywhere else ``--format`` is an input's
format).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from moebalance.app import options
from moebalance.app.console import check_out, err, out
from moebalance.core.errors import InputError
from moebalance.core.io import dumps
from moebalance.core.plan import Placement, read_plan
from moebalance.engines import pad_plan, plan_layers, read_any_load
from moebalance.engines.registry import ENGINES

__all__ = ["EXPORT_FORMATS", "add_parser", "engine_layers", "run"]

#: ``export --to`` values and the suffix of the file each writes.
EXPORT_FORMATS = {name: ENGINES[name].export_suffix for name in sorted(ENGINES)}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="write a plan in the form an engine loads (SGLang, TensorRT-LLM, vLLM)")
    p.add_argument("--plan", required=True)
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to", choices=tuple(EXPORT_FORMATS),
                    help="sglang: --init-expert-location JSON; trtllm: load-balancer YAML; vllm: per-MoE-layer "
                         "physical-to-logical JSON")
    to.add_argument("--format", dest="to", choices=tuple(EXPORT_FORMATS), help=argparse.SUPPRESS)  # the old name
    p.add_argument("--out", required=True, help="output file (.json, or .yaml for trtllm)")
    p.add_argument("--pad", action="store_true",
                   help="fill GPUs up to the plan's largest slot count with the copies that balance best (needs --load)")
    p.add_argument("--load", action=options.OneLoad, help="the load the plan was made on (for --pad)")
    options.add_format(p, "--load-format", "--load's")
    p.add_argument("--dense-layers", metavar="L1,L2,...",
                   help="layers to leave out of trtllm and vllm files (default: those the plan's load had no load in)")
    p.add_argument("--layer-updates-per-iter", type=options.non_negative, default=0,
                   help="trtllm: layers updated online per iteration (0: static)")
    p.add_argument("--model", help="the model the plan is for, for its decoder-layer numbering and MTP layer (default: "
                                   "the model the plan records, else the one model whose shape fits)")
    p.add_argument("--num-hidden-layers", type=options.positive, metavar="H",
                   help="the engine's num_hidden_layers (decoder layers), for a model moebalance does not list")
    p.add_argument("--mtp-layers", type=options.non_negative, metavar="N",
                   help="trtllm: write keys for N multi-token-prediction layers (TensorRT-LLM registers MTP layer i "
                        "as decoder layer num_hidden_layers + i; default: the MTP rows the plan has)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def engine_layers(plan: Placement, given: str | None, model: str | None = None,
                  num_hidden_layers: int | None = None) -> tuple[list[int], list[int]]:
    """``(engine layer id of every plan layer, the plan layers an MoE-layer file lists)``.

    The engine layer ids are :func:`moebalance.engines.layers.plan_layers`'s: the ids the plan records, else the
    model's numbering (a plan of the MoE layers alone starts after the model's dense layers), else ``0 .. L - 1``.
    The dense layers are ``--dense-layers`` (engine numbering) if given, else the plan's layers without load.
    """
    num_layers = plan.num_layers
    ids = list(plan_layers(plan, model=model, num_hidden_layers=num_hidden_layers).layer_ids)
    if given is not None:
        try:
            dense_ids = {int(x) for x in given.split(",") if x.strip()}
        except ValueError:
            raise InputError(f"--dense-layers {given!r} must be comma-separated layer numbers, like 0,1,2") from None
        unknown = sorted(dense_ids - set(ids))
        if unknown:
            raise InputError(f"--dense-layers names layer {unknown[0]} but the plan's layers are {ids[0]}..{ids[-1]}")
        rows = [r for r in range(num_layers) if ids[r] not in dense_ids]
    else:
        rows = [r for r in range(num_layers) if r not in plan.dense_layers]
    return ids, rows


def run(args: argparse.Namespace) -> None:
    engine = ENGINES[args.to]
    suffix = engine.export_suffix
    dest = check_out(args.out, ".yml" if suffix == ".yaml" and args.out.endswith(".yml") else suffix)
    plan = read_plan(args.plan)
    note = None
    if args.pad:
        if args.load is None:
            raise InputError("--pad needs --load: the load the plan was made on decides which copies balance best")
        load = read_any_load(args.load, args.load_format)
        padding = pad_plan(plan, load.counts)
        plan, note = padding.plan, padding.describe(plan)
    elif args.load is not None or args.load_format is not None:
        raise InputError("--load and --load-format are used only with --pad")
    if args.mtp_layers is not None and not engine.mtp_keys:
        carry = [e.name for e in ENGINES.values() if e.mtp_keys]
        raise InputError(f"--mtp-layers is for --to {'|'.join(carry)} (whose placement file registers MTP layers); "
                         f"{args.to}'s file has the decoder layers only (docs/formats.md)")
    ids, rows = engine_layers(plan, args.dense_layers, args.model, args.num_hidden_layers)
    info, how = engine.export(dest, plan, ids, rows, {"model": args.model, "num_hidden_layers": args.num_hidden_layers,
                                                      "mtp_layers": args.mtp_layers,
                                                      "layer_updates_per_iter": args.layer_updates_per_iter})
    layers = [int(x) for x in info.get("layers", [ids[r] for r in rows])]
    if args.json:
        sys.stdout.write(dumps({"format": args.to, "out": str(dest), "moe_layers": layers, "padding": note, **info}))
        return
    for line in [*([note] if note else []), *info.get("notes", ())]:
        err.print(line)
    out.print(f"wrote {dest}: {plan.policy} plan, {info['num_slots']} slots per layer on {plan.num_gpus} GPUs; {how}")
