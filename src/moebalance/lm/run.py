"""Run the MoE LM with every MoE layer executed by the expert-parallel runtime under a plan (``moebalance run``).

Legend: ``W`` ranks = the plan's GPUs (rank ``g`` is GPU ``g`` of ``plan.cluster``), ``B`` batches (forward
steps), ``L`` MoE layers, ``K`` picks per token, ``S`` tokens per sequence, ``V`` vocabulary.

What happens:

1. The tokens are laid out as a capture lays them out (:func:`moebalance.lm.capture.make_layout`):
   batches of sequences, sequence ``j`` of a batch on rank ``j % W``.
2. ``W`` gloo processes start (:func:`moebalance.runtime.launch`), or, under torchrun (:func:`run_torchrun`),
   each of torchrun's ``W`` processes runs its own rank. Each loads the checkpoint, keeps the
   non-MoE parts whole (replicated: data parallel) and, for every MoE layer, only its plan's experts in an
   :class:`~moebalance.runtime.ExpertParallelMoE`. Batch ``b`` is forward step ``b`` on every rank: each rank
   runs its own sequences, and the MoE layers exchange tokens over all-to-all (a rank with no sequence in a
   batch still takes part with zero tokens).
3. This process (rank 0 under torchrun, once every rank's results are gathered there) runs the **dense
   reference**: the same model in one process, every MoE layer by
   :func:`moebalance.runtime.dense_moe` (every expert on every token), on the same batches.
4. The report compares the final logits (max abs difference), the routing (picks where the runtime's gate
   chose differently from the reference's), and each rank's picks computed per ``(batch, layer)`` against the
   **simulator's prediction**: the token-level trace the run saw (its gate's ``topk_ids``, ``src_gpu`` = rank,
   ``batch`` = step, tokens rank-major as in a capture) routed by the router's own ``assign_tokens`` on the
   layer's plan with the runtime's seeding, ``numpy.random.default_rng((router_seed, layer, step))``
   (:mod:`moebalance.runtime.ep`). They must be equal, integer for integer.
5. With ``exact`` (libra's exact mode, :mod:`moebalance.runtime.exact`) every MoE layer plans its extras and
   routing after its gate and copies the extras into a prefetch buffer of ``n`` slots; the simulator's
   prediction is then libra with the batch's true routing (:func:`moebalance.policies.libra.batch_plan` on the
   batch's per-source demand, routed by the router on that per-batch plan), and the report gives per layer the
   time from the gate to the start of expert compute, split into planning, copying and routing.

Bytes are the runtime's: float32 hidden states (``D * 4`` bytes a row), dispatch and combine, split by link as
the plan's cluster maps ranks to nodes.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moebalance.core.errors import InputError, PlanError
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.lm.capture import Layout, make_layout
from moebalance.lm.moe_lm import MoELM, load_checkpoint, save_checkpoint
from moebalance.policies.libra import LibraConfig, batch_plan
from moebalance.prediction.predictors import demand_of
from moebalance.routing import Router, get_router
from moebalance.runtime import (
    EPConfig,
    ExactConfig,
    ExpertParallelMoE,
    ExpertPrefetcher,
    agreed_inputs,
    check_exact,
    dense_moe,
    guarded,
    init_from_env,
    launch,
    layer_placement,
)
from moebalance.runtime.launch import membership, torchrun_world

__all__ = ["RankReport", "RunReport", "check_plan", "dense_reference", "predicted_loads", "rank_body", "run_model",
           "run_torchrun"]

#: Largest max abs logit difference the report calls agreement (float32 sums in a different order).
LOGIT_TOLERANCE = 1e-3


@dataclass(frozen=True, slots=True)
class RankReport:
    """One rank's account over the whole run.

    Example: rank 1 of 2 on one node that computed 3,900 picks, as predicted, and sent 1 MiB to rank 0:
    ``RankReport(rank=1, tokens=2048, picks_computed=3900, picks_predicted=3900, ..., intra_node_bytes=...)``.
    """

    rank: int
    #: Tokens of this rank's own sequences (data parallel).
    tokens: int
    #: Picks its expert slots computed, summed over batches and layers (the simulator's "load").
    picks_computed: int
    picks_predicted: int
    #: Seconds of expert FFN compute (the runtime's clock) and of gathering + routing on the host.
    expert_seconds: float
    routing_seconds: float
    #: Bytes this rank sent over all-to-all (dispatch + combine), to GPUs of its node / of other nodes.
    intra_node_bytes: int
    inter_node_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "tokens": self.tokens, "picks_computed": self.picks_computed,
                "picks_predicted": self.picks_predicted, "expert_seconds": round(self.expert_seconds, 4),
                "routing_seconds": round(self.routing_seconds, 4), "intra_node_bytes": self.intra_node_bytes,
                "inter_node_bytes": self.inter_node_bytes}


@dataclass(frozen=True, slots=True)
class RunReport:
    """What a run did and how it compares with the dense reference and the simulator."""

    world_size: int
    policy: str
    router: str
    router_seed: int
    num_tokens: int
    num_batches: int
    ranks: tuple[RankReport, ...]
    #: ``int64 [B, L, W]``: picks each rank computed in each batch and layer, and the simulator's prediction.
    computed: np.ndarray
    predicted: np.ndarray
    #: Max abs difference of the final logits, runtime against dense reference.
    max_abs_logit_diff: float
    #: (token, layer, pick) entries where the runtime's gate picked another expert than the reference's.
    routing_mismatches: int
    #: Mean over ``(batch, layer)`` of ``mean_g / max_g`` of the picks computed (docs/design.md, "Metrics" balancedness).
    balancedness: float
    seconds: float
    #: The trace the run saw (token-level, rank-major within a batch).
    trace: RoutingTrace = field(repr=False)
    #: ``int8 [B, L, W]`` with two-stage execution: 1 where the rebalancer finished inside the local phase, 0
    #: where the local phase finished first; ``None`` without it.
    rebalancer_hidden: np.ndarray | None = field(default=None, repr=False)
    #: Libra's exact mode, or ``None``.
    exact: ExactConfig | None = None
    #: Exact mode: ``float64 [B, L, W, 3]`` each rank's seconds from the gate to the start of expert compute,
    #: as (planning, copying, routing) (:class:`~moebalance.runtime.ExactTiming`), and ``int64 [B, L, W]`` the
    #: extra experts each rank received; ``None`` without exact mode.
    exact_seconds: np.ndarray | None = field(default=None, repr=False)
    extras_received: np.ndarray | None = field(default=None, repr=False)

    def exact_per_layer(self) -> list[dict[str, Any]] | None:
        """Exact mode: per layer, the mean over batches and ranks of the time from the gate to the start of expert
        compute and of its parts, in milliseconds."""
        s = self.exact_seconds
        if s is None:
            return None
        mean = s.mean(axis=(0, 2)) * 1e3 if s.shape[0] and s.shape[2] else np.zeros((s.shape[1], 3))
        return [{"layer": layer, "gate_to_expert_ms": round(float(m.sum()), 4), "plan_ms": round(float(m[0]), 4),
                 "copy_ms": round(float(m[1]), 4), "route_ms": round(float(m[2]), 4)} for layer, m in enumerate(mean)]

    def hidden_per_batch(self) -> list[float] | None:
        """Per batch, the fraction of (layer, rank) forwards whose rebalancer finished inside the local phase."""
        h = self.rebalancer_hidden
        if h is None:
            return None
        return [float(np.mean(h[b][h[b] >= 0])) if (h[b] >= 0).any() else 0.0 for b in range(h.shape[0])]

    @property
    def counts_match(self) -> bool:
        return bool(np.array_equal(self.computed, self.predicted))

    @property
    def logits_agree(self) -> bool:
        return self.max_abs_logit_diff <= LOGIT_TOLERANCE

    def as_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "policy": self.policy, "router": self.router,
                "router_seed": self.router_seed, "num_tokens": self.num_tokens, "num_batches": self.num_batches,
                "max_abs_logit_diff": float(f"{self.max_abs_logit_diff:.3g}"), "logit_tolerance": LOGIT_TOLERANCE,
                "logits_agree": self.logits_agree, "routing_mismatches": self.routing_mismatches,
                "counts_match_simulator": self.counts_match, "balancedness": round(self.balancedness, 6),
                "seconds": round(self.seconds, 2), "ranks": [r.as_dict() for r in self.ranks],
                **({} if self.rebalancer_hidden is None else
                   {"two_stage": True,
                    # forwards that ran the router in the thread (every (batch, layer, rank) when it qualifies)
                    "two_stage_forwards": int((self.rebalancer_hidden >= 0).sum()),
                    "rebalancer_hidden_forwards": int((self.rebalancer_hidden == 1).sum()),
                    "rebalancer_hidden_per_batch": [round(v, 4) for v in self.hidden_per_batch() or []]}),
                **({} if self.exact is None or self.extras_received is None else
                   {"exact": {"n": self.exact.n, "alpha": self.exact.alpha,
                              "extras_received": int(self.extras_received.sum()),
                              "per_layer": self.exact_per_layer()}})}


def check_plan(plan: Placement, model: MoELM, world_size: int) -> None:
    """Raise a one-line error if ``plan`` is not for this model or this number of ranks."""
    c = model.config
    if (plan.num_layers, plan.num_experts) != (c.num_layers, c.num_experts):
        raise PlanError(f"the plan has {plan.num_layers} layers x {plan.num_experts} experts but the model has "
                        f"{c.num_layers} x {c.num_experts}; make the plan from a capture of this model "
                        "(moebalance capture, then moebalance plan)")
    if world_size != plan.num_gpus:
        raise InputError(f"--world-size {world_size} does not match the plan's {plan.num_gpus} GPUs "
                         f"({plan.cluster.num_nodes} nodes x {plan.cluster.gpus_per_node}); run one rank per GPU")


def _batch_inputs(tokens: np.ndarray, layout: Layout) -> list[list[np.ndarray]]:
    """``[B][W]`` int64 arrays ``[n_r, S]``: each rank's sequences of each batch."""
    S = layout.seq_len
    toks = np.asarray(tokens, dtype=np.int64)
    return [[np.stack([toks[s * S:(s + 1) * S] for s in seqs]) if seqs else np.zeros((0, S), dtype=np.int64)
             for seqs in per_rank] for per_rank in layout.ranks]


