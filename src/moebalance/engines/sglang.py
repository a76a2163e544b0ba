"""SGLang: expert-distribution ``stat`` dumps in, ``--init-expert-location`` placements in and out.

Legend: ``B`` recorded forward passes, ``L`` the model's decoder layers (``num_hidden_layers``, dense ones
included), ``E`` logical experts, ``P = E + ep_num_redundant_experts`` physical slots, ``G`` = ``ep_size`` ranks.

Sources read (sgl-project/sglang, ``python/sglang/srt/eplb/expert_distribution.py`` and ``expert_location.py``;
docs/formats.md has the field-by-field account):

- **stat dump** (``--expert-distribution-recorder-mode stat``, written by rank 0 on
  ``/dump_expert_distribution_record`` into ``$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`` as
  ``expert_distribution_recorder_{time}.pt``): ``torch.save`` of a dict ``{"rank": int, "logical_count": int32
  [B, L, E] summed over ranks, "average_utilization_rate_over_window": float | None}``. ``B`` is the recorder's
  whole ring buffer: passes that never ran are all-zero rows and the order is rotated. ``L`` counts every
  decoder layer: dense layers (DeepSeek-V3: 0-2) are all-zero columns. The tensors may be saved on a GPU.
- **init expert location**: ``--init-expert-location`` takes a ``.pt`` file (``torch.load(weights_only=True)``),
  a ``.json`` file or inline JSON, holding either ``{"physical_to_logical_map": [L, P]}`` (that key only: the
  dict is passed as keyword arguments) or ``{"logical_count": [L, E] or [B, L, E]}`` (SGLang then runs its EPLB).
  ``P % ep_size == 0`` and rank ``r`` owns the contiguous slots ``r * P / ep_size .. (r + 1) * P / ep_size - 1``.
  ``L`` must be ``num_hidden_layers`` (SGLang does not check it: a shorter map fails at the first layer past it),
  and the MTP draft layer has no row (:func:`write_placement`). The team's published DeepSeek-V3 statistics are
  such ``logical_count`` JSON files.

- **per-pass and per-token dumps** (``per_pass`` / ``per_token`` modes): every rank ``r`` writes
  ``expert_distribution_recorder_{time}_{r}.pt``, ``{"records": [one dict per forward pass: "forward_pass_id",
  "rank", "gatherer_key", "global_physical_count" int32 [L, P] (this rank's picks per physical slot), and in
  per_token mode also "topk_ids_of_layer" int32 [L, tokens, 8] (physical ids, -1 padded), "input_ids",
  "positions", ...], "last_physical_to_logical_map": int64 [L, P]}``.

Reading a stat dump keeps the dense layers as zero rows (the model's numbering) and drops the all-zero passes.
A folder of per-pass or per-token dumps is read as counts: each pass's physical counts mapped to logical experts
with the dump's map (the map at dump time: a rebalance while recording would mix maps) and summed over ranks, one
batch per forward pass. When every record carries ``topk_ids_of_layer`` (per_token mode), the folder is read as a
token-level trace instead: one batch per forward pass, source GPU = rank, tokens rank-major, physical ids mapped to
logical experts, the ``-1`` padding beyond ``k`` dropped, and dense layers (no pick at all) left out with the
model's layer ids kept (``LoadMatrix.layer_ids``).

**Launch** (:data:`ENGINE`; options read from SGLang 0.5.23's parser, ``sglang/srt/arg_groups/fields/``):
``python -m sglang.launch_server --model-path M --tp-size G --ep-size G``; where ``D = G / A > 1`` data-parallel
attention ranks of ``A`` GPUs, ``--attn-dp-size D`` (0.5.23's spelling of ``--dp-size D --enable-dp-attention``,
which it deprecates) and, for a model with dense layers whose MLP is replicated (``--dense-tp 1``),
``--moe-dense-tp-size 1``; ``--mem-fraction-static``; DeepEP as ``--moe-a2a-backend deepep --deepep-mode
normal|low_latency|auto``; ``--enable-two-batch-overlap``; ``--quantization fp8`` (a BF16 checkpoint priced in FP8);
``--kv-cache-dtype fp8_e4m3``; ``--max-running-requests`` (over all ranks, as the price's); in prefill
``--chunked-prefill-size`` of every rank's chunk (SGLang divides it by the attention data-parallel size); on several
nodes ``--nnodes N --node-rank $NODE_RANK --dist-init-addr $DIST_INIT_ADDR``. EPLB: ``--ep-num-redundant-experts R
--init-expert-location FILE --ep-dispatch-algorithm static|dynamic|lp`` (no ``--enable-eplb`` for a static plan: it
would re-plan every 1,000 iterations); periodic re-planning adds ``--enable-eplb --eplb-algorithm
deepseek|deepseek_hierarchical --eplb-rebalance-num-iterations S --expert-distribution-recorder-buffer-size W``.
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.io import atomic_write_text, read_json
from moebalance.core.limits import check_alloc
from moebalance.core.load import LoadMatrix, check_counts
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.cost.a2a import kernels_on
from moebalance.cost.deployment import Deployment
from moebalance.cost.time import PRECISION_BYTES
from moebalance.engines.base import Engine, EngineRule, Launch, model_word, placed, unwritten
from moebalance.engines.files import load_model
from moebalance.engines.layers import moe_layer_ids, plan_layers
from moebalance.engines.slots import slot_table

__all__ = ["plan_from_map", "read_dumps", "read_placement", "read_rank_dump", "read_stat", "read_torch",
           "write_placement"]


def read_torch(path: Path) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``, with a one-line error for what it refuses."""
    import torch

    if path.is_file() and not zipfile.is_zipfile(path):
        raise InputError(f"{str(path)!r} is not a torch.save file (torch.save writes a zip archive); give the dump as "
                         "SGLang wrote it")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "not plain tensors"
        raise InputError(f"{str(path)!r} holds pickled objects that are not plain tensors, lists or numbers, and "
                         f"moebalance never unpickles code ({first[:160]}); save plain tensors with torch.save") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError, TypeError, AttributeError,
            zipfile.BadZipFile) as exc:  # torch's legacy reader fails in many ways on a file it did not write
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"cannot read {str(path)!r} with torch.load: {first[:200]} (is it a torch.save file?)") from None


