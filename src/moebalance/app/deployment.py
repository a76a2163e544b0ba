"""The deployment's flags and what they build: ``--gpu`` with the engine, request, calibration and all-to-all flags
turned into one :class:`~moebalance.cost.Deployment` (docs/design.md, "Cost model"), which every command that prices
passes on (``cost``, ``compare``, ``sweep``, ``plan --auto-by goodput``, ``online --gpu``, ``advise``), the routers
bound to it (``metro``), and the checks that refuse these flags where nothing is priced."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from moebalance.app.options import MAX_GPUS, count, fraction, non_negative_float, positive
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.cost.a2a import kernels_on
from moebalance.cost.calibrate import AUTO, profile_names, resolve_calibration
from moebalance.cost.deployment import KERNELS, OVERLAPS, PHASES, PRECISIONS, Deployment, Workload
from moebalance.cost.hardware import GPUS, get_gpu
from moebalance.cost.memory import EngineMemory
from moebalance.cost.time import PRECISION_BYTES, Calibration
from moebalance.models import get_model
from moebalance.pricing.goodput import PlanPrice, price_plan
from moebalance.routing import Router
from moebalance.routing.metro import check_ready, with_deployment

__all__ = [
    "DECODE_FLAGS",
    "ENGINE_FLAGS",
    "FLAGS",
    "REQUEST_FLAGS",
    "TIME_FLAGS",
    "PriceFn",
    "add",
    "add_phase",
    "auto_by_goodput",
    "bind_routers",
    "build",
    "calibration",
    "from_args",
    "price_fn",
    "refuse",
]

_ENGINE, _WORK = EngineMemory(), Workload()  # the defaults the flags show

#: The engine's memory layout (:class:`~moebalance.cost.EngineMemory`'s fields) and the requests
#: (:class:`~moebalance.cost.Workload`'s): ``(flag, dest)``, the dest being the field.
ENGINE_FLAGS = (("--memory-fraction", "memory_fraction"), ("--reserve-gib", "reserve_gib"),
                ("--attention-tp", "attention_tp"), ("--dense-tp", "dense_tp"),
                ("--max-running-requests", "max_running_requests"))
REQUEST_FLAGS = (("--prompt-tokens", "prompt_tokens"), ("--output-tokens", "output_tokens"),
                 ("--prefill-chunk", "prefill_chunk"))
#: Every flag of the deployment besides ``--gpu``: given or not (default None), so that a command can refuse them where
#: nothing is priced.
FLAGS = (*ENGINE_FLAGS, *REQUEST_FLAGS, ("--calibration", "calibration"),
         ("--calibration-any-gpu", "calibration_any_gpu"), ("--a2a", "a2a"),
         ("--precision", "precision"), ("--kv-cache-dtype", "kv_cache_dtype"), ("--overlap", "overlap"))

#: ``(plan, held-out load, router) -> PlanPrice``.
PriceFn = Callable[[Placement, LoadMatrix, "str | Router"], PlanPrice]


def add(p: argparse.ArgumentParser, *, gpu_required: bool) -> None:
    """``--gpu`` and the engine, request, calibration and all-to-all flags."""
    p.add_argument("--gpu", required=gpu_required, choices=sorted(GPUS), help="GPU model of every GPU")
    p.add_argument("--memory-fraction", type=fraction,
                   help=f"share of GPU memory for weights and KV cache, in (0, 1] (SGLang mem_fraction_static; default "
                        f"{_ENGINE.memory_fraction})")
    p.add_argument("--reserve-gib", type=non_negative_float,
                   help="GiB per GPU the engine keeps besides weights and KV cache (default fitted, docs/design.md)")
    p.add_argument("--attention-tp", type=count(MAX_GPUS), help="GPUs splitting attention weights (default: a node)")
    p.add_argument("--dense-tp", type=count(MAX_GPUS), help="GPUs splitting the other non-expert weights (default 1)")
    p.add_argument("--max-running-requests", type=positive,
                   help="requests the deployment runs at once at most, over all its data-parallel ranks, as SGLang's "
                        "flag (default: as many as the KV cache holds)")
    p.add_argument("--kv-cache-dtype", choices=tuple(PRECISION_BYTES),
                   help="the KV cache's numbers: bf16 (the default) or fp8 (half the bytes per token)")
    p.add_argument("--prompt-tokens", type=positive, help=f"default {_WORK.prompt_tokens}")
    p.add_argument("--output-tokens", type=positive, help=f"default {_WORK.output_tokens}")
    p.add_argument("--prefill-chunk", type=positive,
                   help=f"prompt tokens a data-parallel rank prefills per step (default {_WORK.prefill_chunk})")
    p.add_argument("--calibration",
                   help="JSON from 'moebalance calibrate', a shipped profile by name (docs/results/profiles.md: "
                        f"{', '.join(profile_names())}), 'peaks' (the published peaks), or {AUTO} (the default: the "
                        "profile shipped for --gpu, else the published peaks)")
    p.add_argument("--calibration-any-gpu", action="store_true", default=None,
                   help="price with a --calibration fitted on another GPU than --gpu (refused without it: its shares "
                        "of the peaks need not hold there); the output names the calibration's GPU")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="the weights' and GEMMs' precision: served (the default: the model's own checkpoint's, fp8 for "
                        "DeepSeek-V3/R1, Kimi-K2 and MiniMax-M2 where the GPU has FP8 tensor cores, mxfp4 for "
                        "gpt-oss, else bf16), bf16, fp8 (half the weight bytes, the GPU's FP8 peak, FP8 dispatch with "
                        "per-128 scales; combine stays bf16), or mxfp4 (an MXFP4 checkpoint's experts at 4.25 bits a "
                        "weight, the other weights, the GEMMs and the dispatch bf16)")
    p.add_argument("--overlap", choices=OVERLAPS,
                   help="a layer's experts and all-to-all one after the other (none, the default) or in two "
                        "micro-batches that hide each other (tbo, SGLang's --enable-two-batch-overlap)")
    p.add_argument("--a2a", choices=KERNELS,
                   help="how the all-to-all moves tokens: per-gpu (the default: a copy straight to each destination "
                        "GPU, no fixed cost), normal (DeepEP's normal kernels: once per remote node, then NVLink), "
                        "low-latency (DeepEP's: a message per pick), auto (normal in prefill, low-latency in decode, "
                        "as SGLang's --deepep-mode auto); DeepEP's on NVIDIA GPUs only")


def add_phase(p: argparse.ArgumentParser) -> None:
    """``--phase decode|prefill`` (``compare``, ``online``): score the phase's steps (:mod:`moebalance.pricing.phase`)."""
    p.add_argument("--phase", choices=PHASES,
                   help="with --gpu: draw each batch again as a step of the phase (decode: one token per running "
                        "request, the KV cache's concurrency; prefill: --prefill-chunk tokens per data-parallel rank) "
                        "and score those steps")