@torch.no_grad()
def dense_reference(model: MoELM, inputs: Sequence[Sequence[np.ndarray]],
                    progress: Callable[[int], None] | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per batch: ``(logits [n, S, V], topk_ids [n * S, L, K])`` of all ranks' sequences, rank-major, with
    every MoE layer computed by :func:`~moebalance.runtime.dense_moe`."""
    logits, ids = [], []
    for per_rank in inputs:
        idx = torch.as_tensor(np.concatenate(per_rank))
        picks: list[torch.Tensor] = []

        def dense(layer: int, h: torch.Tensor, picks: list[torch.Tensor] = picks) -> torch.Tensor:
            gate, experts, config, bias = model.moe_parts(layer)
            out, g = dense_moe(h, gate, experts, config, selection_bias_E=bias)
            picks.append(g.topk_ids)
            return out

        logits.append(model(idx, moe=dense).logits.numpy())
        ids.append(torch.stack(picks, dim=1).numpy())
        if progress is not None:
            progress(1)
    return logits, ids


def _rank_main(rank: int, world_size: int, checkpoint: str, plan_doc: dict[str, Any], router: str | Router, seed: int,
               inputs: list[list[np.ndarray]], two_stage: bool = False,
               exact: ExactConfig | None = None) -> dict[str, Any]:
    """One rank of a local launch (a module-level function, so that it can be launched): :func:`rank_body`."""
    return rank_body(rank, load_checkpoint(checkpoint), Placement.from_json_dict(plan_doc), router, seed, inputs,
                     two_stage=two_stage, exact=exact)


def rank_body(rank: int, model: MoELM, plan: Placement, router: str | Router, seed: int,
              inputs: Sequence[Sequence[np.ndarray]], device: torch.device | str = "cpu", *,
              two_stage: bool = False, exact: ExactConfig | None = None) -> dict[str, Any]:
    """One rank's run, the same under the local launcher and torchrun: the model with expert-parallel MoE layers
    over every batch, on ``device``, in the default process group. Returns its logits, picks and counts.

    ``two_stage``: Libra's two-stage execution (:class:`~moebalance.runtime.EPConfig` ``router_thread``), and
    per ``(batch, layer)`` whether the router finished inside the local phase (``hidden``: 1, 0, or -1 where the
    router ran first). ``exact``: libra's exact mode, with one prefetch buffer of ``exact.n`` slots shared by
    the layers, and per ``(batch, layer)`` its timing (``exact_seconds [B, L, 3]``) and extras received."""
    model = model.to(device)
    config = EPConfig(router=router, router_seed=seed, router_thread=two_stage, exact=exact)
    prefetcher = None if exact is None else ExpertPrefetcher(exact.n)
    layers = []
    for layer in range(model.config.num_layers):
        gate, experts, gate_config, bias = model.moe_parts(layer)
        layers.append(ExpertParallelMoE.from_full(plan, layer, gate, experts, gate_config, config,
                                                  selection_bias_E=bias, prefetcher=prefetcher))
    B, L = len(inputs), model.config.num_layers
    computed = np.zeros((B, L), dtype=np.int64)
    hidden = np.full((B, L), -1, dtype=np.int8)
    exact_s = np.zeros((B, L, 3))
    extras = np.zeros((B, L), dtype=np.int64)
    sent = {"intra_node": 0, "inter_node": 0}
    expert_s = routing_s = 0.0
    logits, ids = [], []
    with torch.no_grad():
        for step, per_rank in enumerate(inputs):
            picks: list[np.ndarray] = []

            def ep(layer: int, h: torch.Tensor, step: int = step, picks: list[np.ndarray] = picks) -> torch.Tensor:
                nonlocal expert_s, routing_s
                out = layers[layer](h, step=step)
                st = out.stats
                computed[step, layer] = st.tokens_computed
                if st.rebalancer_hidden is not None:
                    hidden[step, layer] = int(st.rebalancer_hidden)
                if st.exact is not None:
                    exact_s[step, layer] = (st.exact.plan_seconds, st.exact.copy_seconds, st.exact.route_seconds)
                    extras[step, layer] = st.prefetch_received
                by = st.bytes()
                for kind in sent:
                    sent[kind] += by[f"dispatch_sent_{kind}"] + by[f"combine_sent_{kind}"]
                expert_s += st.expert_seconds
                routing_s += st.routing_seconds
                picks.append(out.gate.topk_ids.cpu().numpy())
                return out.out

            idx = torch.as_tensor(per_rank[rank], device=device)
            logits.append(model(idx, moe=ep).logits.cpu().numpy())
            ids.append(np.stack(picks, axis=1))
    if prefetcher is not None:
        prefetcher.drain()
    return {"logits": logits, "ids": ids, "computed": computed, "hidden": hidden, "sent": sent,
            "exact_seconds": exact_s if exact is not None else None, "extras": extras, "expert_seconds": expert_s,
            "routing_seconds": routing_s, "tokens": int(sum(p[rank].size for p in inputs))}


def predicted_loads(plan: Placement, trace: RoutingTrace, router: str | Router, seed: int,
                    exact: ExactConfig | None = None) -> np.ndarray:
    """``int64 [B, L, W]``: picks per GPU that the router's ``assign_tokens`` gives each batch and layer of
    ``trace``, with the runtime's seeding (``default_rng((seed, layer, batch))``) on the layer's plan; with
    ``exact``, on libra's per-batch plan made from the batch's true routing (``predictor=oracle``)."""
    B, L, W = trace.num_batches, trace.num_layers, plan.num_gpus
    r = get_router(router)
    out = np.zeros((B, L, W), dtype=np.int64)
    libra = None if exact is None else LibraConfig(predictor="oracle", n=exact.n, alpha=exact.alpha)
    for b in range(B):
        sel = np.flatnonzero(trace.batch == b)
        served = plan
        if libra is not None:
            demand = demand_of(trace.topk_ids[sel], trace.src_gpu[sel], W, trace.num_experts)
            served = batch_plan(plan, demand, libra)[0]
        for layer in range(L):
            sub = RoutingTrace(trace.topk_ids[sel, layer:layer + 1], trace.src_gpu[sel], np.zeros(sel.size, np.int64),
                               num_experts=trace.num_experts)
            dest = r.assign_tokens(layer_placement(served, layer), sub, np.random.default_rng((seed, layer, b)))
            out[b, layer] = np.bincount(dest.ravel(), minlength=W)
    return out


def _prepare(model: MoELM | str | os.PathLike[str] | None, plan: Placement, tokens: np.ndarray, world_size: int,
             router: str | Router, batch_tokens: int, seq_len: int | None, two_stage: bool = False,
             exact: ExactConfig | None = None) -> tuple[MoELM, Layout, list[list[np.ndarray]]]:
    """The model, the batch layout and every rank's inputs, checked: the same in every process."""
    get_router(router)  # an unknown name fails here, in one line, before any process starts
    EPConfig(router=router, router_thread=two_stage, exact=exact)  # so do the options the layers will take
    lm = model if isinstance(model, MoELM) else load_checkpoint(model)
    check_plan(plan, lm, world_size)
    check_exact(exact, plan.num_experts, buffer=False)
    S = lm.config.max_seq_len if seq_len is None else seq_len
    if S > lm.config.max_seq_len:
        raise InputError(f"seq_len ({S}) exceeds the model's max_seq_len ({lm.config.max_seq_len})")
    layout = make_layout(int(np.asarray(tokens).size), seq_len=S, batch_tokens=batch_tokens, num_gpus=world_size)
    return lm, layout, _batch_inputs(tokens, layout)


def run_model(model: MoELM | str | os.PathLike[str] | None, plan: Placement, tokens: np.ndarray, *,
              world_size: int, router: str | Router = "uniform", router_seed: int = 0, batch_tokens: int = 2048,
              seq_len: int | None = None, timeout: float = 300.0, two_stage: bool = False,
              exact: ExactConfig | None = None, progress: Callable[[int], None] | None = None) -> RunReport:
    """Run ``tokens`` through the model on ``world_size`` local gloo ranks under ``plan`` and check it (module doc).

    ``model`` is a model, a checkpoint path, or ``None`` for the bundled checkpoint. ``progress(1)`` is called
    after each batch of the dense reference. ``exact``: libra's exact mode on ``plan`` as the base placement.
    Under torchrun use :func:`run_torchrun`.
    """
    t0 = time.perf_counter()
    lm, layout, inputs = _prepare(model, plan, tokens, world_size, router, batch_tokens, seq_len, two_stage, exact)
    with tempfile.TemporaryDirectory(prefix="moebalance-run-") as tmp:
        if isinstance(model, MoELM):
            path = str(Path(tmp) / "model.safetensors")
            save_checkpoint(path, model, dtype=torch.float32)
        else:
            path = str(lm_path(model))
        ref = dense_reference(lm, inputs, progress)
        outs = launch(_rank_main, world_size, path, plan.to_json_dict(), router, router_seed, inputs, two_stage,
                      exact, timeout=timeout)
    return _report(plan, layout, outs, ref, router, router_seed, t0, exact)


def run_torchrun(model: MoELM | str | os.PathLike[str] | None, plan: Placement, tokens: np.ndarray, *,
                 router: str | Router = "uniform", router_seed: int = 0, batch_tokens: int = 2048,
                 seq_len: int | None = None, backend: str | None = None, two_stage: bool = False,
                 exact: ExactConfig | None = None, timeout: float | None = None,
                 progress: Callable[[int], None] | None = None) -> RunReport | None:
    """:func:`run_model` in a process that torchrun started: this process runs its rank (``RANK``) of the group
    torchrun set up (:func:`moebalance.runtime.init_from_env`: NCCL on GPU ``LOCAL_RANK`` where CUDA is available,
    else gloo). Every rank must call it with the same arguments. The ranks' results are gathered on rank 0,
    which runs the dense reference and returns the report; the other ranks return ``None``. The process group
    is left as found if it existed, else destroyed before returning.

    Every rank checks its inputs before joining the group and the ranks agree on the outcome
    (:func:`moebalance.runtime.agreed_inputs`), so one rank's bad plan or checkpoint is every rank's one-line
    error. Every wait is bounded by ``timeout`` seconds (default ``$MOEBALANCE_DIST_TIMEOUT``, else 60): a rank
    that does not arrive, or that leaves the group mid-run (killed, crashed), is named in a one-line
    :class:`~moebalance.runtime.GroupError` on every other rank (:func:`moebalance.runtime.guarded`).
    """
    t0 = time.perf_counter()
    owned = not torch.distributed.is_initialized()
    _, world_size = torchrun_world()
    with agreed_inputs(timeout, "check the run's inputs"):
        lm, layout, inputs = _prepare(model, plan, tokens, world_size, router, batch_tokens, seq_len, two_stage,
                                      exact)
    rank, world_size, device = init_from_env(backend, timeout)
    try:
        with guarded():
            mine = rank_body(rank, copy.deepcopy(lm), plan, router, router_seed, inputs, device, two_stage=two_stage,
                             exact=exact)
            outs: list[Any] | None = [None] * world_size if rank == 0 else None
            torch.distributed.gather_object(mine, outs, dst=0)
    finally:
        if owned:
            torch.distributed.destroy_process_group()
    member = membership()
    if owned and member is not None:
        member.leave()  # done: a rank that stops beating from now on has not left anyone waiting
    if rank != 0:
        return None
    assert outs is not None
    ref = dense_reference(lm, inputs, progress)
    return _report(plan, layout, outs, ref, router, router_seed, t0, exact)


def _report(plan: Placement, layout: Layout, outs: Sequence[dict[str, Any]],
            ref: tuple[list[np.ndarray], list[np.ndarray]], router: str | Router, router_seed: int,
            t0: float, exact: ExactConfig | None = None) -> RunReport:
    """The report from every rank's :func:`rank_body` result and the dense reference ``(logits, ids)``."""
    ref_logits, ref_ids = ref
    world_size = len(outs)
    diff = 0.0
    mismatches = 0
    run_ids = []
    for b in range(layout.num_batches):
        ep_logits = np.concatenate([o["logits"][b] for o in outs])
        if ep_logits.size:
            diff = max(diff, float(np.max(np.abs(ep_logits - ref_logits[b]))))
        ids = np.concatenate([o["ids"][b] for o in outs])
        mismatches += int(np.sum(ids != ref_ids[b]))
        run_ids.append(ids)
    _, src, bat = layout.token_order()
    trace = RoutingTrace(np.concatenate(run_ids), src, bat, num_experts=plan.num_experts)
    predicted = predicted_loads(plan, trace, router, router_seed, exact)
    computed = np.stack([o["computed"] for o in outs], axis=2)
    hidden = np.stack([o["hidden"] for o in outs], axis=2)
    loads = computed.astype(np.float64)
    mx = loads.max(axis=2)
    bal = float(np.mean(loads.mean(axis=2)[mx > 0] / mx[mx > 0])) if np.any(mx > 0) else float("nan")
    ranks = tuple(RankReport(rank=g, tokens=o["tokens"], picks_computed=int(o["computed"].sum()),
                             picks_predicted=int(predicted[:, :, g].sum()), expert_seconds=o["expert_seconds"],
                             routing_seconds=o["routing_seconds"], intra_node_bytes=o["sent"]["intra_node"],
                             inter_node_bytes=o["sent"]["inter_node"]) for g, o in enumerate(outs))
    return RunReport(world_size=world_size, policy=plan.policy, router=get_router(router).label,
                     router_seed=router_seed, num_tokens=trace.num_tokens, num_batches=layout.num_batches,
                     ranks=ranks, computed=computed, predicted=predicted, max_abs_logit_diff=diff,
                     routing_mismatches=mismatches, balancedness=bal, seconds=time.perf_counter() - t0, trace=trace,
                     rebalancer_hidden=hidden if (hidden >= 0).any() else None, exact=exact,
                     exact_seconds=None if exact is None else np.stack([o["exact_seconds"] for o in outs], axis=2),
                     extras_received=None if exact is None else np.stack([o["extras"] for o in outs], axis=2))


def lm_path(model: str | os.PathLike[str] | None) -> Path:
    """The checkpoint file ``model`` names (``None``: the bundled one)."""
    from moebalance.lm.moe_lm import bundled_checkpoint

    return bundled_checkpoint() if model is None else Path(model)
