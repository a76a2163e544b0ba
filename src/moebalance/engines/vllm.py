"""vLLM: a per-MoE-layer physical-to-logical map, the form vLLM's EPLB keeps its placement in.

Legend: ``L_moe`` MoE layers (vLLM's EPLB numbers only those), ``P`` physical slots (``E +
num_redundant_experts``), rank ``r`` owning the contiguous slots ``r * P / ep_size ..``.

vLLM's EPLB state holds ``physical_to_logical_map [L_moe, P]`` (``vllm/distributed/eplb``), and its policy
interface returns one (``rebalance_experts(weight [L_moe, E], num_replicas, num_groups, num_nodes, num_ranks)``).
No released vLLM reads a placement from a file yet: the open pull request that adds
``eplb_config.initial_expert_map_path`` (vllm-project/vllm#49572) reads a JSON list of per-MoE-layer lists of
``P`` expert ids, which is what :func:`write_map` writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moebalance.core.errors import PlanError
from moebalance.core.io import atomic_write_text
from moebalance.core.plan import Placement
from moebalance.engines.slots import slot_table

__all__ = ["write_map"]


def write_map(path: str | os.PathLike[str], plan: Placement, moe_layers: Sequence[int]) -> dict[str, Any]:
    """Write ``[[P expert ids] per MoE layer]`` JSON (dense layers left out), atomically; returns ``num_slots``,
    ``num_redundant_experts`` and ``ep_size``."""
    table = slot_table(plan)
    if not moe_layers:
        raise PlanError("no MoE layer to write: every layer of the plan is dense (no load)")
    rows = [[int(e) for e in table.phy2log[layer]] for layer in moe_layers]
    atomic_write_text(Path(path), json.dumps(rows, separators=(",", ":")) + "\n")
    return {"num_slots": table.num_slots, "num_redundant_experts": table.num_slots - plan.num_experts,
            "ep_size": plan.num_gpus}
