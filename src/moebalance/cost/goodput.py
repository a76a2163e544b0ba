"""A plan's modelled layer time and goodput on a held-out load, with the memory its replicas leave.

Legend: ``B`` batches, ``L`` MoE layers, ``E`` experts, ``G`` GPUs, ``K`` top-k, ``N`` tokens in a step.

**Layer time on the load.** The load is replayed through the plan with the router
(:func:`moebalance.routing.simulate.replay_picks`): per ``(b, l)`` each GPU's picks ``n_g``, the experts they
touch ``u_g`` (:mod:`moebalance.routing.touched`: exact from a token-level load's picks or a router that says
its split; else the hosted experts with load in that batch, every copy of a replicated one), and the all-to-all
time (from the token-level trace's
copies, or, for counts, every pick sent from a GPU drawn uniformly and not deduplicated per token: more copies
than a token-level trace of the same load would show). The
modelled layer time is the mean over ``(b, l)`` with load of ``max_g t_g + a2a`` (:mod:`moebalance.cost.time`).

**A step of N tokens.** The held-out batches give, per ``(b, l)``, each expert's share ``p_e`` of the picks and
each GPU's share ``f_g`` under the router. With ``N`` tokens, GPU ``g`` serves ``N K f_g`` picks and touches
``sum_{e on g} 1 - exp(-N K p_e / r_e)`` experts (a copy is touched when at least one of its Poisson-many picks
arrives); the all-to-all scales with the picks. A step is the sum over layers of the mean over batches of the
layer time, plus the rest of the model on each data-parallel rank's ``N / ranks`` tokens.

**Goodput** (output tokens per second at saturation): the KV cache holds ``C`` requests of
``prompt + output`` tokens (:mod:`moebalance.cost.memory`); a round serves ``C`` requests: their prompts in
prefill chunks of ``chunk`` tokens per rank and ``output`` decode steps of ``C`` tokens, each reading on average
``prompt + output / 2`` tokens of KV cache per request::

    goodput = C * output / (output * t_decode(C) + C * prompt / (chunk * ranks) * t_prefill(chunk * ranks))

CRAFT's goodput (Section 5.1) is measured, not modelled: the request rate at which time to first token turns up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.cost.hardware import GpuSpec
from moebalance.cost.memory import EngineMemory, MemoryReport, memory_per_gpu
from moebalance.cost.time import Calibration, expert_seconds, rest_seconds
from moebalance.models import ModelSpec
from moebalance.models.fields import check_fields
from moebalance.routing import Router, get_router
from moebalance.routing.simulate import check_compatible, replay_picks

__all__ = ["PlanCost", "Workload", "a2a_estimate", "plan_cost"]

#: At most this many held-out batches feed the step model (evenly spaced): it holds [B, L, E, G]-sized terms.
_STEP_BATCHES = 16


@dataclass(kw_only=True, frozen=True, slots=True)
class Workload:
    """Requests served at saturation: prompt and output tokens each, prefill chunk per data-parallel rank."""

    prompt_tokens: int = 1000
    output_tokens: int = 1000
    #: Prompt tokens a data-parallel rank prefills in one step (CRAFT Section 5.1: chunks of 4096).
    prefill_chunk: int = 4096

    def __post_init__(self) -> None:
        check_fields(self, positive=("prompt_tokens", "output_tokens", "prefill_chunk"), label="")

    @property
    def context_tokens(self) -> int:
        """KV-cache tokens a request holds at its end."""
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class PlanCost:
    """What a plan costs (the ``moebalance cost`` keys with ``--plan``)."""

    memory: MemoryReport
    #: Mean over held-out (batch, layer) with load of the straggler's expert time plus the all-to-all, ms.
    modelled_layer_ms: float
    #: Of which the all-to-all, ms.
    modelled_a2a_ms: float
    #: Output tokens per second of the whole deployment at saturation.
    modelled_goodput: float
    #: A decode step of ``max_concurrency`` tokens and a prefill step of ``chunk * ranks`` tokens, ms.
    decode_step_ms: float
    prefill_step_ms: float

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = dict(self.memory.as_dict())
        out.update({"modelled_layer_ms": round(self.modelled_layer_ms, 6),
                    "modelled_a2a_ms": round(self.modelled_a2a_ms, 6),
                    "modelled_goodput": round(self.modelled_goodput, 3),
                    "decode_step_ms": round(self.decode_step_ms, 6),
                    "prefill_step_ms": round(self.prefill_step_ms, 6)})
        return out


def a2a_estimate(gpu_load: np.ndarray, cluster: Cluster, bytes_per_copy: int) -> np.ndarray:
    """``float64 [...]``: all-to-all seconds for per-GPU picks ``[..., G]`` when every pick's token lives on a GPU
    drawn uniformly and is sent once per pick (counts carry no sources; a token's picks on one GPU are not merged,
    so it counts more copies than the trace behind the counts would)."""
    G, gpn = cluster.num_gpus, cluster.gpus_per_node
    load = np.asarray(gpu_load, dtype=np.float64)
    total = load.sum(axis=-1, keepdims=True)
    node = load.reshape(*load.shape[:-1], cluster.num_nodes, gpn).sum(axis=-1)  # [..., N]
    node_of = np.repeat(node, gpn, axis=-1)  # [..., G]: the load of each GPU's node
    recv_intra, recv_inter = load * (gpn - 1) / G, load * (G - gpn) / G
    send_intra, send_inter = (node_of - load) / G, (total - node_of) / G
    t_intra = np.maximum(recv_intra, send_intra) / cluster.intra_node_bandwidth
    t_inter = np.maximum(recv_inter, send_inter) / cluster.inter_node_bandwidth
    return 2.0 * bytes_per_copy * np.maximum(t_intra, t_inter).max(axis=-1) / 1e9


def plan_cost(plan: Placement, load: LoadMatrix, model: ModelSpec, gpu: GpuSpec, *, router: str | Router = "uniform",
              engine: EngineMemory | None = None, calibration: Calibration | None = None,
              workload: Workload | None = None, seed: int = 0, node_forwarding: bool = False) -> PlanCost:
    """Model ``plan`` on ``load`` (held-out batches) for ``model`` on GPUs ``gpu`` (module docstring).

    ``node_forwarding`` times a token-level load's all-to-all with one network copy per destination node, forwarded
    inside it (DeepEP's normal kernels, GRACE's dispatch; :func:`moebalance.routing.simulate.traffic`).
    """
    check_compatible(plan, load)
    dense = plan.dense_layers | set(np.flatnonzero(load.counts.sum(axis=(0, 2)) == 0).tolist())
    moe = [layer for layer in range(plan.num_layers) if layer not in dense]  # dense rows hold no experts
    if plan.num_experts != model.num_experts or len(moe) > model.num_layers or \
            plan.num_layers not in (model.num_layers, model.num_layers + model.num_dense_layers):
        raise InputError(f"the plan has {plan.num_layers} layers x {plan.num_experts} experts but {model.display_name} "
                         f"has {model.num_layers} MoE layers ({model.num_layers + model.num_dense_layers} with its dense "
                         f"ones) x {model.num_experts} experts; give the model the plan was made for")
    if node_forwarding and load.trace is None:
        raise InputError("--dispatch node needs a token-level load (which GPUs each token goes to); this load has "
                         "counts only: use --dispatch gpu")
    engine = EngineMemory() if engine is None else engine
    cal = Calibration() if calibration is None else calibration
    work = Workload() if workload is None else workload
    cluster = plan.cluster
    G, gpn = cluster.num_gpus, cluster.gpus_per_node
    memory = memory_per_gpu(model, gpu, num_gpus=G, gpus_per_node=gpn, experts_per_gpu=plan.slots()[moe].sum(axis=0),
                            engine=engine, context_tokens=work.context_tokens)
    bytes_per_copy = model.hidden_size * engine.weight_bytes
    r = get_router(router)
    replayed = replay_picks(plan, load, r, np.random.default_rng(seed), with_touched=True, with_traffic=True,
                            bytes_per_copy=bytes_per_copy, node_forwarding=node_forwarding)
    loads, moved = replayed.loads, replayed.traffic
    counts = load.counts.astype(np.float64)
    has = (plan.copies > 0).astype(np.float64)  # [L, E, G]
    touched = replayed.touched  # the experts each GPU's picks read (exact from picks, or the router's own split)
    if touched is None:  # replay_picks gives them when asked
        raise RuntimeError("the replay gave no experts touched")
    a2a = moved.a2a_seconds if moved is not None and moved.a2a_seconds is not None else \
        a2a_estimate(loads, cluster, bytes_per_copy)
    picks = loads.sum(axis=2)  # [B, L]
    active = picks > 0
    if not active.any():
        raise InputError("the load is zero in every batch and layer; there is nothing to model")
    layer = expert_seconds(loads, touched, model, gpu, cal, weight_bytes=engine.weight_bytes).max(axis=2) + a2a
    # the step model, from the shares of (up to _STEP_BATCHES) held-out batches
    busy = np.flatnonzero(active.any(axis=1))  # batches with load: idle ones would make the MoE part look free
    pick = busy[np.unique(np.linspace(0, busy.size - 1, min(busy.size, _STEP_BATCHES)).round().astype(int))]
    with np.errstate(invalid="ignore", divide="ignore"):
        share = counts[pick] / picks[pick][:, :, None]  # [b, L, E]
        gpu_share = loads[pick] / picks[pick][:, :, None]  # [b, L, G]
        a2a_per_pick = a2a[pick] / picks[pick]  # [b, L]
    ok = active[pick]
    reps = plan.replica_counts().astype(np.float64)  # [L, E]
    ranks = G // engine.attention_group(gpn)  # memory_per_gpu checked that the groups divide the GPUs
    K = model.top_k

    def moe_seconds(tokens: float) -> float:
        lam = tokens * K * np.where(ok[:, :, None], share, 0.0) / reps[None]
        used = np.einsum("ble,leg->blg", -np.expm1(-lam), has)
        n = tokens * K * np.where(ok[:, :, None], gpu_share, 0.0)
        t = expert_seconds(n, used, model, gpu, cal, weight_bytes=engine.weight_bytes).max(axis=2)
        t = t + np.where(ok, a2a_per_pick, 0.0) * tokens * K
        per_layer = np.where(ok, t, np.nan)
        means = np.nanmean(np.where(ok.any(axis=0)[None], per_layer, 0.0), axis=0)  # [L]; idle layers cost 0
        return float(np.nansum(means))

    def step(tokens: float, kv_per_rank: float, logits_per_rank: float) -> float:
        return moe_seconds(tokens) + rest_seconds(tokens / ranks, model, gpu, engine, gpn,
                                                  kv_tokens_per_rank=kv_per_rank, logits_per_rank=logits_per_rank,
                                                  calibration=cal)

    C = memory.max_concurrency
    chunk = work.prefill_chunk * ranks
    prefill = step(chunk, 0.0, work.prefill_chunk / work.prompt_tokens)  # one next-token logit per prompt
    # with no room for a whole request the deployment serves nothing; its decode step is still shown for one
    decode_tokens = max(C, 1)
    decode = step(decode_tokens, decode_tokens / ranks * (work.prompt_tokens + work.output_tokens / 2),
                  decode_tokens / ranks)
    round_seconds = work.output_tokens * decode + C * work.prompt_tokens / chunk * prefill
    goodput = C * work.output_tokens / round_seconds
    return PlanCost(memory=memory, modelled_layer_ms=float(layer[active].mean() * 1e3),
                    modelled_a2a_ms=float(a2a[active].mean() * 1e3), modelled_goodput=goodput,
                    decode_step_ms=decode * 1e3, prefill_step_ms=prefill * 1e3)
