"""``moebalance online``: replay a trace batch by batch as a server would (static, periodic and dynamic planning;
docs/design.md, "Online replay and prediction")."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.algorithms.migration import MIGRATIONS
from moebalance.app import deployment, options
from moebalance.app.assumptions import assumption_rows, online_assumptions
from moebalance.app.capture_inputs import build_traces, capture_model, concatenated, hidden_states
from moebalance.app.console import err, note, out, progress, step, write_files
from moebalance.app.html_report import online_report
from moebalance.app.online_report import (
    failure_notes,
    online_markdown,
    online_table,
    plot_online,
    plot_online_time,
)
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.io import atomic_dir, atomic_write_text, check_out_dir, dumps
from moebalance.core.load import LoadMatrix, parse_batch_range
from moebalance.cost.time import prefetch_seconds
from moebalance.models import get_model
from moebalance.online.failure import DEFAULT_RELOAD_GBPS, Failures, parse_failure
from moebalance.online.rearrange import DEFAULT_OVERHEAD_MS, REARRANGE_MODES, Replanning
from moebalance.online.replay import OnlineResult, replay
from moebalance.policies import DYNAMIC_POLICIES, POLICIES
from moebalance.prediction.predictors import PredictorInputs
from moebalance.pricing.phase import PhaseModel, phase_steps
from moebalance.pricing.step import StepPricing

__all__ = ["add_parser", "default_predictor", "phase_load", "prefetch", "pricing_from", "replanning", "run"]

#: The deployment's flags a step of online uses only with ``--phase`` (the memory and the requests size its steps).
_PHASE_ONLY = (("--memory-fraction", "memory_fraction"), ("--reserve-gib", "reserve_gib"),
               ("--output-tokens", "output_tokens"), ("--prefill-chunk", "prefill_chunk"),
               ("--max-running-requests", "max_running_requests"), ("--kv-cache-dtype", "kv_cache_dtype"))
#: The re-plan pricing options, which need --gpu and --replan-every.
_REARRANGE = (("--rearrange", "rearrange"), ("--rearrange-overhead-ms", "rearrange_overhead_ms"),
              ("--layers-per-step", "layers_per_step"))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("online", help="replay a trace batch by batch as a server would: static, periodic and "
                                      "dynamic (libra) planning")
    p.add_argument("--load", action=options.OneLoad, required=True)
    p.add_argument("--policy", required=True, metavar="NAME[,NAME...]",
                   help=f"one or more of: {', '.join([*POLICIES, *DYNAMIC_POLICIES])}")
    options.add_cluster(p)
    options.add_budget(p)
    options.add_set(p)
    options.add_router(p, default=None, help="router for every policy (default: uniform for static policies, "
                                             "rebalance for libra)")
    p.add_argument("--warmup", required=True, metavar="A:B", help="batches the first plan is made on")
    p.add_argument("--batches", metavar="C:D", help="batches served (default: every batch after the warm-up)")
    p.add_argument("--replan-every", type=options.positive, metavar="K",
                   help="static policies re-plan before every K-th served batch (vLLM's step interval)")
    p.add_argument("--window", type=options.positive, metavar="W",
                   help="batches a re-plan looks back on (vLLM's window size; default K)")
    p.add_argument("--build", action="append", metavar="TRACE",
                   help="token-level trace for libra's path table (default: the warm-up batches)")
    p.add_argument("--checkpoint", help="the model that made the capture (libra with lookahead)")
    p.add_argument("--seed", type=options.non_negative, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out-dir", help="write online.md, online.json and online.png (imbalance per batch) here; with "
                                     "--gpu also online_time.png (step time per batch)")
    p.add_argument("--model", help="also model the copies each batch loads (prefetch GiB, ms per GPU and layer over "
                                   "--intra-link), for this model; also names the load's model and, with --gpu, the "
                                   "priced one (default: the load's)")
    options.add_links(p)
    deployment.add(p, gpu_required=False)
    deployment.add_phase(p)
    p.add_argument("--rearrange", choices=REARRANGE_MODES,
                   help="with --gpu and --replan-every: a re-plan's moves stop serving (sync, the default) or run "
                        "beside it, the new plan serving once they land (async)")
    p.add_argument("--rearrange-overhead-ms", type=options.non_negative_float, metavar="MS",
                   help=f"host time a sync rearrangement exposes besides its transfer (default {DEFAULT_OVERHEAD_MS:g}: "
                        "SGLang's measured host time per rearrangement; docs/design.md gives the source)")
    p.add_argument("--router-ms", type=_router_ms, metavar="MS|measure",
                   help="with --gpu: a load-dependent router's (rebalance, minmax) host time per MoE layer, exposed "
                        "where it outlasts the local phase (default 0, as advise: engines decide on the GPU, as "
                        "SGLang's dynamic and LP dispatch do; 'measure': moebalance's router timed on this machine's "
                        "replay, which varies from run to run and machine to machine)")
    p.add_argument("--layers-per-step", type=options.positive, metavar="C",
                   help="a re-plan moves C layers per step, as TensorRT-LLM's layer_updates_per_iter and SGLang's "
                        "layers per chunk (default: all at once)")
    p.add_argument("--migration", choices=MIGRATIONS,
                   help="with --replan-every: each re-plan as planned (fresh, the default), aligned onto the plan in "
                        "service to keep the most experts in place, or bounded by --max-moves")
    p.add_argument("--max-moves", type=options.non_negative, metavar="M",
                   help="with --migration bounded: expert copies one GPU may receive per re-plan, summed over layers")
    p.add_argument("--fail", action="append", metavar="G@BATCH",
                   help="GPU G is gone from served batch BATCH on: static policies and libra's base re-plan on the "
                        "survivors (repeatable)")
    p.add_argument("--reload-link", type=options.link, metavar="PRESET|GBPS",
                   help=f"with --fail and --gpu: the host link experts only a lost GPU held are reloaded over "
                        f"(default pcie5, {DEFAULT_RELOAD_GBPS:g} GB/s)")
    options.add_format(p)
    p.set_defaults(func=run)


def default_predictor(args: argparse.Namespace, load: LoadMatrix, hidden: np.ndarray | None) -> tuple[str, str]:
    """``(predictor, why)`` for a libra given none: ``lookahead`` on a capture with ``hidden`` states whose model is
    at hand, ``path`` on other token-level traces (engines record no hidden states), ``history`` on counts."""
    if load.trace is None:
        return "history", "the load has counts only, no tokens to predict per token"
    if hidden is not None:
        if args.checkpoint is not None:
            return "lookahead", "the capture has hidden states and --checkpoint its model"
        from moebalance.lm.moe_lm import bundled_for  # torch: only for a capture with hidden states

        try:
            bundled_for(load.num_layers, load.num_experts, load.trace.top_k)
        except InputError:
            return "path", "the capture has hidden states but no bundled model of its shape: give --checkpoint"
        return "lookahead", "the capture has hidden states of a bundled model"
    source = "the --build traces" if args.build else "the warm-up batches"
    return "path", f"the trace records no hidden states (engines do not), so the path table built on {source}"


def prefetch(result: OnlineResult, model_name: str, load: LoadMatrix, cluster: Cluster, intra: float,
             weight_bytes: float = 2) -> dict[str, float]:
    """The modelled cost of the copies each served batch loads, in expert weights of ``weight_bytes`` (the
    deployment's precision's; bf16 without ``--gpu``): GiB per batch (all GPUs), and ms per layer for a GPU loading the mean share
    over the intra-node link of ``intra`` GB/s."""
    spec = get_model(model_name)
    per_gpu_layer = result.experts_moved / (load.num_layers * cluster.num_gpus)
    seconds = prefetch_seconds(per_gpu_layer, spec, intra, weight_bytes=weight_bytes)
    return {"gb_per_batch": round(result.experts_moved * spec.expert_params() * weight_bytes / (1 << 30), 6),
            "mean_ms_per_gpu_and_layer": round(float(seconds) * 1e3, 6)}


def pricing_from(args: argparse.Namespace, load: LoadMatrix) -> StepPricing | None:
    """The step pricing of ``--gpu`` (the model ``--model`` or the load's), else None; refuses the pricing flags
    without ``--gpu`` and those it does not use."""
    rearrange = [flag for flag, dest in _REARRANGE if getattr(args, dest) is not None]
    if args.gpu is None:
        deployment.refuse(args, "by online with --gpu (a step's time)")
        given = [*rearrange, *(["--inter-link"] if args.inter_link is not None else []),
                 *(["--router-ms"] if args.router_ms is not None else [])]
        if given:
            raise InputError(f"{given[0]} is used by online with --gpu (a step's time); give --gpu or drop it")
        return None
    for flag, dest in _PHASE_ONLY:
        if getattr(args, dest) is not None and args.phase is None:
            raise InputError(f"{flag} is not used by online without --phase (a step's time needs no memory or request "
                             "mix); drop it or give --phase")
    if args.phase == "prefill":
        deployment.refuse(args, "by decode steps, not by --phase prefill", deployment.DECODE_FLAGS)
    if rearrange and args.replan_every is None:
        raise InputError(f"{rearrange[0]} prices periodic re-plans; give --replan-every K or drop it")
    router_ms = 0.0 if args.router_ms is None else None if args.router_ms == MEASURE else float(args.router_ms)
    return StepPricing(deployment=deployment.build(args, load), phase=args.phase or "prefill", router_ms=router_ms)


#: ``--router-ms measure``: time moebalance's router on this machine (``StepPricing.router_ms`` None).
MEASURE = "measure"


def _router_ms(text: str) -> float | str:
    """``--router-ms``: a finite number of ms >= 0, or ``measure``."""
    return MEASURE if text.strip() == MEASURE else options.non_negative_float(text)


def replanning(args: argparse.Namespace, periodic: bool) -> Replanning:
    """The re-plan flags (``--replan-every``, ``--window``, ``--migration``, ``--max-moves``, ``--rearrange``,
    ``--rearrange-overhead-ms``, ``--layers-per-step``); a policy that does not re-plan periodically (``periodic``
    False) keeps only the host overhead a recovery exposes."""
    overhead = DEFAULT_OVERHEAD_MS if args.rearrange_overhead_ms is None else args.rearrange_overhead_ms
    if not periodic:
        return Replanning(overhead_ms=overhead)
    return Replanning(every=args.replan_every, window=args.window, migration=args.migration or "fresh",
                      max_moves=args.max_moves, rearrange=args.rearrange or "sync", overhead_ms=overhead,
                      layers_per_step=args.layers_per_step)


def phase_load(args: argparse.Namespace, load: LoadMatrix, cluster: Cluster, budget: Budget,
               pricing: StepPricing | None) -> tuple[LoadMatrix, int | None]:
    """``(load, N)``: with ``--phase``, every batch drawn again as a step of that phase of ``N`` tokens for the
    deployment the budget allows (:mod:`moebalance.pricing.phase`); else the load as it is and ``None``."""
    if args.phase is None:
        return load, None
    if pricing is None:  # unreachable: run refuses --phase without --gpu first
        raise InputError(f"--phase {args.phase} needs --gpu")
    spec, L = pricing.deployment.model, pricing.deployment.model.num_layers
    if budget.replicas_per_gpu == "auto":
        raise InputError(f"--phase {args.phase} sizes the steps by the replicas' memory; give --replicas-per-gpu R or "
                         "--slots-per-gpu S, not auto")
    hosted = (budget.slots_per_gpu * L if budget.slots_per_gpu is not None else
              L * math.ceil(spec.num_experts / cluster.num_gpus) + int(budget.replicas_per_gpu or 0))
    phase = PhaseModel(args.phase, pricing.deployment, seed=args.seed)
    tokens = phase.step_tokens(cluster, hosted)
    note(f"--phase {args.phase}: every batch drawn again as a step of {tokens:,} tokens")
    return phase_steps(load, tokens, spec.top_k, args.seed), tokens


def _check_moves(args: argparse.Namespace) -> None:
    """Refuse the migration and failure flags where they do nothing."""
    if args.migration is not None and args.replan_every is None:  # fresh, the default, is no less a re-plan mode
        raise InputError(f"--migration {args.migration} says how periodic re-plans are laid onto the plan in "
                         "service; give --replan-every K or drop it")
    if args.migration == "bounded" and args.max_moves is None:
        raise InputError("--migration bounded needs --max-moves M, the copies one GPU may receive per re-plan")
    if args.max_moves is not None and args.migration != "bounded":
        raise InputError(f"--max-moves is used only by --migration bounded, not {args.migration or 'fresh'}; drop it "
                         "or add --migration bounded")
    if args.reload_link is not None and (args.fail is None or args.gpu is None):
        raise InputError("--reload-link prices the reloads after --fail with --gpu; give both or drop it")


def run(args: argparse.Namespace) -> None:
    policies = list(dict.fromkeys(p.strip() for p in args.policy.split(",") if p.strip()))
    if not policies:
        raise InputError("--policy is empty; give a name like eplb or libra")
    router = None if args.router is None else options.router(args)
    if router is None and args.router_set:
        raise InputError("--router-set needs --router NAME")
    if args.phase is not None and args.gpu is None:
        raise InputError(f"--phase {args.phase} prices the steps of a deployment; give --gpu (and --model when the "
                         "load names none)")
    first = [] if args.groups is None else [("--groups", "num_groups", args.groups)]
    params = options.resolve_set(args.set, policies, first=first, policy_flag="--policy")  # checks the names too
    _check_moves(args)
    if args.window is not None and args.replan_every is None:
        raise InputError("--window needs --replan-every K: the window is what a periodic re-plan looks at")
    if args.intra_link is not None and args.model is None and args.gpu is None:
        raise InputError("--intra-link is used by online only with --model or --gpu (the copies' time); give one")
    out_dir = None if args.out_dir is None else Path(args.out_dir)
    if out_dir is not None:
        check_out_dir(out_dir)  # a file, the current folder, a folder of other files: refused before the work
    cluster = options.cluster(args)
    with step(f"read {Path(args.load).name}"):  # a large token-level trace is read and checked for a while
        load = options.read_load(args)
    pricing = pricing_from(args, load)
    if pricing is not None and args.phase is None:
        note("tokens/s here price each served batch as recorded, as one prefill step of all its tokens; advise prices "
             "decode steps (one token per running request, as many requests as the KV cache holds), far fewer tokens "
             "per second: give --phase decode (or prefill) to price the steps advise does")
    if router is not None:
        router = deployment.bind_routers([router], None if pricing is None else pricing.deployment, load)[0]
    if pricing is not None and router is not None and router.assign_kept is not None:  # it decides after the gate
        note(f"{router.name} decides after the gate; its host time is "
             + ("measured on this machine's replay (--router-ms measure): it varies from run to run"
                if pricing.router_ms is None else f"{pricing.router_ms:g} ms per MoE layer"
                + (" (the default, as advise: engines decide on the GPU; --router-ms measure times moebalance's "
                   "router here)" if args.router_ms is None else " (--router-ms)")))
    budget = options.budget(args)
    load, step_tokens = phase_load(args, load, cluster, budget, pricing)
    warm = parse_batch_range(args.warmup, load.num_batches)
    served = (warm[1], load.num_batches) if args.batches is None else parse_batch_range(args.batches, load.num_batches)
    dynamic = [p for p in policies if p in DYNAMIC_POLICIES]
    # read once: lookahead needs them, and a libra given no predictor takes lookahead where they are
    hidden = hidden_states(args.load, load) if step_tokens is None and any(
        params[p].get("predictor", "lookahead") == "lookahead" for p in dynamic) else None
    if step_tokens is not None and any(params[p].get("predictor") == "lookahead" for p in dynamic):
        raise InputError(f"--phase {args.phase} draws new steps from the batches, so a capture's hidden states no "
                         "longer line up with its tokens; give libra another predictor (--set predictor=path)")
    notes: dict[str, str] = {}
    for p in dynamic:
        if "predictor" not in params[p]:
            params[p]["predictor"], notes[p] = default_predictor(args, load, hidden)
            note(f"{p} predicts with {params[p]['predictor']}: {notes[p]} (--set predictor=NAME to choose)")
    lookahead = any(params[p]["predictor"] == "lookahead" for p in dynamic)
    model = capture_model(args.checkpoint, load) if lookahead and hidden is not None else None
    build = concatenated(build_traces(args.build))
    failures = Failures(tuple(parse_failure(v) for v in args.fail or ()), args.reload_link or DEFAULT_RELOAD_GBPS)
    inputs = PredictorInputs(hidden=hidden, model=model, build=build)
    results: list[OnlineResult] = []
    with progress() as bar:
        for p in policies:
            # a dynamic policy's predictor is built before its first batch (the path table: layer by layer)
            table = bar.add_task(f"online {p}: build the {params[p]['predictor']} predictor", total=None,
                                 visible=False) if p in DYNAMIC_POLICIES else None
            task = bar.add_task(f"online {p}", total=served[1] - served[0])

            def advance(n: int, task: Any = task) -> None:
                bar.advance(task, n)

            def built(done: int, total: int, table: Any = table) -> None:
                bar.update(table, completed=done, total=total, visible=True, refresh=True)

            # with several policies the re-plan knobs go to the static ones (a dynamic policy replans every batch)
            periodic = len(policies) == 1 or p not in DYNAMIC_POLICIES
            results.append(replay(load, cluster, budget, p, params[p], warmup=warm, batches=served, router=router,
                                  seed=args.seed, replanning=replanning(args, periodic),
                                  inputs=inputs if table is None else dataclasses.replace(inputs, progress=built),
                                  failures=failures, pricing=pricing, progress=advance))
    title = (f"{args.load}: batches {served[0]}:{served[1]} served one at a time after warm-up {warm[0]}:{warm[1]}, "
             f"{cluster.num_nodes}x{cluster.gpus_per_node} GPUs, budget {budget.describe()}"
             + ("" if step_tokens is None else f", {args.phase} steps of {step_tokens:,} tokens")
             + ("" if pricing is None else f"; priced with {pricing.deployment.describe()}"))
    docs = [r.as_dict() for r in results]
    for r, d in zip(results, docs, strict=True):
        if r.policy in notes:
            d["predictor_note"] = notes[r.policy]
        if step_tokens is not None:
            d["phase"] = {"phase": args.phase, "step_tokens": step_tokens}
        if pricing is not None:
            d["priced_with"] = pricing.deployment.describe()
    costs: list[dict[str, float] | None] = [None] * len(results)
    if args.model is not None:  # the cost of the copies each batch loads (Libra's prefetch, a replan's moves)
        intra = cluster.intra_node_bandwidth  # --intra-link, else the default link
        weight_bytes = 2 if pricing is None else pricing.deployment.engine.expert_bytes_per_weight
        costs = [prefetch(r, args.model, load, cluster, intra, weight_bytes) for r in results]
        for d, c in zip(docs, costs, strict=True):
            d["modelled_prefetch"] = c
    if out_dir is not None:
        assumed = () if pricing is None else assumption_rows(online_assumptions(
            pricing.deployment, cluster, fit_error=deployment.calibration(args)[1], phase=args.phase,
            step_tokens=step_tokens))
        with atomic_dir(out_dir) as tmp:  # all of the folder or none of it (docs/design.md, "Errors")
            write_files([
                ("online.json", lambda: atomic_write_text(tmp / "online.json",
                                                          dumps({"title": title, "results": docs}))),
                ("online.md", lambda: atomic_write_text(tmp / "online.md", online_markdown(results, title, costs))),
                ("online.png", lambda: plot_online(results, tmp / "online.png", title)),
                *([] if pricing is None else [
                    ("online_time.png", lambda: plot_online_time(results, tmp / "online_time.png", title))]),
                ("report.html", lambda: online_report(results, title, costs, assumed).write(tmp / "report.html"))])
    if args.json:
        sys.stdout.write(dumps(docs[0] if len(docs) == 1 else {"results": docs}))
        return
    out.print(online_table(results, title, costs))
    for line in failure_notes(results):
        out.print(f"failure: {line}")
    if out_dir is not None:
        extra = ", online.png, online_time.png and report.html" if pricing is not None else \
            ", online.png and report.html"
        err.print(f"wrote {out_dir / 'online.md'}, online.json{extra}")
