"""Runtime overhead: replica-aware dispatch against plain expert parallelism, same tokens.

One MoE layer forward on 4 gloo ranks (one CPU process each, ``torch.set_num_threads(1)`` per rank), SwiGLU
experts, softmax top-2, tokens drawn so that the gate's routing is Zipf-skewed (expert popularity
``~ 1 / rank``, hot experts shuffled over the id space). Compared, on the same tokens and weights:

(a) **plain expert parallelism**, the baseline (:class:`PlainEP` below): a contiguous plan without replicas,
    the gate, a static expert -> rank table applied to this rank's own picks, one ``[G]`` all-to-all of row
    counts, one all-to-all of the hidden rows (each token once per destination rank, as the runtime does)
    with each row's picks (local slot, gate weight: ``2K`` floats) riding along as extra columns, the expert
    FFNs, the combine all-to-all and the per-token sum. No router, no all-gather, no global bookkeeping.
    It reuses the runtime's dispatcher, compute and merge, so its rows meet the same matmuls and its output
    is checked to be bit-identical to the replica-aware layer's.
(b) **replica-aware dispatch** (:class:`moebalance.runtime.ExpertParallelMoE`) on the *same* plan with each
    router: every rank all-gathers the ``[T_r, 2K]`` float32 routing and runs the router and
    :func:`~moebalance.runtime.build_dispatch` on the whole batch. Plan, tokens, rows sent and compute are
    identical to (a), so the difference is the routing and dispatch bookkeeping: the overhead.
(c) separately, a plan **with** replicas (EPLB, 2 extra slots per rank, planned on other tokens of the same
    distribution): here the load per rank changes too, so the time difference is the plan's benefit.

Layer time of one iteration = the slowest rank's wall time for the forward, all ranks released together by
a barrier; tables give the median over the timed iterations (after warm-up), the configurations interleaved
in a rotating order within each iteration so that drift hits all alike. Overhead = median over iterations of
(replica-aware - plain) in the same iteration, as a share of plain's median layer time.

Prints the tables and writes docs/results/bench_runtime.md.
Run: .venv/bin/python bench/bench_runtime.py [--runs 24 --settings 512x1024x32x2048,256x512x64x4096,128x256x16x256]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _common import ROOT, machine

from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.policies import Budget, make_plan
from moebalance.routing import ROUTERS
from moebalance.runtime import (
    DispatchMeta,
    EPConfig,
    ExpertParallelMoE,
    GateConfig,
    all_to_all_v,
    build_dispatch,
    exchange_counts,
    launch,
    random_experts,
    route_picks,
    slot_table,
    topk_gating,
)
from moebalance.runtime.dispatch import ExpertWork

WORLD = 4
NODES, GPUS_PER_NODE = 2, 2  # 2 x 2, so that the locality router has a node tier
TOP_K = 2
ROUTER_NAMES = sorted(ROUTERS)
#: The contiguous plan with ``EPConfig(max_tokens_per_rank=T_r)``: one fixed-size routing gather.
FIXED = "contiguous-fixed"
PLAIN_STAGES = ("gate", "static map + row metadata (host)", "count all-to-all", "dispatch all-to-all",
                "expert compute", "combine all-to-all", "merge")
AWARE_STAGES = ("gate", "all-gather routing", "router (host)", "build_dispatch (host)", "dispatch all-to-all",
                "expert compute", "combine all-to-all", "merge")

#: Fixed notes at the end of the report (what the numbers mean on this machine, and what was sped up).
NOTES = """
## Reading the numbers

