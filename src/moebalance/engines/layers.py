"""Which model an engine file is for, and which of the model's decoder layers each row of a plan is.

Legend: ``N`` rows of a load or plan, ``E`` experts, and for a model ``D`` dense layers (the first ones, as
DeepSeek's ``first_k_dense_replace``, or every second, Llama 4 Maverick's), ``L_moe`` MoE layers, ``H = D + L_moe`` decoder layers
(``num_hidden_layers``) and ``M`` multi-token-prediction (MTP) layers, which engines number ``H .. H + M - 1``.

Engine files never name the model, but their shape often does: a load fits a model when it has the model's ``E``
and its rows are the model's numbering (``N = H``, or ``H + M`` with the MTP layer, the ``D`` dense rows without
load) or its MoE layers alone (``N = L_moe``, or the recorded layer ids ``D .. H - 1``). :func:`choose_model`
names the model a load fits when exactly one architecture does (DeepSeek-V3 and DeepSeek-R1 share one and are
named together: "DeepSeek-V3/R1"), or checks the model the caller names. :func:`plan_layers` gives each plan row
its engine layer id, from the ids the plan records, else from the model (given, recorded in the plan as
``params["model"]``, or fitting its shape), else from the plan's own dense rows (a load that kept them as zero
rows was in the engine's numbering); rows numbered ``H`` or more are MTP layers.

Every command that reads a load with a model applies one rule (:func:`fit_load`): the load must fit the model named
(``--model``) or, without one, the model the load names itself. A plan records the layer ids of the load it was made
on (``params["layer_ids"]``), and a plan scored on a load must be for the load's layers (:func:`check_plan_layers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moebalance.core.errors import InputError, PlanError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.models import MODELS, ModelSpec, get_model
from moebalance.models.specs import layer_span

__all__ = ["EngineLayers", "ModelChoice", "check_plan_layers", "choose_model", "decoder_layers", "family_label",
           "fit_load", "moe_layer_ids", "mtp_layers", "plan_layers"]

_NAMING = ("name", "display_name", "source")  # what two names of one architecture may differ in


def decoder_layers(spec: ModelSpec) -> int:
    """``H``: the model's decoder layers, dense and MoE (``num_hidden_layers``; MTP layers excluded)."""
    return spec.num_layers + spec.num_dense_layers


def mtp_layers(spec: ModelSpec) -> int:
    """``M``: the model's MTP layers (``num_nextn_predict_layers``; 0 where the description has none)."""
    return int(getattr(spec, "num_mtp_layers", 0))


def _architecture(spec: ModelSpec) -> tuple[object, ...]:
    return tuple(getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in _NAMING)


def _families() -> list[list[ModelSpec]]:
    """The known models grouped by architecture, in registry order."""
    groups: dict[tuple[object, ...], list[ModelSpec]] = {}
    for spec in MODELS.values():
        groups.setdefault(_architecture(spec), []).append(spec)
    return list(groups.values())


def family_label(spec: ModelSpec) -> str:
    """The display names of every model sharing ``spec``'s architecture, e.g. ``"DeepSeek-V3/R1"``."""
    names = [s.display_name for s in MODELS.values() if _architecture(s) == _architecture(spec)] or [spec.display_name]
    if len(names) == 1:
        return names[0]
    cut = names[0].rfind("-", 0, len(_common_prefix(names)) + 1) + 1  # keep whole words after the shared prefix
    return names[0] + "".join("/" + n[cut:] for n in names[1:])


def _common_prefix(names: Sequence[str]) -> str:
    first = names[0]
    n = 0
    while n < len(first) and all(len(x) > n and x[n] == first[n] for x in names):
        n += 1
    return first[:n]


def _moe_rows(spec: ModelSpec, num_rows: int) -> list[int]:
    """The rows of a load of ``num_rows`` rows that fits ``spec`` which are its MoE (and MTP) layers."""
    if num_rows == spec.num_layers:
        return list(range(num_rows))
    return [i for i in (*spec.moe_layer_ids, *spec.mtp_layer_ids) if i < num_rows]


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """The model a load or plan is for (``None``: unknown), and, when its shape named it, a note saying so."""

    spec: ModelSpec | None
    note: str | None = None

    @property
    def preset(self) -> str | None:
        return None if self.spec is None else self.spec.name


