"""Numbers and plots behind docs/results/moe_lm.md (routing skew per domain, plans on captures, runtime checks).

Run from the repository root: .venv/bin/python bench/moe_lm_report.py [CHECKPOINT] [TAG]
"""
import json
import sys

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.model.capture import capture, write_capture
from moebalance.model.data import domain_tokens
from moebalance.model.moe_lm import load_checkpoint
from moebalance.model.run import run_model
from moebalance.policies import Budget, make_plan
from moebalance.routing.simulate import evaluate
from moebalance.workloads.stats import layer_skew


def main():
    ckpt = sys.argv[1] if len(sys.argv) > 1 else None
    tag = sys.argv[2] if len(sys.argv) > 2 else "main"
    m = load_checkpoint(ckpt)
    G = 8
    N = 20480  # tokens per part: 10 batches of 2048
    res = {}
    caps = {}
    for d in ("code", "prose"):
        toks = domain_tokens(d, "heldout", 2 * N)
        caps[d, "plan"] = capture(m, toks[:N], num_gpus=G, batch_tokens=2048)
        caps[d, "score"] = capture(m, toks[N:2 * N], num_gpus=G, batch_tokens=2048)
        write_capture(f"/tmp/rep_{tag}_{d}_plan.npz", caps[d, "plan"])
        write_capture(f"/tmp/rep_{tag}_{d}_score.npz", caps[d, "score"])
    dist = {}
    for d in ("code", "prose"):
        merged = np.concatenate([caps[d, "plan"].load.counts, caps[d, "score"].load.counts])
        s = layer_skew(merged)
        tot = merged.sum(0).astype(float)
        dist[d] = tot / tot.sum(1, keepdims=True)
        res[f"skew_{d}"] = {"peak_to_mean": s.peak_to_mean.round(2).tolist(), "top2_share": s.top2_share.round(3).tolist(),
                            "cv": s.cv.round(2).tolist(), "hot": s.hot_experts.tolist(), "drift": s.drift.round(3).tolist(),
                            "dead": (tot == 0).sum(1).tolist(), "counts": merged.sum(0).tolist()}
    res["tv_cross"] = (0.5 * np.abs(dist["code"] - dist["prose"]).sum(1)).round(3).tolist()
    for d in ("code", "prose"):
        a = caps[d, "plan"].load.total().astype(float)
        b = caps[d, "score"].load.total().astype(float)
        a /= a.sum(1, keepdims=True)
        b /= b.sum(1, keepdims=True)
        res[f"tv_within_{d}"] = (0.5 * np.abs(a - b).sum(1)).round(3).tolist()
    print(json.dumps({k: v for k, v in res.items()}, indent=None))
    cluster = Cluster(num_nodes=2, gpus_per_node=4)
    policies = [("contiguous", Budget(slots_per_gpu=2), {}), ("greedy", Budget(slots_per_gpu=2), {}),
                ("eplb", Budget(slots_per_gpu=3), {"num_groups": 1}), ("craft", Budget(replicas_per_gpu=2), {}),
                ("craft", Budget(replicas_per_gpu=4), {})]
    rows = []
    plans = {}
    for plan_d in ("code", "prose"):
        for pol, bud, params in policies:
            plan, _ = make_plan(pol, caps[plan_d, "plan"].load, cluster, bud, **params)
            label = f"{pol} ({bud.describe()})"
            plans[plan_d, label] = plan
            for score_d in ("code", "prose"):
                sc = evaluate(plan, caps[score_d, "score"].load, "uniform", bytes_per_copy=128 * 2)
                rows.append({"planned_on": plan_d, "policy": label, "scored_on": score_d, "extra_replicas": plan.extra_replicas,
                             "balancedness": round(sc.balancedness, 4), "imbalance": round(sc.imbalance_ratio, 3),
                             "per_layer": [round(float(x), 3) for x in sc.per_layer_balancedness],
                             "gap": round(sc.lower_bound_gap, 3),
                             "traffic": sc.traffic.as_dict(256) if sc.traffic is not None else None})
                print(rows[-1], flush=True)
    res["rows"] = rows
    # runtime on 8 gloo ranks: the eplb plan made on code, held-out code from the scoring part
    runs = []
    for (d, lab), plan in plans.items():
        if d != "code" or lab.startswith("greedy") or (lab.startswith("craft") and plan.extra_replicas < 32):
            continue
        for router in ("uniform", "random"):
            rep = run_model(ckpt, plan, domain_tokens("code", "heldout", 2 * N)[N:N + 8192], world_size=8, router=router,
                            batch_tokens=2048, timeout=600)
            sc = evaluate(plan, caps["code", "score"].load.select_batches(0, 4), router)
            runs.append({"policy": lab, "router": router, **rep.as_dict(), "sim_balancedness_uniform_split": round(sc.balancedness, 4)})
            print(runs[-1], flush=True)
    res["runs"] = runs
    json.dump(res, open(f"/tmp/report_{tag}.json", "w"), indent=1)

if __name__ == "__main__":
    main()
