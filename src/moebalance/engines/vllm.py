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

**Launch** (:data:`ENGINE`; options read from vLLM 0.33's ``vllm/engine/arg_utils.py`` and
``vllm/entrypoints/common/cli_args.py``): ``vllm serve M --tensor-parallel-size A --data-parallel-size D
--enable-expert-parallel`` (the experts over ``A D = G`` GPUs, ``A`` GPUs per data-parallel attention rank);
DeepEP as ``--all2all-backend deepep_high_throughput|deepep_low_latency`` (vLLM has no automatic mode: ``auto`` is
given as the priced phase's kernel); ``--enable-dbo`` (two-batch overlap); ``--quantization fp8``;
``--kv-cache-dtype fp8``; ``--max-num-seqs`` per rank (vLLM applies it per data-parallel rank,
``vllm/config/scheduler.py``); in prefill ``--max-num-batched-tokens`` a rank's chunk; on several nodes node 0's
``--data-parallel-size-local --data-parallel-address --data-parallel-rpc-port``, the other nodes' ``--headless
--data-parallel-start-rank`` in a comment (vLLM's data-parallel deployment guide). EPLB: ``--enable-eplb
--eplb-config '{"window_size": W, "step_interval": S, "num_redundant_experts": R, "use_async": true}'``. vLLM loads
no placement: its EPLB makes its first plan after ``S / 4`` steps on the ``W`` steps before, then re-plans every
``S`` steps. A static plan is given as ``W = 1000`` (vLLM's default window) and ``S = 4 W``: the first plan after
``W`` steps, the next after ``S`` more. The migration-aware variant is the plug-in's
(``MOEBALANCE_VLLM_EPLB=move-aware``, :mod:`moebalance.engines.vllm_plugin`).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.core.errors import InputError, PlanError
from moebalance.core.io import atomic_write_text, read_json
from moebalance.core.limits import check_alloc
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement, write_plan
from moebalance.core.trace import RoutingTrace
from moebalance.cost.time import PRECISION_BYTES
from moebalance.engines.base import Engine, EngineRule, Launch, model_word
from moebalance.engines.files import load_model, read_npy_bytes
from moebalance.engines.layers import plan_layers
from moebalance.engines.slots import slot_table
from moebalance.engines.vllm_plugin import ENTRY_POINT, ENV
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


#: vLLM's default ``window_size``: the steps a static plan is made on.
STATIC_WINDOW = 1000
#: DeepEP's kernels as ``--all2all-backend`` names them.
_A2A = {"normal": "deepep_high_throughput", "low-latency": "deepep_low_latency"}


def command(at: Launch) -> tuple[list[str], list[str]]:
    """``(words, comments)``: ``vllm serve`` for the priced deployment, before its EPLB flags (module docstring)."""
    d, cluster, phase = at.deployment, at.cluster, at.phase
    model, comments = model_word(d, ENGINE.title, quantizes=True)
    G, N, gpn = cluster.num_gpus, cluster.num_nodes, cluster.gpus_per_node
    A = d.engine.attention_group(gpn)
    D = max(G // A, 1)
    cap = d.engine.max_running_requests
    words = ["vllm", "serve", model, "--tensor-parallel-size", str(A), "--data-parallel-size", str(D)]
    if N > 1 and D % N == 0:
        local = D // N
        words += ["--data-parallel-size-local", str(local), "--data-parallel-address", "$HEAD_IP",
                  "--data-parallel-rpc-port", "$DP_RPC_PORT"]
        start = "i" if local == 1 else f"i * {local}"
        comments.append(f"# on node 0 of {N} (HEAD_IP its address, DP_RPC_PORT a free port); on node i > 0 the "
                        f"same with --headless --data-parallel-start-rank {start}")
    elif N > 1:
        comments.append(f"# {D} data-parallel ranks of {A} GPUs do not split evenly over {N} nodes of {gpn}: "
                        "place the ranks by hand (vLLM's --data-parallel-size-local)")
    words.append("--enable-expert-parallel")
    if d.a2a != "per-gpu":
        kernel = d.a2a_kernel(phase)
        words += ["--all2all-backend", _A2A[kernel]]
        if d.a2a == "auto":
            comments.append(f"# vLLM picks no DeepEP kernel by phase: the {phase} steps' ({kernel}) is given")
    words += ["--enable-dbo"] if d.overlap == "tbo" else []
    words += ["--quantization", "fp8"] if d.precision == "fp8" and d.model.served_precision != "fp8" else []
    words += ["--kv-cache-dtype", "fp8"] if d.engine.kv_bytes == PRECISION_BYTES["fp8"] else []
    words += [] if cap is None else ["--max-num-seqs", str(max(cap // D, 1))]
    words += ["--max-num-batched-tokens", str(d.workload.prefill_chunk)] if phase == "prefill" else []
    return words, comments


def launch(at: Launch) -> list[str]:
    """The whole launch: :func:`command`, vLLM's EPLB flags for ``at.choice`` (module docstring) and the comments."""
    words, comments = command(at)
    c, q = at.choice, shlex.quote
    if c is None:
        return [" ".join(words), "# EPLB off: no --enable-eplb", *comments]
    K, W = c.rebalance if c.rebalance is not None else (4 * STATIC_WINDOW, STATIC_WINDOW)
    config = {"window_size": W, "step_interval": K, "num_redundant_experts": c.redundant_experts, "use_async": True}
    env = [] if c.plugin is None else [f"{ENV}={q(c.plugin)}"]
    lines = [" ".join([*env, *words, "--enable-eplb", "--eplb-config", q(json.dumps(config))])]
    if c.rebalance is None:
        lines.append(f"# vLLM loads no placement: it makes its first plan after step_interval / 4 = {W} steps, on "
                     f"those steps, then re-plans every {K} steps (a step_interval beyond the run would keep "
                     "vLLM's initial layout, experts 0..R-1 copied, not this plan)")
    if c.plugin is not None:
        lines.append(f"# {ENV}: the moebalance plug-in (pip install moebalance[vllm]); if VLLM_PLUGINS is set it "
                     f"must list {ENTRY_POINT}")
    return lines + comments


def _export(path: Path, plan: Placement, ids: list[int], rows: list[int],
            options: dict[str, Any]) -> tuple[dict[str, Any], str]:
    info = write_map(path, plan, rows, model=options.get("model"), num_hidden_layers=options.get("num_hidden_layers"))
    how = (f"{len(rows)} MoE layers x {info['num_slots']} slots; vLLM's EPLB with num_redundant_experts "
           f"{info['num_redundant_experts']} on {info['ep_size']} EP ranks (a released vLLM reads no placement file yet)")
    return info, how


def _claims(path: Path) -> bool:
    """A folder of ``.json`` responses (and no SGLang ``.pt`` dumps), or a JSON response with routed experts."""
    if path.is_dir():
        return not any(path.glob("*.pt")) and any(path.glob("*.json"))
    if path.suffix != ".json":
        return False
    try:
        head = path.read_text()[:4096]
    except (OSError, UnicodeDecodeError):
        return False
    return '"routed_experts"' in head or '"choices"' in head


def _import(path: Path, dest: Path, **kw: Any) -> Any:
    from moebalance.engines.stream import import_routed_experts  # stream reads with this module's functions

    return import_routed_experts(path, dest, **kw)


def _read(path: Path, *, model: str | None, gpus: int, batch_tokens: int, num_experts: int | None) -> LoadMatrix:
    return read_routed_experts(path, gpus=gpus, batch_tokens=batch_tokens, num_experts=num_experts, model=model)


#: vLLM 0.33: EPLB plans itself from its window (no placement file), rearranges asynchronously by default
#: (``use_async``), routes each token to a random copy; the plug-in's ``move-aware`` re-plans as ``aligned`` does.
#: Without EPLB its expert map gives the first ``E mod G`` ranks one expert more (the ``contiguous`` policy's
#: layout). ``watch --write-plan`` writes a moebalance plan, which the plug-in's variants take. A linear-attention
#: layer's recurrent state is kept in the model's dtype (``mamba_ssm_cache_dtype`` ``auto``,
#: ``vllm/model_executor/layers/mamba/mamba_utils.py``): 2 bytes a number in bf16.
ENGINE = Engine(
    name="vllm", title="vLLM", export_suffix=".json",
    rule=EngineRule({"random": "random"}, False, "async", move_aware="move-aware", uneven_off=True,
                    recurrent_state_bytes=2),
    launch=launch, write_files=lambda folder, at, plan, model, mtp: [],
    write_plan=lambda path, plan, model: write_plan(path, plan), export=_export, claims=_claims, read_load=_read,
    streams=lambda path: True, import_load=_import)