def choose_model(num_rows: int, num_experts: int, layer_ids: Sequence[int] | None = None,
                 loaded: Sequence[bool] | None = None, model: str | ModelSpec | None = None,
                 what: str = "the load") -> ModelChoice:
    """The model named by ``model`` (checked against the shape: an :class:`InputError` naming the mismatch),
    else the one model whose architecture alone fits the shape (module docstring; where several fit, the one whose
    MoE rows all carry load), else none. The note of a load
    (``what="the load"``) says what the model's expert groups make eplb do."""
    if model is not None:
        spec = get_model(model) if isinstance(model, str) else model
        spec.check_fits(num_rows, num_experts, layer_ids, loaded, what=what, fix="name the model it was recorded for")
        return ModelChoice(spec)
    fits = [family for family in _families() if family[0].misfit(num_rows, num_experts, layer_ids, loaded) is None]
    if len(fits) > 1 and loaded is not None and layer_ids is None:
        # a MoE layer sees every token: of the models that fit, the one whose MoE rows all carry load (DeepSeek-V3's
        # 61 layers and MTP layer, rows 0-2 dense and idle, not MiniMax-M2's 62 MoE layers with 3 idle)
        full = [family for family in fits if all(loaded[r] for r in _moe_rows(family[0], num_rows))]
        fits = full if len(full) == 1 else fits
    if len(fits) != 1:
        return ModelChoice(None)
    spec = fits[0][0]
    groups = "" if what != "the load" or spec.num_groups == 1 else (
        f", {spec.num_groups} expert groups, so eplb plans as the engines' EPLB does (hierarchical where the node "
        f"count divides {spec.num_groups}; --groups 1 for the global policy)")
    shape = f"{num_rows} layers x {num_experts} experts" if layer_ids is None else \
        f"{num_experts} experts in layers {min(layer_ids)}..{max(layer_ids)}"
    return ModelChoice(spec, f"{what} names no model; its shape ({shape}) is {family_label(spec)}'s alone: taken "
                             f"as {spec.name}{groups}; give --model to name another")


def fit_load(load: LoadMatrix, model: str | None = None, *, what: str | None = None) -> LoadMatrix:
    """``load`` as a load of ``model`` (default: the model it names, its ``preset``): the one rule of every command
    that reads a load with a model. Its shape must fit the model (:meth:`moebalance.models.ModelSpec.misfit`: the
    experts, the rows the MoE layers alone or the engine's numbering, recorded ``layer_ids`` layers the model has), else
    a one-line :class:`InputError` (``what`` names the load); a load of no known model passes as it is."""
    name = load.preset if model is None else model
    spec = None if name is None else get_model(name) if model is not None else MODELS.get(name)
    if spec is None:
        return load
    if model is None:
        load.check_model(spec, what=what or "the load", fix=f"give a load of {spec.name} (the model the load names), "
                                                           "or --model with the one it was recorded for")
    else:
        load.check_model(spec, what=what or f"the load (--model {model})")
    return load if load.preset == spec.name else dataclasses.replace(load, preset=spec.name)


def _implied_ids(rows: int, experts: int, model: object) -> list[int]:
    """The model's layer ids of ``rows`` rows that record none: its MoE layers ``D .. H - 1`` (Llama 4 Maverick's
    every second, :attr:`~moebalance.models.ModelSpec.moe_layer_ids`) where the rows are those of a model
    (``model``, else the one the shape fits) with dense layers, else ``0 .. rows - 1``."""
    try:
        spec = choose_model(rows, experts, None, None, model if isinstance(model, str) and model in MODELS else None).spec
    except InputError:  # the rows do not fit the model: no numbering to assume
        spec = None
    if spec is not None and spec.num_dense_layers and rows == spec.num_layers:
        return list(spec.moe_layer_ids)
    return list(range(rows))


def check_plan_layers(plan: Placement, load: LoadMatrix) -> None:
    """Refuse, in one line, a plan scored on a load of other layers: the model's layer ids the plan records
    (``params["layer_ids"]``: those of the load it was made on) must be the load's (``layer_ids``); a side that
    records none is taken as its rows' numbering (:func:`_implied_ids`)."""
    if plan.layer_ids is None and load.layer_ids is None:
        return
    model = load.preset or plan.params.get("model")
    made = plan.layer_ids if plan.layer_ids is not None else _implied_ids(plan.num_layers, plan.num_experts, model)
    held = [int(i) for i in load.layer_ids] if load.layer_ids is not None else \
        _implied_ids(load.num_layers, load.num_experts, model)
    if [int(i) for i in made] != held:
        raise InputError(f"the plan was made for the model's layers {layer_span(made)} but the load holds layers "
                         f"{layer_span(held)}; score the plan on a load of the layers it was made for, or plan again "
                         "on this load")


