"""Memory per GPU: weights as the engine shards them, expert replicas, the KV cache left, the concurrency it allows.

Legend: ``G`` GPUs, ``L`` MoE layers, ``E`` routed experts per layer, ``S_g`` experts GPU ``g`` hosts over all
layers (replicas included).

An engine (SGLang, vLLM) reserves a fraction ``f`` of each GPU's memory for weights and the KV-cache pool and
gives the KV cache what the weights leave (SGLang: ``mem_fraction_static``; vLLM: ``gpu_memory_utilization``)::

    kv_cache[g] = f * memory - weights[g] - reserve
    weights[g]  = S_g * expert_bytes + non_expert_bytes / shards

(``expert_bytes``: ``3 H F`` weights of ``EngineMemory.expert_bytes_per_weight`` each, 4.25 / 8 bytes for an MXFP4
checkpoint's experts, whose other weights are bf16.)

A GPU's KV cache is set by the GPU hosting the most experts (engines size every rank's pool alike, and the
smallest one bounds the batch: CRAFT Section 4.2.2, Challenge 2). Replicas cost ``(max_g S_g - L * ceil(E / G))
* expert_bytes``; the KV-cache reduction is that memory over the KV cache of the same deployment without
replicas. Concurrency is how many requests of ``context`` tokens the KV cache holds: ``kv_cache /
kv_bytes_per_request(context)`` per GPU of an attention data-parallel rank (full layers cache every token, window
layers at most ``W``, linear layers a state of fixed size: :meth:`moebalance.models.ModelSpec.kv_cache_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from moebalance.core.errors import InputError
from moebalance.cost.hardware import GpuSpec
from moebalance.models import ModelSpec
from moebalance.models.fields import check_fields

__all__ = ["GIB", "EngineMemory", "MemoryReport", "memory_per_gpu"]

GIB = float(1 << 30)


@dataclass(kw_only=True, frozen=True, slots=True)
class EngineMemory:
    """How an engine lays weights and KV cache out on a GPU (defaults: SGLang with data-parallel attention over
    expert parallelism, as CRAFT Section 5.1 runs it; ``docs/design.md``, "Cost model", gives the sources)."""

    #: Share of GPU memory for weights and the KV pool (SGLang's ``mem_fraction_static`` default for 16 or more
    #: GPUs in a model instance).
    memory_fraction: float = 0.79
    #: GiB per GPU held inside that share besides weights and KV cache (CUDA graphs, communication buffers,
    #: activation workspace). Engines publish no single number for it: the default is fitted once, to CRAFT's
    #: KV-cache reduction of EPLB on DeepSeek-R1 over 8 nodes of A100-80GB (19%, CRAFT Section 5.3), by
    #: ``bench/cost_report.py``; the paper's three Kimi-K2 numbers are then predictions.
    reserve_gib: float = 5.85
    #: GPUs that split the attention weights (tensor-parallel attention within a data-parallel rank); ``None``:
    #: the cluster's ``gpus_per_node`` (one data-parallel rank per node); 1: replicated on every GPU.
    attention_tp: int | None = None
    #: GPUs that split the other non-expert weights (dense layers' MLP, shared experts, router, embeddings and
    #: LM head); 1: replicated on every GPU.
    dense_tp: int = 1
    #: Bytes per weight (bf16: 2) and per KV-cache number.
    weight_bytes: int = 2
    kv_bytes: int = 2
    #: Bytes per number of a linear-attention layer's recurrent state (SGLang's float32: 4; vLLM's bf16: 2; an
    #: engine's :attr:`moebalance.engines.base.EngineRule.recurrent_state_bytes`).
    recurrent_state_bytes: int = 4
    #: Bytes per routed-expert weight where the experts are stored unlike the other weights (an MXFP4 checkpoint's
    #: 4.25 / 8: :data:`moebalance.cost.time.EXPERT_WEIGHT_BYTES`, which a deployment sets); ``None``: ``weight_bytes``.
    expert_weight_bytes: float | None = None
    #: The requests the deployment runs at once at most, over all its data-parallel ranks (SGLang's
    #: ``--max-running-requests``, which each rank takes divided by the data-parallel size); ``None``: as many as the
    #: KV cache holds.
    max_running_requests: int | None = None

    def __post_init__(self) -> None:
        check_fields(self, positive_reals=("memory_fraction",), non_negative_reals=("reserve_gib",),
                     positive=("dense_tp", "weight_bytes", "kv_bytes", "recurrent_state_bytes"), label="")
        if self.expert_weight_bytes is not None:
            check_fields(self, positive_reals=("expert_weight_bytes",), label="")
        cap = self.max_running_requests
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise InputError(f"max_running_requests ({cap!r}) must be a positive integer or None (the KV cache's)")
        if self.memory_fraction > 1.0:
            raise InputError(f"memory_fraction ({self.memory_fraction}) must be in (0, 1]")
        tp = self.attention_tp
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise InputError(f"attention_tp ({tp!r}) must be a positive integer or None (a node)")

    @property
    def expert_bytes_per_weight(self) -> float:
        """Bytes per routed-expert weight: ``expert_weight_bytes``, else ``weight_bytes``."""
        return self.weight_bytes if self.expert_weight_bytes is None else self.expert_weight_bytes

    def attention_group(self, gpus_per_node: int) -> int:
        """GPUs of one data-parallel rank: ``attention_tp``, or a node when it is ``None``."""
        return gpus_per_node if self.attention_tp is None else self.attention_tp


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Memory per GPU of one deployment (GiB); the ``moebalance cost`` keys."""

    #: Every weight on the fullest GPU: its experts (replicas included) and its share of the rest.
    weights_gb_per_gpu: float
    #: The fullest GPU's replica memory: experts beyond ``L * ceil(E / G)``.
    replica_gb_per_gpu: float
    kv_cache_gb_per_gpu: float
    #: ``replica_gb_per_gpu / kv cache without replicas`` (1.0 or more: the replicas leave no KV cache).
    kv_cache_reduction: float
    #: Requests of ``context_tokens`` the whole deployment holds in its KV cache at once.
    max_concurrency: int
    context_tokens: int
    #: Experts the fullest GPU hosts over all layers, and without replicas.
    experts_per_gpu: int
    experts_per_gpu_no_replicas: int

    def as_dict(self) -> dict[str, float | int]:
        """Every field by name, floats rounded to 4 places."""
        values = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in values}