def _document(path: Path) -> dict[str, Any]:
    """The dict a ``.pt`` or ``.json`` file (or inline JSON) holds."""
    if path.suffix == ".pt":
        doc = read_torch(path)
    else:
        doc = read_json(path, "SGLang file")
    if not isinstance(doc, dict):
        raise InputError(f"{str(path)!r} holds a {type(doc).__name__}; SGLang files hold a dict with "
                         "'logical_count' or 'physical_to_logical_map'")
    return doc


def _model_of(counts: np.ndarray, layer_ids: np.ndarray | None, model: str | None) -> str | None:
    """The preset of ``counts [B, L, E]`` (``layer_ids``: the model's index of each row, when dense ones are out)."""
    loaded = None if layer_ids is not None else (counts.sum(axis=(0, 2)) > 0).tolist()
    return load_model(counts.shape[1], counts.shape[2], None if layer_ids is None else layer_ids.tolist(), loaded,
                      model)


def _array(value: Any, name: str, source: str) -> np.ndarray:
    try:
        import torch

        arr = value.cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{source}: {name} is not a rectangular array of numbers ({exc})") from None
    if arr.dtype == object:
        raise InputError(f"{source}: {name} is not a rectangular array of 64-bit numbers (rows of different lengths, "
                         "or a number too large?)")
    if arr.dtype.kind not in "iuf":
        raise InputError(f"{source}: {name} holds {arr.dtype} values; it must hold numbers")
    return arr