- On this 2-core machine the 4 ranks share 2 cores, and the end-to-end differences are noisy: the
  *noise floor* row (the baseline against itself, same iterations) is the scale of error of that column.
  The *bookkeeping stages* column is steadier: the host stages are small, and only the two small
  collectives (all-gather of the routing against plain's count all-to-all) carry wait time.
- Where the layer does real work (the first two settings: several hundred ms per forward), the
  bookkeeping stages cost about 0.5-1% (first setting) and 5% (second) of layer time for every router. The
  end-to-end differences scatter more (a few per cent, the noise floor up to 2%) and land above 5% for one router or another in some runs
  (up to 8% on the second setting). Most of the cost is the all-gather of the routing (two collectives: the sizes, then the
  `[T_r, 2K]` float32 rows) against plain's single count all-to-all; the router and `build_dispatch` on the
  whole batch take a few ms.
- Where the layer is latency-bound (the last setting: 256 tokens per rank, a layer of under 20 ms) the
  fixed cost of the extra collective round dominates and the overhead is far above 5%: replica-aware
  dispatch, as built (every rank routes the whole batch after an all-gather), pays off on batches of
  thousands of tokens per rank, not on tiny ones. `EPConfig(max_tokens_per_rank=N)`, for engines that
  bound the tokens per rank anyway (CUDA graphs, DeepEP's low-latency mode), gathers the routing in one
  fixed-size collective instead of two (sizes, then rows): the row "routing gathered in one collective"
  shows what that saves (on the small setting about half of the overhead).
- With replicas (EPLB) the picks per rank become nearly equal, but on 2 shared cores the total CPU work,
  not the slowest rank alone, bounds the layer time, so the measured gain (13-21% on the first two settings
  in the run reported here) understates what separate GPUs would see: the picks-per-rank columns show the balance itself (the hot rank's 9,150 or
  14,935 picks become about 4,100 or 8,200).

Sped up for this benchmark, outputs unchanged (checked against the previous code on thousands of random
cases, and by the runtime tests' dense and simulator equalities), timed in one process on this machine
(commit 94b9fc6 against its parent) with
16,384 tokens x top-2 on 4 GPUs: `build_dispatch` without sorting (boolean tables instead of `np.unique` and
`lexsort`): 5.0 ms to 1.0 ms; the `uniform` router numbers only the picks of replicated experts
(contiguous plan: 3.0 ms to 0.7 ms); `locality` and `wrr` build their draw tables per (GPU, expert) instead
of per token (EPLB plan: 10.3 ms to 4.0 ms and 5.1 ms to 3.2 ms).
"""


# ---------------------------------------------------------------- inputs, identical in every process
def make_inputs(hidden: int, experts: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [tokens, H]`` and the gate ``[H, E]``: token means chosen so that expert ``e``'s mean logit is
    ``log p_e`` with Zipf popularity ``p ~ 1 / rank`` (ranks shuffled over the expert ids)."""
    g = torch.Generator().manual_seed(1000 + experts)  # the gate and the skew: the same for every seed
    gate = torch.randn(hidden, experts, generator=g) / hidden**0.5
    order = torch.randperm(experts, generator=g)
    logit_mean = -torch.log(torch.arange(1, experts + 1, dtype=torch.float64))[torch.argsort(order)]
    mu = torch.linalg.lstsq(gate.T.double(), logit_mean[:, None]).solution[:, 0].float()  # mu @ gate = logit_mean
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)) + mu
    return x, gate


# ---------------------------------------------------------------- the baseline
class PlainEP:
    """Plain expert parallelism on a plan without replicas: the least a layer needs to move and compute.

    Built from a replica-aware layer on the same plan, whose experts, dispatcher (all-to-all), compute and
    merge it reuses, so the two differ only in how each rank learns where rows go and what they carry.
    """

    def __init__(self, layer: ExpertParallelMoE) -> None:
        plan = layer.layer_plan
        if plan.extra_replicas:
            raise ValueError("plain expert parallelism needs a plan with exactly one copy of every expert")
        self.layer = layer
        self.rank, self.world = layer.rank, plan.num_gpus
        E = plan.num_experts
        self.owner_E = np.full(E, -1, dtype=np.int64)
        for g, experts in enumerate(plan.gpu_experts[0]):
            self.owner_E[np.asarray(experts, dtype=np.int64)] = g
        self.slot_E = slot_table(plan)[self.owner_E, np.arange(E)]  # each expert's slot on its owner

    def forward(self, x_TH: torch.Tensor, times: dict[str, float] | None = None) -> torch.Tensor:
        lay, rank, G, K = self.layer, self.rank, self.world, self.layer.gate_config.top_k
        clock = _Stages(times)
        gate = topk_gating(x_TH @ lay.gate_HE, lay.gate_config, selection_bias_E=lay.selection_bias_E)
        clock.mark("gate")
        ids, w = gate.topk_ids.numpy(), gate.topk_weights.numpy()
        dest = np.where(gate.kept.numpy(), self.owner_E[ids], -1)  # [T_r, K]
        T = ids.shape[0]
        need_GT = np.zeros((G, T), dtype=bool)  # token t has a pick served on rank g
        tok, k = np.nonzero(dest >= 0)
        need_GT[dest[tok, k], tok] = True
        local_token = np.flatnonzero(need_GT[rank])
        need_GT[rank] = False  # a pick served here is not sent
        send_dst, send_tok = np.nonzero(need_GT)  # grouped by destination, then token: as build_dispatch
        send_counts = np.bincount(send_dst, minlength=G)
        on = dest[send_tok] == send_dst[:, None]  # [N, K]: the row's picks its destination serves
        meta_NK2 = np.concatenate([np.where(on, self.slot_E[ids[send_tok]], -1),
                                   np.where(on, w[send_tok], 0.0)], axis=1).astype(np.float32)
        lt, lk = np.nonzero(dest == rank)
        local = ExpertWork(pick_row=torch.from_numpy(np.searchsorted(local_token, lt)),
                           pick_slot=torch.from_numpy(self.slot_E[ids[lt, lk]]),
                           pick_weight=torch.from_numpy(w[lt, lk]), num_rows=int(local_token.size))
        clock.mark("static map + row metadata (host)")
        recv_counts = exchange_counts(torch.from_numpy(send_counts))
        clock.mark("count all-to-all")
        send_t = torch.from_numpy(send_tok)
        rows = torch.cat([x_TH.index_select(0, send_t), torch.from_numpy(meta_NK2)], dim=1)
        received = all_to_all_v(rows, send_counts.tolist(), recv_counts.tolist()).wait()
        clock.mark("dispatch all-to-all")
        H = x_TH.shape[1]
        slots_MK = received[:, H:H + K].long()
        r, kk = torch.nonzero(slots_MK >= 0, as_tuple=True)  # row-major: as build_dispatch orders picks
        remote = ExpertWork(pick_row=r, pick_slot=slots_MK[r, kk], pick_weight=received[:, H + K:][r, kk],
                            num_rows=int(received.shape[0]))
        remote_out = lay._compute(received[:, :H], remote)
        local_out = lay._compute(x_TH.index_select(0, torch.from_numpy(local_token)), local)
        clock.mark("expert compute")
        meta = DispatchMeta(rank=rank, send_token=send_t, send_counts=tuple(int(c) for c in send_counts),
                            recv_counts=tuple(int(c) for c in recv_counts), local_token=torch.from_numpy(local_token),
                            local=local, remote=remote)
        back = lay.dispatcher.combine(remote_out.to(x_TH.dtype), meta)
        clock.mark("combine all-to-all")
        out = lay._merge(x_TH, local_out, back, meta)
        clock.mark("merge")
        return out


def staged_forward(layer: ExpertParallelMoE, x_TH: torch.Tensor, step: int,
                   times: dict[str, float]) -> torch.Tensor:
    """:meth:`ExpertParallelMoE.forward` (``local_first=False``) step by step with a clock between the steps,
    for the breakdown only; its output is checked to equal the layer's."""
    clock = _Stages(times)
    gate = topk_gating(x_TH @ layer.gate_HE, layer.gate_config, selection_bias_E=layer.selection_bias_E)
    clock.mark("gate")
    K = layer.gate_config.top_k
    encoded = torch.where(gate.kept, gate.topk_ids, -1 - gate.topk_ids).float()
    routing = torch.cat([encoded, gate.topk_weights.float()], 1)
    parts = [p.numpy() for p in layer.dispatcher.gather_routing(routing, layer.config.max_tokens_per_rank)]
    tokens_per_rank = [p.shape[0] for p in parts]
    allr = np.concatenate(parts)
    clock.mark("all-gather routing")
    enc = allr[:, :K].astype(np.int64)
    kept = enc >= 0
    ids = np.where(kept, enc, -1 - enc)
    rng = np.random.default_rng((layer.config.router_seed, layer.layer, step))
    dest = route_picks(layer.layer_plan, layer.config.router, ids, kept, tokens_per_rank, rng)
    clock.mark("router (host)")
    meta = build_dispatch(dest, ids, allr[:, K:], tokens_per_rank, layer.rank, layer.slot_of)
    clock.mark("build_dispatch (host)")
    received = layer.dispatcher.dispatch(x_TH, meta).wait()
    clock.mark("dispatch all-to-all")
    remote_out = layer._compute(received, meta.remote)
    local_out = layer._compute(x_TH.index_select(0, meta.local_token), meta.local)
    clock.mark("expert compute")
    back = layer.dispatcher.combine(remote_out.to(x_TH.dtype), meta)
    clock.mark("combine all-to-all")
    out = layer._merge(x_TH, local_out, back, meta)
    clock.mark("merge")
    return out


class _Stages:
    """Adds the time since the previous mark to ``times[name]`` (nothing when ``times`` is None)."""

    def __init__(self, times: dict[str, float] | None) -> None:
        self.times = times
        self.t = time.perf_counter()

    def mark(self, name: str) -> None:
        if self.times is not None:
            now = time.perf_counter()
            self.times[name] = self.times.get(name, 0.0) + now - self.t
            self.t = now


# ---------------------------------------------------------------- what every rank runs
def _worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)  # launch() sets it too; one thread per rank, said in the report
    H, F, E, Tr = spec["hidden"], spec["ffn"], spec["experts"], spec["tokens"]
    x_all, gate = make_inputs(H, E, world_size * Tr, seed=1)
    x = x_all[rank * Tr:(rank + 1) * Tr].contiguous()
    full = random_experts(E, H, F, seed=2)
    gcfg = GateConfig(top_k=TOP_K)
    plans = {name: Placement.from_json_dict(doc) for name, doc in spec["plans"].items()}
    layers = {(p, r): ExpertParallelMoE.from_full(plans[p], 0, gate, full, gcfg, EPConfig(router=r))
              for p in plans for r in ROUTER_NAMES}
    # the routing gathered in one fixed-size collective (every rank has Tr tokens: the bound is known)
    layers[(FIXED, "uniform")] = ExpertParallelMoE.from_full(
        plans["contiguous"], 0, gate, full, gcfg, EPConfig(router="uniform", max_tokens_per_rank=Tr))
    plain = PlainEP(layers[("contiguous", "uniform")])

    # correctness first: the baseline and the staged mirror compute exactly what the layer computes
    ref = plain.forward(x)
    for (p, r), layer in layers.items():
        res = layer.forward(x, step=0)
        if p in ("contiguous", FIXED) and not torch.equal(res.out, ref):
            raise AssertionError(f"plain EP and the replica-aware layer ({r}) differ on the same plan")
        if not torch.equal(staged_forward(layer, x, 0, {}), res.out):
            raise AssertionError(f"the staged mirror of the layer ({p}, {r}) differs from the layer")

    # "plain again" is the baseline timed twice per iteration: its difference to plain is the noise floor
    configs: list[tuple[str, Any]] = [("plain", lambda: plain.forward(x)), ("plain again", lambda: plain.forward(x))]
    configs += [(f"{p}/{r}", lambda lay=layer: lay.forward(x)) for (p, r), layer in layers.items()]
    # end to end: the real forward; every configuration once per iteration, the order rotating
    warmup, runs = spec["warmup"], spec["runs"]
    wall: dict[str, list[float]] = {name: [] for name, _ in configs}
    for it in range(warmup + runs):
        shift = it % len(configs)
        for name, fn in configs[shift:] + configs[:shift]:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if it >= warmup:
                wall[name].append(dt)
    # breakdown: plain and the staged replica-aware forward, stage by stage
    staged: dict[str, list[dict[str, float]]] = {"plain": []}
    staged.update({f"{p}/{r}": [] for (p, r) in layers})
    for it in range(warmup + spec["stage_runs"]):
        for name in staged:
            times: dict[str, float] = {}
            dist.barrier()
            if name == "plain":
                plain.forward(x, times)
            else:
                p, r = name.split("/")
                staged_forward(layers[(p, r)], x, it, times)
            if it >= warmup:
                staged[name].append(times)
    loads = {f"{p}/{r}": int(layers[(p, r)].forward(x, step=0).stats.tokens_computed) for (p, r) in layers}
    return {"wall": {k: np.asarray(v) for k, v in wall.items()}, "staged": staged, "loads": loads}


