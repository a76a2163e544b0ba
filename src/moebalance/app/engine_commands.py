"""``moebalance import`` and ``moebalance export``: engines' files in, engines' files out."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from moebalance.app.console import check_out as _check_out
from moebalance.app.console import err, out
from moebalance.core.errors import InputError
from moebalance.core.io import dumps
from moebalance.core.load import write_load
from moebalance.core.plan import Placement, read_plan

__all__ = ["EXPORT_FORMATS", "cmd_export", "cmd_import", "engine_layers"]

#: ``export --format`` values and the file each writes.
EXPORT_FORMATS = {"sglang": ".json", "trtllm": ".yaml", "vllm": ".json"}


def cmd_import(args: argparse.Namespace) -> None:
    from moebalance.engines import read_any_load

    dest = _check_out(args.out, ".npz")
    load = read_any_load(args.load, args.format, gpus=args.gpus, batch_tokens=args.batch_tokens,
                         num_experts=args.experts)
    write_load(dest, load)
    B, L, E = load.counts.shape
    dense = np.flatnonzero(load.counts.sum(axis=(0, 2)) == 0)
    out.print(f"wrote {dest}: [B, L, E] = [{B}, {L}, {E}]"
              + (f", token-level ({load.trace.num_tokens:,} tokens)" if load.trace is not None else "")
              + (f"; dense layers (no load, kept as zero rows): {', '.join(map(str, dense))}" if dense.size else "")
              + ("" if load.layer_ids is None else "; dense layers left out, the model's layer ids kept: "
                 + ",".join(map(str, load.layer_ids.tolist()))))


def engine_layers(plan: Placement, given: str | None) -> tuple[list[int], list[int]]:
    """``(engine layer id of every plan layer, the plan layers an MoE-layer file lists)``.

    A plan made on a load that left dense layers out records the model's layer ids (``layer_ids``); otherwise plan
    layer ``l`` is engine layer ``l``. The dense layers are ``--dense-layers`` (engine numbering) if given, else the
    plan's layers without load (``dense_layers``).
    """
    num_layers = plan.num_layers
    recorded = plan.params.get("layer_ids")
    ids = [int(x) for x in recorded] if isinstance(recorded, list) and len(recorded) == num_layers else \
        list(range(num_layers))
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


def cmd_export(args: argparse.Namespace) -> None:
    from moebalance.engines import pad_plan
    from moebalance.engines.sglang import write_placement
    from moebalance.engines.trtllm import write_config
    from moebalance.engines.vllm import write_map

    suffix = EXPORT_FORMATS[args.format]
    dest = _check_out(args.out, ".yml" if args.format == "trtllm" and args.out.endswith(".yml") else suffix)
    plan = read_plan(args.plan)
    note = None
    if args.pad:
        if args.load is None:
            raise InputError("--pad needs --load: the load the plan was made on decides which copies balance best")
        from moebalance.engines import read_any_load

        load = read_any_load(args.load, args.load_format)
        padding = pad_plan(plan, load.counts)
        plan, note = padding.plan, padding.describe(plan)
    elif args.load is not None:
        raise InputError("--load is used only with --pad")
    ids, rows = engine_layers(plan, args.dense_layers)
    layers = [ids[r] for r in rows]
    if args.format == "sglang":
        info = write_placement(dest, plan, ids)
        how = (f"sglang ... --init-expert-location {dest} --ep-size {info['ep_size']} "
               f"--ep-num-redundant-experts {info['ep_num_redundant_experts']}")
    elif args.format == "trtllm":
        info = write_config(dest, plan, [(r, ids[r]) for r in rows], args.layer_updates_per_iter)
        how = f"moe_config.load_balancer: {dest} (num_slots {info['num_slots']}, ep_size {info['ep_size']})"
    else:
        info = write_map(dest, plan, rows)
        how = (f"{len(layers)} MoE layers x {info['num_slots']} slots; vLLM's EPLB with num_redundant_experts "
               f"{info['num_redundant_experts']} on {info['ep_size']} EP ranks (a released vLLM reads no placement "
               "file yet)")
    if args.json:
        sys.stdout.write(dumps({"format": args.format, "out": str(dest), "moe_layers": layers, "padding": note,
                                **info}))
        return
    if note:
        err.print(note)
    out.print(f"wrote {dest}: {plan.policy} plan, {info['num_slots']} slots per layer on {plan.num_gpus} GPUs; {how}")