def refuse(args: argparse.Namespace, why: str, flags: Sequence[tuple[str, str]] = FLAGS) -> None:
    """Refuse the deployment's ``flags`` given where nothing reads them; ``why`` says what they need."""
    for flag, dest in flags:
        if getattr(args, dest, None) is not None:
            raise InputError(f"{flag} is used {why}; drop it")


#: What only a decode step reads: its requests' length, the KV cache's bytes and how many run at once.
DECODE_FLAGS = (("--output-tokens", "output_tokens"), ("--kv-cache-dtype", "kv_cache_dtype"),
                ("--max-running-requests", "max_running_requests"))
#: What only a time reads, not memory: ``cost`` without a plan prices memory alone (it still reads and names a
#: ``--calibration``, so that a file can be checked).
TIME_FLAGS = (("--a2a", "a2a"), ("--overlap", "overlap"), ("--prefill-chunk", "prefill_chunk"))


def calibration(args: argparse.Namespace) -> tuple[Calibration, float | None]:
    """``--calibration FILE|NAME|auto`` for ``--gpu`` and its fit error (:func:`moebalance.cost.calibrate.
    resolve_calibration`; not given: ``auto``, the profile shipped for the GPU, else the published peaks). One fitted on
    another GPU is refused but with ``--calibration-any-gpu``."""
    name, any_gpu = getattr(args, "calibration", None), bool(getattr(args, "calibration_any_gpu", None))
    if any_gpu and name is None:
        raise InputError("--calibration-any-gpu is used with --calibration FILE fitted on another GPU; give "
                         "--calibration or drop it")
    return resolve_calibration(name, args.gpu, any_gpu=any_gpu)


