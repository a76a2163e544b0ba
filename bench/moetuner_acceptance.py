"""MoETuner against Megatron-LM's contiguous placement (MoETuner Section 5.3) on bundled traces.

Mixtral-8x7B-like token-level trace (8 experts, top-2, 32 layers; 64 batches x 512 tokens, docs/synth.md),
expert parallelism of 4 on one node, 2 nodes x 2 and 2 nodes x 4 GPUs (NVLink 4 inside a node, one 400 Gb/s
NIC per GPU across: the `Cluster` defaults); the same comparison at 64 experts on the OLMoE-like trace
(top-8, 16 layers) shows how the solve scales. Plans are made on the first half of the batches and scored
on the held-out second half. MoETuner runs in both memory modes: ``layer`` (the default: equal experts per
GPU in every layer, what EP engines run) and ``total`` (the paper's Eq. 13: equal experts per GPU summed
over layers, clusters of any size).

Metrics, per batch, then averaged over batches and layers:

- token processing (MoETuner Section 5.2): per layer, the tokens of the most loaded GPU (tail) and the mean
  over GPUs;
- all-to-all under MoETuner's model (Section 4.1): a transition is one (pick in layer l, pick in layer l + 1)
  pair of a token, K^2 per token and layer pair (the paper's R); it moves from the GPU of the first expert
  to the GPU of the second. Tail: the most transitions between one ordered GPU pair; mean: over the G (G - 1)
  pairs; and the transitions that change GPU;
- dispatch copies as engines count them (docs/design.md, "Metrics"): each token goes from its own GPU (the trace's data-
  parallel rank) to each distinct GPU serving one of its picks, and comes back; copies that cross nodes
  and that stay inside a node;
- balancedness (mean / max GPU load), for comparison with the other policies.

Writes docs/results/moetuner.md. Run: .venv/bin/python bench/moetuner_acceptance.py
"""

from __future__ import annotations

from typing import Any

import numpy as np
from _common import ROOT, fold_ranks, machine

from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix, read_load
from moebalance.core.plan import Placement
from moebalance.policies import Budget, make_plan
from moebalance.routing.simulate import evaluate
from moebalance.routing.traffic import cross_layer_traffic, processing_load

MIXTRAL = ("mixtral-8x7b-tokens", "Mixtral-8x7B-like (8 experts, top-2, 32 layers)")
OLMOE = ("olmoe-1b-7b-tokens", "OLMoE-like (64 experts, top-8, 16 layers)")
CASES = (
    (*MIXTRAL, 1, 4),
    (*MIXTRAL, 2, 2),
    (*MIXTRAL, 2, 4),
    (*OLMOE, 1, 4),
    (*OLMOE, 2, 4),
    (*OLMOE, 2, 8),
)
#: (label, policy, params, budget kind)
PLANS = (
    ("contiguous", "contiguous", {}, "slots"),
    ("moetuner", "moetuner", {}, "slots"),
    ("moetuner, memory=total", "moetuner", {"memory": "total"}, "replicas"),
)


def metrics(plan: Placement, test: LoadMatrix) -> dict[str, Any]:
    """Held-out metrics, per batch then averaged (a tail is the tail of one batch, as the paper measures it)."""
    assert test.trace is not None
    B, L = test.num_batches, test.num_layers
    tail, mean = processing_load(plan, test)  # [L] each, averaged over batches
    pair_tail = np.zeros(L - 1)
    pair_mean = np.zeros(L - 1)
    remote = np.zeros(L - 1)
    for b in range(B):
        t = cross_layer_traffic(plan, test.trace.select_batches(b, b + 1))
        pair_tail += t.pair_tail() / B
        pair_mean += t.pair_mean() / B
        remote += t.remote() / B
    score = evaluate(plan, test)
    assert score.traffic is not None
    return {"proc_tail": tail, "proc_mean": mean, "a2a_tail": pair_tail, "a2a_mean": pair_mean, "remote": remote,
            "inter": score.traffic.inter_node / B, "intra": score.traffic.intra_node / B,
            "balancedness": score.balancedness}


def pct(new: float, old: float) -> str:
    return f"{100 * (new - old) / old:+.1f}%" if old else "n/a"


