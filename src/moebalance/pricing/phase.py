"""Decode and prefill steps (``compare`` and ``online`` with ``--phase``): the load's batches re-drawn as the steps
a deployment runs in that phase, and a router's modelled MoE layer time on them.

Legend: ``B`` batches, ``L`` layers, ``E`` experts, ``G`` GPUs, ``K`` picks per token, ``N`` tokens per step.

**A step's tokens.** A decode step holds one token of every running request: ``N`` is the deployment's
concurrency, the requests of ``prompt + output`` tokens its KV cache holds (:func:`moebalance.cost.memory.
memory_per_gpu`, with the plan's experts per GPU). A prefill step holds every data-parallel rank's chunk of
prompt: ``N = prefill_chunk * ranks``. (The goodput model of :mod:`moebalance.pricing.goodput` uses the same two
steps.)

**Steps from a load** (:func:`phase_steps`): one step per batch, drawn from that batch, so batch numbers keep their
meaning (``online --warmup``):

- a token-level load: ``N`` of the batch's tokens drawn at random, each with its picks in every layer and its GPU
  (without replacement when the batch has ``N`` tokens, else with);
- counts: in every layer ``N * K`` picks drawn from the batch's shares of the experts (multinomial), an expert's
  picks capped at ``N`` (a token picks an expert once; the picks over it are drawn again among the loaded experts
  below it). Layers are drawn independently: counts carry no tokens.

**Modelled MoE layer time** (:func:`phase_time`): per ``(step, layer)`` with load, the layer's price
(:func:`moebalance.pricing.layer.price_layers`: the slowest GPU's grouped GEMM over the router's own picks, then the
all-to-all); the mean over them, and its two parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.limits import check_alloc
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.cost.deployment import PHASES, Deployment
from moebalance.cost.memory import memory_per_gpu
from moebalance.models import ModelSpec
from moebalance.pricing.layer import price_layers
from moebalance.routing import Router, get_router

__all__ = ["PHASES", "PhaseModel", "PhaseTime", "phase_steps", "phase_time"]


@dataclass(frozen=True, slots=True)
class PhaseTime:
    """A router's modelled MoE layer time on a phase's steps (module docstring), ms."""

    phase: str
    step_tokens: int
    steps: int
    #: Means over the ``(step, layer)`` with load: the slowest GPU's grouped GEMM, the all-to-all, the layer (their
    #: sum without overlap).
    expert_ms: float
    a2a_ms: float
    moe_layer_ms: float

    def as_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "step_tokens": self.step_tokens, "steps": self.steps,
                "moe_layer_ms": round(self.moe_layer_ms, 6), "expert_ms": round(self.expert_ms, 6),
                "a2a_ms": round(self.a2a_ms, 6)}


def phase_steps(load: LoadMatrix, tokens: int, top_k: int, seed: int, *, shared: int | None = None) -> LoadMatrix:
    """One step of ``tokens`` tokens drawn from each batch of ``load`` (module docstring); counts need ``top_k``.

    ``shared``: draw ``shared >= tokens`` tokens (a token-level load: a random order of the batch's tokens, then
    draws with replacement past its size; counts: that many tokens' picks in a random order) and keep the first
    ``tokens``, so that steps of different sizes from one load and seed share their draws (common random numbers:
    ``advise`` compares candidates whose KV cache allows different step sizes on the same tokens)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int | np.integer) or tokens < 1:
        raise InputError(f"a step's tokens ({tokens!r}) must be a positive number")
    if shared is not None and (isinstance(shared, bool) or not isinstance(shared, int | np.integer) or shared < tokens):
        raise InputError(f"shared draws of {shared!r} tokens must hold the step's {tokens}")
    rng = np.random.default_rng([seed, 1])
    B, L, E = load.counts.shape
    trace = load.trace
    if trace is None:
        check_alloc((B, L, E), 8, "the steps' counts [B, L, E]")
        counts = load.counts.astype(np.float64)
        total = counts.sum(axis=2, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(total > 0, counts / np.where(total > 0, total, 1.0), 1.0 / E)
        drawn = rng.multinomial(int(tokens) * top_k, share) if shared is None else \
            _first_picks(rng.multinomial(int(shared) * top_k, share), int(tokens) * top_k, rng)  # [B, L, E]
        for _ in range(E):  # picks over an expert's cap are drawn again among the experts below it
            over = np.maximum(drawn - int(tokens), 0)
            drawn -= over
            spare = over.sum(axis=2)
            room = share * (drawn < tokens)
            weight = room.sum(axis=2)
            redo = (spare > 0) & (weight > 0)  # where no loaded expert has room the surplus is dropped
            if not redo.any():
                break
            p = room[redo] / weight[redo][:, None]
            drawn[redo] += rng.multinomial(spare[redo], p)
        drawn = np.where(total > 0, drawn, 0)
        return LoadMatrix(drawn.astype(np.int64), None, load.preset, load.layer_ids)
    check_alloc((B * int(tokens), L, trace.top_k), trace.topk_ids.itemsize, "the steps' picks [B * N, L, K]",
                "give a smaller step (--prefill-chunk, --prompt-tokens, --output-tokens) or fewer batches")
    starts = np.searchsorted(trace.batch, np.arange(B + 1))
    chosen = []
    for b in range(B):
        size = int(starts[b + 1] - starts[b])
        if size == 0:
            continue
        if shared is None:
            pick = rng.choice(size, size=int(tokens), replace=size < tokens)
        else:  # the batch's tokens in a random order, then draws with replacement: the first `tokens` of them
            order = rng.permutation(size)
            extra = rng.choice(size, size=max(int(shared) - size, 0), replace=True)
            pick = np.concatenate([order, extra])[:int(tokens)]
        chosen.append(starts[b] + np.sort(pick))
    index = np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)
    steps = RoutingTrace(trace.topk_ids[index], trace.src_gpu[index], trace.batch[index], num_experts=E,
                         num_batches=B)
    return LoadMatrix(steps.counts(), steps, load.preset, load.layer_ids)


