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
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.io import atomic_write_text
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.engines.slots import slot_table

__all__ = ["read_config", "read_statistics", "write_config"]

_KEY = re.compile(r"^(\d+)_(\d+)$")


def read_statistics(folder: str | os.PathLike[str]) -> LoadMatrix:
    """A statistics folder as a load ``[I, L, E]`` (module docstring), the ranks summed."""
    from safetensors import SafetensorError, safe_open

    d = Path(folder)
    meta_path = d / "meta_info.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read {str(meta_path)!r}: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("num_experts"), int) or meta["num_experts"] < 1:
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
                    m = _KEY.match(key)
                    if m is None:
                        raise InputError(f"{str(f)!r} has key {key!r}; TensorRT-LLM's statistics keys are "
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
    if iters != list(range(iters[0], iters[-1] + 1)):
        raise InputError(f"{str(d)!r} records iterations {iters[0]}..{iters[-1]} with gaps; TensorRT-LLM writes one "
                         "contiguous range (EXPERT_STATISTIC_ITER_RANGE): use the files of one run")
    layers = sorted({layer for _, layer in keys})
    if len(keys) != len(iters) * len(layers):
        raise InputError(f"{str(d)!r} does not record every MoE layer in every iteration ({len(keys)} keys for "
                         f"{len(iters)} iterations x {len(layers)} layers)")
    counts = np.zeros((len(iters), layers[-1] + 1, E), dtype=np.int64)
    index = {it: b for b, it in enumerate(iters)}
    for got in per_rank:
        for (it, layer), v in got.items():
            counts[index[it], layer] += v
    return LoadMatrix(counts)


def read_config(path: str | os.PathLike[str], cluster: Cluster, num_layers: int | None = None,
                num_experts: int | None = None, moe_layers: Sequence[int] = ()) -> Placement:
    """A load-balancer YAML as a plan of ``num_layers`` layers (default: up to the last listed one); layers it
    does not list (dense ones) get the engine's default order, slot ``p`` holding expert ``p mod E``."""
    import yaml

    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
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
    if not isinstance(slots, int) or slots < 1:
        raise InputError(f"{str(p)!r}: num_slots must be a positive integer, got {slots!r}")
    if not isinstance(assign, dict) or not assign:
        raise InputError(f"{str(p)!r}: initial_global_assignments must map layer ids to lists of {slots} expert ids")
    rows: dict[int, list[int]] = {}
    for key, ids in assign.items():
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise InputError(f"{str(p)!r}: layer id {key!r} must be a non-negative integer")
        if not isinstance(ids, list) or len(ids) != slots or \
                not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
            raise InputError(f"{str(p)!r}: layer {key} must list {slots} (num_slots) non-negative expert ids")
        rows[key] = ids
    E = num_experts if num_experts is not None else max(max(r) for r in rows.values()) + 1
    L = num_layers if num_layers is not None else max(rows) + 1
    if max(rows) >= L:
        raise PlanError(f"{str(p)!r} places layer {max(rows)} but the load has {L} layers; score it on the model's "
                        "own statistics")
    for layer, ids in rows.items():
        if set(ids) != set(range(E)):
            raise PlanError(f"{str(p)!r}: layer {layer} does not hold every expert 0..{E - 1} at least once "
                            "(TensorRT-LLM requires it)")
    missing = sorted(set(moe_layers) - set(rows))
    if missing:
        raise PlanError(f"{str(p)!r} does not place layer {missing[0]}, which carries load: TensorRT-LLM requires every "
                        "MoE layer in initial_global_assignments")
    default = [p_ % E for p_ in range(slots)]
    m = np.asarray([rows.get(layer, default) for layer in range(L)], dtype=np.int64)
    from moebalance.engines.sglang import plan_from_map

    return plan_from_map(m, cluster, E, source=str(p), policy="trtllm")


def write_config(path: str | os.PathLike[str], plan: Placement, moe_layers: Sequence[tuple[int, int]],
                 layer_updates_per_iter: int = 0) -> dict[str, Any]:
    """Write the load-balancer YAML for ``moe_layers``, ``(plan layer, its decoder-layer id)`` pairs (dense layers
    left out), atomically; returns ``num_slots`` and ``ep_size``."""
    import yaml

    table = slot_table(plan)
    if not moe_layers:
        raise PlanError("no MoE layer to write: every layer of the plan is dense (no load)")
    doc = {"num_slots": table.num_slots,
           "initial_global_assignments": {int(lid): [int(e) for e in table.phy2log[row]] for row, lid in moe_layers},
           "layer_updates_per_iter": int(layer_updates_per_iter)}
    text = yaml.safe_dump(doc, default_flow_style=None, sort_keys=False, width=10**6)
    atomic_write_text(Path(path), text)
    return {"num_slots": table.num_slots, "ep_size": plan.num_gpus}