def main() -> None:
    quality = ["| model | GPUs | plan | token processing tail | mean | a2a tail (transitions, GPU pair) | mean | "
               "transitions changing GPU | dispatch copies inter-node | intra-node | balancedness |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
    solve = ["| model | GPUs | plan | solve time | O1 (tokens) | proven bound | ILP 1 gap (relative) | ILP 1 gap (of a "
             "GPU's mean load, worst layer) | ILP 2 method | O2 | proven bound | ILP 2 gap | Eq. 13 | experts per GPU "
             "over layers | time limit hit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    deltas = ["| model | GPUs | plan | token processing tail | all-to-all tail | transitions changing GPU | "
              "inter-node copies | balancedness |", "|---|---|---|---|---|---|---|---|"]
    per_layer: dict[str, dict[str, Any]] = {}
    for name, label, nodes, gpn in CASES:
        cluster = Cluster(num_nodes=nodes, gpus_per_node=gpn)
        G = cluster.num_gpus
        load = fold_ranks(read_load(f"bundled:{name}"), G)
        train, test = load.split(0.5)
        got = {}
        for plan_label, policy, params, kind in PLANS:
            budget = Budget(slots_per_gpu=-(-load.num_experts // G)) if kind == "slots" else Budget(replicas_per_gpu=0)
            if params.get("memory") == "total" and load.num_experts == G:
                continue  # one expert per GPU: both memory modes are the same program
            plan, seconds = make_plan(policy, train, cluster, budget, **params)
            m = metrics(plan, test)
            got[plan_label] = m
            if name == MIXTRAL[0] and (nodes, gpn) == (1, 4):
                per_layer[plan_label] = m
            quality.append(f"| {label} | {nodes}x{gpn} | {plan_label} | {m['proc_tail'].mean():.1f} | "
                           f"{m['proc_mean'].mean():.1f} | {m['a2a_tail'].mean():.1f} | {m['a2a_mean'].mean():.1f} | "
                           f"{m['remote'].mean():.0f} | {m['inter']:.0f} | {m['intra']:.0f} | "
                           f"{m['balancedness']:.4f} |")
            print(quality[-1], flush=True)
            if policy == "moetuner":
                p = plan.params
                hit = [k for k in ("ilp1", "ilp2") if p[f"{k}_time_limit_hit"]]
                solve.append(
                    f"| {label} | {nodes}x{gpn} | {plan_label} | {seconds:.2f} s | {p['ilp1_objective']:.0f} | "
                    f"{p['ilp1_bound']:.1f} | {100 * p['ilp1_gap']:.2f}% | {100 * p['ilp1_gap_vs_mean_load']:.2f}% | "
                    f"{p['ilp2_method']} | {p['ilp2_objective']:.1f} | {p['ilp2_bound']:.1f} | {100 * p['ilp2_gap']:.2f}% | "
                    f"{p['eq13']} | {p['experts_per_gpu_total'][0]}-{p['experts_per_gpu_total'][1]} | "
                    f"{', '.join(k.upper().replace('ILP', 'ILP ') for k in hit) or 'no'} |")
                print(solve[-1], flush=True)
        base = got["contiguous"]
        for plan_label, m in got.items():
            if plan_label == "contiguous":
                continue
            deltas.append(
                f"| {label} | {nodes}x{gpn} | {plan_label} | {pct(m['proc_tail'].mean(), base['proc_tail'].mean())} | "
                f"{pct(m['a2a_tail'].mean(), base['a2a_tail'].mean())} | "
                f"{pct(m['remote'].mean(), base['remote'].mean())} | {pct(m['inter'], base['inter'])} | "
                f"{m['balancedness'] - base['balancedness']:+.4f} |")

    names = list(per_layer)
    layers = ["| layer | " + " | ".join(f"tail: {n}" for n in names) + " | "
              + " | ".join(f"a2a tail to next: {n}" for n in names) + " | "
              + " | ".join(f"a2a mean to next: {n}" for n in names) + " |",
              "|---" * (1 + 3 * len(names)) + "|"]
    L = len(per_layer["contiguous"]["proc_tail"])
    for layer in range(L):
        a2a = [f"{per_layer[n]['a2a_tail'][layer]:.1f}" if layer < L - 1 else "" for n in names]
        a2a_mean = [f"{per_layer[n]['a2a_mean'][layer]:.1f}" if layer < L - 1 else "" for n in names]
        layers.append(f"| {layer} | " + " | ".join(f"{per_layer[n]['proc_tail'][layer]:.1f}" for n in names)
                      + " | " + " | ".join(a2a) + " | " + " | ".join(a2a_mean) + " |")
    mean_tok = float(per_layer["contiguous"]["proc_mean"].mean())

    text = "\n".join([
        "# MoETuner vs contiguous placement (held-out)",
        "",
        "Bundled token-level traces, planned on the first 32 batches, scored per batch on the last 32 and averaged "
        f"(tokens per batch). Machine: {machine()}.",
        "Reproduce: `.venv/bin/python bench/moetuner_acceptance.py`. Solver: HiGHS (`highspy`), default settings "
        "(relative gap 0.025 as in the paper, time limit 60 s). `moetuner` keeps equal experts per GPU in every "
        "layer (`--set memory=layer`, the default; slots_per_gpu = E / G); `memory=total` is the paper's Eq. 13, "
        "equal experts per GPU summed over layers (budget `--replicas-per-gpu 0`: no replicas, a GPU's memory over "
        "all layers as contiguous).",
        "",
        "Token processing: per layer, the most loaded GPU's tokens (tail) and the mean over GPUs (MoETuner "
        "Section 5.2). All-to-all in MoETuner's model: a transition is one (pick in layer l, pick in layer l + 1) "
        "pair of a token (K^2 per token: 4 for Mixtral, 64 for OLMoE), moving from the GPU of the first expert to "
        "the GPU of the second; tail = the most transitions between one ordered GPU pair, mean = over all pairs. "
        "Dispatch copies: as engines count them (docs/design.md, Metrics), each token to each distinct GPU serving one of its "
        "picks from its own data-parallel rank, per batch, summed over layers.",
        "",
        "## Balance and traffic",
        "",
        *quality,
        "",
        "## Against contiguous",
        "",
        *deltas,
        "",
        "## Solves",
        "",
        *solve,
        "",
        "O1 is ILP 1's objective summed over layers (tokens: total deviation of the GPUs' loads from their mean, "
        "planning batches); O2 is ILP 2's (tokens / (GB/s): the bandwidth-weighted all-to-all tail summed over "
        "layer pairs). ILP 1 gap (relative) is the usual `(sum O1 - sum bound) / sum O1`; it reads 100% where "
        "every layer is split to within a few tokens of perfect, which no LP bound proves (the bound stays near "
        "0). So each layer's solve stops once its gap, measured against the larger of O1 and a GPU's mean load, "
        "is within 2.5% (the next column; `ilp1_gap` in moebalance/policies/moetuner.py). ILP 2 `dp` is exact; "
        "`dp+swaps` is the exact optimum without Eq. 13 repaired by swaps to meet it, proven within the gap by "
        "that optimum; `milp` is HiGHS (with Eq. 13 when it says enforced), `milp+swaps` a MILP optimum without "
        "Eq. 13 repaired when no time was left for the MILP with it.",
        "",
        "## Per layer: Mixtral-8x7B-like, one node of 4 GPUs",
        "",
        f"Tokens per batch; the mean GPU processes {mean_tok:.0f} in every layer.",
        "",
        *layers,
        "",
        "## Reading",
        "",
        "MoETuner's paper (Section 5.3) reports on Mixtral-8x7B, single node: tail token-processing -36% and "
        "all-to-all tail -36%. Here the directions reproduce. With equal experts per GPU in every layer (what EP "
        "engines run) the token-processing tail falls less than the paper's; the paper's own memory constraint "
        "(Eq. 13 over layers, `memory=total`) lets a hot expert share its GPU with fewer others and closes part "
        "of that difference (-20% against -13% on one node). How much balancing gains depends on how skewed each layer is and how its hot experts "
        "happen to fall into contiguous pairs, which differ between our synthetic trace and the paper's measured one.",
        "",
        "- Mixtral on 2 x 4 GPUs has one expert per GPU, so every placement processes the same tokens per GPU; "
        "only ILP 2's choice of GPU for each expert changes, and it cuts the all-to-all tail.",
        "- Dispatch copies as engines count them barely move: a token starts on its data-parallel rank, which is "
        "independent of its experts, so which GPU hosts an expert changes few copies on average. MoETuner's "
        "traffic model (tokens flowing from expert to expert between layers) is what ILP 2 optimises; where "
        "attention runs on the token's home rank after every layer, the cross-layer gain does not materialise.",
        "- Solve time: the Mixtral cases and 64 experts on 4 or 8 GPUs solve to the requested gap in about a "
        "second (ILP 2 by the exact DP over node layouts). On 16 GPUs ILP 2 is a MILP whose bound is weak: the "
        "60 s default limit stops it, the best plan found is kept and the proven gaps are reported "
        "(`time_limit_hit` in the plan's params); its plan still beats contiguous.",
        "",
    ])
    print(text)
    (ROOT / "docs" / "results" / "moetuner.md").write_text(text)


if __name__ == "__main__":
    main()