# ---------------------------------------------------------------- planning and the report
def plan_inputs(hidden: int, experts: int, tokens: int) -> dict[str, dict[str, Any]]:
    """Contiguous and EPLB plans for ``WORLD`` ranks, planned on other tokens (seed 0) of the same routing."""
    x, gate = make_inputs(hidden, experts, WORLD * tokens, seed=0)
    ids = topk_gating(x @ gate, GateConfig(top_k=TOP_K)).topk_ids.numpy()
    src = np.repeat(np.arange(WORLD), tokens)
    trace = RoutingTrace(ids[:, None, :], src, np.zeros(src.size, dtype=np.int64), num_experts=experts)
    load = LoadMatrix(trace.counts(), trace)
    cluster = Cluster(num_nodes=NODES, gpus_per_node=GPUS_PER_NODE)
    per_gpu = experts // WORLD
    contiguous, _ = make_plan("contiguous", load, cluster, Budget(slots_per_gpu=per_gpu))
    eplb, _ = make_plan("eplb", load, cluster, Budget(slots_per_gpu=per_gpu + 2), num_groups=1)
    return {"contiguous": contiguous.to_json_dict(), "eplb": eplb.to_json_dict()}


def skew(hidden: int, experts: int, tokens: int) -> float:
    x, gate = make_inputs(hidden, experts, WORLD * tokens, seed=1)
    ids = topk_gating(x @ gate, GateConfig(top_k=TOP_K)).topk_ids.numpy()
    counts = np.bincount(ids.ravel(), minlength=experts)
    return float(counts.max() / counts.mean())


