"""Write the bundled real trace ``bundled:esft-law`` (``src/moebalance/workloads/data/esft_law.npz``).

The source is real routing, not ours: DeepSeek's ESFT repository (github.com/deepseek-ai/ESFT, commit
579a7711e4b332b4c57b47e378a0cf240d85caa6, ``results/expert_scores/law/expert_weights_{1..26}.txt``, made by its
``scripts/expert/get_expert_scores.py``), converted to ``law_topk.npz`` (``expert_ids [26, T, 6]``,
``gate_weights [26, T, 6]``, ``seq_offsets``; T = 8,327 tokens). Licence and provenance ship beside the data in
``src/moebalance/workloads/data/esft_law.LICENSE.txt``.

Conversion, as the benchmarks do it (``bench/_common.py``): each token's picks re-ordered by gate weight (top-1
first), the law sequences concatenated in order and cut into batches of 512 tokens (the partial tail, 135 tokens,
is dropped: 16 batches, 8,192 tokens), and each batch's tokens dealt to 8 data-parallel ranks in contiguous blocks
of 64. Written through the library as a token-level load with ``preset = "deepseek-v2-lite"`` and ``layer_ids``
1..26 (the model's decoder-layer index of each MoE layer; layer 0 is dense).

Run: .venv/bin/python bench/make_bundled_esft.py --esft DIR (the folder holding law_topk.npz)
(or set MOEBALANCE_ESFT_DIR). ``--check`` compares the bundled file with the source instead of writing it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from _common import ROOT, batches_load, esft_batches, esft_folder, esft_sequences

from moebalance.core.load import LoadMatrix, read_load, write_load
from moebalance.models import get_model

TASK = "law"
PRESET = "deepseek-v2-lite"
BATCH_TOKENS = 512
RANKS = 8
OUT = ROOT / "src" / "moebalance" / "workloads" / "data" / f"esft_{TASK}.npz"


def build(folder: Path) -> tuple[LoadMatrix, int, int]:
    """The bundled load from the ESFT folder, with the task's token count and the tokens dropped at the tail."""
    spec = get_model(PRESET)
    seqs = esft_sequences(folder / f"{TASK}_topk.npz")
    tokens = sum(len(s) for s in seqs)
    parts = esft_batches(seqs, BATCH_TOKENS, RANKS)
    raw = batches_load(parts, spec.num_experts)
    layer_ids = np.arange(spec.num_dense_layers, spec.num_dense_layers + spec.num_layers)
    load = LoadMatrix(raw.counts, raw.trace, PRESET, layer_ids)
    if load.num_layers != spec.num_layers or raw.trace is None or raw.trace.top_k != spec.top_k:
        sys.exit(f"make_bundled_esft: {folder / f'{TASK}_topk.npz'} has {load.num_layers} layers, not the "
                 f"{spec.num_layers} MoE layers of top-{spec.top_k} of {PRESET}")
    return load, tokens, tokens - len(parts) * BATCH_TOKENS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--esft", type=Path,
                        help="folder with law_topk.npz and translation_topk.npz (default: $MOEBALANCE_ESFT_DIR)")
    parser.add_argument("--check", action="store_true",
                        help="compare the bundled file with the source instead of writing it (exit 1 if they differ)")
    args = parser.parse_args()
    folder = esft_folder(args.esft)
    if folder is None:
        sys.exit("make_bundled_esft: no ESFT routing; give --esft DIR or MOEBALANCE_ESFT_DIR (a folder with "
                 "law_topk.npz and translation_topk.npz)")
    load, tokens, dropped = build(folder)
    if args.check:
        have = read_load(OUT).to_arrays()
        want = load.to_arrays()
        same = sorted(have) == sorted(want) and all(np.array_equal(have[k], want[k]) for k in want)
        print(f"{OUT.relative_to(ROOT)} {'matches' if same else 'DIFFERS FROM'} the source")
        sys.exit(0 if same else 1)
    write_load(OUT, load)
    B, L, E = load.shape
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size / 1e6:.2f} MB): {B} batches x {BATCH_TOKENS} tokens "
          f"on {RANKS} ranks, {L} layers x {E} experts; {tokens:,} tokens in the source, the last {dropped} dropped")


if __name__ == "__main__":
    main()
