"""TensorRT-LLM: expert statistics folders in, MoE load-balancer YAML in and out.

Legend: ``I`` recorded iterations, ``L`` decoder layers up to the last MoE layer (dense ones as zero rows),
``E`` experts, ``P`` = ``num_slots``, ``G`` = ``ep_size``.

Sources read (NVIDIA/TensorRT-LLM; docs/formats.md has the field-by-field account):

- **statistics** (``tensorrt_llm/_torch/expert_statistic.py``): with ``EXPERT_STATISTIC_ITER_RANGE=start-stop``
  and ``EXPERT_STATISTIC_PATH=DIR``, when iteration ``stop`` is reached rank 0 writes ``DIR/meta_info.json``
  ``{"num_experts", "num_experts_per_token"}`` and every rank ``r`` writes ``DIR/rank{r}.safetensors``, whose key
  ``"{iter}_{layer}"`` holds that rank's int64 expert counts ``[E]`` for one iteration and one MoE layer (the
  model's decoder-layer index: dense layers have no keys). The example reader
  (``examples/wide_ep/ep_load_balancer/utils.py``) sums the ranks; so do we. Collect with the load balancer off:
  with it on, the counts are per slot.
- **load-balancer YAML** (``moe_config.load_balancer``; ``MoeLoadBalancerConfig``): exactly ``num_slots``,
  ``initial_global_assignments`` (decoder-layer id -> ``num_slots`` expert ids, every MoE layer present, every
  expert at least once; rank ``r`` owns slots ``r * P / G .. (r + 1) * P / G - 1``) and
  ``layer_updates_per_iter`` (0: static).

Iterations become batches; layers keep their decoder-layer ids, so layers without keys below the last MoE
layer (dense ones) are all-zero rows.

**Launch** (:data:`ENGINE`; options from TensorRT-LLM's ``trtllm-serve`` documentation and Wide-EP example,
``examples/wide_ep/README.md``): ``trtllm-serve M --tp_size G --ep_size G --extra_llm_api_options FILE``, FILE
(:func:`api_options`) holding ``enable_attention_dp`` (TensorRT-LLM's attention is data-parallel on every GPU or
tensor-parallel over all), ``kv_cache_config.dtype`` and ``moe_config.load_balancer`` naming the load-balancer YAML;
``--max_batch_size`` per rank; in prefill ``--max_num_tokens`` a rank's chunk. Its online balancer moves
``layer_updates_per_iter`` layers per iteration beside serving. A model's window layers (gpt-oss, Llama 4) are priced
as holding ``W`` tokens of a request (:meth:`moebalance.models.ModelSpec.kv_cache_bytes`); TensorRT-LLM sizes its
pools per window from ``kv_cache_config.max_attention_window``, which the launch does not set, and how it splits
them has not been checked against that price.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.io import atomic_write_text, read_json
from moebalance.core.limits import check_alloc
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.cost.deployment import A2A_WORDS
from moebalance.cost.time import PRECISION_BYTES
from moebalance.engines.base import Engine, EngineRule, Launch, model_word, placed, unwritten
from moebalance.engines.files import load_model
from moebalance.engines.layers import moe_layer_ids, plan_layers
from moebalance.engines.sglang import plan_from_map
from moebalance.engines.slots import slot_table
from moebalance.models import MODELS

__all__ = ["read_config", "read_statistics", "write_config"]

_KEY = re.compile(r"([0-9]{1,18})_([0-9]{1,18})")  # fullmatch; 18 digits fit int64 (Python refuses > 4300 digits)
_LAYER = re.compile(r"[0-9]{1,18}")


def _shown(key: object) -> str:
    """``key``'s repr, cut to 40 characters (a key may be thousands long)."""
    text = repr(key)
    return text if len(text) <= 40 else text[:37] + "..."