def read_stat(path: str | os.PathLike[str], *, model: str | None = None) -> LoadMatrix:
    """A stat dump (``.pt``) or a ``logical_count`` JSON as a load ``[B, L, E]`` (module docstring), for ``model``
    (default: the one its shape fits, :func:`moebalance.engines.layers.choose_model`)."""
    p = Path(path)
    doc = _document(p)
    if "logical_count" not in doc:
        if "physical_to_logical_map" in doc:
            raise InputError(f"{str(p)!r} is an SGLang placement (physical_to_logical_map), not a load; score it with "
                             "evaluate --plan or compare --baseline")
        raise InputError(f"{str(p)!r} has no 'logical_count' (keys: {sorted(map(str, doc))}); an SGLang "
                         "expert-distribution stat dump holds logical_count [B, L, E]")
    counts = _array(doc["logical_count"], "logical_count", str(p))
    if counts.ndim == 2:
        counts = counts[None]
    if counts.ndim != 3:
        raise InputError(f"{str(p)!r}: logical_count has shape {counts.shape}; SGLang writes [B, L, E] (or [L, E])")
    counts = check_counts(counts, "logical_count")
    ran = counts.reshape(counts.shape[0], -1).any(axis=1)
    if ran.any():
        counts = counts[ran]  # ring-buffer rows of passes that never ran
    else:
        counts = counts[:1]
    return LoadMatrix(counts, preset=_model_of(counts, None, model))


def read_rank_dump(f: Path) -> tuple[np.ndarray, list[tuple[int, np.ndarray, np.ndarray | None]]]:
    """One rank's ``per_pass``/``per_token`` dump, checked: its map ``int64 [L, P]`` and its records in file order,
    each ``(forward_pass_id, global_physical_count int64 [L, P], topk_ids_of_layer [L, tokens, W] as stored or
    None)``; every problem is one line naming ``f``."""
    doc = read_torch(f)
    if not isinstance(doc, dict) or "records" not in doc or "last_physical_to_logical_map" not in doc:
        keys = sorted(map(str, doc)) if isinstance(doc, dict) else type(doc).__name__
        raise InputError(f"{str(f)!r} has {keys}; a per_pass/per_token dump holds 'records' and "
                         "'last_physical_to_logical_map' (a stat dump is one file: give the file, not the folder)")
    m = _array(doc["last_physical_to_logical_map"], "last_physical_to_logical_map", str(f))
    if m.ndim != 2 or not np.issubdtype(m.dtype, np.integer) or (m < 0).any():
        raise InputError(f"{str(f)!r}: last_physical_to_logical_map must be non-negative integer ids [L, P], got "
                         f"{m.dtype} {m.shape}")
    if m.size and int(m.max()) >= m.shape[1]:  # every expert has a slot, so ids stay below the slot count
        raise InputError(f"{str(f)!r}: last_physical_to_logical_map holds expert id {int(m.max())} but has only "
                         f"{m.shape[1]} slots per layer, and every expert has one; is the file damaged?")
    if not isinstance(doc["records"], list):
        raise InputError(f"{str(f)!r}: 'records' must be a list of per-pass records")
    records: list[tuple[int, np.ndarray, np.ndarray | None]] = []
    for rec in doc["records"]:
        if not isinstance(rec, dict) or "forward_pass_id" not in rec or "global_physical_count" not in rec:
            raise InputError(f"{str(f)!r}: each record needs 'forward_pass_id' and 'global_physical_count'")
        fid = rec["forward_pass_id"]
        if isinstance(fid, bool) or not isinstance(fid, int):
            raise InputError(f"{str(f)!r}: forward_pass_id {fid!r} must be an integer (SGLang numbers passes)")
        c = _array(rec["global_physical_count"], "global_physical_count", str(f))
        if c.shape != m.shape:
            raise InputError(f"{str(f)!r}: global_physical_count has shape {c.shape} but the map {m.shape}; "
                             "both are [L, P]")
        counts = check_counts(c[None], "global_physical_count")[0]
        t = None
        if "topk_ids_of_layer" in rec:
            t = _array(rec["topk_ids_of_layer"], "topk_ids_of_layer", str(f))
            if t.ndim != 3 or t.shape[0] != m.shape[0] or t.dtype.kind not in "iu" or (t < -1).any() \
                    or (t >= m.shape[1]).any():
                raise InputError(f"{str(f)!r}: topk_ids_of_layer must be physical slot ids [L, tokens, 8] "
                                 f"(-1 padded), got {t.dtype} {t.shape}")
        records.append((fid, counts, t))
    return m.astype(np.int64), records