def non_expert_gib_per_gpu(model: ModelSpec, engine: EngineMemory, gpus_per_node: int) -> float:
    """GiB of non-expert weights on one GPU: attention split over ``attention_tp``, the rest over ``dense_tp``."""
    parts = model.non_expert_params()
    attention_tp = engine.attention_group(gpus_per_node)
    params = parts["attention"] / attention_tp + (sum(parts.values()) - parts["attention"]) / engine.dense_tp
    return params * engine.weight_bytes / GIB


def memory_per_gpu(model: ModelSpec, gpu: GpuSpec, *, num_gpus: int, gpus_per_node: int,
                   experts_per_gpu: int | np.ndarray | None = None, replicas_per_gpu: int = 0,
                   engine: EngineMemory | None = None, context_tokens: int = 4096) -> MemoryReport:
    """Memory per GPU of ``model`` on ``num_gpus`` GPUs of ``gpu``.

    ``experts_per_gpu`` is what each GPU hosts over all MoE layers (``int [G]`` from a plan's slots, or the most
    any GPU hosts); without it every GPU hosts ``L * ceil(E / G)`` plus ``replicas_per_gpu``.
    """
    engine = EngineMemory() if engine is None else engine
    if num_gpus < 1 or gpus_per_node < 1 or num_gpus % gpus_per_node:
        raise InputError(f"{num_gpus} GPUs are not whole nodes of {gpus_per_node}: give --nodes and --gpus-per-node "
                         "as positive integers")
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < 1:
        raise InputError(f"context_tokens ({context_tokens!r}) must be a positive integer")
    attention_tp = engine.attention_group(gpus_per_node)
    if num_gpus % attention_tp:
        raise InputError(f"--attention-tp {attention_tp} must divide the {num_gpus} GPUs into data-parallel ranks; "
                         f"give a divisor of {num_gpus}")
    if engine.dense_tp > num_gpus:
        raise InputError(f"--dense-tp {engine.dense_tp} is more than the {num_gpus} GPUs; give at most {num_gpus}")
    base = model.num_layers * math.ceil(model.num_experts / num_gpus)
    if experts_per_gpu is None:
        if replicas_per_gpu < 0:
            raise InputError(f"replicas_per_gpu ({replicas_per_gpu}) must be >= 0")
        hosted = base + int(replicas_per_gpu)
    else:
        hosted = int(np.max(experts_per_gpu))
    expert_gib = model.expert_params() * engine.expert_bytes_per_weight / GIB
    fixed = non_expert_gib_per_gpu(model, engine, gpus_per_node)
    budget = engine.memory_fraction * gpu.memory_gib - engine.reserve_gib
    kv_without = budget - fixed - base * expert_gib
    if kv_without <= 0:
        raise InputError(f"{model.display_name} does not fit on {num_gpus} x {gpu.display_name}: its weights take "
                         f"{fixed + base * expert_gib:.1f} GiB per GPU of the {budget:.1f} GiB the engine gives "
                         "weights and KV cache; use more GPUs or a larger memory_fraction")
    replica_gib = max(0, hosted - base) * expert_gib
    kv = kv_without - replica_gib
    # each data-parallel rank (attention_tp GPUs) holds its own requests, each split over its GPUs' pools
    per_request = model.kv_bytes_per_request(context_tokens, engine.kv_bytes, attention_tp,
                                             engine.recurrent_state_bytes) / GIB
    per_rank = math.floor(max(0.0, kv) / per_request)
    ranks = num_gpus // attention_tp
    if engine.max_running_requests is not None:  # each rank runs its share of the cap (SGLang divides it)
        if engine.max_running_requests < ranks:
            raise InputError(f"--max-running-requests {engine.max_running_requests} leaves no request to each of the "
                             f"{ranks} data-parallel ranks (each runs the cap divided by {ranks}); give at least "
                             f"{ranks}")
        per_rank = min(per_rank, engine.max_running_requests // ranks)
    return MemoryReport(
        weights_gb_per_gpu=fixed + hosted * expert_gib,
        replica_gb_per_gpu=replica_gib,
        kv_cache_gb_per_gpu=max(0.0, kv),
        kv_cache_reduction=replica_gib / kv_without,
        max_concurrency=per_rank * ranks,
        context_tokens=context_tokens,
        experts_per_gpu=hosted,
        experts_per_gpu_no_replicas=base,
    )
