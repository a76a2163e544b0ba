"""What every engine module declares (docs/design.md, "Engines"): an :class:`Engine`, the one record the commands loop
over (:mod:`moebalance.engines.registry`), with what the engine runs (:class:`EngineRule`), its launch command with
the EPLB flags of a configuration (:class:`EplbChoice`), the files that command names, its placement writer, and
its readers of loads and placements.

The launch command states the deployment it was priced with, as the engine's own options (each engine module lists
the options it reads and their sources); what the engine has no option for is a ``#`` comment. Every value is
quoted for a POSIX shell (:func:`shlex.quote`) but the ``$NAME`` placeholders a launch on several nodes fills in.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.cost.a2a import kernels_on
from moebalance.cost.deployment import Deployment
from moebalance.models import ModelSpec

__all__ = ["MODEL_PLACEHOLDER", "Engine", "EngineRule", "EplbChoice", "Launch", "model_id", "model_word", "placed",
           "unwritten"]

#: The model's place in a command where its spec records no Hugging Face id.
MODEL_PLACEHOLDER = "MODEL_PATH"
_HF_CONFIG = re.compile(r"https://huggingface\.co/([\w.-]+/[\w.-]+)/(?:blob|resolve)/[\w.-]+/config\.json")


@dataclass(frozen=True, slots=True)
class EngineRule:
    """What an engine runs: its routers (``{moebalance router: the engine's name}``), whether it loads a placement
    file (any static plan: CRAFT padded, global EPLB where hierarchical applies, worst-of plans), how its periodic
    re-planning moves experts, and its plug-in variant for migration-aware re-plans."""

    routers: dict[str, str]
    placement_file: bool
    rearrange: str
    #: ``None``: all layers at once; ``"spread"``: ``ceil(L / step_interval)`` layers per step.
    layers_per_step: str | None = None
    #: The moebalance plug-in variant that re-plans migration-aware (``aligned``), where the engine has one.
    move_aware: str | None = None
    #: Whether EPLB off runs when the experts do not divide over the EP ranks (some ranks then hold one more); with
    #: EPLB every engine needs the experts plus the redundant ones to divide by the EP size.
    uneven_off: bool = False
    #: The GPU vendors it runs on (:attr:`moebalance.cost.hardware.GpuSpec.vendor`).
    vendors: tuple[str, ...] = ("nvidia", "amd")
    #: Bytes per number of a linear-attention layer's recurrent state by default (SGLang 0.5.23: float32; vLLM 0.33:
    #: the model's bf16, ``mamba_ssm_cache_dtype`` ``auto``; TensorRT-LLM: not checked, float32 assumed), which a
    #: price for the engine takes (:attr:`moebalance.cost.memory.EngineMemory.recurrent_state_bytes`).
    recurrent_state_bytes: int = 4


@dataclass(frozen=True, slots=True)
class EplbChoice:
    """The EPLB configuration a launch runs (``None`` in its place: EPLB off): ``redundant_experts`` copies beyond
    the experts, moebalance's ``router`` (the engine's name is its rule's), periodic re-planning every
    ``rebalance = (step_interval, window)`` steps or a static plan (``None``), EPLB's ``hierarchical`` mode, the
    plug-in variant where one is needed, and the layers moved per step (TensorRT-LLM's ``layer_updates_per_iter``)."""

    redundant_experts: int
    router: str
    rebalance: tuple[int, int] | None = None
    hierarchical: bool = False
    plugin: str | None = None
    layers_per_step: int = 0


@dataclass(frozen=True, slots=True)
class Launch:
    """What a launch is for: the deployment priced, on ``cluster``, in ``phase``, with ``choice`` (``None``: EPLB
    off), and the folder its files are (or will be) read from (``None``: not written yet, named as placeholders)."""

    deployment: Deployment
    cluster: Cluster
    phase: str
    choice: EplbChoice | None
    folder: Path | None


@dataclass(frozen=True, slots=True)
class Engine:
    """One serving engine as the commands see it; each engine module defines its own (``ENGINE``).

    ``write_files`` writes the files its launch reads besides a moebalance plan into a folder (``(folder, launch,
    plan or None for EPLB off, model, mtp_layers) -> paths``; the launch's folder is where they will be read).
    ``launch``: the whole command and its ``#`` comments.
    ``write_plan``: a plan as the engine loads it at a path (``watch --write-plan``), ``(path, plan, model)``.
    ``export``: ``moebalance export``'s file, ``(path, plan, engine layer ids, plan rows listed, options) -> (what
    was written, a line on how the engine takes it)``. ``claims``: whether a load file or folder is this engine's;
    ``read_load``: it as a :class:`~moebalance.core.load.LoadMatrix`; ``streams`` and ``import_load``: whether and
    how ``moebalance import`` reads it a file at a time. ``read_plan``: a placement file laid out on a cluster, for
    a load, ``-> (plan, the load's layer ids it was read for, or None)``; ``plan_suffixes`` and ``plan_key`` name
    such files (their suffixes, or the JSON key that marks them)."""

    name: str
    title: str
    rule: EngineRule
    export_suffix: str
    launch: Callable[[Launch], list[str]]
    write_files: Callable[[Path, Launch, Placement | None, str, int], list[Path]]
    write_plan: Callable[[Path, Placement, str | None], None]
    export: Callable[[Path, Placement, list[int], list[int], dict[str, Any]], tuple[dict[str, Any], str]]
    claims: Callable[[Path], bool]
    read_load: Callable[..., LoadMatrix]
    streams: Callable[[Path], bool] = lambda path: False
    import_load: Callable[..., Any] | None = None
    read_plan: Callable[[Path, Cluster, LoadMatrix | None], tuple[Placement, Any]] | None = None
    plan_suffixes: tuple[str, ...] = ()
    plan_key: str | None = None
    #: Whether its placement file carries multi-token-prediction layers (``--mtp-layers``).
    mtp_keys: bool = False
    #: Why it cannot serve a priced deployment (one line naming the fix), or ``None``.
    refuses: Callable[[Deployment], str | None] = lambda d: None


def model_id(spec: ModelSpec) -> str | None:
    """The model's Hugging Face id (``deepseek-ai/DeepSeek-V3``) where its ``source`` is its ``config.json`` there."""
    m = _HF_CONFIG.fullmatch(spec.source)
    return m.group(1) if m else None


def model_word(d: Deployment, title: str, *, quantizes: bool) -> tuple[str, list[str]]:
    """The model word of a command and the comments every engine shares: the model placeholder, weights of another
    precision than the checkpoint's (``quantizes``: whether the engine, ``title``, makes FP8 weights of a BF16
    checkpoint itself; an FP8 or MXFP4 checkpoint priced in bf16 needs a BF16 copy; an MXFP4 one priced in mxfp4 needs
    no flag, engines read its ``quantization_config``), and an all-to-all no engine option selects."""
    spec, comments = d.model, []
    name = model_id(spec)
    if name is None:
        comments.append(f"# {MODEL_PLACEHOLDER}: {spec.display_name}'s weights (a folder or a Hugging Face id); its "
                        "model spec records no Hugging Face id")
    if d.precision == "bf16" and spec.served_precision != "bf16":
        comments.append(f"# priced with BF16 weights, but {spec.display_name}'s checkpoint is "
                        f"{spec.served_precision.upper()}: serve a BF16 copy of it in the model's place")
    if d.precision == "fp8" and spec.served_precision != "fp8" and not quantizes:
        comments.append(f"# priced with FP8 weights: give {title} an FP8-quantized checkpoint of "
                        f"{spec.display_name} in the model's place")
    if d.a2a == "per-gpu":
        deepep = "; --a2a normal, low-latency or auto prices DeepEP's kernels" if "auto" in kernels_on(d.gpu) else ""
        comments.append("# priced with a plain all-to-all (a copy per destination GPU, no fixed cost: a bandwidth "
                        f"lower bound), which no engine option selects{deepep}")
    return shlex.quote(name or MODEL_PLACEHOLDER), comments


def placed(name: str, folder: Path | None) -> str:
    """The path a launch names file ``name`` by: in ``folder``, else the name alone (a placeholder until written)."""
    return str(folder / name) if folder is not None else name


def unwritten(names: Sequence[str], folder: Path | None) -> list[str]:
    """The comment that asks for ``--out-dir`` where the files a launch names are not written yet."""
    return [f"# give --out-dir to write {' and '.join(names)}"] if folder is None else []