def read_statistics(folder: str | os.PathLike[str], *, model: str | None = None) -> LoadMatrix:
    """A statistics folder as a load ``[I, L, E]`` (module docstring), the ranks summed, for ``model`` (default:
    the one its shape fits)."""
    from safetensors import SafetensorError, safe_open

    d = Path(folder)
    meta_path = d / "meta_info.json"
    meta = read_json(meta_path, "TensorRT-LLM statistics file")
    experts = meta.get("num_experts") if isinstance(meta, dict) else None
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise InputError(f"{str(meta_path)!r} must hold {{\"num_experts\": E, \"num_experts_per_token\": k}} with E a "
                         f"positive integer, got {meta!r}")
    E = int(meta["num_experts"])
    files = sorted(d.glob("rank*.safetensors"), key=lambda f: int(re.sub(r"\D", "", f.stem) or -1))
    if not files:
        raise InputError(f"{str(d)!r} has meta_info.json but no rank*.safetensors; copy every rank's file")
    per_rank: list[dict[tuple[int, int], np.ndarray]] = []
    for f in files:
        got: dict[tuple[int, int], np.ndarray] = {}
        try:
            with safe_open(str(f), framework="numpy") as fh:
                for key in fh.keys():
                    m = _KEY.fullmatch(key)
                    if m is None:
                        raise InputError(f"{str(f)!r} has key {_shown(key)}; TensorRT-LLM's statistics keys are "
                                         "'{iteration}_{layer}'")
                    v = np.asarray(fh.get_tensor(key))
                    if v.shape != (E,) or not np.issubdtype(v.dtype, np.integer) or (v < 0).any():
                        raise InputError(f"{str(f)!r}: {key!r} has shape {v.shape} and dtype {v.dtype}; each key holds "
                                         f"[{E}] non-negative integer counts (num_experts in meta_info.json)")
                    got[int(m.group(1)), int(m.group(2))] = v.astype(np.int64)
        except SafetensorError as exc:
            raise InputError(f"cannot read {str(f)!r}: {exc}") from None
        per_rank.append(got)
    keys = set(per_rank[0])
    for f, got in zip(files[1:], per_rank[1:], strict=True):
        if set(got) != keys:
            missing = sorted(keys - set(got)) or sorted(set(got) - keys)
            raise InputError(f"the ranks disagree: {f.name} and {files[0].name} record different (iteration, layer) "
                             f"keys (first difference: {missing[0][0]}_{missing[0][1]}); use the files of one run")
    if not keys:
        raise InputError(f"{str(files[0])!r} holds no counts; record at least one iteration")
    iters = sorted({i for i, _ in keys})
    if iters[-1] - iters[0] + 1 != len(iters):
        raise InputError(f"{str(d)!r} records iterations {iters[0]}..{iters[-1]} with gaps; TensorRT-LLM writes one "
                         "contiguous range (EXPERT_STATISTIC_ITER_RANGE): use the files of one run")
    layers = sorted({layer for _, layer in keys})
    if len(keys) != len(iters) * len(layers):
        raise InputError(f"{str(d)!r} does not record every MoE layer in every iteration ({len(keys)} keys for "
                         f"{len(iters)} iterations x {len(layers)} layers)")
    check_alloc((len(iters), layers[-1] + 1, E), 8, f"{str(d)!r}: counts [iterations, layers 0..{layers[-1]}, E]",
                f"its keys name layer {layers[-1]}; keys are '{{iteration}}_{{layer}}' with the model's decoder-layer "
                "index (is a file damaged?)")
    counts = np.zeros((len(iters), layers[-1] + 1, E), dtype=np.int64)
    index = {it: b for b, it in enumerate(iters)}
    for got in per_rank:
        for (it, layer), v in got.items():
            counts[index[it], layer] += v
    return LoadMatrix(counts, preset=load_model(counts.shape[1], E, None,
                                                (counts.sum(axis=(0, 2)) > 0).tolist(), model))


