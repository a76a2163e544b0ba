"""The demo, as data: two comparisons on bundled traces (``moebalance demo``; ``make demo``).

Part 1 balances a DeepSeek-V3-like load on 8 nodes x 8 GPUs with 5 expert slots per GPU (EPLB's budget) and
CRAFT with 8 extra slots per GPU over all layers; part 2 weighs all-to-all traffic against balance on a
token-level OLMoE-like trace (GRACE-MoE's question). The command line prints what these describe.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from moebalance.app.compare import Comparison, Scenario
from moebalance.app.report import ComparisonRow
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.workloads.stats import layer_skew

__all__ = ["BALANCE", "DEMO", "TRAFFIC", "intro"]

_SLOTS5 = Budget(slots_per_gpu=5)
_SLOTS10 = Budget(slots_per_gpu=10)


def _balance_notes(rows: Mapping[str, ComparisonRow]) -> list[str]:
    return [
        "- EPLB's hierarchical policy packs one expert group per node (DeepSeek-V3 has 8 groups, here 8 nodes), "
        "so node loads follow group loads; its global policy ignores groups.",
        f"- EPLB (global) under vLLM/SGLang-style random replica choice: balancedness "
        f"{rows['eplb-global-random'].score.balancedness:.4f} (equal split: "
        f"{rows['eplb-global'].score.balancedness:.4f}); with Libra's token rebalancer "
        f"{rows['eplb-global-rebalance'].score.balancedness:.4f}, with the best split of each batch "
        f"(minmax router) {rows['eplb-global-minmax'].score.balancedness:.4f}.",
        "- Routing gap: how far the straggler is above the best split of the same tokens over the same copies.",
        "- craft (R=8) has a budget of 8 extra expert slots per GPU over all layers, 1/7 of EPLB's 58 here.",
        "- Gap to bound: how far the straggler is above max(total / G, max_e load_e / replicas_e).",
    ]


#: Part 1: balance. The table's title names the slots budget; craft's row says its own.
BALANCE = Comparison(
    load="bundled:deepseek-v3-8x8",
    cluster=Cluster(num_nodes=8, gpus_per_node=8),
    scenarios=(
        Scenario("contiguous", _SLOTS5),
        Scenario("greedy", _SLOTS5),
        Scenario("eplb", _SLOTS5),
        # DeepSeek-V3 has 8 expert groups, so on 8 nodes EPLB runs its hierarchical policy; show the global too
        Scenario("eplb", _SLOTS5, {"num_groups": 1}, label="eplb (global)", plan_name="eplb-global",
                 name="eplb-global"),
        # CRAFT with R = 8 extra slots per GPU: 1/7 of EPLB's 58 per GPU (one per layer)
        Scenario("craft", Budget(replicas_per_gpu=8), label="craft (R=8)", plan_name="craft"),
        Scenario("eplb", _SLOTS5, {"num_groups": 1}, router="random", label="eplb (global, random router)",
                 shown=False, name="eplb-global-random"),
        Scenario("eplb", _SLOTS5, {"num_groups": 1}, router="rebalance", label="eplb (global, rebalance router)",
                 shown=False, name="eplb-global-rebalance"),
        Scenario("eplb", _SLOTS5, {"num_groups": 1}, router="minmax", label="eplb (global, minmax router)",
                 shown=False, name="eplb-global-minmax"),
    ),
    notes=_balance_notes,
)


def _traffic_notes(rows: Mapping[str, ComparisonRow]) -> list[str]:
    return [
        "- All plans get 10 expert slots per GPU per layer (64 experts on 8 GPUs need 8): EPLB fills them with "
        "replicas; GRACE uses them for uneven affinity groups and a few replicas of hot experts.",
        "- GRACE co-locates experts that the same tokens pick, cutting inter-node copies at a cost in balance; "
        "its locality router keeps tokens on their own GPU or node when a replica is there.",
        "- MoETuner balances each layer's clusters of experts with an integer program (ILP 1, to the requested gap) "
        "and puts experts that pass tokens to each other in adjacent layers on the same GPU (ILP 2); results in "
        "its own traffic model are in docs/results/moetuner.md.",
        "- All-to-all time: dispatch + combine over the busiest link (450 GB/s NVLink, 50 GB/s per GPU across "
        "nodes), 2-byte activations of the model's hidden size.",
    ]


#: Part 2: all-to-all traffic against balance on a token-level trace (GRACE-MoE Section 5.3).
TRAFFIC = Comparison(
    load="bundled:olmoe-1b-7b-tokens",
    cluster=Cluster(num_nodes=2, gpus_per_node=4),
    scenarios=(
        Scenario("contiguous", _SLOTS10),
        Scenario("moetuner", _SLOTS10),
        Scenario("eplb", _SLOTS10, {"num_groups": 1}, router="random", label="eplb (random router)", plan_name="eplb"),
        Scenario("grace", _SLOTS10, {"replication": "none"}, label="grace, no replicas", plan_name="grace-no-replicas"),
        Scenario("grace", _SLOTS10, router="wrr", label="grace (wrr router)", plan_name="grace"),
        Scenario("grace", _SLOTS10, router="locality", label="grace (locality router)", plan_name="grace"),
    ),
    notes=_traffic_notes,
)

#: The demo's parts, in order, with the folder (under ``--out-dir``) each writes to.
DEMO: tuple[tuple[str, Comparison, str], ...] = (
    ("moebalance demo", BALANCE, ""),
    ("part 2: all-to-all traffic (token-level trace)", TRAFFIC, "traffic"),
)


def intro(comparison: Comparison, load: LoadMatrix) -> list[str]:
    """The lines printed before a part's table."""
    if comparison is BALANCE:
        skew = layer_skew(load.counts)
        return [f"Bundled data: {load.preset} routing, {load.num_batches} batches x {load.num_layers} layers x "
                f"{load.num_experts} experts (synthetic, calibrated to CRAFT/MoETuner observations; docs/synth.md).",
                f"Skew: peak/mean expert load ranges {np.min(skew.peak_to_mean):.1f}x to "
                f"{np.max(skew.peak_to_mean):.1f}x; {int(np.sum(skew.high_skew))} of {load.num_layers} layers "
                "are high-skew (> 10x)."]
    tokens = load.trace.num_tokens if load.trace is not None else 0
    c = comparison.cluster
    return [f"Bundled data: {load.preset} token-level routing, {tokens:,} tokens on 8 ranks, {load.num_layers} layers "
            f"x {load.num_experts} experts, top-8; {c.num_nodes} nodes x {c.gpus_per_node} GPUs."]
