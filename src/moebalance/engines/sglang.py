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
  The team's published DeepSeek-V3 statistics are such ``logical_count`` JSON files.

Reading a stat dump keeps the dense layers as zero rows (the model's numbering) and drops the all-zero passes.
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.io import atomic_write_text
from moebalance.core.load import LoadMatrix, check_counts
from moebalance.core.plan import Placement
from moebalance.engines.slots import slot_table

__all__ = ["plan_from_map", "read_placement", "read_stat", "read_torch", "write_placement"]


def read_torch(path: Path) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``, with a one-line error for what it refuses."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "not plain tensors"
        raise InputError(f"{str(path)!r} holds pickled objects that are not plain tensors, lists or numbers, and "
                         f"moebalance never unpickles code ({first[:160]}); save plain tensors with torch.save") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"cannot read {str(path)!r} with torch.load: {first[:200]} (is it a torch.save file?)") from None


def _document(path: Path) -> dict[str, Any]:
    """The dict a ``.pt`` or ``.json`` file (or inline JSON) holds."""
    if path.suffix == ".pt":
        doc = read_torch(path)
    else:
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"cannot read {str(path)!r} as JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InputError(f"{str(path)!r} holds a {type(doc).__name__}; SGLang files hold a dict with "
                         "'logical_count' or 'physical_to_logical_map'")
    return doc


def _array(value: Any, name: str, source: str) -> np.ndarray:
    try:
        import torch

        arr = value.cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{source}: {name} is not a rectangular array of numbers ({exc})") from None
    if arr.dtype == object:
        raise InputError(f"{source}: {name} is not a rectangular array of numbers (rows of different lengths?)")
    return arr


def read_stat(path: str | os.PathLike[str]) -> LoadMatrix:
    """A stat dump (``.pt``) or a ``logical_count`` JSON as a load ``[B, L, E]`` (module docstring)."""
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
    return LoadMatrix(counts)


def plan_from_map(phy2log: np.ndarray, cluster: Cluster, num_experts: int | None = None,
                  source: str = "placement", policy: str = "sglang") -> Placement:
    """A :class:`Placement` from a physical-to-logical map ``[L, P]``: GPU ``r`` holds slots
    ``r * P / G .. (r + 1) * P / G - 1`` (SGLang's, vLLM's and TensorRT-LLM's layout)."""
    m = np.asarray(phy2log)
    if m.ndim != 2 or m.shape[1] == 0:
        raise PlanError(f"{source}: the physical-to-logical map has shape {m.shape}; it must be [layers, slots]")
    if not np.issubdtype(m.dtype, np.integer):
        if not np.all(np.isfinite(m)) or not np.all(m == np.round(m)):
            raise PlanError(f"{source}: the physical-to-logical map must hold integer expert ids")
        m = m.astype(np.int64)
    G = cluster.num_gpus
    P = int(m.shape[1])
    if P % G:
        raise PlanError(f"{source}: {P} physical slots do not split evenly over {G} GPUs (--nodes x --gpus-per-node); "
                        "SGLang requires P % ep_size == 0: give the cluster the file was made for")
    E = int(m.max()) + 1 if num_experts is None else num_experts
    if m.min() < 0 or m.max() >= E:
        raise PlanError(f"{source}: expert id {int(m.min() if m.min() < 0 else m.max())} is outside [0, {E})")
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


def write_placement(path: str | os.PathLike[str], plan: Placement) -> dict[str, Any]:
    """Write ``{"physical_to_logical_map": [L, P]}`` JSON for ``--init-expert-location`` (atomically); returns what
    an SGLang launch needs to match it (``ep_size``, ``ep_num_redundant_experts``)."""
    table = slot_table(plan)
    atomic_write_text(Path(path), json.dumps({"physical_to_logical_map": table.phy2log.tolist()},
                                             separators=(",", ":")) + "\n")
    return {"ep_size": plan.num_gpus, "ep_num_redundant_experts": table.num_slots - plan.num_experts,
            "num_slots": table.num_slots}
