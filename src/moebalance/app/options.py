"""Options shared by the commands (:mod:`moebalance.app.commands`): argument types with bounds, the cluster, budget,
link, format, router and cost flags, what they build, and the one ``--set`` rule.

The ``--set`` rule (:func:`resolve_set`), the same in ``plan``, ``compare``, ``sweep``, ``online`` and ``predict``:
``policy.key=value`` goes to that policy only, ``key=value`` to every chosen policy that has ``key``; items apply
in the order given, so a later item wins; a dedicated flag (``--groups`` for ``num_groups``) counts as an item
placed before every ``--set``; a key no chosen policy has is a one-line error naming the keys they have.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moebalance.app.console import note
from moebalance.core.budget import Budget
from moebalance.core.cluster import LINK_PRESETS, Cluster
from moebalance.core.errors import InputError
from moebalance.core.io import read_json
from moebalance.core.limits import check_count
from moebalance.core.load import LoadMatrix
from moebalance.cost.goodput import Workload
from moebalance.cost.hardware import GPUS
from moebalance.cost.memory import EngineMemory
from moebalance.cost.time import Calibration
from moebalance.engines import LOAD_FORMATS, open_load
from moebalance.engines.detect import detect_load
from moebalance.models import get_model
from moebalance.policies import DYNAMIC_POLICIES, POLICIES
from moebalance.routing import ROUTERS, Router, get_router
from moebalance.routing.metro import CALIBRATION_OPTIONS, check_ready, fill

__all__ = [
    "COST_OPTIONS",
    "MAX_GPUS",
    "MAX_REPLICAS_PER_GPU",
    "MAX_SLOTS_PER_GPU",
    "add_auto_by",
    "add_budget",
    "add_cluster",
    "add_cost_options",
    "add_format",
    "add_links",
    "add_model",
    "add_phase",
    "add_router",
    "add_set",
    "budget",
    "calibration_from",
    "cluster",
    "count",
    "engine_from",
    "fraction",
    "given_cost_options",
    "link",
    "links",
    "load_model",
    "non_negative",
    "non_negative_float",
    "parse_items",
    "parse_set",
    "policy_keys",
    "positive",
    "read_load",
    "replicas",
    "resolve_set",
    "router",
    "router_context",
    "routers",
    "with_context",
    "workload_from",
]

#: The most GPUs a cluster flag describes (``--nodes`` x ``--gpus-per-node``): far above any expert-parallel
#: deployment, far below a size whose arrays a machine cannot hold.
MAX_GPUS = 65_536
#: The most expert slots per GPU and layer (the budget also refuses more than the load's experts).
MAX_SLOTS_PER_GPU = 65_536
#: The most extra replicas per GPU over all layers (``L * E`` of the largest model is far below it).
MAX_REPLICAS_PER_GPU = 1 << 20


# ----- argument types --------------------------------------------------------------------------------------------

def count(maximum: int | None = None, *, minimum: int = 1, fix: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in ``[minimum, maximum]``; anything else is one line naming the value."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value:,} is more than {maximum:,}" + (f"; {fix}" if fix else ""))
        return value

    return integer


non_negative = count(minimum=0)
positive = count()


def fraction(text: str) -> float:
    """An argparse type: a number in ``(0, 1]``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text.strip()} must be in (0, 1]")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number ``>= 0``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0.0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text.strip()} must be a finite number >= 0")
    return value


