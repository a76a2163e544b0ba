"""Store the ``metro`` search's modelled layer times on seeded inputs, the reference its faster search is held to.

Writes ``tests/data/metro/reference.npz``: for every seeded ``(batch, layer)`` problem its loads, host matrix and
cost vector, and the layer time of the split that the search returned when the file was made (the kernel's own
measure, :func:`moebalance.algorithms.metro.layer_time`). The stored numbers come from the search of the commit
"metro: store the nine-search kernel's layer times" (nine local searches from three starts);
``tests/test_metro.py`` holds today's faster search to them: in total no slower on the DeepSeek-V3 problems, and
within 0.1% in total on the random ones. Rerunning overwrites the reference with today's search, so the script
refuses unless given ``--force``.

Inputs: DeepSeek-V3-like decode counts (64 GPUs x 256 experts, EPLB with 256 redundant experts, 8 and 32 tokens
per GPU) and small random problems (4-16 GPUs, 8-64 experts, 1-3 copies each), with decode and prefill costs.
Run: .venv/bin/python bench/metro_reference.py --force
"""

from __future__ import annotations

import sys

import numpy as np
from _common import ROOT

from moebalance.algorithms import metro, minmax
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import get_gpu
from moebalance.models import get_model
from moebalance.policies import Budget, make_plan
from moebalance.workloads.synth import synthesize

OUT = ROOT / "tests" / "data" / "metro" / "reference.npz"


def _problems() -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(W [E], has [E, G], cost [5])`` per problem."""
    out = []
    d = Deployment(model=get_model("deepseek-v3"), gpu=get_gpu("h100-80gb"), precision="bf16")
    cluster = Cluster(num_nodes=8, gpus_per_node=8)
    cost = d.cost_vector(cluster)
    for per_gpu in (8, 32):
        arrays = synthesize("deepseek-v3", num_batches=10, tokens_per_batch=per_gpu * 64, num_gpus=64, seed=per_gpu)
        load = LoadMatrix(arrays["counts"], None, "deepseek-v3")
        plan = make_plan("eplb", load.select_batches(0, 8), cluster, Budget(slots_per_gpu=8))[0]
        for b in (8, 9):
            for layer in range(0, 58, 4):
                out.append((load.counts[b, layer].astype(np.int64), plan.copies[layer] > 0, cost))
    rng = np.random.default_rng(7)
    decode = cost.copy()
    prefill = cost * np.array([1.0, 0.02, 1.0, 1.0, 1.0])  # weights cheap beside the picks: compute-bound
    for i in range(400):
        G, E = int(rng.integers(4, 17)), int(rng.integers(8, 65))
        has = np.zeros((E, G), dtype=bool)
        has[np.arange(E), rng.integers(0, G, E)] = True
        for e in np.flatnonzero(rng.random(E) < 0.4):
            has[e, rng.choice(G, size=int(rng.integers(1, 3)), replace=False)] = True
        scale = float(rng.choice([3.0, 30.0, 300.0]))
        W = rng.poisson(scale * rng.pareto(1.5, E)).astype(np.int64)
        out.append((W, has, decode if i % 2 == 0 else prefill))
    return out


def main() -> None:
    if OUT.exists() and "--force" not in sys.argv[1:]:
        raise SystemExit(f"{OUT.relative_to(ROOT)} holds the reference of an earlier search; give --force to replace it")
    problems = _problems()
    times = np.empty(len(problems))
    for i, (W, has, cost) in enumerate(problems):
        hstart, hosts = minmax.host_lists(has)
        take = metro.split_layer(W, hstart, hosts, has.shape[1], cost)
        times[i] = metro.layer_time(take, hosts, has.shape[1], cost)
    E = max(p[1].shape[0] for p in problems)
    G = max(p[1].shape[1] for p in problems)
    W = np.zeros((len(problems), E), dtype=np.int64)
    has = np.zeros((len(problems), E, G), dtype=bool)
    shape = np.array([p[1].shape for p in problems], dtype=np.int64)
    for i, (w, h, _) in enumerate(problems):
        W[i, :w.size] = w
        has[i, :h.shape[0], :h.shape[1]] = h
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, loads=W, has=has, shape=shape, cost=np.array([p[2] for p in problems]), seconds=times)
    print(f"wrote {OUT.relative_to(ROOT)}: {len(problems)} problems, total {times.sum() * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
