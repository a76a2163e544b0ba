"""Writes docs/results/moe_lm.md entirely: every number in it is computed here or read from the checkpoint record.

Run from the repository root (``make bench`` does):

    .venv/bin/python bench/moe_lm_report.py [--checkpoint CKPT] [--compare AUX_CKPT] [--out MD] [--skip-run]

- training facts come from the checkpoint's record (``moe_lm.json`` next to the checkpoint);
- routing skew, held-out balancedness of plans, and the runtime checks are measured on held-out text;
- ``--compare`` adds a section for a second checkpoint (e.g. one trained with ``--aux-loss-coef 0.01``),
  measured the same way (its bits per byte come from its own record, when it has one);
- ``--skip-run`` leaves out the 8-rank runtime section (it is the slow part: minutes on 2 cores).

Also writes the plots docs/results/moe_lm_routing.png and moe_lm_balance.png next to the markdown, and the raw
numbers as JSON to /tmp/moe_lm_report.json.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.core.io import atomic_write_text, save_png
from moebalance.lm.capture import capture
from moebalance.lm.data import domain_tokens
from moebalance.lm.moe_lm import bundled_checkpoint, load_checkpoint
from moebalance.lm.run import run_model
from moebalance.policies import Budget, make_plan
from moebalance.routing.simulate import evaluate
from moebalance.workloads.stats import layer_skew

DOMAINS = ("code", "prose")
G = 8  # ranks of a capture and of the runtime runs
NODES, GPUS_PER_NODE = 2, 4
BATCH = 2048  # tokens per batch
PART = 10 * BATCH  # tokens per part: A (plan) and B (score)
RUN_TOKENS = 4 * BATCH
BYTES_PER_COPY = 128 * 2  # d_model x float16, for the traffic counts
POLICIES = [("contiguous", Budget(slots_per_gpu=2), {}), ("greedy", Budget(slots_per_gpu=2), {}),
            ("eplb", Budget(slots_per_gpu=3), {"num_groups": 1}), ("craft", Budget(replicas_per_gpu=2), {}),
            ("craft", Budget(replicas_per_gpu=4), {})]
RUN_POLICIES = ("contiguous (slots_per_gpu=2)", "eplb (slots_per_gpu=3)", "craft (replicas_per_gpu=4)")


def _record(ckpt: Path) -> dict[str, Any] | None:
    p = ckpt.with_suffix(".json")
    return json.loads(p.read_text()) if p.is_file() else None


def _tv(a: np.ndarray, b: np.ndarray) -> list[float]:
    """Total-variation distance per layer between two ``[L, E]`` count tables."""
    a = a.astype(float) / a.sum(1, keepdims=True)
    b = b.astype(float) / b.sum(1, keepdims=True)
    return (0.5 * np.abs(a - b).sum(1)).tolist()


def analyse(model: Any) -> dict[str, Any]:
    """Captures of held-out text, skew statistics, and plans scored on the other half."""
    caps = {}
    for d in DOMAINS:
        toks = domain_tokens(d, "heldout", 2 * PART)
        caps[d, "A"] = capture(model, toks[:PART], num_gpus=G, batch_tokens=BATCH)
        caps[d, "B"] = capture(model, toks[PART:2 * PART], num_gpus=G, batch_tokens=BATCH)
    res: dict[str, Any] = {"caps": caps, "skew": {}, "tv_within": {}}
    totals = {}
    for d in DOMAINS:
        merged = np.concatenate([caps[d, "A"].load.counts, caps[d, "B"].load.counts])
        s = layer_skew(merged)
        tot = merged.sum(0)
        totals[d] = tot
        share = tot / tot.sum(1, keepdims=True)
        res["skew"][d] = {"peak_to_mean": s.peak_to_mean.tolist(), "top2_share": s.top2_share.tolist(),
                          "dead": (tot == 0).sum(1).tolist(), "picks_per_layer": int(tot[0].sum()),
                          "tokens": int(merged.shape[0] * BATCH), "share": share.tolist(),
                          "max_share": share.max(1).tolist()}
        res["tv_within"][d] = _tv(caps[d, "A"].load.total(), caps[d, "B"].load.total())
    res["tv_cross"] = _tv(totals["code"], totals["prose"])
    cluster = Cluster(num_nodes=NODES, gpus_per_node=GPUS_PER_NODE)
    rows, plans = [], {}
    for plan_d in DOMAINS:
        for pol, bud, params in POLICIES:
            plan, _ = make_plan(pol, caps[plan_d, "A"].load, cluster, bud, **params)
            label = f"{pol} ({bud.describe()})"
            plans[plan_d, label] = plan
            for score_d in DOMAINS:
                sc = evaluate(plan, caps[score_d, "B"].load, "uniform", bytes_per_copy=BYTES_PER_COPY)
                rows.append({"planned_on": plan_d, "policy": label, "scored_on": score_d,
                             "extra_replicas": int(plan.extra_replicas), "balancedness": float(sc.balancedness),
                             "imbalance": float(sc.imbalance_ratio), "gap": float(sc.lower_bound_gap),
                             "per_layer": [float(x) for x in sc.per_layer_balancedness],
                             "duplicates": _same_gpu_copies(plan)})
    res["rows"], res["plans"] = rows, plans
    return res


def _same_gpu_copies(plan: Any) -> int:
    """(layer, GPU) pairs holding some expert twice or more."""
    return sum(len(g) != len(set(g)) for layer in plan.gpu_experts for g in layer)


def _row(res: dict[str, Any], label: str, plan_d: str, score_d: str) -> dict[str, Any]:
    return next(r for r in res["rows"] if r["policy"] == label and r["planned_on"] == plan_d
                and r["scored_on"] == score_d)


def runtime_runs(ckpt: Path, res: dict[str, Any]) -> list[dict[str, Any]]:
    """The code-planned plans on 8 gloo ranks, part B of held-out code, uniform and random routers."""
    toks = domain_tokens("code", "heldout", 2 * PART)[PART:PART + RUN_TOKENS]
    runs = []
    for label in RUN_POLICIES:
        plan = res["plans"]["code", label]
        for router in ("uniform", "random"):
            rep = run_model(str(ckpt), plan, toks, world_size=G, router=router, batch_tokens=BATCH, timeout=600)
            sc = evaluate(plan, res["caps"]["code", "B"].load.select_batches(0, RUN_TOKENS // BATCH), router)
            runs.append({**rep.as_dict(), "policy": label, "router": router, "evaluate": float(sc.balancedness)})
            print(label, router, rep.seconds, flush=True)
    return runs


def _f(x: float, nd: int = 3) -> str:
    return f"{x:.{nd}f}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _span(xs: list[float], nd: int = 2) -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo:.{nd}f}" if round(lo, nd) == round(hi, nd) else f"{lo:.{nd}f}-{hi:.{nd}f}"


def _plots(res: dict[str, Any], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = len(res["skew"]["code"]["share"])
    E = len(res["skew"]["code"]["share"][0])
    fig, axes = plt.subplots(1, L, figsize=(3.2 * L, 3), sharey=True)
    for layer, ax in enumerate(np.atleast_1d(axes)):
        x = np.arange(E)
        ax.bar(x - 0.2, np.array(res["skew"]["code"]["share"][layer]) * 100, 0.4, label="code")
        ax.bar(x + 0.2, np.array(res["skew"]["prose"]["share"][layer]) * 100, 0.4, label="prose")
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("expert")
    np.atleast_1d(axes)[0].set_ylabel("% of picks")
    np.atleast_1d(axes)[0].legend()
    save_png(fig, out_dir / "moe_lm_routing.png")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    for ax, d in zip(axes, DOMAINS, strict=True):
        for pol, bud, _ in POLICIES:
            label = f"{pol} ({bud.describe()})"
            ax.plot(range(L), _row(res, label, d, d)["per_layer"], marker="o", label=label)
        ax.set_title(f"planned and scored on {d} (held out)")
        ax.set_xlabel("layer")
        ax.set_xticks(range(L))
    axes[0].set_ylabel("balancedness")
    axes[0].legend(fontsize=7)
    save_png(fig, out_dir / "moe_lm_balance.png")


def _label(label: str) -> str:
    pol, rest = label.split(" (", 1)
    rest = rest.rstrip(")")
    key, val = rest.split("=")
    return f"{pol} ({val} slots/GPU)" if key == "slots_per_gpu" else f"{pol} (R = {val})"


def render(rec: dict[str, Any] | None, ckpt: Path, model: Any, res: dict[str, Any],
           runs: list[dict[str, Any]] | None, cmp: dict[str, Any] | None) -> str:
    out: list[str] = []
    w = out.append
    cfg = model.config
    L = cfg.num_layers
    n_expert = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("moe.w1", "moe.w2", "moe.w3")))
    n_params = sum(p.numel() for p in model.parameters())
    w("# A small MoE language model: training, routing skew, and plans that balance it")
    w("")
    w("<!-- Generated by bench/moe_lm_report.py (make bench); do not edit by hand. -->")
    w("")
    w("moebalance ships a small byte-level MoE language model (`moebalance.lm`), trained on two kinds of text "
      "that every CPython carries: Python source code and English prose. Its routing is real, not synthetic. "
      "Captures of that routing are planned on, scored with the simulator and run on the expert-parallel runtime.")
    w("")
    w(f"This report was generated with {platform.python_implementation()} {platform.python_version()} and "
      f"torch {__import__('torch').__version__}.")
    w("")
    w("## Model")
    w("")
    w("| | |")
    w("|---|---|")
    w(f"| layers | {L} decoder blocks, each with causal self-attention ({cfg.num_heads} heads) and an MoE FFN: "
      f"all {L} are MoE layers (`L = {L}`) |")
    w(f"| width | `d_model = {cfg.d_model}`, context {cfg.max_seq_len} tokens |")
    w(f"| vocabulary | {cfg.vocab_size} tokens: byte values plus special tokens, no tokenizer |")
    w(f"| MoE layer | {cfg.num_experts} SwiGLU experts (`F = {cfg.ffn_size}`), top-{cfg.top_k} gating "
      "(`runtime.gating.topk_gating`, docs/papers/routing.md), no capacity, so no pick is dropped |")
    w(f"| parameters | {n_params:,}, of which {n_expert:,} are expert weights |")
    size = ckpt.stat().st_size
    dtype = rec["checkpoint"]["dtype"] if rec else "?"
    w(f"| checkpoint | `{ckpt.name}`, {dtype}, {size / 1e6:.1f} MB; its record is `{ckpt.with_suffix('.json').name}` |")
    w("")
    if rec is not None:
        t, data, r = rec["train"], rec["data"], rec["results"]
        w("## Data and training")
        w("")
        w("From the checkpoint's record:")
        w("")
        for d in DOMAINS:
            dd = data[d]
            w(f"- **{d}**: {dd['kind']}; {dd['documents']} documents, a stream of {dd['stream_tokens']:,} tokens; "
              f"{dd['train']['tokens']:,} training tokens used, {dd['heldout']['tokens']:,} held-out tokens "
              "evaluated.")
        w(f"- Held-out rule: {data['held_out_rule']}. Evaluation, capture and `run` read only held-out text.")
        w(f"- Text from {data['python_implementation']} {data['python_version']}; the record keeps a SHA-256 of "
          "every split.")
        w("")
        w(f"Recipe: {t['steps']:,} steps of {t['batch_size']} sequences of {t['seq_len']} tokens, half from each "
          f"domain; AdamW at lr {t['lr']:g} with {t['warmup']} warm-up steps and weight decay {t['weight_decay']:g} "
          f"(schedule, clipping and decay groups in `moebalance.lm.train`); auxiliary loss coefficient "
          f"{t['aux_loss_coef']:g}; seed {t['seed']}.")
        w("")
        w("```")
        w(rec["command"])
        w("```")
        w("")
        w(f"Training took **{rec['train_seconds']:.0f} s** with torch {rec['torch_version']} on "
          f"{rec['torch_threads']} thread(s).")
        w("")
        w(f"| held-out ({t['eval_tokens']:,} tokens) | bits per byte | unigram baseline | difference |")
        w("|---|---|---|---|")
        for d in DOMAINS:
            bpb, uni = r["bits_per_byte"][d], r["unigram_bits_per_byte"][d]
            w(f"| {d} | **{bpb:.3f}** | {uni:.3f} | {bpb - uni:+.2f} bits |")
        w("")
        w("The unigram baseline is the cross-entropy of the held-out bytes under the training bytes' frequencies.")
        w("")
        w("![loss curve](moe_lm_loss.png)")
        w("")
    sk = res["skew"]
    w("## Routing skew")
    w("")
    w(f"Captures of {sk['code']['tokens']:,} held-out tokens per domain, in batches of {BATCH:,} tokens spread "
      f"over {G} ranks (`moebalance capture --domain D --tokens {sk['code']['tokens']} --gpus {G} "
      f"--batch-tokens {BATCH}`); skew from `moebalance.workloads.stats.layer_skew`.")
    w("")
    w("| layer | peak/mean code | peak/mean prose | top-2 share code | top-2 share prose | experts never picked, "
      "code / prose | TV code vs prose | TV within code | TV within prose |")
    w("|---|---|---|---|---|---|---|---|---|")
    for layer in range(L):
        w(f"| {layer} | {_f(sk['code']['peak_to_mean'][layer], 2)} | {_f(sk['prose']['peak_to_mean'][layer], 2)} | "
          f"{_pct(sk['code']['top2_share'][layer])} | {_pct(sk['prose']['top2_share'][layer])} | "
          f"{sk['code']['dead'][layer]} / {sk['prose']['dead'][layer]} | {_f(res['tv_cross'][layer])} | "
          f"{_f(res['tv_within']['code'][layer])} | {_f(res['tv_within']['prose'][layer])} |")
    w("")
    E, K = cfg.num_experts, cfg.top_k
    w(f"- peak/mean: the hottest expert's load over the mean load; 1 for uniform routing, at most "
      f"{E // K} under top-{K} of {E}.")
    w(f"- top-2 share: the fraction of picks taken by the two hottest experts; {_pct(2 / E)} for uniform routing.")
    w(f"- experts never picked: no pick among the layer's {sk['code']['picks_per_layer']:,} picks.")
    w(f"- TV: total-variation distance between per-layer expert distributions; \"within\" compares the first "
      f"{PART:,} held-out tokens of a domain with the next {PART:,} (the control).")
    w(f"- The hottest expert takes {_span([100 * x for x in sk['code']['max_share']], 0)} % of code picks and "
      f"{_span([100 * x for x in sk['prose']['max_share']], 0)} % of prose picks, depending on the layer.")
    w(f"- Code and prose differ by TV {_span(res['tv_cross'])} per layer; two halves of one domain by "
      f"{_span(res['tv_within']['code'])} (code) and {_span(res['tv_within']['prose'])} (prose).")
    w("")
    w("![expert load per layer](moe_lm_routing.png)")
    w("")
    w("## Acceptance experiment: plan on one capture, score on held-out text")
    w("")
    w(f"- Cluster: {NODES} nodes x {GPUS_PER_NODE} GPUs; the {E} experts fit in {-(-E // G)} slots per GPU.")
    w(f"- Each domain's capture is split: **part A** (first {PART // BATCH} batches) to plan, **part B** (next "
      f"{PART // BATCH}) to score. Neither was used in training.")
    w("- Scoring: `moebalance.routing.simulate.evaluate`, uniform router (docs/design.md, \"Metrics\").")
    w("")
    w("```")
    w(f"moebalance capture --domain code --tokens {2 * PART} --gpus {G} --batch-tokens {BATCH} --out code.npz")
    w(f"moebalance compare --load code.npz --policies contiguous,greedy,eplb --nodes {NODES} --gpus-per-node "
      f"{GPUS_PER_NODE} --slots-per-gpu 3 --groups 1 --train-frac 0.5")
    w("```")
    w("")
    w(_acceptance_table(res))
    w("")
    w("Each cell is held-out balancedness (mean / max GPU load, 1 is perfect), planned on → scored on. "
      "Imbalance ratio and the gap to the lower bound, same order:")
    w("")
    w("| policy (budget) | imbalance ratio, code → code | prose → prose | lower-bound gap, code → code | prose → prose |")
    w("|---|---|---|---|---|")
    for pol, bud, _ in POLICIES:
        label = f"{pol} ({bud.describe()})"
        cc, pp = _row(res, label, "code", "code"), _row(res, label, "prose", "prose")
        w(f"| {_label(label)} | {cc['imbalance']:.2f} | {pp['imbalance']:.2f} | {cc['gap']:.3f} | {pp['gap']:.3f} |")
    w("")
    cont, ep = _row(res, "contiguous (slots_per_gpu=2)", "code", "code"), _row(res, "eplb (slots_per_gpu=3)", "code", "code")
    cr2 = _row(res, "craft (replicas_per_gpu=2)", "code", "code")
    w(f"- Planned and scored on code, EPLB with one extra slot per GPU per layer ({ep['extra_replicas']} extra "
      f"replicas) takes balancedness from {cont['balancedness']:.3f} (contiguous) to {ep['balancedness']:.3f}; "
      f"CRAFT at R = 2 reaches {cr2['balancedness']:.3f} with {cr2['extra_replicas']} extra replicas.")
    loss = [_row(res, f"{p} ({b.describe()})", d, d)["balancedness"] - _row(res, f"{p} ({b.describe()})", o, d)["balancedness"]
            for p, b, _ in POLICIES if p in ("eplb", "craft") for d, o in (("code", "prose"), ("prose", "code"))]
    w(f"- Planning on the other domain changes the replicated plans' held-out balancedness by {-max(loss):+.2f} to "
      f"{-min(loss):+.2f} against planning on the scored domain.")
    w("")
    dup = ep["duplicates"]
    w(f"EPLB's reference algorithm put two copies of one expert on one GPU in {dup} layer-GPU pair(s) of the "
      "code-planned plan (docs/design.md, \"Data formats\": a warning; docs/papers/eplb.md).")
    w("")
    w("![per-layer held-out balancedness](moe_lm_balance.png)")
    w("")
    if runs:
        w(_runtime_section(runs, L, K))
    if cmp is not None:
        w(_compare_section(res, rec, cmp))
    w("## Caveats")
    w("")
    w(f"- The model is tiny ({n_params / 1e6:.1f} M parameters). Treat it as a stress case for placement, not as "
      "a stand-in for a production model.")
    w("- Another CPython version ships different standard-library text, so its held-out text and these numbers "
      "differ slightly; the checkpoint's record names the text it was trained on.")
    w("")
    return "\n".join(out)


def _acceptance_table(res: dict[str, Any]) -> str:
    lines = ["| policy (budget) | extra replicas | code → code | prose → prose | code → prose | prose → code |",
             "|---|---|---|---|---|---|"]
    for pol, bud, _ in POLICIES:
        label = f"{pol} ({bud.describe()})"
        cells = [_f(_row(res, label, p, s)["balancedness"])
                 for p, s in (("code", "code"), ("prose", "prose"), ("code", "prose"), ("prose", "code"))]
        lines.append(f"| {_label(label)} | {_row(res, label, 'code', 'code')['extra_replicas']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _runtime_section(runs: list[dict[str, Any]], L: int, K: int) -> str:
    out = ["## The plans on the runtime: `moebalance run`", ""]
    r0 = runs[0]
    out.append(f"Each run uses {r0['world_size']} gloo processes (rank `g` = GPU `g` of the plan) on "
               f"{r0['num_tokens']:,} tokens of part B of held-out code in {r0['num_batches']} forward steps; the "
               f"plans were made on part A of code. All {L} MoE layers run through the expert-parallel layer.")
    out.append("")
    out.append("```")
    out.append(f"moebalance plan --load code.npz --policy eplb --nodes {NODES} --gpus-per-node {GPUS_PER_NODE} "
               f"--slots-per-gpu 3 --groups 1 --batches 0:{PART // BATCH} --out eplb.json")
    out.append(f"moebalance run --world-size {G} --plan eplb.json --domain code --offset {PART} --tokens {RUN_TOKENS}")
    out.append("```")
    out.append("")
    out.append("| plan | router | max abs logit diff vs dense | routing mismatches | picks per (batch, layer, rank) "
               "== simulator | runtime balancedness | `evaluate` (same router, same batches) |")
    out.append("|---|---|---|---|---|---|---|")
    for r in runs:
        out.append(f"| {_label(r['policy'])} | {r['router']} | {r['max_abs_logit_diff']:.2g} | "
                   f"{r['routing_mismatches']} | {'**yes**' if r['counts_match_simulator'] else 'NO'} | "
                   f"{r['balancedness']:.3f} | {r['evaluate']:.3f} |")
    out.append("")
    total = L * K * r0["num_tokens"]
    out.append(f"Picks computed per rank ({L} layers x {K} picks x {r0['num_tokens']:,} tokens = {total:,}), "
               "uniform router:")
    out.append("")
    out.append("| plan | " + " | ".join(f"rank {i}" for i in range(r0["world_size"])) + " |")
    out.append("|---|" + "---|" * r0["world_size"])
    uni = [r for r in runs if r["router"] == "uniform"]
    for r in uni:
        out.append(f"| {_label(r['policy'])} | " + " | ".join(f"{x['picks_computed']:,}" for x in r["ranks"]) + " |")
    out.append("")
    out.append("All-to-all bytes, summed over ranks (dispatch + combine), uniform router:")
    out.append("")
    out.append("| plan | within nodes | across nodes |")
    out.append("|---|---|---|")
    for r in uni:
        intra = sum(x["intra_node_bytes"] for x in r["ranks"]) / 1e6
        inter = sum(x["inter_node_bytes"] for x in r["ranks"]) / 1e6
        out.append(f"| {_label(r['policy'])} | {intra:.1f} MB | {inter:.1f} MB |")
    out.append("")
    out.append(f"- **Output**: logits with every MoE layer expert-parallel against the single-process dense model; "
               f"tolerance {r0['logit_tolerance']:g}.")
    out.append("- **Token counts**: the picks each rank computed per batch and layer against what the router's "
               "`assign_tokens` gives for the trace the run saw (same seeding as the runtime).")
    out.append("- **The `evaluate` column** scores the same batches with the simulator: for the uniform router it "
               "splits fractionally where the runtime splits integers round-robin, and for the random router it "
               "draws from another seeding, so it agrees only approximately; the exact check is the column before.")
    out.append("")
    return "\n".join(out)


def _compare_section(res: dict[str, Any], rec: dict[str, Any] | None, cmp: dict[str, Any]) -> str:
    other, orec, name = cmp["res"], cmp["record"], cmp["name"]
    out = [f"## For comparison: `{name}`", ""]
    if orec is not None:
        out.append(f"A second checkpoint, auxiliary loss coefficient {orec['train']['aux_loss_coef']:g}, otherwise "
                   f"trained as recorded in its record ({orec['train_seconds']:.0f} s); not shipped. Measured the "
                   "same way as above.")
    else:
        out.append("A second checkpoint, measured the same way as above.")
    out.append("")
    out.append(f"| | shipped | `{name}` |")
    out.append("|---|---|---|")
    if rec is not None and orec is not None and "results" in orec:
        a, b = rec["results"]["bits_per_byte"], orec["results"]["bits_per_byte"]
        out.append(f"| held-out bits per byte, code / prose | {a['code']:.3f} / {a['prose']:.3f} | "
                   f"{b['code']:.3f} / {b['prose']:.3f} |")

    def per_layer(r: dict[str, Any], key: str, d: str, nd: int = 2) -> str:
        return " ".join(f"{x:.{nd}f}" if isinstance(x, float) else str(x) for x in r["skew"][d][key])

    for d in DOMAINS:
        out.append(f"| peak/mean per layer, {d} | {per_layer(res, 'peak_to_mean', d)} | {per_layer(other, 'peak_to_mean', d)} |")
    out.append(f"| experts never picked per layer (code) | {per_layer(res, 'dead', 'code')} | {per_layer(other, 'dead', 'code')} |")
    out.append(f"| TV code vs prose per layer | {' '.join(f'{x:.2f}' for x in res['tv_cross'])} | "
               f"{' '.join(f'{x:.2f}' for x in other['tv_cross'])} |")
    for pol, bud, _ in POLICIES:
        label = f"{pol} ({bud.describe()})"
        for pair in ((("code", "code"), ("prose", "prose")), (("code", "prose"), ("prose", "code"))):
            desc = " / ".join(f"{p} → {s}" for p, s in pair)
            va = " / ".join(_f(_row(res, label, p, s)["balancedness"]) for p, s in pair)
            vb = " / ".join(_f(_row(other, label, p, s)["balancedness"]) for p, s in pair)
            out.append(f"| {_label(label)}, {desc} | {va} | {vb} |")
    out.append("")
    return "\n".join(out)


def _jsonable(res: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in res.items() if k not in ("caps", "plans")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--compare", type=Path, default=None, help="a second checkpoint to compare with")
    ap.add_argument("--out", type=Path, default=Path("docs/results/moe_lm.md"))
    ap.add_argument("--skip-run", action="store_true", help="leave out the 8-rank runtime runs")
    args = ap.parse_args()
    ckpt = Path(args.checkpoint) if args.checkpoint is not None else bundled_checkpoint()
    model = load_checkpoint(ckpt)
    res = analyse(model)
    runs = None if args.skip_run else runtime_runs(ckpt, res)
    cmp = None
    if args.compare is not None:
        cmp = {"res": analyse(load_checkpoint(args.compare)), "record": _record(args.compare),
               "name": args.compare.name}
    rec = _record(ckpt)
    text = render(rec, ckpt, model, res, runs, cmp)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        _plots(res, args.out.parent)
    except ImportError as exc:  # matplotlib missing: keep the previous plots
        print(f"plots skipped: {exc}")
    atomic_write_text(args.out, text)
    raw = {"main": _jsonable(res), "runs": runs, "compare": None if cmp is None else _jsonable(cmp["res"])}
    Path("/tmp/moe_lm_report.json").write_text(json.dumps(raw, indent=1, default=float))
    print(f"wrote {args.out} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    main()