def replicas(text: str) -> int | str:
    """An argparse type: extra replicas per GPU, an integer in ``[0, MAX_REPLICAS_PER_GPU]``, or ``auto``."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor 'auto'") from None
    if value > MAX_REPLICAS_PER_GPU:
        raise argparse.ArgumentTypeError(f"{value:,} is more than {MAX_REPLICAS_PER_GPU:,} extra replicas per GPU")
    return value  # a negative R is the Budget's to refuse, naming the value


def link(value: str) -> float:
    """A link bandwidth in GB/s per GPU and direction: a preset name (LINK_PRESETS) or a number."""
    if value in LINK_PRESETS:
        return LINK_PRESETS[value]
    try:
        gbps = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a number of GB/s nor a link preset ({', '.join(LINK_PRESETS)})") from None
    if not (gbps > 0 and math.isfinite(gbps)):
        raise argparse.ArgumentTypeError(f"{value!r} must be a positive number of GB/s")
    return gbps


# ----- flags -------------------------------------------------------------------------------------------------------

def add_cluster(p: argparse.ArgumentParser, *, required: bool = True, what: str = "") -> None:
    """``--nodes`` and ``--gpus-per-node`` (at most :data:`MAX_GPUS` GPUs in all, :func:`cluster` checks)."""
    gpus = count(MAX_GPUS)
    p.add_argument("--nodes", type=gpus, required=required, help=f"number of nodes N{what}")
    p.add_argument("--gpus-per-node", type=gpus, required=required, help=f"GPUs per node M (G = N * M){what}")


def add_budget(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    """The budget: ``--slots-per-gpu S`` or ``--replicas-per-gpu R|auto``."""
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--slots-per-gpu", type=count(MAX_SLOTS_PER_GPU),
                   help="experts per GPU per layer, the same in every layer (EPLB)")
    g.add_argument("--replicas-per-gpu", type=replicas, metavar="R|auto",
                   help="extra expert slots per GPU over all layers (CRAFT's R; craft accepts auto)")


def add_set(p: argparse.ArgumentParser, *, groups: bool = True) -> None:
    """``--groups`` (eplb's ``num_groups``) and ``--set`` (the rule in the module docstring)."""
    if groups:
        p.add_argument("--groups", type=int, help="expert groups for eplb's hierarchical policy (default: the load's "
                                                  "model's); the same as a first --set num_groups=G")
    p.add_argument("--set", action="append", metavar="[POLICY.]KEY=VALUE",
                   help="policy parameter: POLICY.KEY=VALUE for one policy, KEY=VALUE for every chosen policy that "
                        "has KEY; later items win (repeatable)")


def add_model(p: argparse.ArgumentParser, cost: str = "--gpu") -> None:
    """``--model``: the load's model (engine files name none; eplb uses its expert groups), and the cost model's."""
    p.add_argument("--model", help="the model the load was recorded for, which engine files do not name (eplb uses "
                                   f"its expert groups); with {cost} also the cost model's (default: the load's)")


def add_auto_by(p: argparse.ArgumentParser) -> None:
    """``--auto-by``: how craft chooses ``R`` under ``--replicas-per-gpu auto``."""
    p.add_argument("--auto-by", choices=("gain", "goodput"), default="gain",
                   help="craft with --replicas-per-gpu auto: choose R by CRAFT's balancedness curve (gain) or by "
                        "modelled goodput (needs --gpu)")


def add_links(p: argparse.ArgumentParser, *, inter: bool = True) -> None:
    p.add_argument("--intra-link", type=link, metavar="PRESET|GBPS",
                   help=f"GB/s per GPU and direction inside a node (default nvlink4; presets: "
                        f"{', '.join(LINK_PRESETS)})")
    if inter:
        p.add_argument("--inter-link", type=link, metavar="PRESET|GBPS",
                       help="GB/s per GPU and direction across nodes (default ib-ndr400)")


class OneLoad(argparse.Action):
    """``--load`` of a command that reads one load: given twice it is an error, not the last one silently
    (``plan`` and ``advise`` take several)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            raise argparse.ArgumentError(self, "given twice; this command reads one load (several workloads: "
                                               "moebalance plan or advise with --load repeated)")
        setattr(namespace, self.dest, values)


def add_format(p: argparse.ArgumentParser, flag: str = "--format", what: str = "the --load file's") -> None:
    p.add_argument(flag, choices=LOAD_FORMATS,
                   help=f"{what} format (default: detected; SGLang .pt/.json dumps, TensorRT-LLM statistics folders, "
                        "vLLM routed experts, moebalance .npy/.npz)")


def add_router(p: argparse.ArgumentParser, *, several: bool = False, default: str | None = "uniform",
               help: str | None = None) -> None:
    """``--router`` (one name, or several comma-separated with ``several``) and ``--router-set``."""
    what = "comma-separated routers, one row each per policy" if several else "router"
    p.add_argument("--router", default=default, metavar="NAME" + ("[,NAME...]" if several else ""),
                   help=help or f"{what}: {', '.join(sorted(ROUTERS))} (default {default})")
    p.add_argument("--router-set", action="append", metavar="KEY=VALUE",
                   help="router option, e.g. eps=0.02 for rebalance (repeatable)")


def add_phase(p: argparse.ArgumentParser) -> None:
    """``--phase decode|prefill`` (``compare``, ``online``): score the phase's steps (:mod:`moebalance.app.phase`)."""
    p.add_argument("--phase", choices=("decode", "prefill"),
                   help="with --gpu: draw each batch again as a step of the phase (decode: one token per running "
                        "request, the KV cache's concurrency; prefill: --prefill-chunk tokens per data-parallel rank) "
                        "and score those steps")


_ENGINE, _WORK = EngineMemory(), Workload()  # the defaults the cost options show

#: ``(flag, dest)`` of the cost model's options besides ``--gpu``: given or not (default None), so that a command
#: can refuse them where it has no cost model.
COST_OPTIONS = (("--memory-fraction", "memory_fraction"), ("--reserve-gib", "reserve_gib"),
                ("--attention-tp", "attention_tp"), ("--dense-tp", "dense_tp"), ("--prompt-tokens", "prompt_tokens"),
                ("--output-tokens", "output_tokens"), ("--prefill-chunk", "prefill_chunk"),
                ("--calibration", "calibration"), ("--dispatch", "dispatch"))


def add_cost_options(p: argparse.ArgumentParser, *, gpu_required: bool) -> None:
    """The GPU, engine and workload options of ``cost`` (and of ``plan``/``compare``/``sweep`` with ``--gpu``)."""
    p.add_argument("--gpu", required=gpu_required, choices=sorted(GPUS), help="GPU model of every GPU")
    p.add_argument("--memory-fraction", type=fraction,
                   help=f"share of GPU memory for weights and KV cache, in (0, 1] (SGLang mem_fraction_static; default "
                        f"{_ENGINE.memory_fraction})")
    p.add_argument("--reserve-gib", type=non_negative_float,
                   help="GiB per GPU the engine keeps besides weights and KV cache (default fitted, docs/design.md)")
    p.add_argument("--attention-tp", type=count(MAX_GPUS), help="GPUs splitting attention weights (default: a node)")
    p.add_argument("--dense-tp", type=count(MAX_GPUS), help="GPUs splitting the other non-expert weights (default 1)")
    p.add_argument("--prompt-tokens", type=positive, help=f"default {_WORK.prompt_tokens}")
    p.add_argument("--output-tokens", type=positive, help=f"default {_WORK.output_tokens}")
    p.add_argument("--prefill-chunk", type=positive,
                   help=f"prompt tokens a data-parallel rank prefills per step (default {_WORK.prefill_chunk})")
    p.add_argument("--calibration", help="JSON from 'moebalance calibrate' (default: published peaks)")
    p.add_argument("--dispatch", choices=("gpu", "node"),
                   help="all-to-all of token-level loads: a copy per destination GPU (gpu, the default), or one per "
                        "destination node forwarded inside it, as DeepEP and GRACE do (node)")


def given_cost_options(args: argparse.Namespace) -> list[str]:
    """The cost-model flags (besides ``--gpu``) given on the command line."""
    return [flag for flag, dest in COST_OPTIONS if getattr(args, dest, None) is not None]


# ----- what the flags build --------------------------------------------------------------------------------------

def cluster(args: argparse.Namespace) -> Cluster:
    """The cluster of ``--nodes`` and ``--gpus-per-node`` with the links given (the Cluster defaults for the rest)."""
    check_count(args.nodes * args.gpus_per_node, "--nodes x --gpus-per-node", MAX_GPUS,
                "give fewer nodes or GPUs per node")
    return Cluster(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node, **links(args))


def budget(args: argparse.Namespace) -> Budget:
    return Budget(slots_per_gpu=args.slots_per_gpu, replicas_per_gpu=args.replicas_per_gpu)


def links(args: argparse.Namespace) -> dict[str, Any]:
    """The link bandwidths given on the command line, as :class:`Cluster` keywords."""
    out: dict[str, Any] = {}
    if getattr(args, "intra_link", None) is not None:
        out["intra_node_bandwidth"] = args.intra_link
    if getattr(args, "inter_link", None) is not None:
        out["inter_node_bandwidth"] = args.inter_link
    return out


def load_model(load: LoadMatrix, name: str | None) -> LoadMatrix:
    """``load`` naming model ``name`` (so that eplb finds the model's expert groups): engine files name none, and a
    model of the same shape may stand for a recorded one (DeepSeek-R1 for V3); checked against the load's experts
    and layers."""
    if name is None or load.preset == name:
        return load
    spec = get_model(name)
    L = spec.num_layers
    # the load may hold the MoE layers only, the dense ones too (zero rows), and a multi-token-prediction layer
    if spec.num_experts != load.num_experts or not L <= load.num_layers <= L + spec.num_dense_layers + 1:
        raise InputError(f"--model {name} has {L} MoE layers ({L + spec.num_dense_layers} with its dense ones) x "
                         f"{spec.num_experts} experts but the load has {load.num_layers} x {load.num_experts}; give "
                         "the load's --model")
    return dataclasses.replace(load, preset=name)


def read_load(args: argparse.Namespace, *, model: bool = True) -> LoadMatrix:
    """``--load`` in its detected format, or ``--format``'s; with ``model``, ``--model`` names the load's model
    (:func:`load_model`). Where an engine file's shape named the model and ``--model`` did not, a note on stderr
    says which."""
    name = getattr(args, "model", None)
    fmt = getattr(args, "format", None)
    # an engine file's reader takes the model named (its expert count, its layer numbering); a moebalance load is
    # checked against it by load_model below
    opened = open_load(args.load, fmt, model=None if (fmt or detect_load(args.load)) == "moebalance" else name)
    for text in opened.notes:  # the model an engine file's shape named: say so, and how to name another
        note(text)
    return load_model(opened.load, name) if model else opened.load


def engine_from(args: argparse.Namespace) -> EngineMemory:
    given = {dest: getattr(args, dest, None) for dest in ("memory_fraction", "reserve_gib", "attention_tp", "dense_tp")}
    return EngineMemory(**{k: v for k, v in given.items() if v is not None})


def workload_from(args: argparse.Namespace) -> Workload:
    given = {dest: getattr(args, dest, None) for dest in ("prompt_tokens", "output_tokens", "prefill_chunk")}
    return Workload(**{k: v for k, v in given.items() if v is not None})


def calibration_from(args: argparse.Namespace) -> Calibration:
    """``--calibration FILE`` (written by ``moebalance calibrate``), else the published peaks."""
    if getattr(args, "calibration", None) is None:
        return Calibration()
    path = Path(args.calibration)
    doc = read_json(path, "calibration")
    fields = {f.name for f in dataclasses.fields(Calibration)}
    recorded = {"format", "mean_abs_log_error"}  # the fit's quality, recorded beside its constants
    if not isinstance(doc, dict) or doc.get("format") != "moebalance.calibration" or not set(doc) - recorded <= fields:
        raise InputError(f"{str(path)!r} is not a calibration written by 'moebalance calibrate' (keys: "
                         f"format, {', '.join(sorted(fields))})")
    try:
        return Calibration(**{k: v for k, v in doc.items() if k not in recorded})
    except TypeError as exc:
        raise InputError(f"{str(path)!r}: {exc}") from None


# ----- the --set rule -------------------------------------------------------------------------------------------

def parse_items(items: Sequence[str] | None, flag: str = "--set") -> list[tuple[str, Any]]:
    """``key=value`` items in order as ``(key, value)``; values parse as JSON where they can (``eps=0.02`` -> 0.02),
    else stay strings."""
    out: list[tuple[str, Any]] = []
    for item in items or ():
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise InputError(f"{flag} {item!r} must look like key=value")
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            value = text
        except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
            raise InputError(f"{flag} {key}: {text[:20]}... cannot be read ({str(exc).split(':')[0]}); give a "
                             "smaller number") from None
        out.append((key, value))
    return out


def parse_set(items: Sequence[str] | None, flag: str = "--set") -> dict[str, Any]:
    """``key=value`` items as a dict (a later item wins)."""
    return dict(parse_items(items, flag))


def policy_keys(name: str) -> tuple[str, ...] | None:
    """The ``--set`` keys of policy ``name``: its config's fields; ``None`` for a callable that takes any keyword."""
    policy: Any = POLICIES.get(name) or DYNAMIC_POLICIES.get(name)
    if policy is None:
        names = [*POLICIES, *DYNAMIC_POLICIES]
        raise InputError(f"unknown policy {name!r}; choose one of: {', '.join(names)}")
    config = getattr(policy, "config", None)
    if config is not None:
        return tuple(f.name for f in dataclasses.fields(config))
    params = inspect.signature(policy).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params if p.name not in ("load", "cluster", "budget"))


