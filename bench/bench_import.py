"""Streamed ``moebalance import`` of SGLang per-token dumps: peak memory and time at 0.5M and 2M tokens.

The dumps are DeepSeek-V3's as SGLang's ``per_token`` recorder writes them (the fields of ``write_pass_dumps`` in
``tests/test_engines.py``): one ``torch.save`` file per rank, ``expert_distribution_recorder_{time}_{rank}.pt``,
holding ``last_physical_to_logical_map int64 [61, 288]`` and a record per forward pass with ``forward_pass_id``,
``global_physical_count int32 [61, 288]``, ``topk_ids_of_layer int32 [61, tokens, 8]`` (the model's 61 decoder
layers, the three dense ones -1 throughout; 256 experts on 288 physical slots, experts 0-31 with a second copy)
and the pass's ``input_ids`` and ``positions`` lists. Each token's 8 experts lie 32 apart from a start drawn from
a Zipf-like law (so they are distinct), each served by a random copy.

Folders: 8 ranks x 16 passes x 4,096 tokens (524,288 tokens) and 32 ranks of the same (2,097,152 tokens): the
files are the same size, so memory should not move; then 8 ranks x 64 passes (2,097,152 tokens in files four
times larger): memory follows the largest file, not the total. ``moebalance import`` runs in a fresh process
(peak resident memory: ``ru_maxrss`` of a fresh parent's child, as in ``bench/bench_large.py``); at 0.5M tokens
today's whole read (``read_dumps`` then ``write_load``, what ``import`` ran before) runs too, and the two files'
arrays are checked equal.

Writes docs/results/bench_import.md. Run: .venv/bin/python bench/bench_import.py (about 5 minutes on 2 cores;
needs about 12 GB of free disk under $TMPDIR).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _common import ROOT, machine, peak_run

LAYERS, DENSE, EXPERTS, COPIES, TOP_K, PAD = 61, 3, 256, 32, 8, 8  # DeepSeek-V3; SGLang pads top-k ids to 8
SLOTS = EXPERTS + COPIES
PASS_TOKENS = 4096

_WHOLE = ("import sys; from moebalance.core.load import write_load; from moebalance.engines.sglang import read_dumps; "
          "write_load(sys.argv[2], read_dumps(sys.argv[1]))")


def write_rank(path: Path, rank: int, passes: int, rng: np.random.Generator, tokens: int = PASS_TOKENS) -> None:
    """One rank's per_token dump of ``passes`` passes of ``tokens`` tokens each, as SGLang writes it."""
    weights = 1.0 / np.arange(1, EXPERTS + 1) ** 0.8
    cdf = np.cumsum(weights / weights.sum())
    phy2log = np.tile(np.concatenate([np.arange(EXPERTS), np.arange(COPIES)]), (LAYERS, 1)).astype(np.int64)
    records = []
    for fid in range(passes):
        start = np.minimum(np.searchsorted(cdf, rng.random((LAYERS - DENSE, tokens))), EXPERTS - 1)
        logical = (start[..., None] + (EXPERTS // TOP_K) * np.arange(TOP_K)) % EXPERTS
        copy = (logical < COPIES) & (rng.random(logical.shape) < 0.5)
        topk = np.full((LAYERS, tokens, PAD), -1, dtype=np.int32)
        topk[DENSE:, :, :TOP_K] = np.where(copy, logical + EXPERTS, logical)
        picked = topk[DENSE:].reshape(LAYERS - DENSE, -1)
        count = np.zeros((LAYERS, SLOTS), dtype=np.int32)
        count[DENSE:] = [np.bincount(row, minlength=SLOTS) for row in picked]
        records.append({"forward_pass_id": fid, "rank": rank, "gatherer_key": "primary",
                        "input_ids": rng.integers(0, 129280, tokens).tolist(),
                        "positions": list(range(tokens)), "extend_seq_lens": [tokens], "forward_mode": 1,
                        "global_physical_count": torch.from_numpy(count),
                        "topk_ids_of_layer": torch.from_numpy(topk), "misc_objects": []})
    torch.save({"records": records, "last_physical_to_logical_map": torch.from_numpy(phy2log)}, path)


def write_folder(folder: Path, ranks: int, passes: int, seed: int, tokens: int) -> None:
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for rank in range(ranks):
        write_rank(folder / f"expert_distribution_recorder_1719999999.123_{rank}.pt", rank, passes, rng, tokens)


def _disk(folder: Path) -> tuple[int, int]:
    """``(largest file, total)`` of a folder, in bytes."""
    sizes = [f.stat().st_size for f in folder.iterdir()]
    return max(sizes), sum(sizes)


def same_arrays(a: Path, b: Path) -> bool:
    with np.load(a) as x, np.load(b) as y:
        return sorted(x.files) == sorted(y.files) and all(
            x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]) for k in x.files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pass-tokens", type=int, default=PASS_TOKENS,
                        help="tokens of each rank's pass (smaller for a quick check of the script)")
    tokens = parser.parse_args().pass_tokens
    rows: list[tuple[str, int, str, float, float, float, float]] = []
    equal = None
    with tempfile.TemporaryDirectory(prefix="moebalance-import-") as tmp:
        t = Path(tmp)
        t0 = time.perf_counter()
        write_folder(t / "r32", 32, 16, seed=0, tokens=tokens)
        (t / "r8").mkdir()
        for f in sorted((t / "r32").iterdir(), key=lambda p: int(p.stem.rsplit("_", 1)[1]))[:8]:
            os.link(f, t / "r8" / f.name)  # the first 8 ranks: the same files
        write_folder(t / "big", 8, 64, seed=1, tokens=tokens)
        print(f"wrote the dumps in {time.perf_counter() - t0:.0f} s", flush=True)
        cases = [(f"8 ranks x {16 * tokens:,} tokens", "r8", 8 * 16),
                 (f"32 ranks x {16 * tokens:,} tokens", "r32", 32 * 16),
                 (f"8 ranks x {64 * tokens:,} tokens", "big", 8 * 64)]
        for label, name, passes in cases:
            folder, out = t / name, t / f"{name}.npz"
            total_tokens = passes * tokens
            largest, total = _disk(folder)
            seconds, peak = peak_run(["-m", "moebalance", "import", "--load", str(folder), "--out", str(out)])
            rows.append((label, total_tokens, "`moebalance import` (streamed)", largest / 2**20, total / 2**30, seconds, peak))
            print(f"{label}: import {seconds:.1f} s, peak {peak:.2f} GB, {out.stat().st_size / 2**30:.2f} GiB out",
                  flush=True)
            if name == "r8":
                whole = t / "whole.npz"
                seconds, peak = peak_run(["-c", _WHOLE, str(folder), str(whole)])
                rows.append((label, total_tokens, "whole read (`read_dumps` + `write_load`, before)", largest / 2**20,
                             total / 2**30, seconds, peak))
                equal = same_arrays(out, whole)
                print(f"{label}: whole read {seconds:.1f} s, peak {peak:.2f} GB; arrays equal: {equal}", flush=True)
                whole.unlink()
            out.unlink()
    w = ["# Streamed import of SGLang per-token dumps", "",
         "<!-- Generated by bench/bench_import.py; do not edit by hand. -->", "",
         "DeepSeek-V3 per_token dumps as SGLang writes them (one `torch.save` file per rank; per pass "
         f"`topk_ids_of_layer int32 [61, {tokens}, 8]` over the 61 decoder layers, the 3 dense ones -1, and "
         "`global_physical_count int32 [61, 288]`, 256 experts on 288 slots), imported into a token-level `.npz` "
         "(58 MoE layers, top-8, `int16` ids stored uncompressed). Each command in its own process; peak resident "
         "memory is its `ru_maxrss`.", "", f"Machine: {machine()}.", "",
         "| dumps | tokens | reader | largest file MB | dumps GiB | seconds | peak GB |", "|---|---|---|---|---|---|---|"]
    for label, n, what, largest, total, seconds, peak in rows:
        w.append(f"| {label} | {n:,} | {what} | {largest:.0f} | {total:.2f} | {seconds:.1f} | {peak:.2f} |")
    w += ["", f"The streamed file's arrays equal the whole read's at {rows[0][1]:,} tokens: {'yes' if equal else 'NO'}. "
          "The whole read holds every rank's ids at once as int64 (and copies of them), so at four times the tokens "
          "it would need about four times that peak; it is not run there. The streamed import reads one file at a "
          "time and stages each pass's ids beside the output (about the output's size of free disk), so its memory "
          "follows the largest file, not the number of tokens.", ""]
    (ROOT / "docs" / "results" / "bench_import.md").write_text("\n".join(w))
    print("wrote docs/results/bench_import.md")


if __name__ == "__main__":
    main()
