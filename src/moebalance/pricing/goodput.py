"""A plan's modelled layer time and goodput on a held-out load, with the memory its replicas leave.

Legend: ``B`` batches, ``L`` MoE layers, ``E`` experts, ``G`` GPUs, ``K`` top-k, ``N`` tokens in a step.

**Layer time on the load.** Every held-out ``(b, l)`` priced through the plan and the router
(:func:`moebalance.pricing.layer.price_layers`: each GPU's grouped GEMM, then the all-to-all; for counts each token's
picks taken as independent, :func:`moebalance.cost.a2a.a2a_estimate`); the modelled layer time is their mean over
the ``(b, l)`` with load.

**A step of N tokens.** The held-out batches give, per ``(b, l)``, each expert's share ``p_e`` of the picks and
each GPU's share ``f_g`` under the router. With ``N`` tokens, GPU ``g`` serves ``N K f_g`` picks and touches
``sum_{e on g} 1 - exp(-N K p_e / r_e)`` experts (a copy is touched when at least one of its Poisson-many picks
arrives); the all-to-all's bytes scale with the picks, beside the kernel's fixed cost. A step is the sum over layers of the mean over batches of the
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

from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.cost.deployment import Deployment
from moebalance.cost.memory import MemoryReport, memory_per_gpu
from moebalance.pricing.layer import price_layers
from moebalance.routing import Router, get_router
from moebalance.routing.simulate import check_compatible

__all__ = ["PlanPrice", "price_plan"]

#: At most this many held-out batches feed the step model (evenly spaced): it holds [B, L, E, G]-sized terms.
_STEP_BATCHES = 16


@dataclass(frozen=True, slots=True)
class PlanPrice:
    """What a plan costs (the ``moebalance cost`` keys with ``--plan``)."""

    memory: MemoryReport
    #: Mean over held-out (batch, layer) with load of the straggler's expert time plus the all-to-all, ms.
    modelled_layer_ms: float
    #: The all-to-all of those (batch, layer), ms (with overlap, part of it hides under the experts).
    modelled_a2a_ms: float
    #: Output tokens per second of the whole deployment at saturation.
    modelled_goodput: float
    #: A decode step of ``max_concurrency`` tokens and a prefill step of ``chunk * ranks`` tokens, ms.
    decode_step_ms: float
    prefill_step_ms: float
    #: The slowest GPU's grouped GEMM of those (batch, layer), ms.
    modelled_expert_ms: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = dict(self.memory.as_dict())
        out.update({"modelled_layer_ms": round(self.modelled_layer_ms, 6),
                    "modelled_a2a_ms": round(self.modelled_a2a_ms, 6),
                    "modelled_expert_ms": round(self.modelled_expert_ms, 6),
                    "modelled_goodput": round(self.modelled_goodput, 3),
                    "decode_step_ms": round(self.decode_step_ms, 6),
                    "prefill_step_ms": round(self.prefill_step_ms, 6)})
        return out


def price_plan(plan: Placement, load: LoadMatrix, deployment: Deployment, *, router: str | Router = "uniform",
              seed: int = 0) -> PlanPrice:
    """Model ``plan`` on ``load`` (held-out batches) for ``deployment`` (module docstring).

    The load's own batches are priced with the kernel of a decode step where the deployment's ``a2a`` is ``auto``
    (:meth:`~moebalance.cost.Deployment.a2a_kernel`); each step with its phase's.
    """
    check_compatible(plan, load)
    model, engine, work = deployment.model, deployment.engine, deployment.workload
    dense = plan.dense_layers | set(np.flatnonzero(load.counts.sum(axis=(0, 2)) == 0).tolist())
    moe = [layer for layer in range(plan.num_layers) if layer not in dense]  # dense rows hold no experts
    deployment.check_load(load, what="the plan's load", fix="give the model the plan was made for")
    cluster = plan.cluster
    G, gpn = cluster.num_gpus, cluster.gpus_per_node
    memory = memory_per_gpu(model, deployment.gpu, num_gpus=G, gpus_per_node=gpn,
                            experts_per_gpu=plan.slots()[moe].sum(axis=0), engine=engine,
                            context_tokens=work.context_tokens)
    priced = price_layers(plan, load, get_router(router), deployment, np.random.default_rng(seed))
    loads, active = priced.loads, priced.active
    if not active.any():
        raise InputError("the load is zero in every batch and layer; there is nothing to model")
    counts = load.counts.astype(np.float64)
    has = (plan.copies > 0).astype(np.float64)  # [L, E, G]
    picks = loads.sum(axis=2)  # [B, L]
    # the step model, from the shares of (up to _STEP_BATCHES) held-out batches
    busy = np.flatnonzero(active.any(axis=1))  # batches with load: idle ones would make the MoE part look free
    pick = busy[np.unique(np.linspace(0, busy.size - 1, min(busy.size, _STEP_BATCHES)).round().astype(int))]
    ok = active[pick]

    def moved_per_pick(phase: str) -> np.ndarray:
        """``[b, L]``: all-to-all seconds per pick besides the fixed cost, as the phase's kernel moves tokens (a
        second replay where ``auto`` gives the two phases different kernels)."""
        same = deployment.a2a_kernel(phase) == deployment.a2a_kernel()
        a2a = priced.a2a if same else price_layers(plan, load, get_router(router), deployment,
                                                    np.random.default_rng(seed), phase).a2a
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(ok, (a2a[pick] - deployment.a2a_fixed_seconds(phase)) / picks[pick], 0.0)

    per_pick = {phase: moved_per_pick(phase) for phase in ("prefill", "decode")}
    with np.errstate(invalid="ignore", divide="ignore"):
        share = counts[pick] / picks[pick][:, :, None]  # [b, L, E]
        gpu_share = loads[pick] / picks[pick][:, :, None]  # [b, L, G]
    reps = plan.replica_counts().astype(np.float64)  # [L, E]
    ranks = deployment.ranks(cluster)  # memory_per_gpu checked that the groups divide the GPUs
    K = model.top_k

    def moe_layers(tokens: float, phase: str) -> np.ndarray:
        lam = tokens * K * np.where(ok[:, :, None], share, 0.0) / reps[None]
        used = np.einsum("ble,leg->blg", -np.expm1(-lam), has)
        n = tokens * K * np.where(ok[:, :, None], gpu_share, 0.0)
        a2a = np.where(ok, per_pick[phase] * tokens * K + deployment.a2a_fixed_seconds(phase), 0.0)
        t = deployment.layer_seconds(deployment.gemm_seconds(n, used), a2a)
        per_layer = np.where(ok, t, np.nan)
        means = np.nanmean(np.where(ok.any(axis=0)[None], per_layer, 0.0), axis=0)  # [L]
        return np.nan_to_num(means)  # idle layers cost 0

    def step(tokens: float, phase: str) -> float:
        return deployment.step_seconds(moe_layers(tokens, phase), tokens / ranks, gpn, phase)

    C = memory.max_concurrency
    chunk = work.prefill_chunk * ranks
    prefill = step(chunk, "prefill")  # one next-token logit per prompt
    # with no room for a whole request the deployment serves nothing; its decode step is still shown for one
    decode = step(max(C, 1), "decode")
    round_seconds = work.output_tokens * decode + C * work.prompt_tokens / chunk * prefill
    goodput = C * work.output_tokens / round_seconds
    return PlanPrice(memory=memory, modelled_layer_ms=float(priced.seconds[active].mean() * 1e3),
                    modelled_a2a_ms=float(priced.a2a[active].mean() * 1e3), modelled_goodput=goodput,
                    modelled_expert_ms=float(priced.expert.max(axis=2)[active].mean() * 1e3),
                    decode_step_ms=decode * 1e3, prefill_step_ms=prefill * 1e3)