def read_config(path: str | os.PathLike[str], cluster: Cluster, num_layers: int | None = None,
                num_experts: int | None = None, moe_layers: Sequence[int] = (), unscored: Sequence[int] = ()) -> Placement:
    """A load-balancer YAML as a plan of ``num_layers`` layers (default: up to the last listed one); layers it
    does not list (dense ones) get the engine's default order, slot ``p`` holding expert ``p mod E``. Keys in
    ``unscored`` at or past ``num_layers`` (the model's MTP layers, when the load did not record them) are checked
    and left out."""
    import yaml

    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except RecursionError:
        raise InputError(f"{str(p)!r} nests its YAML deeper than Python parses; the load-balancer YAML is two levels "
                         "deep") from None
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"cannot read {str(p)!r} as YAML: {first}") from None
    if not isinstance(doc, dict):
        raise InputError(f"{str(p)!r} holds a {type(doc).__name__}; the load-balancer YAML is a mapping with num_slots "
                         "and initial_global_assignments")
    unknown = sorted(set(map(str, doc)) - {"num_slots", "initial_global_assignments", "layer_updates_per_iter"})
    if unknown:
        raise InputError(f"{str(p)!r} has unknown keys {unknown}; TensorRT-LLM accepts num_slots, "
                         "initial_global_assignments and layer_updates_per_iter")
    slots, assign = doc.get("num_slots"), doc.get("initial_global_assignments")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise InputError(f"{str(p)!r}: num_slots must be a positive integer, got {slots!r}")
    if not isinstance(assign, dict) or not assign:
        raise InputError(f"{str(p)!r}: initial_global_assignments must map layer ids to lists of {slots} expert ids")
    rows: dict[int, list[int]] = {}
    for key, ids in assign.items():
        layer = int(key) if isinstance(key, str) and _LAYER.fullmatch(key) else key  # pydantic reads "3" as 3
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise InputError(f"{str(p)!r}: layer id {_shown(key)} must be a non-negative integer")
        if layer in rows:
            raise InputError(f"{str(p)!r}: layer {layer} is listed twice ({key!r} and {layer!r} are one layer)")
        if not isinstance(ids, list) or len(ids) != slots or \
                not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
            raise InputError(f"{str(p)!r}: layer {key} must list {slots} (num_slots) non-negative expert ids")
        rows[layer] = ids
    E = num_experts if num_experts is not None else max(max(r) for r in rows.values()) + 1
    if E > slots:  # every expert has a slot: checked before the ids are compared with range(E)
        raise PlanError(f"{str(p)!r} names expert {E - 1} but has {slots} slots per layer, and every expert needs one "
                        "(TensorRT-LLM requires it)")
    L = num_layers if num_layers is not None else max(rows) + 1
    kept = {layer: ids for layer, ids in rows.items() if layer < L or layer not in set(unscored)}
    if kept and max(kept) >= L:
        raise PlanError(f"{str(p)!r} places layer {max(kept)} but the load has {L} layers; score it on the model's "
                        "own statistics")
    check_alloc((L, slots), 8, f"{str(p)!r}: a placement of layers 0..{L - 1}", "is a layer id damaged?")
    for layer, ids in rows.items():
        if set(ids) != set(range(E)):
            raise PlanError(f"{str(p)!r}: layer {layer} does not hold every expert 0..{E - 1} at least once "
                            "(TensorRT-LLM requires it)")
    rows = {layer: ids for layer, ids in rows.items() if layer < L}
    missing = sorted(set(moe_layers) - set(rows))
    if missing:
        raise PlanError(f"{str(p)!r} does not place layer {missing[0]}, which carries load: TensorRT-LLM requires every "
                        "MoE layer in initial_global_assignments")
    default = [p_ % E for p_ in range(slots)]
    m = np.asarray([rows.get(layer, default) for layer in range(L)], dtype=np.int64)
    return plan_from_map(m, cluster, E, source=str(p), policy="trtllm")


