"""Which model an engine file is for, and which of the model's decoder layers each row of a plan is.

Legend: ``N`` rows of a load or plan, ``E`` experts, and for a model ``D`` dense layers (the first ones, as
DeepSeek's ``first_k_dense_replace``), ``L_moe`` MoE layers, ``H = D + L_moe`` decoder layers
(``num_hidden_layers``) and ``M`` multi-token-prediction (MTP) layers, which engines number ``H .. H + M - 1``.

Engine files never name the model, but their shape often does: a load fits a model when it has the model's ``E``
and its rows are the model's numbering (``N = H``, or ``H + M`` with the MTP layer, the ``D`` dense rows without
load) or its MoE layers alone (``N = L_moe``, or the recorded layer ids ``D .. H - 1``). :func:`choose_model`
names the model a load fits when exactly one architecture does (DeepSeek-V3 and DeepSeek-R1 share one and are
named together: "DeepSeek-V3/R1"), or checks the model the caller names. :func:`plan_layers` gives each plan row
its engine layer id, from the ids the plan records, else from the model (given, recorded in the plan as
``params["model"]``, or fitting its shape), else from the plan's own dense rows (a load that kept them as zero
rows was in the engine's numbering); rows numbered ``H`` or more are MTP layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from moebalance.core.errors import InputError, PlanError
from moebalance.core.plan import Placement
from moebalance.models import MODELS, ModelSpec, get_model

__all__ = ["EngineLayers", "ModelChoice", "choose_model", "decoder_layers", "family_label",
           "mtp_layers", "plan_layers"]

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
    else the one model whose architecture alone fits the shape (module docstring), else none. The note of a load
    (``what="the load"``) says what the model's expert groups make eplb do."""
    if model is not None:
        spec = get_model(model) if isinstance(model, str) else model
        spec.check_fits(num_rows, num_experts, layer_ids, loaded, what=what, fix="name the model it was recorded for")
        return ModelChoice(spec)
    fits = [family for family in _families() if family[0].misfit(num_rows, num_experts, layer_ids, loaded) is None]
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
        notes.append(f"the plan's {N} layers are taken as {who}'s MoE layers {H - N}..{H - 1} (its load left the "
                     f"{H - N} dense layers out)")
        return EngineLayers(tuple(range(H - N, H)), H, spec, None, tuple(notes))
    if N < H:
        raise PlanError(f"the plan has {N} layers but the model has {H} decoder layers; give the plan of this model")
    if spec is not None and N > H + mtp_layers(spec):
        raise PlanError(f"the plan has {N} layers but {spec.display_name} has {spec.shape_text()}; give the plan of this "
                        "model")
    return EngineLayers(tuple(range(N)), H, spec, None, tuple(notes))