def read_dumps(folder: str | os.PathLike[str], *, model: str | None = None,
               files: Sequence[str | os.PathLike[str]] | None = None) -> LoadMatrix:
    """A folder of per-rank ``per_pass``/``per_token`` dumps as a load ``[passes, L, E]`` (module docstring), for
    ``model`` (default: the one its shape fits); ``files``: those of one dump only (its ranks' files), not the
    folder's every ``.pt``."""
    d = Path(folder)
    files = sorted(d.glob("*.pt")) if files is None else sorted(Path(f) for f in files)
    if not files:
        raise InputError(f"{str(d)!r} has no .pt files; SGLang's per_pass/per_token dumps are one "
                         "expert_distribution_recorder_*_{rank}.pt per rank")
    maps: list[np.ndarray] = []
    passes: list[dict[int, np.ndarray]] = []
    picks: list[dict[int, np.ndarray]] = []  # per_token mode: each pass's physical top-k ids [L, tokens, 8]
    for f in files:
        m, records = read_rank_dump(f)
        maps.append(m)
        got: dict[int, np.ndarray] = {}
        ids_of: dict[int, np.ndarray] = {}
        for fid, c, t in records:
            got[fid] = c
            if t is not None:
                ids_of[fid] = t.astype(np.int64)
        passes.append(got)
        picks.append(ids_of)
    for f, m in zip(files[1:], maps[1:], strict=True):
        if m.shape != maps[0].shape or not np.array_equal(m, maps[0]):
            raise InputError(f"the ranks disagree: {f.name} and {files[0].name} hold different "
                             "last_physical_to_logical_map; use the dumps of one run")
    ids = sorted(passes[0])
    for f, got in zip(files[1:], passes[1:], strict=True):
        if sorted(got) != ids:
            raise InputError(f"the ranks disagree: {f.name} and {files[0].name} record different forward passes; use "
                             "the dumps of one recording")
    if not ids:
        raise InputError(f"{str(d)!r}: the dumps hold no records; record at least one forward pass")
    m = maps[0]
    L, P = m.shape
    E = int(m.max()) + 1
    if all(len(ids_of) == len(ids) for ids_of in picks):
        return _token_level(picks, ids, m, E, str(d), model)
    check_alloc((len(ids), L, E), 8, f"{str(d)!r}: counts [passes, L, E]", "record fewer passes")
    counts = np.zeros((len(ids), L, E), dtype=np.int64)
    rows = np.repeat(np.arange(L), P)
    for got in passes:
        for b, fid in enumerate(ids):
            np.add.at(counts[b], (rows, m.ravel()), got[fid].ravel())
    return LoadMatrix(counts, preset=_model_of(counts, None, model))


def _token_level(picks: list[dict[int, np.ndarray]], passes: list[int], m: np.ndarray, E: int,
                 source: str, model: str | None) -> LoadMatrix:
    """The per_token dumps as a token-level trace: batch = forward pass, source GPU = rank, tokens rank-major within
    a pass; physical ids mapped to logical experts; layers without picks (dense: all -1) left out, the model's
    layer ids kept."""
    parts, src, batch = [], [], []
    for b, fid in enumerate(passes):
        for rank, ids_of in enumerate(picks):
            t = ids_of[fid]  # [L, T, 8]
            parts.append(t.transpose(1, 0, 2))
            src.append(np.full(t.shape[1], rank))
            batch.append(np.full(t.shape[1], b))
    phys = np.concatenate(parts)  # [N, L, 8]
    used = (phys >= 0).any(axis=(0, 2))
    keep = np.flatnonzero(used)
    if keep.size == 0:
        raise InputError(f"{source}: topk_ids_of_layer holds no pick in any layer")
    k = (phys[:, keep] >= 0).sum(axis=2)
    K = int(k.max()) if k.size else 0
    if k.size and (k != K).any():
        raise InputError(f"{source}: tokens pick different numbers of experts ({int(k.min())} to {K}) in the MoE layers")
    phys = phys[:, keep, :K]
    logical = m[keep][np.arange(keep.size)[None, :, None], phys]  # [N, L', K]: each slot's logical expert
    trace = RoutingTrace(logical, np.concatenate(src), np.concatenate(batch), num_experts=E,
                         num_batches=len(passes))
    ids = keep if keep.size < m.shape[0] else None
    preset = load_model(keep.size, E, None if ids is None else ids.tolist(), None, model)
    return LoadMatrix(trace.counts(), trace, preset, ids)


