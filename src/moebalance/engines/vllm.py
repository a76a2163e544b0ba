"""vLLM: routed experts in (``--enable-return-routed-experts``), a per-MoE-layer physical-to-logical map out.

Legend: ``L_moe`` MoE layers (vLLM's EPLB numbers only those), ``P`` physical slots (``E +
num_redundant_experts``), rank ``r`` owning the contiguous slots ``r * P / ep_size ..``.

vLLM's EPLB state holds ``physical_to_logical_map [L_moe, P]`` (``vllm/distributed/eplb``), and its policy
interface returns one (``rebalance_experts(weight [L_moe, E], num_replicas, num_groups, num_nodes, num_ranks)``).
No released vLLM reads a placement from a file yet: the open pull request that adds
``eplb_config.initial_expert_map_path`` (vllm-project/vllm#49572) reads a JSON list of per-MoE-layer lists of
``P`` expert ids, which is what :func:`write_map` writes.

**Routed experts** (read; ``--enable-return-routed-experts``, ``vllm/model_executor/layers/fused_moe/
routed_experts_capturer.py``): each request's ``routed_experts`` is ``[tokens, L, k]``, token-major; the Python API
returns it as a numpy array (``CompletionOutput.routed_experts``), recent HTTP responses as a base64-encoded
``.npy`` string in each choice (``"routed_experts"``; uint8 or uint16 in recent releases, int32 in older ones:
the ``.npy`` header says). ``L`` has been the model's ``num_hidden_layers``, with dense layers as all-zero rows;
:func:`read_routed_experts` takes a layer whose every token picks one expert ``k`` times (zeros) as dense and
leaves it out, recording the model's layer index of each kept layer (``LoadMatrix.layer_ids``). Requests become
a token-level trace: in the order read, packed into batches of at least ``batch_tokens`` tokens, request ``j`` of
a batch on rank ``j mod gpus`` (a data-parallel server spreads requests).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.core.errors import InputError, PlanError
from moebalance.core.io import atomic_write_text, read_json
from moebalance.core.limits import check_alloc
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.engines.files import load_model, read_npy_bytes
from moebalance.engines.layers import plan_layers
from moebalance.engines.slots import slot_table
from moebalance.models import get_model

__all__ = ["deal", "experts_of", "read_routed_experts", "request_files", "requests_in", "write_map"]


def request_files(path: Path) -> list[Path]:
    """What :func:`requests_in` reads, in order: ``path`` itself, or a folder's ``.npy`` and ``.json`` entries,
    sorted by name."""
    if not path.is_dir():
        return [path]
    files = sorted(f for f in path.iterdir() if f.suffix in (".npy", ".json"))
    if not files:
        raise InputError(f"{str(path)!r} has no .npy or .json files of vLLM routed experts")
    return files


def requests_in(path: Path) -> list[np.ndarray]:
    """Every request's ``[tokens, L, k]`` array in ``path`` (a .npy, a JSON response or list of them, a folder)."""
    if path.is_dir():
        return [a for f in request_files(path) for a in requests_in(f)]
    if path.suffix == ".npy":
        return [read_npy_bytes(path.read_bytes(), str(path))]
    doc = read_json(path, "vLLM response file")
    out: list[np.ndarray] = []
    for item in doc if isinstance(doc, list) else [doc]:
        choices = item.get("choices", [item]) if isinstance(item, dict) else None
        if not isinstance(choices, list):
            raise InputError(f"{str(path)!r}: expected vLLM responses (objects with 'choices') or choices")
        for c in choices:
            value = c.get("routed_experts") if isinstance(c, dict) else None
            if not isinstance(value, str):
                raise InputError(f"{str(path)!r}: a choice has no base64 'routed_experts' string; start vLLM with "
                                 "--enable-return-routed-experts")
            try:
                data = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise InputError(f"{str(path)!r}: routed_experts is not base64") from None
            out.append(read_npy_bytes(data, str(path)))
    return out