def write_config(path: str | os.PathLike[str], plan: Placement, moe_layers: Sequence[tuple[int, int]] | None = None,
                 layer_updates_per_iter: int = 0, *, model: str | None = None, mtp_layers: int | None = None,
                 num_hidden_layers: int | None = None) -> dict[str, Any]:
    """Write the load-balancer YAML, atomically; returns ``num_slots``, ``ep_size``, the ``layers`` written and
    ``notes`` on what was assumed.

    ``moe_layers``: ``(plan row, its decoder-layer id)`` pairs of the rows to write (default: the plan's rows with
    load); ids equal to the rows are resolved with the model instead (:func:`moebalance.engines.layers.plan_layers`,
    so a plan of the MoE layers alone gets the model's numbering). TensorRT-LLM registers MTP layer ``i`` as
    decoder layer ``H + i`` (``H = num_hidden_layers``) and needs its key: ``mtp_layers`` (default: the MTP rows the
    plan has, from a load that recorded them) writes keys ``H .. H + mtp_layers - 1``, each from the plan's MTP row
    where it has one, else in the engine's default order (slot ``p`` holding expert ``p mod E``)."""
    import yaml

    table = slot_table(plan)
    layers = plan_layers(plan, model=model, num_hidden_layers=num_hidden_layers)
    given = dict(moe_layers) if moe_layers is not None else {}
    rows = list(given) if moe_layers is not None else [r for r in range(plan.num_layers) if r not in plan.dense_layers]
    explicit = any(int(lid) != int(r) for r, lid in given.items())
    ids = {int(r): int(lid) for r, lid in given.items()} if explicit else dict(enumerate(layers.layer_ids))
    H, notes = layers.num_hidden_layers, list(layers.notes)
    base = 0 if H is None else H  # MTP layer i is decoder layer H + i (none is known without H)
    assign = {ids[r]: [int(e) for e in table.phy2log[r]] for r in rows if H is None or ids[r] < H}
    planned = {} if H is None else {lid - H: r for r, lid in ids.items() if lid >= H}
    if mtp_layers is not None:
        if isinstance(mtp_layers, bool) or not isinstance(mtp_layers, int) or mtp_layers < 0:
            raise PlanError(f"mtp_layers ({mtp_layers!r}) must be a non-negative integer: the MTP layers the engine "
                            "serves with (DeepSeek-V3/R1: 1)")
        if mtp_layers and H is None:
            raise PlanError(f"MTP layers are numbered after the model's decoder layers, but {layers.unknown}")
        dropped = sorted(i for i in planned if i >= mtp_layers)
        if dropped:
            notes.append(f"the plan's MTP layer{'s' * (len(dropped) > 1)} {', '.join(str(base + i) for i in dropped)} "
                         f"left out (mtp_layers {mtp_layers})")
    wanted = [] if H is None else sorted(planned) if mtp_layers is None else list(range(mtp_layers))
    default = [p % plan.num_experts for p in range(table.num_slots)]
    missing = []
    for i in wanted:
        assign[base + i] = [int(e) for e in table.phy2log[planned[i]]] if i in planned else default
        missing += [] if i in planned else [base + i]
    if missing:
        notes.append(f"MTP layer{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} (TensorRT-LLM's numbering) "
                     "had no load in the plan: written in the engine's default order")
    if not assign:
        raise PlanError("no MoE layer to write: every layer of the plan is dense (no load)")
    doc = {"num_slots": table.num_slots, "initial_global_assignments": assign,
           "layer_updates_per_iter": int(layer_updates_per_iter)}
    text = yaml.safe_dump(doc, default_flow_style=None, sort_keys=False, width=10**6)
    atomic_write_text(Path(path), text)
    return {"num_slots": table.num_slots, "ep_size": plan.num_gpus, "layers": list(assign), "notes": notes}


#: The files ``advise --out-dir`` writes: the load balancer, and the options that name it.
FILES = {"placement": "trtllm-load-balancer.yaml", "options": "trtllm-extra-llm-api-options.yaml"}


