"""Plans that hold across workloads: EPLB and CRAFT planned on one task, on the sum of two, and for the worst of two.

Routing: DeepSeek-V2-Lite from DeepSeek's ESFT release (``law`` and ``translation``, 26 MoE layers of 64 experts,
top-6; token level), read as ``bench/real_report.py`` reads it: each task's sequences in order, tokens in batches
of 512 dealt to the ranks in contiguous blocks. Each task is split into halves by sequence; one half plans, the
other scores (held out). Both ways round: split A plans on the first halves and scores on the second, split B the
reverse.

Plans, each scored on both tasks' held-out halves with the uniform router (the default for scoring placements):
``law`` and ``translation`` (planned on that task alone), ``sum`` (both tasks' planning halves, ``objective=sum``:
the summed load, what ``moebalance plan --load A --load B`` does by default) and ``worst`` (``objective=worst``:
for the worst of the two). 2 nodes x 4 GPUs. EPLB global (one expert group, as in ``bench/real_report.py``) with 9
slots per GPU, 8 extra replicas per layer; CRAFT with R = 13 (104 extra replicas, half of EPLB's, where Alg. 2
has layers to choose between; at R = 26 the ladder 1, 2, 4, 8 leaves none: every layer takes 8) and R = 26.

Writes docs/results/robust.md. Run: .venv/bin/python bench/robust_report.py --esft DIR (or MOEBALANCE_ESFT_DIR=DIR),
DIR holding law_topk.npz and translation_topk.npz. Without the files it says so and writes nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import ROOT, batches_load, esft_batches, esft_from_args, esft_sequences, machine

from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.policies import make_plan
from moebalance.routing.simulate import evaluate

TASKS = ("law", "translation")
BATCH = 512
CLUSTER = Cluster(num_nodes=2, gpus_per_node=4)
E = 64
POLICIES: list[tuple[str, str, Budget, dict[str, Any]]] = [
    ("EPLB (global, 9 slots per GPU)", "eplb", Budget(slots_per_gpu=9), {"num_groups": 1}),
    ("CRAFT (R = 13)", "craft", Budget(replicas_per_gpu=13), {}),
    ("CRAFT (R = 26)", "craft", Budget(replicas_per_gpu=26), {}),
]
PLANS = ("law", "translation", "sum", "worst")
#: The row every plan is measured against: experts in order, 8 per GPU, no replica (it depends on no load).
CONTIGUOUS = "contiguous (no replicas)"


def halves(folder: Path) -> dict[str, tuple[LoadMatrix, LoadMatrix]]:
    """Each task's ``(first half, second half)`` of its sequences as token-level loads."""
    out = {}
    for t in TASKS:
        seqs = esft_sequences(folder / f"{t}_topk.npz")
        half = len(seqs) // 2
        first, second = (batches_load(esft_batches(part, BATCH, CLUSTER.num_gpus), E)
                         for part in (seqs[:half], seqs[half:]))
        out[t] = (first, second)
    return out


def concatenated(loads: list[LoadMatrix]) -> LoadMatrix:
    """The loads' batches one after another (counts only: the planners read counts)."""
    return LoadMatrix(np.concatenate([x.counts for x in loads]))


def mixed(loads: list[LoadMatrix]) -> LoadMatrix:
    """Batches that serve both tasks at once: batch ``i`` of each load added up (as many as the shorter has)."""
    n = min(x.num_batches for x in loads)
    return LoadMatrix(np.sum([x.counts[:n] for x in loads], axis=0))