def plan_from_map(phy2log: np.ndarray, cluster: Cluster, num_experts: int | None = None,
                  source: str = "placement", policy: str = "sglang") -> Placement:
    """A :class:`Placement` from a physical-to-logical map ``[L, P]``: GPU ``r`` holds slots
    ``r * P / G .. (r + 1) * P / G - 1`` (SGLang's, vLLM's and TensorRT-LLM's layout)."""
    m = np.asarray(phy2log)
    if m.ndim != 2 or m.shape[1] == 0:
        raise PlanError(f"{source}: the physical-to-logical map has shape {m.shape}; it must be [layers, slots]")
    G = cluster.num_gpus
    P = int(m.shape[1])
    if not np.issubdtype(m.dtype, np.integer):
        with np.errstate(invalid="ignore"):
            whole = np.isfinite(m) & (m == np.round(m))
        if not whole.all():
            raise PlanError(f"{source}: the physical-to-logical map must hold integer expert ids, not "
                            f"{m[~whole].ravel()[0]!r}")
    if P % G:
        raise PlanError(f"{source}: {P} physical slots do not split evenly over {G} GPUs (--nodes x --gpus-per-node); "
                        "SGLang requires P % ep_size == 0: give the cluster the file was made for")
    # every expert has a slot, so a valid id is below the slot count: checked before any cast or allocation
    bound = P if num_experts is None else num_experts
    lo, hi = m.min(), m.max()
    if lo < 0 or hi >= bound:
        bad = lo if lo < 0 else hi
        shown = int(bad) if np.issubdtype(m.dtype, np.integer) else f"{float(bad):g}"
        limit = f"[0, {bound})" if num_experts is not None else f"[0, {P}) (the map has {P} slots per layer)"
        raise PlanError(f"{source}: expert id {shown} is outside {limit}")
    m = m.astype(np.int64)
    E = int(m.max()) + 1 if num_experts is None else num_experts
    S = P // G
    lists = [[[int(e) for e in row[g * S:(g + 1) * S]] for g in range(G)] for row in m]
    return Placement(lists, E, cluster, policy=policy, params={"source": source})


def read_placement(path: str | os.PathLike[str], cluster: Cluster, num_experts: int | None = None) -> Placement:
    """An ``--init-expert-location`` file (``.pt`` or ``.json``) with ``physical_to_logical_map`` as a plan."""
    p = Path(path)
    doc = _document(p)
    if "physical_to_logical_map" not in doc:
        raise InputError(f"{str(p)!r} has no 'physical_to_logical_map' (keys: {sorted(map(str, doc))}); a placement "
                         "file for --init-expert-location holds physical_to_logical_map [L, P]")
    m = _array(doc["physical_to_logical_map"], "physical_to_logical_map", str(p))
    return plan_from_map(m, cluster, num_experts, source=str(p))


def write_placement(path: str | os.PathLike[str], plan: Placement, layer_ids: list[int] | None = None, *,
                    model: str | None = None, num_hidden_layers: int | None = None) -> dict[str, Any]:
    """Write ``{"physical_to_logical_map": [H, P]}`` JSON for ``--init-expert-location`` (atomically); returns what
    an SGLang launch needs to match it (``ep_size``, ``ep_num_redundant_experts``), ``num_hidden_layers`` and
    ``notes`` on what was assumed.

    SGLang's map has one row per decoder layer, ``H = num_hidden_layers`` rows (docs/formats.md, "SGLang"): the
    rows come from :func:`moebalance.engines.layers.plan_layers` (the plan's recorded layer ids, else ``model``, the
    model the plan records or the one its shape fits, else its own dense rows); a plan that cannot say them is
    refused with the reason. Rows the plan lacks (dense layers, which SGLang never routes) hold SGLang's own
    trivial layout, slot ``p`` holding expert ``p mod E``; the plan's MTP rows (engine layer ``H`` and above) are
    left out, as SGLang's draft layer does not read the map. ``layer_ids`` other than ``0 .. L - 1`` give the
    engine layer of each plan row explicitly."""
    if layer_ids is not None and list(layer_ids) != list(range(plan.num_layers)):
        plan = plan.with_params({**plan.params, "layer_ids": [int(x) for x in layer_ids]})
    layers = plan_layers(plan, model=model, num_hidden_layers=num_hidden_layers)
    H = layers.require_rows("an SGLang placement")
    table = slot_table(plan)
    rows = np.tile(np.arange(table.num_slots) % plan.num_experts, (H, 1))
    keep = [r for r, i in enumerate(layers.layer_ids) if i < H]
    rows[[layers.layer_ids[r] for r in keep]] = table.phy2log[keep]
    notes = list(layers.notes)
    if layers.mtp_rows:
        notes.append(f"the plan's MTP layer{'s' * (len(layers.mtp_rows) > 1)} "
                     f"({', '.join(str(layers.layer_ids[r]) for r in layers.mtp_rows)}) left out: SGLang's map has "
                     f"the {H} decoder layers only (its MTP draft layer does not read it)")
    atomic_write_text(Path(path), json.dumps({"physical_to_logical_map": rows.tolist()},
                                             separators=(",", ":")) + "\n")
    return {"ep_size": plan.num_gpus, "ep_num_redundant_experts": table.num_slots - plan.num_experts,
            "num_slots": table.num_slots, "num_hidden_layers": H, "notes": notes}