def deal(lengths: np.ndarray, gpus: int, batch_tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(batch [R], rank [R], batches)`` of requests of ``lengths [R]`` tokens, whole and in order: each batch takes
    requests until it holds ``batch_tokens`` or more, dealt round-robin to the ``gpus`` ranks from rank 0."""
    batch = np.empty(len(lengths), dtype=np.int64)
    rank = np.empty(len(lengths), dtype=np.int64)
    b = filled = j = 0
    for i, n in enumerate(lengths):
        batch[i], rank[i] = b, j % gpus
        filled, j = filled + int(n), j + 1
        if filled >= batch_tokens:
            b, filled, j = b + 1, 0, 0
    return batch, rank, b + (filled > 0)


def experts_of(num_experts: int | None, model: str | None) -> tuple[int | None, str]:
    """``(experts per layer or None for the largest id seen + 1, what bounds the ids)`` of ``--experts`` and
    ``--model``: a named model has its experts, picked or not."""
    if num_experts is not None and (isinstance(num_experts, bool) or not isinstance(num_experts, int)
                                    or num_experts < 1):
        raise InputError(f"--experts ({num_experts!r}) must be a positive integer, the model's expert count")
    if num_experts is None and model is not None:
        return get_model(model).num_experts, f"{model}'s expert count"
    return num_experts, "--experts"


def read_routed_experts(path: str | os.PathLike[str], *, gpus: int = 1, batch_tokens: int = 4096,
                        num_experts: int | None = None, model: str | None = None) -> LoadMatrix:
    """vLLM's routed experts (module docstring) as a token-level load, dense layers left out, for ``model``
    (default: the one its shape fits)."""
    p = Path(path)
    reqs = requests_in(p)
    if not reqs:
        raise InputError(f"{str(p)!r} holds no request")
    shapes = {a.shape[1:] for a in reqs}
    for a in reqs:
        if a.ndim != 3 or not np.issubdtype(a.dtype, np.integer):
            raise InputError(f"{str(p)!r}: routed_experts must be integer [tokens, layers, top-k], got {a.dtype} "
                             f"{a.shape}")
    if len(shapes) != 1:
        raise InputError(f"{str(p)!r}: the requests disagree on [layers, top-k]: {sorted(shapes)}; one model's output")
    if min((int(a.min()) for a in reqs if a.size), default=0) < 0:
        raise InputError(f"{str(p)!r}: routed_experts holds a negative expert id")
    top = max((int(a.max()) for a in reqs if a.size), default=0)
    narrow = np.int16 if top <= np.iinfo(np.int16).max else np.int32 if top <= np.iinfo(np.int32).max else np.int64
    ids = np.concatenate([a.astype(narrow, copy=False) for a in reqs])  # the ids' own range: no wrap, 2-4 bytes each
    K = ids.shape[2]
    same = (ids == ids[:, :, :1]).all(axis=2)  # every pick of a token the same expert
    dense = same.all(axis=0) & ((ids[:, :, 0] == 0).all(axis=0) if K == 1 else True)
    keep = np.flatnonzero(~dense)
    if keep.size == 0:
        raise InputError(f"{str(p)!r}: every layer looks dense (each token picks one expert {K} times)")
    num_experts, limit = experts_of(num_experts, model)
    E = int(ids.max()) + 1 if num_experts is None else num_experts
    if ids.max() >= E:
        raise InputError(f"{str(p)!r}: expert id {int(ids.max())} is not below {limit} {E}")
    lengths = np.array([len(a) for a in reqs], dtype=np.int64)
    batch, rank, num_batches = deal(lengths, gpus, batch_tokens)
    check_alloc((num_batches, keep.size, E), 8, f"{str(p)!r}: counts [B, L, E] with E = {E:,} experts",
                "give --experts the model's expert count (ids in the file must be below it)")
    tr = RoutingTrace(ids[:, keep], np.repeat(rank, lengths), np.repeat(batch, lengths), num_experts=E)
    layer_ids = keep if dense.any() else None
    preset = load_model(keep.size, E, None if layer_ids is None else layer_ids.tolist(), None, model)
    return LoadMatrix(tr.counts(), tr, preset, layer_ids)


def write_map(path: str | os.PathLike[str], plan: Placement, moe_layers: Sequence[int] | None = None, *,
              model: str | None = None, num_hidden_layers: int | None = None) -> dict[str, Any]:
    """Write ``[[P expert ids] per MoE layer]`` JSON for the plan rows ``moe_layers`` (default: those with load),
    atomically; returns ``num_slots``, ``num_redundant_experts``, ``ep_size`` and ``notes``. The plan's MTP rows
    (engine layer ``num_hidden_layers`` and above, :func:`moebalance.engines.layers.plan_layers`) are left out:
    vLLM balances an MTP drafter's experts in a state of their own."""
    table = slot_table(plan)
    layers = plan_layers(plan, model=model, num_hidden_layers=num_hidden_layers)
    rows = [r for r in range(plan.num_layers) if r not in plan.dense_layers] if moe_layers is None else \
        [int(r) for r in moe_layers]
    notes = list(layers.notes)
    mtp = [r for r in rows if r in layers.mtp_rows]
    if mtp:
        rows = [r for r in rows if r not in mtp]
        notes.append(f"the plan's MTP layer{'s' * (len(mtp) > 1)} ({', '.join(str(layers.layer_ids[r]) for r in mtp)})"
                     " left out: vLLM balances an MTP drafter's experts separately")
    if not rows:
        raise PlanError("no MoE layer to write: every layer of the plan is dense (no load)")
    data = [[int(e) for e in table.phy2log[layer]] for layer in rows]
    atomic_write_text(Path(path), json.dumps(data, separators=(",", ":")) + "\n")
    return {"num_slots": table.num_slots, "num_redundant_experts": table.num_slots - plan.num_experts,
            "ep_size": plan.num_gpus, "notes": notes}