def run_setting(hidden: int, ffn: int, experts: int, tokens: int, runs: int, stage_runs: int,
                warmup: int) -> dict[str, Any]:
    spec = {"hidden": hidden, "ffn": ffn, "experts": experts, "tokens": tokens, "runs": runs,
            "stage_runs": stage_runs, "warmup": warmup, "plans": plan_inputs(hidden, experts, tokens)}
    t0 = time.perf_counter()
    per_rank = launch(_worker, WORLD, spec, timeout=3600.0)
    seconds = time.perf_counter() - t0
    layer = {k: np.max([r["wall"][k] for r in per_rank], axis=0) for k in per_rank[0]["wall"]}  # [runs]
    stages = {}
    for name in per_rank[0]["staged"]:
        keys = per_rank[0]["staged"][name][0].keys()
        # per iteration the slowest rank's stage time, then the median over iterations
        stages[name] = {s: float(np.median(np.max([[it[s] for it in r["staged"][name]] for r in per_rank], axis=0)))
                        for s in keys}
    loads = {k: [r["loads"][k] for r in per_rank] for k in per_rank[0]["loads"]}
    return {"spec": spec, "layer": layer, "stages": stages, "loads": loads, "seconds": seconds,
            "skew": skew(hidden, experts, tokens)}


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def report(results: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Runtime benchmark: replica-aware dispatch against plain expert parallelism",
        "",
        f"Machine: {machine()}; torch {torch.__version__}. {WORLD} gloo ranks on this machine, one process each "
        "with `torch.set_num_threads(1)`. With fewer cores than ranks the ranks share cores, so layer times are "
        "longer than on a machine with a core per rank; the overhead is host work on the same shared cores, so "
        "the ratio is the figure to read.",
        f"Command: `{command}`.",
        "",
        "Setting: one MoE layer, SwiGLU experts, softmax top-2, no capacity limit, a cluster of 2 nodes x 2 GPUs "
        "(one rank per GPU), tokens drawn so that the gate's routing is Zipf-skewed. *plain* is expert "
        "parallelism with a static expert -> rank table, a count all-to-all and the rows' picks riding on the "
        "dispatch all-to-all (no router, no all-gather); the replica-aware layer all-gathers the routing and runs "
        "the router and `build_dispatch` for the whole batch on every rank. On the contiguous plan both send "
        "the same rows to the same experts and their outputs are bit-identical (checked before timing), so the "
        "difference is the replica-aware bookkeeping. Layer time = the slowest rank's forward, ranks released "
        "together by a barrier; median over the timed iterations; overhead = median of the per-iteration "
        "difference to plain, as a share of plain's median.",
    ]
    for res in results:
        sp = res["spec"]
        layer, loads = res["layer"], res["loads"]
        base = float(np.median(layer["plain"]))
        noise = float(np.median(layer["plain again"] - layer["plain"]))
        lines += [
            "",
            f"## H = {sp['hidden']}, FFN = {sp['ffn']}, {sp['experts']} experts, {sp['tokens']} tokens per rank",
            "",
            f"Routing skew: the hottest expert gets {res['skew']:.1f}x the mean expert load. "
            f"{sp['runs']} timed iterations after {sp['warmup']} warm-up, breakdown over {sp['stage_runs']} "
            f"(whole run {res['seconds']:.0f} s).",
            "",
            "### Overhead: the same contiguous plan (no replicas), the same tokens",
            "",
            "| dispatch | router | layer time (median) | end to end vs plain | share of layer time "
            "| bookkeeping stages vs plain's | share of layer time | picks per rank |",
            "|---|---|---|---|---|---|---|---|",
            f"| plain EP (baseline) | none: static map | {_ms(base)} | - | - | - | - | {loads['contiguous/uniform']} |",
            f"| plain EP, timed again (noise floor) | none: static map | {_ms(float(np.median(layer['plain again'])))} "
            f"| {1e3 * noise:+.1f} ms | {100 * noise / base:+.1f}% | - | - | same |",
        ]
        st = res["stages"]
        plain_only = st["plain"]["static map + row metadata (host)"] + st["plain"]["count all-to-all"]
        rows = [("replica-aware", f"contiguous/{r}", r) for r in ROUTER_NAMES]
        rows.append(("replica-aware, routing gathered in one collective (`max_tokens_per_rank`)", f"{FIXED}/uniform",
                     "uniform"))
        for label, key, r in rows:
            t = layer[key]
            diff = float(np.median(t - layer["plain"]))
            book = sum(st[key][s] for s in AWARE_STAGES[1:4]) - plain_only
            lines.append(f"| {label} | {r} | {_ms(float(np.median(t)))} | {diff * 1e3:+.1f} ms | "
                         f"{100 * diff / base:+.1f}% | {book * 1e3:+.1f} ms | {100 * book / base:+.1f}% | "
                         f"{loads[key]} |")
        lines += [
            "",
            "*End to end*: median over iterations of the difference to plain in the same iteration. *Bookkeeping "
            "stages*: from the breakdown below, (all-gather routing + router + build_dispatch) minus plain's "
            "(static map + count all-to-all), the stages in which the two differ.",
        ]
        lines += [
            "",
            "### With replicas: EPLB, 2 extra slots per rank (load changes too: this is the plan's benefit)",
            "",
            "| plan | router | layer time (median) | vs plain EP on contiguous | picks per rank |",
            "|---|---|---|---|---|",
        ]
        for r in ROUTER_NAMES:
            t = layer[f"eplb/{r}"]
            diff = float(np.median(t - layer["plain"]))
            lines.append(f"| eplb | {r} | {_ms(float(np.median(t)))} | {100 * diff / base:+.1f}% | "
                         f"{loads[f'eplb/{r}']} |")
        lines += [
            "",
            "(The EPLB plan has no routing weights, so `wrr` draws replicas with equal weights, like `random`.)",
            "",
            "### Breakdown (per stage: the slowest rank, median over iterations)",
            "",
            "Collective stages include waiting for the other ranks to arrive. The slowest rank differs between "
            "stages (the rank with the hot experts computes longest, the others wait for it in the combine), so "
            "a column does not add up to the layer time.",
            "",
        ]
        shown = ["plain", *(f"contiguous/{r}" for r in ROUTER_NAMES), f"{FIXED}/uniform", "eplb/locality"]
        stage_names = list(dict.fromkeys([*PLAIN_STAGES[:2], *AWARE_STAGES[1:4], *PLAIN_STAGES[2:]]))
        heads = [s.replace(f"{FIXED}/", "one-collective gather, ").replace("contiguous/", "").replace("/", " ") for s in shown]
        lines.append("| stage | " + " | ".join(heads) + " |")
        lines.append("|---|" + "---|" * len(shown))
        for st in stage_names:
            cells = [_ms(res["stages"][n][st]) if st in res["stages"][n] else "-" for n in shown]
            lines.append(f"| {st} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + NOTES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=24)
    ap.add_argument("--stage-runs", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--settings", default="512x1024x32x2048,256x512x64x4096,128x256x16x256",
                    help="comma-separated HIDDENxFFNxEXPERTSxTOKENS_PER_RANK")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "bench_runtime.md"))
    args = ap.parse_args()
    results = []
    for setting in args.settings.split(","):
        h, f, e, t = (int(v) for v in setting.split("x"))
        results.append(run_setting(h, f, e, t, args.runs, args.stage_runs, args.warmup))
        print(f"done {setting} in {results[-1]['seconds']:.0f} s", flush=True)
    command = ".venv/bin/python bench/bench_runtime.py"
    if (args.runs, args.stage_runs, args.warmup) != (24, 8, 3) or args.settings != ap.get_default("settings"):
        command += f" --runs {args.runs} --stage-runs {args.stage_runs} --warmup {args.warmup} --settings {args.settings}"
    text = report(results, command)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
