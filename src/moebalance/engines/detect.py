"""Read any supported load or placement file: moebalance's own, SGLang's, TensorRT-LLM's.

Detection (``--format`` overrides it): a folder with ``meta_info.json`` is TensorRT-LLM statistics, a folder of
``.pt`` files SGLang's per-rank per_pass/per_token dumps; ``.pt`` and
``.json`` files are SGLang's (``logical_count``: a load; ``physical_to_logical_map``: a placement; a moebalance
plan JSON has ``"format": "moebalance.plan"``); ``.yaml``/``.yml`` is TensorRT-LLM's load-balancer config;
``.npy``, ``.npz`` and ``bundled:NAME`` are moebalance loads; JSON responses with ``routed_experts`` (or a folder
of them) are vLLM's, and a ``.npy`` of one request's routed experts needs ``--format vllm``.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.io import read_json
from moebalance.core.limits import machine_memory_bytes
from moebalance.core.load import BUNDLED_PREFIX, LoadMatrix, read_load, write_load
from moebalance.core.plan import Placement, read_plan, with_dense_layers
from moebalance.engines.layers import choose_model, fit_load
from moebalance.engines.registry import DETECTION, ENGINES
from moebalance.models import get_model

__all__ = ["LOAD_FORMATS", "LOAD_KINDS", "PLAN_FORMATS", "Imported", "OpenedLoad", "detect_load", "import_load",
           "open_load", "read_any_load", "read_any_plan"]

#: ``--format`` values of a load: moebalance's and every engine's.
LOAD_FORMATS = ("moebalance", *sorted(ENGINES))
#: ``--format`` values of a plan: moebalance's and those of the engines whose placement files are read.
PLAN_FORMATS = ("moebalance", *sorted(name for name, e in ENGINES.items() if e.read_plan is not None))


#: Every kind of load ``--load`` reads, for the messages that refuse another.
LOAD_KINDS = ("a moebalance load (.npz, or .npy of [L, E] or [B, L, E] counts; bundled:NAME), an SGLang expert "
              "distribution dump (.pt or .json, or a folder of per-rank .pt dumps), a TensorRT-LLM statistics folder "
              "(meta_info.json and rank*.safetensors), or vLLM routed experts (.json responses or a folder of them; "
              "a .npy with --format vllm)")


def detect_load(path: str | os.PathLike[str]) -> str:
    """The format of a load file or folder (module docstring); a missing path, or a file of no kind ``--load`` reads,
    is one line naming it."""
    text = str(path)
    if text.startswith(BUNDLED_PREFIX):
        return "moebalance"
    p = Path(path)
    if not p.exists():  # before any guess from its name: a typo is a missing file, not a format to choose
        raise InputError(f"load file {text!r} does not exist; check the path")
    if p.is_dir():
        for engine in DETECTION:
            if engine.claims(p):
                return engine.name
        raise InputError(f"{text!r} is a folder without meta_info.json, .pt or .json files; give {LOAD_KINDS}")
    if p.suffix not in (".pt", ".json", ".npy", ".npz"):
        raise InputError(f"load file {text!r} is of no kind --load reads (it must end in .npy, .npz, .pt or .json, "
                         f"or be a folder): give {LOAD_KINDS}")
    return next((engine.name for engine in DETECTION if engine.claims(p)), "moebalance")


@dataclass(frozen=True, slots=True)
class OpenedLoad:
    """A load read by :func:`open_load`, its format, and notes to show the user (the model its shape named)."""

    load: LoadMatrix
    format: str
    notes: tuple[str, ...] = ()


def open_load(path: str | os.PathLike[str], fmt: str | None = None, *, model: str | None = None, gpus: int = 1,
              batch_tokens: int = 4096, num_experts: int | None = None) -> OpenedLoad:
    """The load in ``path``, of format ``fmt`` (default: detected), for ``model``; ``gpus``, ``batch_tokens`` and
    ``num_experts`` lay out vLLM's per-request routed experts (:func:`moebalance.engines.vllm.read_routed_experts`).

    Engine files do not name the model: ``model`` names it (checked against the shape), else the readers attach
    the one model whose architecture alone fits the shape (:func:`moebalance.engines.layers.choose_model`), and a
    note says so. A moebalance load keeps the model it records unless ``model`` names one, and must fit the one it
    is for (:func:`moebalance.engines.layers.fit_load`)."""
    kind = detect_load(path) if fmt is None else fmt
    if kind not in LOAD_FORMATS:
        raise InputError(f"unknown load format {kind!r}; choose one of: {', '.join(LOAD_FORMATS)}")
    if not str(path).startswith(BUNDLED_PREFIX) and not Path(path).exists():
        raise InputError(f"load file {str(path)!r} does not exist; check the path")
    if kind == "moebalance":  # refuses a load of another shape or of layers the model lacks
        return OpenedLoad(fit_load(read_load(path), model), kind)
    _check_fits(Path(path), kind)
    load = ENGINES[kind].read_load(Path(path), model=model, gpus=gpus, batch_tokens=batch_tokens,
                                   num_experts=num_experts)
    return OpenedLoad(load, kind, () if model is not None else _inferred(load))


def _stream_reader(path: Path, kind: str) -> Callable[..., Any] | None:
    """The import that reads this dump a file at a time (:mod:`moebalance.engines.stream`: vLLM's routed experts and
    SGLang's folders of per-rank dumps), or ``None``."""
    engine = ENGINES.get(kind)
    return engine.import_load if engine is not None and engine.streams(path) else None


def _check_fits(path: Path, kind: str) -> None:
    """Refuse, in one line and before reading, an engine dump larger than this machine's memory: the commands read
    engines' files whole (``import`` reads the dumps :func:`_stream_reader` has a reader for a file at a time instead, and a
    moebalance trace is mapped and walked in chunks)."""
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    size = sum(p.stat().st_size for p in files)
    limit = machine_memory_bytes()
    if size > limit:
        fix = (f"run moebalance import --load {shlex.quote(str(path))} --out X.npz first (it reads one file at a "
               "time), then give --load X.npz") if _stream_reader(path, kind) is not None else \
            "import the dumps in parts (a folder of some of the files at a time)"
        raise InputError(f"{str(path)!r} holds {size / 2**30:.1f} GiB of {kind} dumps, and reading them takes at least "
                         f"that much memory; this machine has {limit / 2**30:.1f} GiB: {fix}")


@dataclass(frozen=True, slots=True)
class Imported:
    """What :func:`import_load` wrote: the load's counts, model and layer ids (its token-level trace, if any, is in
    the file: ``num_tokens`` tokens), its format, and notes to show the user."""

    load: LoadMatrix
    format: str
    num_tokens: int | None = None
    notes: tuple[str, ...] = ()


def import_load(path: str | os.PathLike[str], out: str | os.PathLike[str], fmt: str | None = None, *,
                model: str | None = None, gpus: int = 1, batch_tokens: int = 4096,
                num_experts: int | None = None) -> Imported:
    """Write the load in ``path`` to the ``.npz`` ``out``, atomically, as :func:`open_load` reads it and
    :func:`moebalance.core.load.write_load` writes it. vLLM's routed experts and SGLang's folders of per-rank dumps
    are read one file at a time (:mod:`moebalance.engines.stream`: the same arrays, the token-level ones stored
    uncompressed), so their tokens need not fit in memory."""
    dest = Path(out)
    if dest.suffix != ".npz":
        raise InputError(f"output {str(dest)!r} must end in .npz")
    kind = detect_load(path) if fmt is None else fmt
    p = Path(path)
    stream = None if str(path).startswith(BUNDLED_PREFIX) or not p.exists() else _stream_reader(p, kind)
    if stream is None:
        opened = open_load(path, fmt, model=model, gpus=gpus, batch_tokens=batch_tokens, num_experts=num_experts)
        write_load(dest, opened.load)
        trace = opened.load.trace
        return Imported(opened.load, opened.format, None if trace is None else trace.num_tokens, opened.notes)
    if model is not None:
        get_model(model)  # a misspelt name before the first pass, not after it
    got = stream(p, dest, gpus=gpus, batch_tokens=batch_tokens, num_experts=num_experts, model=model)
    return Imported(got.load, kind, got.num_tokens, () if model is not None else _inferred(got.load))


def _inferred(load: LoadMatrix) -> tuple[str, ...]:
    """The note of an engine load whose reader named the model from its shape."""
    if load.preset is None:
        return ()
    ids = None if load.layer_ids is None else load.layer_ids.tolist()
    loaded = None if ids is not None else (load.counts.sum(axis=(0, 2)) > 0).tolist()
    note = choose_model(load.num_layers, load.num_experts, ids, loaded).note
    if note is None:  # the reader named the model on less evidence than the rows give here: still say so
        note = (f"the load is taken as {load.preset} from its shape ({load.num_layers} layers x {load.num_experts} "
                "experts); --model NAME names another")
    return (note,)


def read_any_load(path: str | os.PathLike[str], fmt: str | None = None, *, gpus: int = 1, batch_tokens: int = 4096,
                  num_experts: int | None = None, model: str | None = None) -> LoadMatrix:
    """:func:`open_load`'s load alone."""
    return open_load(path, fmt, model=model, gpus=gpus, batch_tokens=batch_tokens, num_experts=num_experts).load


def read_any_plan(path: str | os.PathLike[str], cluster: Cluster | None = None, fmt: str | None = None,
                  load: LoadMatrix | None = None) -> Placement:
    """The plan in ``path``: a moebalance plan, or an engine's placement file laid out on ``cluster`` (needed for
    engine files, which do not record the topology); ``load`` gives the layers and experts to align with. Engine
    files number the model's decoder layers: on a load of the MoE layers alone
    (:func:`moebalance.engines.layers.moe_layer_ids`) a TensorRT-LLM
    YAML's keys, and an SGLang map with more rows than the load, give the load's layers from the model's ids."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"plan file {str(p)!r} does not exist")
    kind = fmt
    if kind is None:
        kind = next((name for name, e in ENGINES.items() if p.suffix in e.plan_suffixes), None)
    if kind is None:
        head = read_json(p, "plan file", error=PlanError)  # not JSON: neither a moebalance nor an SGLang plan
        if isinstance(head, dict) and "logical_count" in head:
            raise InputError(f"{str(p)!r} is an SGLang load (logical_count), not a placement; give it as --load")
        kind = next((name for name, e in ENGINES.items() if isinstance(head, dict) and e.plan_key in head),
                    "moebalance")
    if kind not in PLAN_FORMATS:
        raise InputError(f"unknown plan format {kind!r}; choose one of: {', '.join(PLAN_FORMATS)}")
    if kind == "moebalance":
        return read_plan(p)
    if cluster is None:
        raise InputError(f"{str(p)!r} is a {kind} placement, which does not record the cluster; give --nodes and "
                         "--gpus-per-node")
    reader = ENGINES[kind].read_plan
    if reader is None:  # not in PLAN_FORMATS
        raise InputError(f"{kind} placements are not read")
    plan, ids = reader(p, cluster, load)
    if ids is None:  # the engine's rows of dense layers (no load) hold no experts there: no copies, whatever they list
        dense = [] if load is None or load.num_layers != plan.num_layers else \
            np.flatnonzero(load.counts.sum(axis=(0, 2)) == 0).tolist()
        return with_dense_layers(plan, dense) if len(dense) < plan.num_layers else plan
    # the load left dense layers out: keep the engine's rows of the load's layers (the model's numbering)
    if int(ids[-1]) >= plan.num_layers:
        raise InputError(f"{str(p)!r} places {plan.num_layers} layers but the load has layer {int(ids[-1])}; give "
                         "the placement of this model")
    return Placement([plan.gpu_experts[int(i)] for i in ids], plan.num_experts, plan.cluster, policy=plan.policy,
                     params={**plan.params, "layer_ids": [int(i) for i in ids]})
