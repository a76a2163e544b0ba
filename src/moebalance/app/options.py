"""Options shared by the commands (:mod:`moebalance.app.commands`): argument types with bounds, the cluster, budget,
link, format and router flags, reading loads and plans, what they build, and the one ``--set`` rule (the
deployment's flags are :mod:`moebalance.app.deployment`'s).

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
from dataclasses import dataclass
from typing import Any

import numpy as np

from moebalance.app.console import note
from moebalance.core.budget import Budget
from moebalance.core.cluster import LINK_PRESETS, Cluster
from moebalance.core.errors import InputError
from moebalance.core.limits import check_count
from moebalance.core.load import LoadMatrix, check_same_model, concatenate_loads, parse_batch_range
from moebalance.core.plan import Placement
from moebalance.cost.calibrate import resolve_calibration
from moebalance.cost.hardware import get_gpu
from moebalance.engines import LOAD_FORMATS, open_load, read_any_plan
from moebalance.engines.layers import check_plan_layers, fit_load
from moebalance.policies import DYNAMIC_POLICIES, POLICIES
from moebalance.routing import ROUTERS, Router, get_router

__all__ = [
    "MAX_GPUS",
    "MAX_REPLICAS_PER_GPU",
    "MAX_SLOTS_PER_GPU",
    "Workloads",
    "add_auto_by",
    "add_budget",
    "add_cluster",
    "add_format",
    "add_links",
    "add_model",
    "add_router",
    "add_set",
    "budget",
    "bytes_per_copy",
    "cluster",
    "count",
    "fraction",
    "link",
    "links",
    "load_model",
    "non_negative",
    "non_negative_float",
    "parse_items",
    "parse_set",
    "policy_keys",
    "positive",
    "positive_float",
    "read_load",
    "read_plan",
    "read_workloads",
    "replicas",
    "resolve_set",
    "router",
    "routers",
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


def positive_float(text: str) -> float:
    """An argparse type: a finite number ``> 0``."""
    value = non_negative_float(text)
    if value == 0.0:
        raise argparse.ArgumentTypeError(f"{text.strip()} must be a finite number > 0")
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
                   help=f"GB/s per GPU and direction inside a node (default: with --gpu its own node's link, e.g. "
                        f"nvlink5 for b200, xgmi-mi300x for mi300x; else nvlink4; presets: "
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


# ----- what the flags build --------------------------------------------------------------------------------------

def cluster(args: argparse.Namespace) -> Cluster:
    """The cluster of ``--nodes`` and ``--gpus-per-node`` with the links given (the Cluster defaults for the rest)."""
    check_count(args.nodes * args.gpus_per_node, "--nodes x --gpus-per-node", MAX_GPUS,
                "give fewer nodes or GPUs per node")
    return Cluster(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node, **links(args))


def budget(args: argparse.Namespace) -> Budget:
    return Budget(slots_per_gpu=args.slots_per_gpu, replicas_per_gpu=args.replicas_per_gpu)


def links(args: argparse.Namespace) -> dict[str, Any]:
    """The link bandwidths given on the command line, as :class:`Cluster` keywords; where a flag is not given and
    a deployment is priced (``--gpu``), the link ``--calibration``'s profile measured (``calibrate --measure``), if
    any."""
    out: dict[str, Any] = {}
    if getattr(args, "gpu", None) is not None:
        profile = resolve_calibration(getattr(args, "calibration", None), args.gpu,
                                      any_gpu=bool(getattr(args, "calibration_any_gpu", None)))[0]
        if profile.intra_node_gbs:
            out["intra_node_bandwidth"] = profile.intra_node_gbs
        if profile.inter_node_gbs:
            out["inter_node_bandwidth"] = profile.inter_node_gbs
    if getattr(args, "intra_link", None) is not None:
        out["intra_node_bandwidth"] = args.intra_link
    elif getattr(args, "gpu", None) is not None and "intra_node_bandwidth" not in out:  # the GPU's own node's link
        out["intra_node_bandwidth"] = LINK_PRESETS[get_gpu(args.gpu).intra_link]
    if getattr(args, "inter_link", None) is not None:
        out["inter_node_bandwidth"] = args.inter_link
    return out


def load_model(load: LoadMatrix, name: str | None) -> LoadMatrix:
    """``load`` naming model ``name`` (so that eplb finds the model's expert groups): engine files name none, and a
    model of the same shape may stand for a recorded one (DeepSeek-R1 for V3); checked against the load's experts
    and layers, as the model a load names itself is (:func:`moebalance.engines.layers.fit_load`)."""
    return fit_load(load, name)


def bytes_per_copy(load: LoadMatrix, hidden_size: int | None, dtype_bytes: int) -> int | None:
    """Bytes one dispatched copy carries (``--hidden-size``, ``--dtype-bytes``): ``hidden_size`` (default: the load's
    model's) x ``dtype_bytes``."""
    if hidden_size is None and load.model is not None:
        hidden_size = load.model.hidden_size
    return None if hidden_size is None else hidden_size * dtype_bytes


def read_plan(args: argparse.Namespace, load: LoadMatrix, fmt: str | None = None) -> Placement:
    """``--plan`` in any placement format, for ``load``: an engine's file laid out on ``--nodes`` x
    ``--gpus-per-node`` (both or neither; a moebalance plan records its own cluster, which they must then match),
    with the links given (plan files record the topology, not the links: the time model takes them from here)."""
    if (args.nodes is None) != (args.gpus_per_node is None):
        raise InputError("give both --nodes and --gpus-per-node (the cluster an engine's placement file is laid out "
                         "on), or neither for a moebalance plan")
    given = None if args.nodes is None else cluster(args)
    plan = read_any_plan(args.plan, given, fmt, load)
    check_plan_layers(plan, load)  # a plan made for other layers than the load's
    c = plan.cluster
    if given is not None and (c.num_nodes, c.gpus_per_node) != (args.nodes, args.gpus_per_node):
        raise InputError(f"the plan is for {c.num_nodes}x{c.gpus_per_node} GPUs but --nodes {args.nodes} "
                         f"--gpus-per-node {args.gpus_per_node} were given; drop them for a moebalance plan")
    given_links = links(args)
    if given_links:  # the links given (or --gpu's own) replace the plan's; the others stay as the plan has them
        kept = {"intra_node_bandwidth": c.intra_node_bandwidth, "inter_node_bandwidth": c.inter_node_bandwidth}
        plan = dataclasses.replace(plan, cluster=Cluster(num_nodes=c.num_nodes, gpus_per_node=c.gpus_per_node,
                                                         **{**kept, **given_links}))
    return plan


def read_load(args: argparse.Namespace, *, model: bool = True) -> LoadMatrix:
    """``--load`` in its detected format, or ``--format``'s; with ``model``, ``--model`` names the load's model
    (:func:`load_model`). Where an engine file's shape named the model and ``--model`` did not, a note on stderr
    says which."""
    name = getattr(args, "model", None)
    fmt = getattr(args, "format", None)
    # an engine file's reader takes the model named (its expert count, its layer numbering); a moebalance load is
    # checked against it, or against the model it names itself
    opened = open_load(args.load, fmt, model=name)
    for text in opened.notes:  # the model an engine file's shape named: say so, and how to name another
        note(text)
    return load_model(opened.load, name) if model else opened.load


@dataclass(frozen=True, slots=True)
class Workloads:
    """The ``--load`` files of ``plan``: each one's planning batches, and all of them in one load."""

    #: The ``--load`` texts, in order.
    names: list[str]
    #: Each workload's planning batches (``--batches`` of each file).
    parts: list[LoadMatrix]
    #: Each workload's ``--batches`` range, ``"a:b"``.
    ranges: list[str]
    #: The planning batches of every workload, concatenated in ``--load`` order (the first alone for one file).
    load: LoadMatrix
    #: Layers without load in every whole file (an engine's dense layers).
    dense: list[int]


def read_workloads(args: argparse.Namespace, flag: str = "--load") -> Workloads:
    """Every ``--load`` (one model: same layers and experts; ``flag`` names the option in messages), ``--model``
    applied, ``--batches`` taken from each."""
    names = list(args.load)
    full = [load_model(read_load(argparse.Namespace(**{**vars(args), "load": path}), model=False),
                               args.model) for path in names]
    for path, other in zip(names[1:], full[1:], strict=True):
        check_same_model(names[0], full[0], path, other, flag)
    # dense layers: no load in any whole file, not merely in the planning window (engine exports leave them out)
    has_load = np.logical_or.reduce([f.counts.sum(axis=(0, 2)) > 0 for f in full])
    parts, ranges = [], []
    for f in full:
        start, stop = parse_batch_range(args.batches, f.num_batches)
        parts.append(f.select_batches(start, stop))
        ranges.append(f"{start}:{stop}")
    load = parts[0] if len(parts) == 1 else concatenate_loads(parts)
    return Workloads(names, parts, ranges, load, [int(x) for x in np.flatnonzero(~has_load)])


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


def router(args: argparse.Namespace) -> Router:
    """The one router of a command that scores with one (``evaluate``, ``cost``, ``run``, ``online``)."""
    given = routers(args)
    if len(given) > 1:
        raise InputError(f"--router {args.router!r} names {len(given)} routers; this command takes one "
                         "(compare takes several)")
    return given[0]