#: The placement file ``advise --out-dir`` writes.
PLACEMENT_FILE = "sglang-init-expert-location.json"
#: DeepEP's kernels as ``--deepep-mode`` names them, with its automatic choice by phase.
_DEEPEP = {"normal": "normal", "low-latency": "low_latency", "auto": "auto"}


def command(at: Launch) -> tuple[list[str], list[str]]:
    """``(words, comments)``: ``sglang.launch_server`` for the priced deployment, before its EPLB flags (module
    docstring)."""
    d, cluster = at.deployment, at.cluster
    model, comments = model_word(d, ENGINE.title, quantizes=True)
    G, N = cluster.num_gpus, cluster.num_nodes
    D = max(G // d.engine.attention_group(cluster.gpus_per_node), 1)
    cap = d.engine.max_running_requests
    words = ["python", "-m", "sglang.launch_server", "--model-path", model, "--tp-size", str(G), "--ep-size", str(G)]
    if D > 1:
        words += ["--attn-dp-size", str(D)]
        if d.engine.dense_tp == 1 and d.model.num_dense_layers > 0:
            words += ["--moe-dense-tp-size", "1"]
    if N > 1:
        words += ["--nnodes", str(N), "--node-rank", "$NODE_RANK", "--dist-init-addr", "$DIST_INIT_ADDR"]
        comments.append(f"# on each of the {N} nodes: NODE_RANK its rank (0 to {N - 1}), DIST_INIT_ADDR node 0's "
                        "HOST:PORT")
    words += ["--mem-fraction-static", f"{d.engine.memory_fraction:g}"]
    if d.a2a != "per-gpu":
        words += ["--moe-a2a-backend", "deepep", "--deepep-mode", _DEEPEP[d.a2a]]
    words += ["--enable-two-batch-overlap"] if d.overlap == "tbo" else []
    if d.overlap == "tbo" and d.a2a == "per-gpu" and D == 1:  # sglang/srt/arg_groups/validation_hook.py
        fix = "give --a2a or an --attention-tp below the GPUs" if "auto" in kernels_on(d.gpu) else \
            "give an --attention-tp below the GPUs"
        comments.append(f"# SGLang refuses two-batch overlap without DeepEP unless attention is data parallel: {fix}")
    words += ["--quantization", "fp8"] if d.precision == "fp8" and d.model.served_precision != "fp8" else []
    words += ["--kv-cache-dtype", "fp8_e4m3"] if d.engine.kv_bytes == PRECISION_BYTES["fp8"] else []
    words += [] if cap is None else ["--max-running-requests", str(cap)]
    words += ["--chunked-prefill-size", str(d.workload.prefill_chunk * D)] if at.phase == "prefill" else []
    return words, comments


def launch(at: Launch) -> list[str]:
    """The whole launch: :func:`command`, SGLang's EPLB flags for ``at.choice`` (module docstring), the comments."""
    words, comments = command(at)
    c = at.choice
    if c is None:
        return [" ".join(words), "# EPLB off: the trivial expert location, no --enable-eplb", *comments]
    words += ["--ep-num-redundant-experts", str(c.redundant_experts), "--init-expert-location",
              shlex.quote(placed(PLACEMENT_FILE, at.folder)), "--ep-dispatch-algorithm", ENGINE.rule.routers[c.router]]
    if c.rebalance is not None:
        words += ["--enable-eplb", "--eplb-algorithm", "deepseek_hierarchical" if c.hierarchical else "deepseek",
                  "--eplb-rebalance-num-iterations", str(c.rebalance[0]), "--expert-distribution-recorder-buffer-size",
                  str(c.rebalance[1])]
    return [" ".join(words), *unwritten([PLACEMENT_FILE], at.folder), *comments]


def _write_files(folder: Path, at: Launch, plan: Placement | None, model: str, mtp_layers: int) -> list[Path]:
    if plan is None:
        return []
    write_placement(folder / PLACEMENT_FILE, plan, model=model)
    return [folder / PLACEMENT_FILE]


def _write_plan(path: Path, plan: Placement, model: str | None) -> None:
    write_placement(path, plan, model=model)


def _export(path: Path, plan: Placement, ids: list[int], rows: list[int],
            options: dict[str, Any]) -> tuple[dict[str, Any], str]:
    info = write_placement(path, plan, ids, model=options.get("model"),
                           num_hidden_layers=options.get("num_hidden_layers"))
    return info, (f"sglang ... --init-expert-location {path} --ep-size {info['ep_size']} "
                  f"--ep-num-redundant-experts {info['ep_num_redundant_experts']}")


def _read(path: Path, *, model: str | None, **_: Any) -> LoadMatrix:
    return read_dumps(path, model=model) if path.is_dir() else read_stat(path, model=model)


def _import(path: Path, dest: Path, *, model: str | None, **_: Any) -> Any:
    from moebalance.engines.stream import import_dumps  # stream reads with this module's functions

    return import_dumps(path, dest, model=model)


def _read_plan(path: Path, cluster: Cluster, load: LoadMatrix | None) -> tuple[Placement, np.ndarray | None]:
    """The placement, and the load's layer ids it stands for: on a load of the MoE layers alone, an SGLang map with
    more rows than the load gives the load's layers from the model's ids."""
    plan = read_placement(path, cluster, None if load is None else load.num_experts)
    if load is None or load.layer_ids is not None:
        return plan, None if load is None else load.layer_ids
    moe_only = moe_layer_ids(load)
    return plan, moe_only if moe_only is not None and plan.num_layers > load.num_layers else None


def _refuses(d: Deployment) -> str | None:
    """What SGLang 0.5.23 does not serve: MXFP4 experts on an AMD GPU but its gfx95 ones (``Mxfp4Config.from_config``
    raises on another ROCm architecture, ``srt/layers/quantization/mxfp4.py``)."""
    if d.precision == "mxfp4" and d.gpu.vendor == "amd" and not d.gpu.arch.startswith("gfx95"):
        return (f"SGLang serves MXFP4 experts on AMD's gfx95 GPUs only (the MI355X), not on --gpu {d.gpu.name} "
                f"({d.gpu.arch or 'its architecture not recorded'}); give --engine vllm, or --precision bf16 to price "
                "a BF16 copy")
    return None


#: SGLang 0.5: ``--init-expert-location`` loads any plan; rearrangement stops serving; static, dynamic and LP
#: dispatch read as the ``uniform``, ``rebalance`` and ``minmax`` routers; physical experts that do not divide by
#: ``--ep-size`` are refused. Loads: a folder of per-rank ``.pt`` dumps, a ``.pt`` stat dump or its ``.json``.
ENGINE = Engine(
    name="sglang", title="SGLang", export_suffix=".json",
    rule=EngineRule({"uniform": "static", "rebalance": "dynamic", "minmax": "lp"}, True, "sync"),
    launch=launch, write_files=_write_files,
    write_plan=_write_plan,
    export=_export, claims=lambda p: any(p.glob("*.pt")) if p.is_dir() else p.suffix in (".pt", ".json"),
    read_load=_read, streams=lambda path: path.is_dir(), import_load=_import, read_plan=_read_plan,
    plan_suffixes=(".pt",), plan_key="physical_to_logical_map", refuses=_refuses)
