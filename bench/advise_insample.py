"""How far ``advise``'s in-sample gains hold on batches it did not plan on.

With one statistics file (counts summed over a run, as SGLang's ``--init-expert-location`` statistics are)
``advise`` plans and prices every configuration on the same counts: its gains over EPLB off are in sample. Here
the same configurations are priced both ways on real routing no one here wrote, DeepSeek-V2-Lite from DeepSeek's
ESFT release (``law`` and ``translation``, 26 MoE layers of 64 experts, top-6; token level; each task's sequences in
order, tokens in batches of 512 dealt to 8 ranks in contiguous blocks):

- **in sample**: the first half of a task's batches summed into one statistics batch, ``advise --json`` on it;
- **held out**: the first half planned on and the second half priced (``advise --train-frac F`` with F the first
  half's share), the same phase, deployment and candidates;
- **another workload**: the first half planned on and the other task's second half priced (``advise --price-load``),
  the auditor's question of how far a gain holds on routing of another kind.

For each configuration both runs price (the periodic re-plans need several batches and are left out), the
difference of its gain over EPLB off, held out minus in sample, in percentage points; and whether the in-sample
pick still beats EPLB off held out. 1 node x 8 H100s, SGLang, prefill steps (where balance decides the step: a decode
step of this model reads every hosted expert whatever the balance), default options.

Writes docs/results/advise_insample.md. Run: .venv/bin/python bench/advise_insample.py --esft DIR (or
MOEBALANCE_ESFT_DIR; DIR holds law_topk.npz and translation_topk.npz). Without them it says so and writes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import ROOT, batches_load, esft_batches, esft_from_args, esft_sequences, machine

from moebalance.core.load import LoadMatrix, write_load

TASKS = ("law", "translation")
BATCH = 512
GPUS = 8
ARGS = ["--model", "deepseek-v2-lite", "--nodes", "1", "--gpus-per-node", str(GPUS), "--gpu", "h100-80gb",
        "--engine", "sglang", "--phase", "prefill", "--json"]


def _advise(load: Path, *extra: str) -> tuple[dict[str, float], str]:
    """``({label: gain over EPLB off}, the recommendation's label)`` of ``advise --json`` on ``load``."""
    proc = subprocess.run([sys.executable, "-m", "moebalance", "advise", "--load", str(load), *ARGS, *extra],
                          capture_output=True, text=True, check=True)
    doc = json.loads(proc.stdout)
    off = next(c for c in doc["candidates"] if c["label"].startswith("off "))["tokens_per_s"]
    return {c["label"]: c["tokens_per_s"] / off - 1.0 for c in doc["candidates"]}, doc["recommendation"]["label"]


def main() -> None:
    folder = esft_from_args(__doc__, "docs/results/advise_insample.md")
    if folder is None:
        return
    t0 = time.perf_counter()
    rows, picks, cross_rows, cross_picks = [], [], [], []
    insample: dict[str, tuple[dict[str, float], str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for task in TASKS:
            seqs = esft_sequences(folder / f"{task}_topk.npz")
            parts = esft_batches(seqs, BATCH, GPUS)
            load = batches_load(parts, 64)
            half = load.num_batches // 2
            full, stats = Path(tmp) / f"{task}.npz", Path(tmp) / f"{task}_stats.npz"
            write_load(full, LoadMatrix(load.counts, load.trace, "deepseek-v2-lite"))
            write_load(stats, LoadMatrix(load.counts[:half].sum(axis=0, keepdims=True), None, "deepseek-v2-lite"))
            inside, pick = _advise(stats)
            insample[task] = inside, pick
            named = LoadMatrix(load.counts, load.trace, "deepseek-v2-lite")
            write_load(Path(tmp) / f"{task}_first.npz", named.select_batches(0, half))
            write_load(Path(tmp) / f"{task}_second.npz", named.select_batches(half, load.num_batches))
            held, _ = _advise(full, "--train-frac", f"{half / load.num_batches:.12g}")
            common = [k for k in inside if k in held and not k.startswith("off ")]
            diffs = np.array([100 * (held[k] - inside[k]) for k in common])
            rows.append(f"| {task} | {load.num_batches} ({half} planned on) | {len(common)} | {diffs.min():+.1f} | "
                        f"{np.median(diffs):+.1f} | {diffs.max():+.1f} |")
            picks.append(f"- {task}: in sample `advise` picks {pick} ({100 * inside[pick]:+.1f}% over EPLB off); held "
                         f"out the same configuration models {100 * held.get(pick, float('nan')):+.1f}%.")
        for task, other in ((TASKS[0], TASKS[1]), (TASKS[1], TASKS[0])):
            inside, pick = insample[task]
            cross, _ = _advise(Path(tmp) / f"{task}_first.npz", "--price-load", str(Path(tmp) / f"{other}_second.npz"))
            common = [k for k in inside if k in cross and not k.startswith("off ")]
            diffs = np.array([100 * (cross[k] - inside[k]) for k in common])
            cross_rows.append(f"| {task} | {other} | {len(common)} | {diffs.min():+.1f} | {np.median(diffs):+.1f} | "
                              f"{diffs.max():+.1f} |")
            cross_picks.append(f"- planned on {task}, priced on {other}: the in-sample pick, {pick}, models "
                               f"{100 * cross.get(pick, float('nan')):+.1f}% over EPLB off (in sample "
                               f"{100 * inside[pick]:+.1f}%).")
    lines = ["# advise: in-sample gains against held-out ones", "",
             "<!-- Generated by bench/advise_insample.py; do not edit by hand. -->", "",
             f"Machine: {machine()}. Whole run: {time.perf_counter() - t0:.0f} s. Method: the script's docstring.", "",
             "Each configuration's gain over EPLB off, held out minus in sample, in percentage points:", "",
             "| task | batches | configurations | least | median | most |", "|---|---|---|---|---|---|", *rows, "",
             *picks, "", "An in-sample gain says how a configuration does on the routing it was planned on; on later "
             "routing of the same task the gains above moved by the amounts in the table. Read an in-sample figure "
             "with that spread, and where a load has several batches let `advise` plan and price on different ones "
             "(its default, `--train-frac 0.5`).", "",
             "## On another workload", "",
             "Each configuration planned on one task's first half and priced on the other task's second half "
             "(`advise --price-load`), its gain over EPLB off minus the in-sample gain, in percentage points:", "",
             "| planned on | priced on | configurations | least | median | most |", "|---|---|---|---|---|---|",
             *cross_rows, "", *cross_picks, "",
             "Routing of another kind moves a gain further than later routing of the same kind. Where the served "
             "traffic changes, give `advise` a load of the new traffic (`--price-load`) before trusting its figure.",
             ""]
    out = ROOT / "docs" / "results" / "advise_insample.md"
    tmp_out = out.with_suffix(".md.tmp")
    tmp_out.write_text("\n".join(lines))
    os.replace(tmp_out, out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