@dataclass(frozen=True, slots=True)
class EngineLayers:
    """Each plan row's engine layer id, the model's decoder-layer count ``H`` when known (else why not), the
    model, and notes on what was assumed."""

    layer_ids: tuple[int, ...]
    num_hidden_layers: int | None
    spec: ModelSpec | None = None
    unknown: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def mtp_rows(self) -> tuple[int, ...]:
        """Plan rows numbered ``H`` or more: the model's MTP layers."""
        H = self.num_hidden_layers
        return () if H is None else tuple(r for r, i in enumerate(self.layer_ids) if i >= H)

    def require_rows(self, fmt: str) -> int:
        """``H``, or a :class:`PlanError` saying why the plan cannot say it."""
        if self.num_hidden_layers is None:
            raise PlanError(f"{fmt} needs a row for each of the model's decoder layers, but {self.unknown}")
        return self.num_hidden_layers


def plan_layers(plan: Placement, *, model: str | ModelSpec | None = None,
                num_hidden_layers: int | None = None) -> EngineLayers:
    """Each row's engine layer id and the model's ``H`` (module docstring); a :class:`PlanError` when the plan
    contradicts the model named."""
    N, E = plan.num_layers, plan.num_experts
    recorded = plan.layer_ids  # checked when the plan was built (moebalance.core.plan.check_layer_params)
    ids = None if recorded is None else [int(x) for x in recorded]
    loaded = [r not in plan.dense_layers for r in range(N)]
    named = model if model is not None else plan.params.get("model")
    if isinstance(named, str) and model is None and named not in MODELS:
        named = None  # a plan from another moebalance may name a model this one does not know
    try:
        choice = choose_model(N, E, ids, loaded, named, what="the plan")
    except InputError as exc:
        raise PlanError(str(exc)) from None
    spec, notes = choice.spec, [choice.note] if choice.note else []
    H = num_hidden_layers if num_hidden_layers is not None else (None if spec is None else decoder_layers(spec))
    if H is not None and (isinstance(H, bool) or not isinstance(H, int) or H < 1):
        raise PlanError(f"num_hidden_layers ({H!r}) must be a positive integer")
    if ids is not None:
        return EngineLayers(tuple(ids), H if H is not None else ids[-1] + 1, spec, None, tuple(notes))
    if H is None:
        if plan.dense_layers:  # its load kept the dense layers as zero rows: the engine's numbering
            return EngineLayers(tuple(range(N)), N, None, None, tuple(notes))
        why = (f"the plan's {N} layers all carry load and it names no model, so which of the model's decoder layers "
               "they are is unknown (a load of the MoE layers alone leaves the dense ones out); give the model "
               f"(--model, one of {', '.join(sorted(MODELS))}) or its num_hidden_layers")
        return EngineLayers(tuple(range(N)), None, None, why, tuple(notes))
    dense = spec.num_dense_layers if spec is not None else H - N
    if N < H and dense > 0 and (spec is None or N == spec.num_layers):  # the MoE layers alone, dense ones first
        who = spec.display_name if spec is not None else "the model"
        # ... or interleaved with them (Llama 4 Maverick: every second layer MoE)
        mixed = spec is not None and spec.moe_layer_step > 1 and H == spec.num_decoder_layers
        where = spec.moe_layers_text() if spec is not None and mixed else f"{H - N}..{H - 1}"
        notes.append(f"the plan's {N} layers are taken as {who}'s MoE layers {where} (its load left the "
                     f"{H - N} dense layers out)")
        return EngineLayers(spec.moe_layer_ids if spec is not None and mixed else tuple(range(H - N, H)), H, spec,
                            None, tuple(notes))
    if N < H:
        raise PlanError(f"the plan has {N} layers but the model has {H} decoder layers; give the plan of this model")
    if spec is not None and N > H + mtp_layers(spec):
        raise PlanError(f"the plan has {N} layers but {spec.display_name} has {spec.shape_text()}; give the plan of this "
                        "model")
    return EngineLayers(tuple(range(N)), H, spec, None, tuple(notes))


def moe_layer_ids(load: LoadMatrix) -> np.ndarray | None:
    """The decoder-layer ids of the MoE layers (``D .. H - 1``, or Llama 4 Maverick's every second:
    :attr:`~moebalance.models.ModelSpec.moe_layer_ids`) of a load that is a model's MoE layers alone (``[B, L_moe, E]``,
    no ids recorded: a plain ``.npy`` of a model with dense layers), the model being the load's preset or the one
    its shape fits (:func:`choose_model`); ``None`` for any other load."""
    if load.layer_ids is not None:
        return None
    named = load.preset if load.preset in MODELS else None
    try:
        spec = choose_model(load.num_layers, load.num_experts, None, None, named).spec
    except InputError:  # the load's recorded model does not fit its shape: no numbering to assume
        return None
    if spec is None or spec.num_dense_layers == 0 or load.num_layers != spec.num_layers:
        return None
    return np.asarray(spec.moe_layer_ids, dtype=np.int64)  # D .. H - 1, or Llama 4 Maverick's every second