def resolve_set(items: Sequence[str] | None, policies: Sequence[str], *, first: Sequence[tuple[str, str, Any]] = (),
                keys: Callable[[str], tuple[str, ...] | None] = policy_keys, flag: str = "--set",
                policy_flag: str = "--policies", owner: str = "policy",
                word: str = "parameter") -> dict[str, dict[str, Any]]:
    """Each of ``policies``' parameters from ``--set`` ``items`` (the rule in the module docstring).

    ``first`` holds dedicated flags as ``(flag, key, value)``, applied as plain items before every ``--set``
    item. ``keys(policy)`` lists a policy's keys (None: any key). ``owner``, ``word`` and ``policy_flag`` name
    what the items configure in error messages (``predict``: a predictor's options).
    """
    known = {p: keys(p) for p in policies}
    out: dict[str, dict[str, Any]] = {p: {} for p in policies}

    def has(p: str, key: str) -> bool:
        k = known[p]
        return k is None or key in k

    def listing(p: str) -> str:
        k = known[p]
        return "any" if k is None else ", ".join(k) or "none"

    def missing(p: str, key: str, source: str) -> InputError:
        k = known[p]
        hint = f"its {word}s: {', '.join(k)}" if k else "it takes none"
        return InputError(f"{source}: {owner} {p!r} has no {word} {key!r}; {hint}")

    steps = [(f, key, value, False) for f, key, value in first]
    steps += [(f"{flag} {key}", key, value, True) for key, value in parse_items(items, flag)]
    for source, key, value, dotted in steps:
        target, dot, name = key.partition(".") if dotted and "." in key else ("", "", key)
        if dot:
            if target not in out:
                raise InputError(f"{source}: {target!r} is not among {policy_flag} {','.join(policies)}; give "
                                 f"{flag} KEY=VALUE or {flag} POLICY.KEY=VALUE for one of them")
            if not has(target, name):
                raise missing(target, name, source)
            out[target][name] = value
            continue
        takers = [p for p in policies if has(p, name)]
        if not takers:
            if len(policies) == 1:
                raise missing(policies[0], name, source)
            raise InputError(f"{source}: no {owner} among {policy_flag} {','.join(policies)} has {word} {name!r}; "
                             + "; ".join(f"{p}: {listing(p)}" for p in policies))
        for p in takers:
            out[p][name] = value
    return out


