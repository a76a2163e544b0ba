"""Runtime: an expert-parallel MoE layer on torch.distributed that runs any placement plan (docs/design.md, "Runtime").

Glossary (see also :mod:`moebalance`)
-------------------------------------
rank
    One process of the expert-parallel group; rank ``g`` is GPU ``g`` of the plan's cluster and holds the
    tokens that live there (the trace's ``src_gpu``).
logical expert
    Expert ``e`` of the model: one set of weights ``w1[e], w2[e] (, w3[e])``.
physical expert / slot
    One copy of a logical expert's weights on one rank. Rank ``g`` holds ``plan.gpu_experts[l][g]`` in
    layer ``l``, in that order: its *local* slots ``0 .. S-1``.
redundant expert / replica
    A second or later physical copy of a logical expert (on another rank); the router picks which serves a
    token. Two copies on one rank: the first serves, the second is idle (docs/design.md, "Data formats" warns about them).
local / remote pick
    A (token, expert) pick served on the token's own rank (no communication: Libra's MoE_local) or on
    another rank (dispatched and combined over the all-to-all: MoE_remote).
capacity
    The most picks an expert takes from one rank's tokens (the classic capacity factor).

Modules: :mod:`~moebalance.runtime.gating` (top-k gating and capacity),
:mod:`~moebalance.runtime.experts` (expert weights, FFN, dense reference),
:mod:`~moebalance.runtime.comm` (variable all-to-all on NCCL or gloo, point-to-point batches),
:mod:`~moebalance.runtime.dispatch` (who sends what, dispatchers by name),
:mod:`~moebalance.runtime.route` (which GPU serves each pick, on every rank alike),
:mod:`~moebalance.runtime.ep` (the layer, Libra Section 3.1's two-stage execution),
:mod:`~moebalance.runtime.prefetch` (per-batch plans: Libra's extra experts in a double buffer),
:mod:`~moebalance.runtime.exact` (exact mode: Libra's extras and routing planned after each layer's gate),
:mod:`~moebalance.runtime.stats` (what a forward reports, exact mode's time from the gate to the experts),
:mod:`~moebalance.runtime.agree` (every rank fails alike on one rank's bad input),
:mod:`~moebalance.runtime.errors` (errors every rank raises alike; :class:`GroupError`),
:mod:`~moebalance.runtime.group` (bounded waits: agreeing before joining, naming a rank that left),
:mod:`~moebalance.runtime.rearrange` (moving weights when the plan changes),
:mod:`~moebalance.runtime.launch` (local multi-process groups for tests and benchmarks; joining a torchrun group).
"""

from moebalance.runtime.agree import RankCheck, agreed_gather, plan_digest
from moebalance.runtime.comm import A2AImpl, all_gather_v, all_to_all_v, exchange_counts, p2p_exchange
from moebalance.runtime.dispatch import (
    DISPATCHERS,
    Dispatcher,
    DispatchMeta,
    build_dispatch,
    build_local,
    make_dispatcher,
)
from moebalance.runtime.ep import EPConfig, ExpertParallelMoE
from moebalance.runtime.errors import GroupError
from moebalance.runtime.exact import (
    ExactConfig,
    ExactPlan,
    check_exact,
    exact_demand,
    exact_layer_plan,
    plan_exact,
)
from moebalance.runtime.experts import ExpertWeights, dense_moe, expert_ffn, random_experts
from moebalance.runtime.gating import GateConfig, GateOutput, apply_capacity, expert_capacity, topk_gating
from moebalance.runtime.group import DEFAULT_TIMEOUT, TIMEOUT_ENV, dist_timeout
from moebalance.runtime.launch import (
    TORCHRUN_VARS,
    agreed_inputs,
    free_port,
    guarded,
    init_from_env,
    launch,
    torchrun_env,
)
from moebalance.runtime.prefetch import ExpertPrefetcher, Fetch, PrefetchResult, batch_extras, plan_fetches
from moebalance.runtime.rearrange import RearrangeReport, Transfer, plan_transfers, rearrange
from moebalance.runtime.route import KEEPS_LOCAL, keeps_local, layer_placement, route_picks, slot_table
from moebalance.runtime.stats import EPStats, ExactTiming, MoEOutput

__all__ = [
    "DEFAULT_TIMEOUT",
    "DISPATCHERS",
    "KEEPS_LOCAL",
    "TIMEOUT_ENV",
    "TORCHRUN_VARS",
    "A2AImpl",
    "DispatchMeta",
    "Dispatcher",
    "EPConfig",
    "EPStats",
    "ExactConfig",
    "ExactPlan",
    "ExactTiming",
    "ExpertParallelMoE",
    "ExpertPrefetcher",
    "ExpertWeights",
    "Fetch",
    "GateConfig",
    "GateOutput",
    "GroupError",
    "MoEOutput",
    "PrefetchResult",
    "RankCheck",
    "RearrangeReport",
    "Transfer",
    "agreed_gather",
    "agreed_inputs",
    "all_gather_v",
    "all_to_all_v",
    "apply_capacity",
    "batch_extras",
    "build_dispatch",
    "build_local",
    "check_exact",
    "dense_moe",
    "dist_timeout",
    "exact_demand",
    "exact_layer_plan",
    "exchange_counts",
    "expert_capacity",
    "expert_ffn",
    "free_port",
    "guarded",
    "init_from_env",
    "keeps_local",
    "launch",
    "layer_placement",
    "make_dispatcher",
    "p2p_exchange",
    "plan_digest",
    "plan_exact",
    "plan_fetches",
    "plan_transfers",
    "random_experts",
    "rearrange",
    "route_picks",
    "slot_table",
    "topk_gating",
    "torchrun_env",
]