def score_split(plan_on: dict[str, LoadMatrix], score_on: dict[str, LoadMatrix]) -> dict[tuple[str, str], dict[str, float]]:
    """``{(policy label, plan): {task or "mixed": held-out balancedness}}``."""
    both = concatenated([plan_on[t] for t in TASKS])
    sizes = [plan_on[t].num_batches for t in TASKS]
    scored = {**score_on, "mixed": mixed([score_on[t] for t in TASKS])}
    out: dict[tuple[str, str], dict[str, float]] = {}
    for label, policy, budget, params in POLICIES:
        for which in PLANS:
            if which in TASKS:
                plan, _ = make_plan(policy, plan_on[which], CLUSTER, budget, **params)
            else:
                plan, _ = make_plan(policy, both, CLUSTER, budget, objective=which, workload_batches=sizes, **params)
            out[label, which] = {t: evaluate(plan, load).balancedness for t, load in scored.items()}
    plan, _ = make_plan("contiguous", both, CLUSTER, Budget(slots_per_gpu=E // CLUSTER.num_gpus))
    out[CONTIGUOUS, "none"] = {t: evaluate(plan, load).balancedness for t, load in scored.items()}
    return out


def table(results: dict[tuple[str, str], dict[str, float]]) -> list[str]:
    rows = ["| policy | planned on | law (held out) | translation (held out) | worst of the two | mixed batches |",
            "|---|---|---|---|---|---|"]
    got = results[CONTIGUOUS, "none"]
    rows.append(f"| {CONTIGUOUS} | no load | {got['law']:.3f} | {got['translation']:.3f} | "
                f"{min(got[t] for t in TASKS):.3f} | {got['mixed']:.3f} |")
    for label, *_ in POLICIES:
        for which in PLANS:
            got = results[label, which]
            shown = {"sum": "both, summed (objective=sum)", "worst": "both, worst (objective=worst)"}.get(which, which)
            rows.append(f"| {label} | {shown} | {got['law']:.3f} | {got['translation']:.3f} | "
                        f"{min(got[t] for t in TASKS):.3f} | {got['mixed']:.3f} |")
    return rows


def verdicts(split: str, results: dict[tuple[str, str], dict[str, float]]) -> list[str]:
    """One line per policy: does the worst-of plan have the best held-out worst case? Said as it is."""
    lines = []
    for label, *_ in POLICIES:
        worst = {w: min(results[label, w][t] for t in TASKS) for w in PLANS}
        others = ", ".join(f"{w} {worst[w]:.3f}" for w in PLANS if w != "worst")
        best_single = max(worst["law"], worst["translation"])
        if worst["worst"] > best_single:
            verdict = f"**better** than a plan on either task (by {worst['worst'] - best_single:+.3f})"
        else:
            verdict = f"**not better** than the better single-task plan ({worst['worst'] - best_single:+.3f})"
        vs_sum = "above" if worst["worst"] > worst["sum"] else "not above"
        lines.append(f"- Split {split}, {label}: worst-of plan's held-out worst case {worst['worst']:.3f}, "
                     f"{verdict}; {vs_sum} the summed plan ({others}).")
    return lines


def unseen(split: str, results: dict[tuple[str, str], dict[str, float]]) -> list[str]:
    """A plan scored on the task it was not made on (a workload it never saw), against contiguous, said plainly."""
    base = results[CONTIGUOUS, "none"]
    lines = []
    for label, *_ in POLICIES:
        cells = [(f"{made} plan on {other}", results[label, made][other] - base[other])
                 for made, other in (("law", "translation"), ("translation", "law"))]
        shown = "; ".join(f"{text} {gain:+.3f}" for text, gain in cells)
        lines.append(f"- Split {split}, {label}, against contiguous on the task the plan never saw: {shown}.")
    return lines


def mixed_note(split: str, results: dict[tuple[str, str], dict[str, float]]) -> str:
    """Where the summed plan is the right one: batches holding both tasks at once."""
    cells = "; ".join(f"{label}: sum {results[label, 'sum']['mixed']:.3f}, worst {results[label, 'worst']['mixed']:.3f}"
                      for label, *_ in POLICIES)
    return f"- Split {split}, on batches that mix both tasks (held-out batch `i` of each added up): {cells}."


def main() -> None:
    folder = esft_from_args(__doc__, "docs/results/robust.md")
    if folder is None:
        return
    t0 = time.perf_counter()
    parts = halves(folder)
    first = {t: parts[t][0] for t in TASKS}
    second = {t: parts[t][1] for t in TASKS}
    a = score_split(first, second)
    b = score_split(second, first)
    batches = {t: (parts[t][0].num_batches, parts[t][1].num_batches) for t in TASKS}
    w = ["# Plans that hold across workloads", "",
         "<!-- Generated by bench/robust_report.py; do not edit by hand. -->", "",
         "Held-out balancedness (`mean / max` GPU load per batch and layer, averaged; 1 is perfect; uniform router) "
         "of plans made on one ESFT task, on the sum of both, and for the worst of both "
         "(`moebalance plan --load A --load B --set objective=worst`). The method is in "
         "`bench/robust_report.py`'s docstring; the algorithm in `src/moebalance/algorithms/robust.py`.", "",
         f"Machine: {machine()}. Whole report: {{seconds}} s.", "",
         "Routing: ESFT-vanilla-lite (DeepSeek-V2-Lite architecture) over the `law` and `translation` tasks "
         "(github.com/deepseek-ai/ESFT, commit 579a7711e4b332b4c57b47e378a0cf240d85caa6, `results/expert_scores`). "
         f"Batches of {BATCH} tokens per half: law {batches['law'][0]} + {batches['law'][1]}, translation "
         f"{batches['translation'][0]} + {batches['translation'][1]}. 2 nodes x 4 GPUs.", "",
         "## What it shows", "", *verdicts("A", a), *verdicts("B", b), "",
         "Every plan above was made on routing of the tasks it is scored on (other sequences of the same tasks). "
         "On a task a plan never saw, it can do worse than no plan at all: a plan made on one task and scored on "
         "the other, against contiguous (experts in order, no replicas), in balancedness:", "",
         *unseen("A", a), *unseen("B", b), "",
         "The summed and worst-of plans saw both tasks, so two tasks cannot show them on one they never saw; "
         "nothing here says they transfer better. Plan on routing of the workload you serve: a plan made for other "
         "tasks is a guess about this one.", "",
         "Planning for the worst fits workloads that arrive in turn (each batch from one of them). Where every "
         "batch mixes them, their sum is what a GPU serves, and the summed plan is the one made for it:", "",
         mixed_note("A", a), mixed_note("B", b), "",
         "## Split A: planned on the first halves, scored on the second", "", *table(a), "",
         "## Split B: planned on the second halves, scored on the first", "", *table(b), ""]
    text = "\n".join(w).replace("{seconds}", f"{time.perf_counter() - t0:.0f}")
    out = ROOT / "docs" / "results" / "robust.md"
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
