"""Large token-level traces: peak memory and time of the everyday commands at 1M and 10M DeepSeek-V3-like tokens.

The trace: ``moebalance synth --token-level`` draws a base of 4 batches x 16,384 tokens of the DeepSeek-V3 preset
(58 MoE layers, 256 experts, top-8) on 64 ranks; the bench then writes traces of 1,048,576 and 10,485,760 tokens
(64 and 640 batches) from it, each 4-batch tile with the expert ids of every layer renamed by its own random
permutation (each tile as skewed as the base, its hot experts elsewhere), streamed into an uncompressed ``.npz``
as ``numpy.savez`` would write it (the 10M trace is 9.7 GB of ``int16`` ids; it is never held in memory, never
committed). ``synth`` itself draws a Gumbel race over all 256 experts per token and layer: 6 minutes per 1M
tokens here, so it makes the base only.

Each command then runs in its own process at both sizes; its peak resident memory (``ru_maxrss`` of the child,
file pages it maps included) and wall time are recorded: ``stats``, ``plan --policy eplb``, ``plan --policy
grace``, ``evaluate --router random``, ``compare`` (two policies, two routers) and ``online`` (EPLB re-planned
every 16 batches). Target: every command under 3 GB at 10M tokens, time linear in tokens (the 10M/1M ratio near
10).

What keeps memory flat: the ids memory-mapped from the file (compressed or 64-bit members spilled once to an
unlinked temporary file and mapped), every count walking them in chunks and handing each chunk's pages back
(``moebalance.core.tally``), replay routing a few batches at a time and releasing them
(``moebalance.routing.simulate``).

Writes docs/results/bench_large.md. Run: .venv/bin/python bench/bench_large.py [--sizes 1,10] (millions of
tokens, multiples of 1,048,576 / 2**20 rounded to whole tiles).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
from _common import ROOT, machine, peak_run

BATCH, BASE_BATCHES, GPUS = 16384, 4, 64
TARGET_GB = 3.0

def run(argv: list[str]) -> tuple[float, float]:
    """``(seconds, peak GB)`` of ``moebalance argv`` in a fresh process (its own ``ru_maxrss``)."""
    return peak_run(["-m", "moebalance", *argv])


def _member(zf: zipfile.ZipFile, name: str, array: np.ndarray) -> None:
    with zf.open(name, "w", force_zip64=True) as fh:
        np.lib.format.write_array(fh, np.asarray(array), allow_pickle=False)


def write_tiled(base: Path, out: Path, tiles: int, seed: int = 0) -> int:
    """Write ``tiles`` copies of the base trace, each with its experts renamed per layer, as an uncompressed
    ``.npz`` at ``out``, streaming the ids; returns the tokens written."""
    with np.load(base, allow_pickle=False) as data:
        ids, src, batch, counts = data["topk_ids"], data["src_gpu"], data["batch"], data["counts"]
        preset = data["preset"]
    T, L, K = ids.shape
    B, _, E = counts.shape
    rng = np.random.default_rng(seed)
    perms = [np.stack([rng.permutation(E) for _ in range(L)]) for _ in range(tiles)]  # [L, E] per tile
    layer = np.arange(L)[None, :, None]
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        with zf.open("topk_ids.npy", "w", force_zip64=True) as fh:
            np.lib.format.write_array_header_2_0(fh, {"descr": np.lib.format.dtype_to_descr(ids.dtype),
                                                      "fortran_order": False, "shape": (tiles * T, L, K)})
            for perm in perms:
                fh.write(np.ascontiguousarray(perm[layer, ids].astype(ids.dtype)).tobytes())
        _member(zf, "src_gpu.npy", np.tile(src, tiles))
        _member(zf, "batch.npy", np.concatenate([batch + i * B for i in range(tiles)]))
        tiled = np.empty((tiles * B, L, E), dtype=counts.dtype)
        for i, perm in enumerate(perms):  # expert perm[l, e] gets e's picks
            np.put_along_axis(tiled[i * B:(i + 1) * B], np.broadcast_to(perm[None], (B, L, E)), counts, axis=2)
        _member(zf, "counts.npy", tiled)
        _member(zf, "preset.npy", preset)
    return tiles * T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,10", help="trace sizes in units of 2**20 tokens, comma-separated")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    rows: list[tuple[int, str, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="moebalance-large-") as tmp:
        base = Path(tmp) / "base.npz"
        seconds, peak = run(["synth", "--preset", "deepseek-v3", "--batches", str(BASE_BATCHES), "--tokens-per-batch",
                             str(BATCH), "--gpus", str(GPUS), "--token-level", "--out", str(base)])
        print(f"synth base ({BASE_BATCHES * BATCH:,} tokens): {seconds:.1f} s, peak {peak:.2f} GB", flush=True)
        for size in sizes:
            trace, plan = Path(tmp) / f"trace{size}.npz", str(Path(tmp) / "eplb.json")
            t0 = time.perf_counter()
            tokens = write_tiled(base, trace, size * (1 << 20) // (BASE_BATCHES * BATCH))
            print(f"wrote {tokens:,} tokens ({trace.stat().st_size / 1e9:.1f} GB) in {time.perf_counter() - t0:.0f} s",
                  flush=True)
            t = str(trace)
            cluster = ["--nodes", "8", "--gpus-per-node", "8", "--slots-per-gpu", "5"]
            steps = [
                ("stats", ["stats", "--load", t]),
                ("plan --policy eplb", ["plan", "--load", t, "--policy", "eplb", *cluster, "--out", plan]),
                ("plan --policy grace", ["plan", "--load", t, "--policy", "grace", *cluster,
                                         "--out", str(Path(tmp) / "grace.json")]),
                ("evaluate --router random", ["evaluate", "--plan", plan, "--load", t, "--router", "random"]),
                ("compare (eplb, grace; uniform, rebalance)", ["compare", "--load", t, "--policies", "eplb,grace",
                                                               "--router", "uniform,rebalance", *cluster]),
                ("online (eplb every 16 batches)", ["online", "--load", t, "--policy", "eplb", "--warmup", "0:4",
                                                    "--replan-every", "16",
                                                    *cluster]),
            ]
            for label, argv in steps:
                seconds, peak = run(argv)
                rows.append((tokens, label, seconds, peak))
                print(f"{tokens:,} tokens, {label}: {seconds:.1f} s, peak {peak:.2f} GB", flush=True)
            trace.unlink()
    labels = list(dict.fromkeys(label for _, label, _, _ in rows))
    counts = sorted({n for n, _, _, _ in rows})
    cell = {(n, label): (s, gb) for n, label, s, gb in rows}
    head = "| command | " + " | ".join(f"{n:,} tokens: seconds | peak GB" for n in counts)
    head += " | time ratio | under 3 GB |" if len(counts) > 1 else " | under 3 GB |"
    w = ["# Large token-level traces", "", "<!-- Generated by bench/bench_large.py; do not edit by hand. -->", "",
         "Synthetic DeepSeek-V3-like token-level traces (58 MoE layers, 256 experts, top-8, 64 ranks; 4-batch tiles "
         "of a `synth` base with each layer's experts renamed per tile), stored uncompressed; each command in its "
         f"own process on 8 x 8 GPUs with 5 slots each. Target: under {TARGET_GB:g} GB at every size, time linear "
         "in tokens.", "", f"Machine: {machine()}.", "", head,
         "|---|" + "---|---|" * len(counts) + ("---|---|" if len(counts) > 1 else "---|")]
    for label in labels:
        parts = [f"{cell[(n, label)][0]:.1f} | {cell[(n, label)][1]:.2f}" for n in counts]
        line = f"| `{label}` | " + " | ".join(parts)
        if len(counts) > 1:
            line += f" | {cell[(counts[-1], label)][0] / cell[(counts[0], label)][0]:.1f}x for " \
                    f"{counts[-1] / counts[0]:.0f}x tokens"
        ok = all(cell[(n, label)][1] < TARGET_GB for n in counts)
        w.append(line + f" | {'yes' if ok else 'no'} |")
    w += ["", "Peak resident memory is the command's own `ru_maxrss` (mapped file pages it holds included), "
          f"measured from a fresh parent process. At {counts[-1]:,} tokens the ids alone are "
          f"{counts[-1] * 58 * 8 * 2 / 1e9:.1f} GB as int16: memory-mapped, walked in chunks, each chunk's pages "
          "handed back.", ""]
    (ROOT / "docs" / "results" / "bench_large.md").write_text("\n".join(w))
    print("wrote docs/results/bench_large.md")


if __name__ == "__main__":
    main()