# ----- routers ----------------------------------------------------------------------------------------------------

def routers(args: argparse.Namespace) -> list[Router]:
    """The routers of ``--router NAME[,NAME...]`` with ``--router-set key=value`` applied to each that has the option."""
    names = [n.strip() for n in args.router.split(",") if n.strip()]
    if not names:
        raise InputError("--router is empty; give a name like uniform or rebalance")
    chosen = [get_router(n) for n in names]
    params = parse_set(args.router_set, "--router-set")
    for key in params:
        if not any(key in r.params for r in chosen):
            takers = sorted(f"{n} ({', '.join(r.params)})" for n, r in ROUTERS.items() if r.params)
            raise InputError(f"--router-set {key}: no router given ({', '.join(names)}) has option {key!r}; routers "
                             f"with options: {'; '.join(takers)}")
    return [r.with_params(**{k: v for k, v in params.items() if k in r.params}) for r in chosen]


def router_context(args: argparse.Namespace, load: LoadMatrix | None = None) -> dict[str, Any]:
    """The command's cost options as router options (``metro``'s ``gpu``, ``model``, calibration): ``--gpu``,
    ``--model`` (else the load's model) and ``--calibration`` where the command has them."""
    model = getattr(args, "model", None)
    if model is None and load is not None and load.model is not None:
        model = load.model.name
    out: dict[str, Any] = {"gpu": getattr(args, "gpu", None), "model": model}
    if getattr(args, "calibration", None) is not None:
        cal = calibration_from(args)
        out.update({name: getattr(cal, name) for name in CALIBRATION_OPTIONS})
    return out


def with_context(chosen: Sequence[Router], context: dict[str, Any]) -> list[Router]:
    """``chosen`` with the options of ``context`` that ``--router-set`` left unset (:func:`router_context`); a
    router still missing what it needs (``metro`` without a GPU or model) is a one-line error."""
    out = [fill(r, context) for r in chosen]
    for r in out:
        check_ready(r)
    return out


def router(args: argparse.Namespace) -> Router:
    """The one router of a command that scores with one (``evaluate``, ``cost``, ``run``, ``online``)."""
    given = routers(args)
    if len(given) > 1:
        raise InputError(f"--router {args.router!r} names {len(given)} routers; this command takes one "
                         "(compare takes several)")
    return given[0]