def _first_picks(drawn: np.ndarray, picks: int, rng: np.random.Generator) -> np.ndarray:
    """``int64 [B, L, E]``: the first ``picks`` of each ``(b, l)``'s picks ``drawn [B, L, E]`` laid out in one random
    order (a row with fewer keeps them all); the same draws give nested results for any ``picks``."""
    out = np.zeros_like(drawn)
    E = drawn.shape[2]
    for b, layer in np.ndindex(*drawn.shape[:2]):
        row = drawn[b, layer]
        ids = rng.permutation(np.repeat(np.arange(E), row))[:picks]
        out[b, layer] = np.bincount(ids, minlength=E)
    return out


def phase_time(plan: Placement, steps: LoadMatrix, router: str | Router, deployment: Deployment, *, phase: str,
               step_tokens: int, seed: int = 0) -> PhaseTime:
    """``router``'s modelled MoE layer time on ``steps`` (of ``step_tokens`` tokens each) through ``plan``."""
    priced = price_layers(plan, steps, get_router(router), deployment, np.random.default_rng(seed), phase)
    active = priced.active
    if not active.any():
        raise InputError("the steps carry no load in any layer; there is nothing to time")
    e_ms = float(priced.expert.max(axis=2)[active].mean() * 1e3)
    a_ms = float(priced.a2a[active].mean() * 1e3)
    return PhaseTime(phase=phase, step_tokens=int(step_tokens), steps=steps.num_batches, expert_ms=e_ms,
                     a2a_ms=a_ms, moe_layer_ms=float(priced.seconds[active].mean() * 1e3))


@dataclass(frozen=True, slots=True)
class PhaseModel:
    """What ``--phase`` scores with: the phase, the deployment, and the seed of the steps' draws."""

    phase: str
    deployment: Deployment
    seed: int = 0

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise InputError(f"phase {self.phase!r} is unknown; choose one of: {', '.join(PHASES)}")
        if not isinstance(self.deployment, Deployment):
            raise InputError(f"PhaseModel.deployment ({self.deployment!r}) must be a Deployment")

    @property
    def model(self) -> ModelSpec:
        return self.deployment.model

    def step_tokens(self, cluster: Cluster, experts_per_gpu: int | np.ndarray) -> int:
        """``N``: the concurrency (decode) or the prompt chunks of every rank (prefill) on ``cluster`` with GPUs
        hosting ``experts_per_gpu`` experts over the MoE layers (module docstring)."""
        d = self.deployment
        G, gpn = cluster.num_gpus, cluster.gpus_per_node
        memory = memory_per_gpu(d.model, d.gpu, num_gpus=G, gpus_per_node=gpn, experts_per_gpu=experts_per_gpu,
                                engine=d.engine, context_tokens=d.workload.context_tokens)
        if self.phase == "prefill":
            return d.workload.prefill_chunk * (G // d.engine.attention_group(gpn))
        if memory.max_concurrency < 1:
            raise InputError(f"{d.model.display_name} on {G} x {d.gpu.display_name} leaves no KV cache for one "
                             f"request of {d.workload.context_tokens} tokens, so there is no decode step; give fewer "
                             "replicas, more GPUs or shorter requests (--prompt-tokens, --output-tokens)")
        return memory.max_concurrency

    def plan_steps(self, plan: Placement, load: LoadMatrix) -> tuple[LoadMatrix, int]:
        """``(steps, N)``: ``load``'s batches as this phase's steps for ``plan``'s deployment."""
        zero = load.counts.sum(axis=(0, 2)) == 0
        moe = [li for li in range(plan.num_layers) if li not in plan.dense_layers and not zero[li]]
        tokens = self.step_tokens(plan.cluster, plan.slots()[moe].sum(axis=0))
        return phase_steps(load, tokens, self.model.top_k, self.seed), tokens

    def time(self, plan: Placement, steps: LoadMatrix, router: str | Router, tokens: int) -> PhaseTime:
        """:func:`phase_time` with this model."""
        return phase_time(plan, steps, router, self.deployment, phase=self.phase, step_tokens=tokens, seed=self.seed)
