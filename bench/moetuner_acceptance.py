"""MoETuner against Megatron-LM's contiguous placement (paper 004, Section 5.3) on bundled traces (issue 5).

Mixtral-8x7B-like token-level trace (8 experts, top-2, 32 layers; 64 batches x 512 tokens, docs/synth.md),
expert parallelism of 4 on one node and of 8 on 2 nodes x 4 GPUs (NVLink 4 inside a node, one 400 Gb/s NIC
per GPU across: the `Cluster` defaults); the same comparison at 64 experts on the OLMoE-like trace (top-8,
16 layers) shows how the solve scales. Plans are made on the first half of the batches and scored on the
held-out second half, with MoETuner's metrics (Section 5.2):

- token processing: per layer, the tokens of the most loaded GPU (tail) and the mean over GPUs, averaged over
  batches, then over layers;
- all-to-all between adjacent layers under MoETuner's model (a (token, pick) moves from the GPU of its expert
  in layer l to the GPU of its expert in layer l + 1): the largest GPU-to-GPU volume (tail) and the mean
  over GPU pairs, per layer pair and batch, averaged; and the tokens that change GPU.

Writes docs/results/moetuner.md. Run: .venv/bin/python bench/moetuner_acceptance.py
"""

from __future__ import annotations

from _common import ROOT, fold_ranks, machine

from moebalance.cluster import Cluster
from moebalance.load import LoadMatrix, read_load
from moebalance.plan import Placement
from moebalance.policies import Budget, make_plan
from moebalance.policies.moetuner import cross_layer_traffic, processing_load

CASES = (
    ("mixtral-8x7b-tokens", "Mixtral-8x7B (8 experts, top-2, 32 layers)", 1, 4),
    ("mixtral-8x7b-tokens", "Mixtral-8x7B (8 experts, top-2, 32 layers)", 2, 4),
    ("olmoe-1b-7b-tokens", "OLMoE-1B-7B (64 experts, top-8, 16 layers)", 1, 4),
    ("olmoe-1b-7b-tokens", "OLMoE-1B-7B (64 experts, top-8, 16 layers)", 2, 4),
    ("olmoe-1b-7b-tokens", "OLMoE-1B-7B (64 experts, top-8, 16 layers)", 2, 8),
)


def metrics(plan: Placement, test: LoadMatrix) -> dict[str, float]:
    """Held-out metrics, per batch then averaged (a tail is the tail of one batch, as the paper measures it)."""
    assert test.trace is not None
    tail, mean = processing_load(plan, test)
    pair_tail = pair_mean = remote = 0.0
    for b in range(test.num_batches):
        t = cross_layer_traffic(plan, test.trace.select_batches(b, b + 1))
        pair_tail += float(t.pair_tail().mean())
        pair_mean += float(t.pair_mean().mean())
        remote += float(t.remote().mean())
    B = test.num_batches
    return {"proc_tail": float(tail.mean()), "proc_mean": float(mean.mean()), "a2a_tail": pair_tail / B,
            "a2a_mean": pair_mean / B, "remote": remote / B}


def main() -> None:
    lines = ["| model | GPUs | plan | token processing tail | mean | all-to-all tail (GPU pair) | mean | tokens changing GPU "
             "| solve time | ILP 1 gap | ILP 2 gap | ILP 2 method |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    deltas = ["| model | GPUs | token processing tail | all-to-all tail | tokens changing GPU |", "|---|---|---|---|---|"]
    for name, label, nodes, gpn in CASES:
        cluster = Cluster(num_nodes=nodes, gpus_per_node=gpn)
        G = cluster.num_gpus
        load = fold_ranks(read_load(f"bundled:{name}"), G)
        train, test = load.split(0.5)
        budget = Budget(slots_per_gpu=-(-load.num_experts // G))
        got = {}
        for policy in ("contiguous", "moetuner"):
            plan, seconds = make_plan(policy, train, cluster, budget)
            m = metrics(plan, test)
            got[policy] = m
            p = plan.params
            solve = f"{seconds:.2f} s" + (" (limit hit)" if p.get("time_limit_hit") else "")
            gaps = (f"{100 * p['ilp1_gap']:.2f}%", f"{100 * p['ilp2_gap']:.2f}%", str(p.get("ilp2_method"))) \
                if policy == "moetuner" else ("", "", "")
            lines.append(f"| {label} | {nodes}x{gpn} | {policy} | {m['proc_tail']:.1f} | {m['proc_mean']:.1f} | "
                         f"{m['a2a_tail']:.1f} | {m['a2a_mean']:.1f} | {m['remote']:.1f} | {solve} | "
                         + " | ".join(gaps) + " |")
            print(lines[-1], flush=True)
        c, t = got["contiguous"], got["moetuner"]

        def pct(key: str, c: dict[str, float] = c, t: dict[str, float] = t) -> str:
            return f"{100 * (t[key] - c[key]) / c[key]:+.1f}%"

        deltas.append(f"| {label} | {nodes}x{gpn} | {pct('proc_tail')} | {pct('a2a_tail')} | {pct('remote')} |")
    text = "\n".join([
        "# MoETuner vs contiguous placement (held-out)",
        "",
        "Bundled token-level traces, planned on the first 32 batches, scored per batch on the last 32 and averaged "
        f"(tokens per batch; layer means). Machine: {machine()}.",
        "Reproduce: `.venv/bin/python bench/moetuner_acceptance.py`. Solver: HiGHS (`highspy`), default settings "
        "(relative gap 0.025 as in the paper, time limit 60 s).",
        "",
        *lines,
        "",
        "## MoETuner against contiguous",
        "",
        *deltas,
        "",
        "MoETuner's paper (Section 5.3) reports on Mixtral-8x7B, single node: tail token-processing -36% and "
        "all-to-all tail -36%. Here both move the same way, the all-to-all tail about as much (-32%) and the "
        "token-processing tail less (-13%): what balancing can gain depends on how skewed each layer is and on "
        "how its hot experts happen to fall into contiguous pairs, which differ between our synthetic trace and "
        "the paper's measured one.",
        "",
        "- Mixtral on 2 x 4 GPUs has one expert per GPU, so every placement processes the same tokens per GPU; "
        "only ILP 2's choice of GPU for each expert changes, and it cuts the all-to-all tail.",
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