def command(at: Launch) -> tuple[list[str], list[str]]:
    """``(words, comments)``: ``trtllm-serve`` for the priced deployment, before ``--extra_llm_api_options``."""
    d, cluster, phase = at.deployment, at.cluster, at.phase
    model, comments = model_word(d, ENGINE.title, quantizes=False)
    G, N = cluster.num_gpus, cluster.num_nodes
    A = d.engine.attention_group(cluster.gpus_per_node)
    D = max(G // A, 1)
    cap = d.engine.max_running_requests
    words = ["trtllm-serve", model, "--tp_size", str(G), "--ep_size", str(G)]
    ranks = G if A < G else 1  # TensorRT-LLM's attention: data-parallel on every GPU, or tensor-parallel over all
    if 1 < A < G:
        comments.append(f"# priced with attention tensor-parallel over {A} GPUs in {D} data-parallel ranks, which "
                        "TensorRT-LLM does not run (its attention is data-parallel on every GPU or tensor-parallel "
                        "over all): enable_attention_dp is given; --attention-tp 1 prices its layout")
    words += [] if cap is None else ["--max_batch_size", str(max(cap // ranks, 1))]
    words += ["--max_num_tokens", str(d.workload.prefill_chunk)] if phase == "prefill" else []
    if d.a2a != "per-gpu":
        comments.append(f"# priced with {A2A_WORDS[d.a2a]}; TensorRT-LLM chooses its all-to-all kernels itself")
    if d.overlap == "tbo":
        comments.append("# priced with two-batch overlap, which moebalance names no TensorRT-LLM option for")
    if N > 1:
        comments.append(f"# on {N} nodes: launch it on all of them in one MPI world (mpirun or srun)")
    return words, comments


def api_options(at: Launch) -> dict[str, Any]:
    """TensorRT-LLM's ``--extra_llm_api_options`` YAML: data-parallel attention where the price had more than one
    rank, an FP8 KV cache where it had one, and ``moe_config.load_balancer`` naming the load-balancer file in the
    launch's folder (none for EPLB off)."""
    d = at.deployment
    doc: dict[str, Any] = {}
    if d.engine.attention_group(at.cluster.gpus_per_node) < at.cluster.num_gpus:
        doc["enable_attention_dp"] = True
    if d.engine.kv_bytes == PRECISION_BYTES["fp8"]:
        doc["kv_cache_config"] = {"dtype": "fp8"}
    if at.choice is not None:
        doc["moe_config"] = {"load_balancer": placed(FILES["placement"], at.folder)}
    return doc


def _options_text(at: Launch) -> str:
    import yaml

    return yaml.safe_dump(api_options(at), default_flow_style=False, sort_keys=False, width=10**6)


def launch(at: Launch) -> list[str]:
    """The whole launch: :func:`command` naming the options file, what that file holds, and the comments."""
    words, comments = command(at)
    options = placed(FILES["options"], at.folder)
    lines = [" ".join([*words, "--extra_llm_api_options", shlex.quote(options)]), f"# {options} holds:"]
    lines += [f"#   {line}" for line in _options_text(at).splitlines()]
    if at.choice is None:
        lines.append("# EPLB off: no moe_config.load_balancer")
    names = [FILES["options"], *([] if at.choice is None else [FILES["placement"]])]
    return lines + unwritten(names, at.folder) + comments


def _write_files(folder: Path, at: Launch, plan: Placement | None, model: str, mtp_layers: int) -> list[Path]:
    """The load balancer (for a plan) and the options naming it where the launch's folder says."""
    written = []
    if plan is not None:
        written.append(folder / FILES["placement"])
        layers = 0 if at.choice is None else at.choice.layers_per_step
        write_config(written[-1], plan, None, layers, model=model, mtp_layers=mtp_layers)
    written.append(folder / FILES["options"])
    atomic_write_text(written[-1], _options_text(at))
    return written


def _export(path: Path, plan: Placement, ids: list[int], rows: list[int],
            options: dict[str, Any]) -> tuple[dict[str, Any], str]:
    info = write_config(path, plan, [(r, ids[r]) for r in rows], options.get("layer_updates_per_iter", 0),
                        mtp_layers=options.get("mtp_layers"), model=options.get("model"),
                        num_hidden_layers=options.get("num_hidden_layers"))
    return info, f"moe_config.load_balancer: {path} (num_slots {info['num_slots']}, ep_size {info['ep_size']})"


def _read(path: Path, *, model: str | None, **_: Any) -> LoadMatrix:
    if not path.is_dir():
        raise InputError(f"{str(path)!r} is a file; TensorRT-LLM statistics are a folder (meta_info.json and "
                         "rank*.safetensors)")
    return read_statistics(path, model=model)


def _read_plan(path: Path, cluster: Cluster, load: LoadMatrix | None) -> tuple[Placement, np.ndarray | None]:
    """The load balancer's plan, and the load's layer ids it stands for. Its keys are decoder-layer ids: on a load of
    the MoE layers alone they give the load's layers from the model's ids; a load of the model's decoder layers
    leaves out its MTP keys."""
    ids = None if load is None else load.layer_ids
    moe_only = None if load is None or ids is not None else moe_layer_ids(load)
    ids = ids if moe_only is None else moe_only
    if load is None:
        moe: list[int] = []
    elif ids is not None:
        moe = [int(i) for i in ids]
    else:
        moe = [int(x) for x in np.flatnonzero(load.counts.sum(axis=(0, 2)) > 0)]
    model = MODELS.get(load.preset) if load is not None and load.preset is not None else None
    mtp = () if model is None or load is None or load.num_layers != model.num_decoder_layers else model.mtp_layer_ids
    E = None if load is None else load.num_experts
    return read_config(path, cluster, None if load is None or ids is not None else load.num_layers, E, moe, mtp), ids


def _write_plan(path: Path, plan: Placement, model: str | None) -> None:
    write_config(path, plan, None, 0, model=model)


#: TensorRT-LLM (NVIDIA GPUs only): a load-balancer YAML loads any plan, and its MTP layers need keys; its online balancer moves
#: ``layer_updates_per_iter`` layers per iteration beside serving; slots that do not divide by its EP size are
#: refused. Loads: a statistics folder (``meta_info.json`` and ``rank*.safetensors``).
ENGINE = Engine(
    name="trtllm", title="TensorRT-LLM", export_suffix=".yaml",
    rule=EngineRule({"uniform": "uniform"}, True, "async", layers_per_step="spread", vendors=("nvidia",)),
    launch=launch, write_files=_write_files,
    write_plan=_write_plan, export=_export, claims=lambda p: p.is_dir() and (p / "meta_info.json").is_file(),
    read_load=_read, read_plan=_read_plan, plan_suffixes=(".yaml", ".yml"), mtp_keys=True)
