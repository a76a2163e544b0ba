"""``moebalance advise``: what to run on an engine, every configuration it can run priced in tokens per second on
held-out batches (docs/design.md, "Advice"; :mod:`moebalance.app.advise`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from moebalance.app import deployment, options
from moebalance.app.advise import (
    DEFAULT_MARGIN,
    ENGINES,
    STATISTICS_STEPS,
    Setup,
    candidates,
    concatenate,
    margin_of,
    price,
    recommend,
)
from moebalance.app.advise_engines import (
    advice_text,
    advise_report,
    advise_table,
    launch_lines,
    write_engine_files,
)
from moebalance.app.assumptions import assumption_text, assumptions
from moebalance.app.console import err, note, out, progress, write_files
from moebalance.core.errors import InputError
from moebalance.core.io import atomic_dir, atomic_write_text, check_out_dir, dumps
from moebalance.core.load import LoadMatrix, check_same_model
from moebalance.engines.detect import detect_load
from moebalance.engines.registry import ENGINES as REGISTRY
from moebalance.pricing.phase import PHASES, PhaseModel
from moebalance.pricing.step import StepPricing

__all__ = ["add_parser", "run"]

#: Periodic re-planning tried: ``(step_interval, window)`` in steps, the largest that re-plan within the steps priced.
_INTERVALS = (2, 4, 8, 16, 32)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("advise", help="what to run on vLLM, SGLang or TensorRT-LLM: every expert-parallel "
                                      "configuration the engine can run, priced in tokens per second")
    p.add_argument("--load", required=True, action="append",
                   help="recorded routing in any format --load reads; repeatable: several workloads of one model")
    options.add_format(p)
    p.add_argument("--model", help="the model the load was recorded for (default: the load's)")
    options.add_cluster(p)
    p.add_argument("--engine", choices=ENGINES, help="the engine (default: from the load's format)")
    p.add_argument("--phase", choices=PHASES,
                   help="the steps priced: decode (the default: one token per running request, as many as the KV "
                        "cache holds) or prefill (--prefill-chunk tokens per data-parallel rank)")
    p.add_argument("--train-frac", type=options.fraction,
                   help="share of each load's batches to plan on; the rest are priced (default 0.5; a load of one "
                        "batch plans and prices on it)")
    p.add_argument("--price-load", action="append", metavar="LOAD",
                   help="price on this load instead, another workload of the same model (repeatable): every --load "
                        "is then planned on whole, and the gains say how the plans do on routing they never saw")
    p.add_argument("--margin", type=options.non_negative_float,
                   help=f"the modelled gain over EPLB off a configuration must clear to be recommended (default "
                        f"{DEFAULT_MARGIN}; with --calibration recording its fit error, the larger of the two)")
    p.add_argument("--router-ms", type=options.non_negative_float, default=0.0, metavar="MS",
                   help="host time per MoE layer of a load-dependent router (SGLang's dynamic and LP dispatch), exposed "
                        "where it outlasts the local phase (default 0: SGLang computes them on the GPU)")
    options.add_links(p)
    deployment.add(p, gpu_required=True)
    p.add_argument("--seed", type=options.non_negative, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out-dir", help="write the engine's files, launch.txt, advise.json and report.html here")
    p.add_argument("--mtp-layers", type=options.non_negative, metavar="N",
                   help="trtllm: write keys for N multi-token-prediction layers (TensorRT-LLM registers MTP layer i as "
                        "decoder layer num_hidden_layers + i and stops without its key; default: the model's, "
                        "DeepSeek-V3/R1: 1; 0 to serve without MTP)")
    p.set_defaults(func=run)


def _engine(args: argparse.Namespace) -> str:
    if args.engine is not None:
        return str(args.engine)
    formats = {detect_load(path) if args.format is None else args.format for path in args.load}
    engines = sorted(f for f in formats if f in ENGINES)
    if len(engines) != 1 or len(formats) != 1:
        found = ", ".join(sorted(formats))
        raise InputError(f"the loads' format ({found}) names no one engine; give --engine {'|'.join(ENGINES)}")
    return engines[0]


def _split(load: LoadMatrix, train_frac: float) -> tuple[LoadMatrix, LoadMatrix, bool]:
    """``(plan on, price, held out)``: a load of one batch plans and prices on it, drawn several times."""
    if load.num_batches == 1:
        return load, concatenate([load] * STATISTICS_STEPS), False
    train, test = load.split(train_frac)
    return train, test, train_frac < 1.0


def _setup(args: argparse.Namespace, engine: str) -> tuple[Setup, str, int, float | None]:
    """The deployment and batches of the command line: ``(setup, model name, steps priced for periodic re-planning
    (0 for statistics), the calibration's fit error)``."""
    workloads = options.read_workloads(argparse.Namespace(**{**vars(args), "batches": None}))
    if args.model is None and workloads.load.preset is None:
        raise InputError("the load names no model; give --model (e.g. --model deepseek-v3)")
    calibrated, fit_error = deployment.calibration(args)
    dep = deployment.build(args, workloads.load, calibrated=calibrated)
    # what the engine keeps that no flag sets: a linear-attention layer's recurrent state
    dep = dataclasses.replace(dep, engine=dataclasses.replace(
        dep.engine, recurrent_state_bytes=REGISTRY[engine].rule.recurrent_state_bytes))
    name = dep.model.name
    phase = args.phase or "decode"
    if phase == "prefill":
        deployment.refuse(args, "by decode steps, not by --phase prefill", deployment.DECODE_FLAGS)
    cluster = options.cluster(args)
    pricing = StepPricing(deployment=dep, router_ms=args.router_ms, phase=phase)
    if args.price_load:
        return (*_cross_setup(args, workloads, dep, cluster, pricing, phase), fit_error)
    trains, tests, notes = [], [], []
    for path, part in zip(workloads.names, workloads.parts, strict=True):
        train, test, held = _split(part, 0.5 if args.train_frac is None else args.train_frac)
        trains.append(train)
        tests.append(test)
        if part.num_batches == 1:
            notes.append(f"{path} has one batch (statistics): plans are made and priced on it ({STATISTICS_STEPS} "
                         f"{phase} steps drawn from it), not on held-out batches, so its gains are in sample: on later "
                         "routing of the same workload they moved by a few points, on another workload's by up to "
                         "17 (docs/results/advise_insample.md): --price-load prices on a load of the traffic served; "
                         "no periodic re-planning")
        elif not held:
            notes.append(f"{path}: --train-frac 1 plans and prices on the same batches (in sample)")
    setup = Setup(cluster=cluster, pricing=pricing, train=concatenate(trains), test=concatenate(tests),
                  phase=PhaseModel(phase, dep, seed=args.seed),
                  workload_batches=tuple(t.num_batches for t in trains), seed=args.seed, notes=tuple(notes))
    statistics = any(p.num_batches == 1 for p in workloads.parts)
    return setup, name, 0 if statistics else setup.test.num_batches, fit_error


def _cross_setup(args: argparse.Namespace, workloads: options.Workloads, dep: Any, cluster: Any, pricing: StepPricing,
                 phase: str) -> tuple[Setup, str, int]:
    """``--price-load``: plan on every ``--load`` whole, price on the other workloads (one model, checked), each of
    one batch drawn as several steps; ``(setup, model name, steps priced for periodic re-planning)``."""
    if args.train_frac is not None:
        raise InputError("--train-frac splits --load into batches planned on and batches priced; with --price-load "
                         "every --load is planned on whole: give one of the two")
    priced = options.read_workloads(argparse.Namespace(**{**vars(args), "load": args.price_load, "batches": None}),
                                    "--price-load")
    check_same_model(workloads.names[0], workloads.load, priced.names[0], priced.load, "--price-load")
    tests = [part if part.num_batches > 1 else concatenate([part] * STATISTICS_STEPS) for part in priced.parts]
    setup = Setup(cluster=cluster, pricing=pricing, train=concatenate(list(workloads.parts)),
                  test=concatenate(tests), phase=PhaseModel(phase, dep, seed=args.seed),
                  workload_batches=tuple(t.num_batches for t in workloads.parts), seed=args.seed,
                  cross=f"planned on {', '.join(workloads.names)}, priced on {', '.join(priced.names)}")
    same = [name for name in priced.names if name in workloads.names]
    if same:  # the plans' own batches priced: in sample, said as a one-batch load is
        setup = dataclasses.replace(setup, notes=(f"{', '.join(same)} is both a --load and a --price-load: plans are "
                                                  "priced on the batches they were made on (in sample)",))
    statistics = any(p.num_batches == 1 for p in priced.parts)
    return setup, dep.model.name, 0 if statistics else setup.test.num_batches


def run(args: argparse.Namespace) -> None:
    out_dir = None if args.out_dir is None else Path(args.out_dir)
    if out_dir is not None:
        check_out_dir(out_dir)  # a file, the current folder, a folder of other files: refused before the work
    engine = _engine(args)
    if args.mtp_layers is not None and not REGISTRY[engine].mtp_keys:
        carry = [e.name for e in REGISTRY.values() if e.mtp_keys]
        raise InputError(f"--mtp-layers is for --engine {'|'.join(carry)} (whose placement file registers MTP "
                         f"layers); {engine} needs no MTP key")
    setup, name, served, fit_error = _setup(args, engine)
    mtp = setup.phase.deployment.model.num_mtp_layers if args.mtp_layers is None else int(args.mtp_layers)
    margin = margin_of(args.margin, fit_error)
    periods = [(k, k) for k in _INTERVALS if k < served][-2:]
    listed, left_out = candidates(setup, engine, periods=periods)
    priced = []
    with progress() as bar:
        task = bar.add_task(f"advise {engine}", total=len(listed))
        for c in listed:
            priced.append(price(setup, c))
            bar.advance(task, 1)
    advice = recommend(priced, engine, margin)
    notes = [*setup.notes, *left_out]
    cluster, phase = setup.cluster, setup.phase.phase
    # setup.notes are the in-sample notes _setup made (a load of one batch, --train-frac 1)
    assumed = assumptions(setup.phase.deployment, cluster, fit_error=fit_error, phase=phase,
                          tokens_per_step=advice.recommended.step_tokens, margin=margin, held_out=not setup.notes,
                          held_out_note=" ".join(setup.notes) or setup.cross,
                          step_note="the recommendation's (each candidate's: step tokens)" if phase == "decode" else None)
    title = (f"{', '.join(args.load)} on {engine}: {name}, {cluster.num_nodes} x {cluster.gpus_per_node} "
             f"{setup.phase.deployment.gpu.display_name}, {phase} steps"
             + ("" if args.phase else " (the default phase)") + f"; assumed: {assumption_text(assumed)}")
    files: list[Path] = []
    if out_dir is not None:
        with atomic_dir(out_dir) as tmp:  # all of the folder or none of it (docs/design.md, "Errors")
            written = write_engine_files(advice, setup, tmp, name, mtp_layers=mtp, named=out_dir)
            files = [out_dir / f.relative_to(tmp) for f in written]  # what the files are read as: never tmp
            doc = advice.as_dict(files)
            atomic_write_text(tmp / "advise.json", dumps({"title": title, **doc, "notes": notes,
                                                          "priced_with": setup.phase.deployment.describe(),
                                                          "margin": margin, "assumptions": assumed}))
            shown = {f.name: f.read_text() for f in written if f.suffix != ".json" or f.stat().st_size < 20_000}
            shown["files written"] = "\n".join(str(f) for f in files)
            # the engine's files and advise.json are quick; the report replays the plans on the held-out batches
            write_files([("report.html", lambda: advise_report(advice, setup, title, shown, notes,
                                                               assumptions=assumed).write(tmp / "report.html"))])
    for text in notes:
        note(text)
    if args.json:  # what it priced with: the profile, precision, KV cache, overlap and all-to-all, and all it assumed
        sys.stdout.write(dumps({**advice.as_dict(files), "priced_with": setup.phase.deployment.describe(),
                                "margin": margin, "assumptions": assumed}))
        return
    out.print(advise_table(advice, title))
    out.print(advice_text(advice))
    for line in launch_lines(advice, setup, out_dir):
        out.print(line, markup=False)
    if out_dir is not None:
        err.print(f"wrote {', '.join(str(f) for f in files)}, {out_dir / 'advise.json'} and {out_dir / 'report.html'}")