def build(args: argparse.Namespace, load: LoadMatrix | None = None, *,
          calibrated: Calibration | None = None) -> Deployment:
    """The deployment of the command line: ``--gpu``, the model of ``--model`` (else the load's, checked against the
    load's shape: :meth:`moebalance.core.load.LoadMatrix.check_model`) and the other flags, defaults where not given;
    ``calibrated``: ``--calibration`` already read (:func:`calibration`)."""
    name = getattr(args, "model", None) or (load.preset if load is not None else None)
    if name is None:
        raise InputError("the load names no model; give --model with --gpu (e.g. --model deepseek-v3)")
    spec = get_model(name)
    if load is not None:
        load.check_model(spec)
    engine = {dest: getattr(args, dest, None) for _, dest in ENGINE_FLAGS}
    kv_dtype = getattr(args, "kv_cache_dtype", None)
    engine["kv_bytes"] = None if kv_dtype is None else PRECISION_BYTES[kv_dtype]
    work = {dest: getattr(args, dest, None) for _, dest in REQUEST_FLAGS}
    gpu = get_gpu(args.gpu)
    return Deployment(model=spec, gpu=gpu,
                      calibration=calibration(args)[0] if calibrated is None else calibrated,
                      engine=EngineMemory(**{k: v for k, v in engine.items() if v is not None}),
                      workload=Workload(**{k: v for k, v in work.items() if v is not None}),
                      # the GPU's default kernel; Deployment refuses an --a2a the GPU cannot run (DeepEP's on AMD)
                      a2a=getattr(args, "a2a", None) or kernels_on(gpu)[0],
                      precision=getattr(args, "precision", None) or "served",
                      overlap=getattr(args, "overlap", None) or "none")


def bind_routers(chosen: Sequence[Router], deployment: Deployment | None, load: LoadMatrix | None = None) -> list[Router]:
    """``chosen`` pricing on ``deployment`` (``metro``; its ``--router-set`` options win), or, without one, with the
    load's model where ``--router-set`` gave none; a router still missing what it needs (``metro`` without a GPU
    or model) is a one-line error."""
    model = load.model.name if deployment is None and load is not None and load.model is not None else None
    out = [with_deployment(r, deployment, model) for r in chosen]
    for r in out:
        check_ready(r)
    return out


def price_fn(deployment: Deployment | None, seed: int) -> PriceFn | None:
    """A plan's price on a held-out load for ``deployment`` (``compare``, ``sweep``; ``None`` without one)."""
    if deployment is None:
        return None

    def price(plan: Placement, test: LoadMatrix, router: str | Router) -> PlanPrice:
        return price_plan(plan, test, deployment, router=router, seed=seed)

    return price


def from_args(args: argparse.Namespace, load: LoadMatrix) -> Deployment | None:
    """The deployment of ``--gpu`` for ``load``, else ``None``, refusing the deployment's other flags without it."""
    if getattr(args, "gpu", None) is None:
        refuse(args, "with --gpu (the cost model)")
        return None
    return build(args, load)


def auto_by_goodput(args: argparse.Namespace, deployment: Deployment | None,
                    policies: Sequence[str]) -> Callable[[Placement, LoadMatrix], PlanPrice] | None:
    """``(plan, load) -> PlanPrice`` when ``--auto-by goodput`` asks for it (checked), else None."""
    if args.auto_by != "goodput":
        return None
    if args.replicas_per_gpu != "auto" or "craft" not in policies:
        raise InputError("--auto-by goodput chooses craft's R: give --policy craft (or craft in --policies) with "
                         "--replicas-per-gpu auto")
    if deployment is None:
        raise InputError("--auto-by goodput needs --gpu (and --model when the load names none): the cost model")
    return lambda plan, part: price_plan(plan, part, deployment, router="uniform", seed=args.seed)
