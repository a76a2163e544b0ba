"""Libra's exact mode in the runtime (docs/design.md, "Runtime"): each layer plans its extras and routing after its
gate, on real gloo process groups of 2 and 4 ranks. The outputs equal the dense reference, every rank routes as the
simulator's libra with the batch's true routing does (the per-batch plan from ``policies.libra.batch_plan`` on the
batch's per-source demand, routed by the router), the prefetch buffers hold exactly the planned experts, the
timing from the gate to the experts is reported in three non-negative parts, and the errors are one line. One
4-rank launch (per test process) runs everything, the 2-rank jobs in a subgroup of ranks 0 and 1.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import assert_user_error, run_cli

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, MoebalanceError
from moebalance.core.plan import Placement, write_plan
from moebalance.core.trace import RoutingTrace
from moebalance.policies.libra import LibraConfig, batch_plan
from moebalance.prediction.predictors import demand_of
from moebalance.routing import ROUTERS, get_router
from moebalance.runtime import (
    EPConfig,
    ExactConfig,
    ExpertParallelMoE,
    ExpertPrefetcher,
    ExpertWeights,
    GateConfig,
    dense_moe,
    exact_layer_plan,
    launch,
    layer_placement,
    plan_exact,
    random_experts,
)

E, H, FFN, K, L, N, ALPHA, SEED, BATCHES = 8, 16, 24, 2, 3, 2, 0.5, 5, 3
CLUSTER = {2: (1, 2), 4: (2, 2)}
TOKENS = {2: [24, 16], 4: [20, 0, 14, 10]}  # rank 1 of 4 has no tokens
#: name: (router, local_first, max_tokens_per_rank set, capacity factor)
VARIANTS = {"rebalance": ("rebalance", False, False, None), "local_first": ("rebalance", True, False, None),
            "fixed_size": ("rebalance", False, True, None), "capacity": ("rebalance", False, False, 1.0),
            "uniform": ("uniform", True, False, None)}


# ---------------------------------------------------------------- inputs, identical in every process
def _base(world_size: int) -> Placement:
    """Contiguous experts, plus in layer 1 a second copy of expert 0 on the last GPU (another node on 4 GPUs)."""
    G = world_size
    per = E // G
    layer = [list(range(g * per, (g + 1) * per)) for g in range(G)]
    with_copy = [list(x) for x in layer]
    with_copy[-1].append(0)
    return Placement([layer, with_copy, layer], E, Cluster(num_nodes=CLUSTER[G][0], gpus_per_node=CLUSTER[G][1]))


def _x(world_size: int, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED * 100 + 10 * world_size + batch)
    return torch.randn(sum(TOKENS[world_size]), H, generator=g)


def _gates() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    # a skew towards experts 0 and 1, so that GPU 0 is the hot one and the planner has work to do
    return [torch.randn(H, E, generator=g) + torch.tensor([1.5, 1.0] + [0.0] * (E - 2)) for _ in range(L)]


def _experts() -> list[ExpertWeights]:
    return [random_experts(E, H, FFN, seed=SEED + li) for li in range(L)]


def _identity_experts(layer: int) -> ExpertWeights:
    """Every entry of expert ``e`` of ``layer`` is ``1000 * layer + e``: a buffer slot shows what it holds."""
    ident = (1000.0 * layer + torch.arange(E, dtype=torch.float32))[:, None, None]
    return ExpertWeights(ident.expand(E, H, FFN).clone(), ident.expand(E, FFN, H).clone(),
                         ident.expand(E, H, FFN).clone())


def _gate_config(capacity: float | None) -> GateConfig:
    return GateConfig(top_k=K, capacity_factor=capacity)


# ---------------------------------------------------------------- what every rank runs
def _worker(rank: int, world_size: int, jobs: list[int]) -> dict[int, Any]:
    pair = torch.distributed.new_group([0, 1]) if world_size > 2 else None  # every rank must create it
    return {ws: _run(rank, ws, None if ws == world_size else pair) for ws in jobs if rank < ws}


def _layers(base: Placement, full: list[ExpertWeights], cfg: EPConfig, gcfg: GateConfig, group: Any,
            ) -> tuple[list[ExpertParallelMoE], ExpertPrefetcher]:
    pf = ExpertPrefetcher(N, group=group)
    gates = _gates()
    return [ExpertParallelMoE.from_full(base, li, gates[li], full[li], gcfg, cfg, group=group, prefetcher=pf)
            for li in range(L)], pf


def _run(rank: int, world_size: int, group: Any) -> dict[str, Any]:
    base = _base(world_size)
    off = np.concatenate([[0], np.cumsum(TOKENS[world_size])])
    xs = [_x(world_size, b)[off[rank]:off[rank + 1]] for b in range(BATCHES)]
    out: dict[str, Any] = {"runs": {}, "ident": []}
    exact = ExactConfig(n=N, alpha=ALPHA)
    for name, (router, local_first, fixed, capacity) in VARIANTS.items():
        cfg = EPConfig(router=router, router_seed=SEED, local_first=local_first, exact=exact,
                       max_tokens_per_rank=max(TOKENS[world_size]) if fixed else None)
        layers, pf = _layers(base, _experts(), cfg, _gate_config(capacity), group)
        run = []
        for b in range(BATCHES):  # a residual chain, as in a model
            h, per_layer = xs[b], []
            for li in range(L):
                res = layers[li](h, step=b)
                s = res.stats
                per_layer.append({"dest": res.dest, "per_slot": s.tokens_per_slot, "received": s.prefetch_received,
                                  "exact": s.exact})
                h = h + res.out
            run.append({"h": h.numpy(), "layers": per_layer})
        pf.drain()
        out["runs"][name] = run

    # the buffer holds exactly the planned experts: weights that name themselves, inspected after each layer
    cfg = EPConfig(router="rebalance", router_seed=SEED, exact=exact)
    layers, pf = _layers(base, [_identity_experts(li) for li in range(L)], cfg, _gate_config(None), group)
    for b in range(BATCHES):
        for li in range(L):
            res = layers[li](xs[b], step=b)
            n = len(res.stats.tokens_per_slot) - len(base.gpu_experts[li][rank])
            buf = pf.views(li % 2)
            out["ident"].append([float(buf.w1_SHF[j].min()) for j in range(n)] +
                                [float(buf.w1_SHF[j].max()) for j in range(n)])

    # a per-batch plan given to an exact layer: every rank raises the same line, and stays in step
    try:
        layers[0](xs[0], step=0, batch_plan=base)
        out["error"] = ("", "")
    except MoebalanceError as exc:
        out["error"] = (type(exc).__name__, str(exc))
    out["after"] = layers[0](xs[0], step=0).out.numpy()
    pf.drain()
    return out


@functools.cache
def _results() -> dict[int, list[dict[str, Any]]]:
    per_rank = launch(_worker, 4, [2, 4])
    return {ws: [r[ws] for r in per_rank[:ws]] for ws in (2, 4)}


# ---------------------------------------------------------------- references, computed here
def _reference(world_size: int, batch: int, router: str, capacity: float | None, chain: bool = True,
               ) -> tuple[torch.Tensor, list[tuple[list[tuple[int, ...]], np.ndarray, bool]]]:
    """The dense chain, and per layer the simulator's libra with the batch's true routing: (each GPU's extras,
    every pick's GPU, whether a pick was dropped)."""
    base = _base(world_size)
    src = np.repeat(np.arange(world_size), TOKENS[world_size])
    h = _x(world_size, batch)
    layers = []
    libra = LibraConfig(predictor="oracle", n=N, alpha=ALPHA)
    for li, (gate, full) in enumerate(zip(_gates(), _experts(), strict=True)):
        out, g = dense_moe(h, gate, full, _gate_config(capacity), group_sizes=TOKENS[world_size])
        ids, kept = g.topk_ids.numpy(), g.kept.numpy()
        demand = demand_of(np.where(kept, ids, -1)[:, None, :], src, world_size, E)
        plan, extras = batch_plan(layer_placement(base, li), demand, libra)
        trace = RoutingTrace(ids[:, None, :], src, np.zeros(len(src), np.int64), num_experts=E)
        r, rng = ROUTERS[router], np.random.default_rng((SEED, li, batch))
        if r.assign_kept is not None:
            dest = r.assign_kept(plan, trace, kept[:, None, :], rng)[:, 0, :]
        else:
            dest = np.where(kept, r.assign_tokens(plan, trace, rng)[:, 0, :], -1)
        layers.append(([tuple(int(e) for e in row if e >= 0) for row in extras[0]], dest, bool((~kept).any())))
        h = h + out if chain else h
    return h, layers


# ---------------------------------------------------------------- checks
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_exact_mode_equals_dense_and_the_simulators_libra(world_size: int, variant: str) -> None:
    ranks = _results()[world_size]
    router, _, _, capacity = VARIANTS[variant]
    base = _base(world_size)
    keys: dict[int, Any] = {}  # the fill each buffer holds, to know when a forward copied nothing
    on_extras = dropped = 0
    for b in range(BATCHES):
        ref_h, ref_layers = _reference(world_size, b, router, capacity)
        got = np.concatenate([r["runs"][variant][b]["h"] for r in ranks])
        torch.testing.assert_close(torch.from_numpy(got), ref_h, rtol=1e-4, atol=1e-4)  # 3 layers deep
        for li, (extras, dest, drops) in enumerate(ref_layers):
            dropped += drops
            layers = [r["runs"][variant][b]["layers"][li] for r in ranks]
            for g, x in enumerate(layers):
                assert np.array_equal(x["dest"], dest), (b, li, g)  # on every rank, the simulator's routing
                S = len(base.gpu_experts[li][g])
                assert len(x["per_slot"]) == S + len(extras[g])
                assert int(x["per_slot"].sum()) == int((dest == g).sum())
                on_extras += int(x["per_slot"][S:].sum())
            fresh = keys.get(li % 2) != (li, tuple(extras))
            keys[li % 2] = (li, tuple(extras))
            assert [x["received"] for x in layers] == [len(e) if fresh else 0 for e in extras]
    assert on_extras > 0  # the extra copies took load
    assert (dropped > 0) == (capacity is not None)  # the capacity variant drops picks, and they count nowhere


@pytest.mark.parametrize("world_size", [2, 4])
def test_exact_mode_reports_the_time_from_gate_to_experts(world_size: int) -> None:
    for r in _results()[world_size]:
        for run in r["runs"].values():
            for batch in run:
                for x in batch["layers"]:
                    t = x["exact"]
                    parts = (t.plan_seconds, t.copy_seconds, t.route_seconds)
                    assert all(np.isfinite(p) and p >= 0 for p in parts), parts
                    assert t.total_seconds == pytest.approx(sum(parts)) and 0 < t.total_seconds < 60


@pytest.mark.parametrize("world_size", [2, 4])
def test_exact_mode_buffers_hold_the_planned_experts(world_size: int) -> None:
    ranks = _results()[world_size]
    for b in range(BATCHES):
        _, ref_layers = _reference(world_size, b, "rebalance", None, chain=False)
        for li, (extras, _, _) in enumerate(ref_layers):
            for g, r in enumerate(ranks):
                want = [1000.0 * li + e for e in extras[g]]
                assert r["ident"][b * L + li] == want + want, (b, li, g)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_per_batch_plan_given_to_an_exact_layer_fails_every_rank_alike(world_size: int) -> None:
    ranks = _results()[world_size]
    others = ", ".join(str(r) for r in range(1, world_size))
    assert {r["error"] for r in ranks} == {("InputError", "rank 0: this layer runs exact mode, which plans each "
                                            "batch's extras after the gate; pass no batch_plan, or build the layer "
                                            f"without EPConfig(exact=...) (the same on ranks {others})")}
    ref, _ = dense_moe(_x(world_size, 0), _gates()[0], _identity_experts(0), _gate_config(None),
                       group_sizes=TOKENS[world_size])
    torch.testing.assert_close(torch.from_numpy(np.concatenate([r["after"] for r in ranks])), ref, rtol=1e-5,
                               atol=1e-2)  # still in step (the identity experts' outputs are large)


# ---------------------------------------------------------------- single-process pieces
def test_the_planner_equals_the_policy_and_the_router_on_random_inputs() -> None:
    """:func:`plan_exact` (what a swap to a faster planner must keep) against ``policies.libra.batch_plan`` and the
    ``rebalance`` router on the per-batch plan, on random plans (replicas, a second copy on one GPU), routings
    (dropped picks, ranks without tokens), ``n``, ``alpha`` and ``eps``."""
    rng = np.random.default_rng(7)
    for case in range(60):
        G = int(rng.integers(2, 7))
        E_ = int(rng.integers(G, 20))
        gpus: list[list[int]] = [[] for _ in range(G)]
        for e in range(E_):
            for g in rng.choice(G, size=int(rng.integers(1, 3)), replace=False):
                gpus[int(g)].append(e)
        if case % 5 == 0:
            gpus[0].append(gpus[0][0] if gpus[0] else 0)  # a second copy on one GPU
        base = Placement([gpus], E_, Cluster(num_nodes=1 if G % 2 else 2, gpus_per_node=G if G % 2 else G // 2))
        tokens = [int(t) for t in rng.integers(0, 30, size=G)]
        T, k = sum(tokens), int(rng.integers(1, min(4, E_) + 1))
        p = rng.dirichlet(np.full(E_, 0.3))
        ids = np.stack([rng.choice(E_, size=k, replace=False, p=p) for _ in range(T)]).reshape(T, k)
        kept = rng.random((T, k)) > 0.15
        n, alpha = int(rng.integers(0, min(5, E_) + 1)), float(rng.choice([0.0, 0.25, 0.5, 1.0]))
        router = get_router("rebalance", {"eps": float(rng.choice([0.0, 0.05]))})
        xp = exact_layer_plan(base, ids, kept, tokens, ExactConfig(n=n, alpha=alpha), router)

        src = np.repeat(np.arange(G), tokens)
        demand = demand_of(np.where(kept, ids, -1)[:, None, :], src, G, E_)
        plan, _ = batch_plan(base, demand, LibraConfig(predictor="oracle", n=n, alpha=alpha))
        assert xp.layer_plan.gpu_experts == plan.gpu_experts, case
        trace = RoutingTrace(ids[:, None, :], src, np.zeros(T, np.int64), num_experts=E_)
        assert router.assign_kept is not None
        want = router.assign_kept(plan, trace, kept[:, None, :], np.random.default_rng(0))[:, 0, :]
        assert xp.dest is not None and np.array_equal(xp.dest, want), case
        # another router: the same extras, and the caller routes
        other = exact_layer_plan(base, ids, kept, tokens, ExactConfig(n=n, alpha=alpha), "uniform")
        assert other.dest is None and other.extras == xp.extras
        extras, dest = plan_exact(base.copies[0], ids, kept, tokens, ExactConfig(n=n, alpha=alpha), 1, None)
        assert dest is None and extras.shape == (G, n)


def test_exact_mode_options_are_checked_in_one_line() -> None:
    plan = Placement([[[0, 1], [2, 3]]], 4, Cluster(num_nodes=1, gpus_per_node=2))
    one = Placement([[[0, 1, 2, 3]]], 4, Cluster(num_nodes=1, gpus_per_node=1))
    gate, full = torch.zeros(H, 4), random_experts(4, H, FFN)

    def layer(cfg: EPConfig, pf: ExpertPrefetcher | None, p: Placement = one) -> ExpertParallelMoE:
        return ExpertParallelMoE.from_full(p, 0, gate, full, GateConfig(top_k=2), cfg, prefetcher=pf)

    local = functools.partial(EPConfig, dispatcher="local")
    cases: list[tuple[Any, str]] = [
        (lambda: ExactConfig(n=-1), r"^exact mode's n \(-1\) must be a non-negative integer"),
        (lambda: ExactConfig(n=True), r"^exact mode's n \(True\) must be a non-negative integer"),
        (lambda: ExactConfig(alpha=1.5), r"^exact mode's alpha \(1\.5\) must be a number in \[0, 1\]"),
        (lambda: ExactConfig(alpha=float("nan")), r"^exact mode's alpha \(nan\) must be a number in \[0, 1\]"),
        (lambda: EPConfig(exact={"n": 2}), r"^exact \(dict\) must be a moebalance\.runtime\.ExactConfig or None$"),
        (lambda: EPConfig(exact=ExactConfig(), router_thread=True), r"^exact mode plans a layer's extras .* turn "
                                                                    r"router_thread off or exact mode off$"),
        (lambda: layer(local(exact=ExactConfig(n=5)), ExpertPrefetcher(5)), r"^exact mode's n \(5\) exceeds the "
                                                                            r"layer's 4 experts"),
        (lambda: layer(local(exact=ExactConfig(n=2)), None), r"^exact mode with n=2 copies extra experts into a "
                                                             r"prefetch buffer; build the layers with "
                                                             r"prefetcher=ExpertPrefetcher\(2\), or use n=0$"),
        (lambda: layer(local(exact=ExactConfig(n=2)), ExpertPrefetcher(1)), r"^exact mode's n \(2\) is more than the "
                                                                            r"prefetch buffer's 1 slots"),
    ]
    for make, message in cases:
        with pytest.raises(InputError, match=message) as info:
            make()
        assert "\n" not in str(info.value)
    # one process holding every expert: nothing to copy, and the output is the dense one
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(1))
    res = layer(local(exact=ExactConfig(n=0), router="rebalance"), None)(x)
    torch.testing.assert_close(res.out, dense_moe(x, gate, full, GateConfig(top_k=2))[0], rtol=1e-5, atol=1e-6)
    assert res.stats.exact is not None and res.stats.prefetch_received == 0
    assert plan.num_gpus == 2  # (a 2-GPU plan needs a group: the distributed tests above run it)


# ---------------------------------------------------------------- the command line
def _write_plans(tmp: Path) -> dict[int, Path]:
    """Contiguous plans of the bundled 4 x 16 top-2 model on 2 and 4 GPUs."""
    out = {}
    for G, (nodes, per) in CLUSTER.items():
        path = tmp / f"plan{G}.json"
        write_plan(path, Placement([[[g * (16 // G) + i for i in range(16 // G)] for g in range(G)]] * 4, 16,
                                   Cluster(num_nodes=nodes, gpus_per_node=per), policy="contiguous"))
        out[G] = path
    return out


def test_run_command_exact_mode_reports_the_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plans = _write_plans(tmp_path)
    rc, out, err = run_cli(["run", "--world-size", 2, "--plan", plans[2], "--policy", "libra", "--set", "n=2",
                            "--set", "predictor=oracle", "--domain", "code", "--tokens", 512, "--batch-tokens", 256,
                            "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["logits_agree"] and doc["counts_match_simulator"] and doc["router"] == "rebalance"
    ex = doc["exact"]
    assert (ex["n"], ex["alpha"]) == (2, 0.5) and ex["extras_received"] > 0
    assert [row["layer"] for row in ex["per_layer"]] == [0, 1, 2, 3]
    for row in ex["per_layer"]:
        parts = [row["plan_ms"], row["copy_ms"], row["route_ms"]]
        assert all(p >= 0 for p in parts) and row["gate_to_expert_ms"] == pytest.approx(sum(parts), abs=2e-4)
    # 4 ranks on 2 nodes, text: the same checks pass and the table is there
    rc, out, err = run_cli(["run", "--world-size", 4, "--plan", plans[4], "--policy", "libra", "--set", "n=1",
                            "--domain", "prose", "--tokens", 512, "--batch-tokens", 512], capsys)
    assert rc == 0, err
    assert "libra exact (n=1, alpha=0.5) on contiguous" in out and "(agree, tolerance" in out
    assert "on libra's per-batch plans of the trace the run saw): yes" in out
    assert re.search(r"exact mode: gate to expert compute per layer", out)
    assert re.search(r"extra experts copied into the prefetch buffers: [1-9]", out)
    # without --policy nothing changes: no exact block
    rc, out, err = run_cli(["run", "--world-size", 2, "--plan", plans[2], "--domain", "code", "--tokens", 256,
                            "--batch-tokens", 256, "--json"], capsys)
    assert rc == 0, err
    assert "exact" not in json.loads(out) and json.loads(out)["router"] == "uniform"


@pytest.mark.parametrize(("extra", "fragments"), [
    (["--policy", "eplb"], ["--policy 'eplb': run takes libra"]),
    (["--set", "n=2"], ["--set configures --policy libra; give --policy libra or drop --set"]),
    (["--policy", "libra", "--set", "predictor=lookahead"], ["--set predictor=lookahead: run plans libra after each "
                                                             "layer's gate", "predictor=exact"]),
    (["--policy", "libra", "--set", "base=eplb"], ["--set base: run takes only predictor, n, alpha for libra"]),
    (["--policy", "libra", "--set", "buffer=2"], ["--set buffer: policy 'libra' has no parameter 'buffer'"]),
    (["--policy", "libra", "--set", "n=-1"], ["exact mode's n (-1) must be a non-negative integer"]),
    (["--policy", "libra", "--set", "n=17"], ["exact mode's n (17) exceeds the layer's 16 experts"]),
    (["--policy", "libra", "--set", "alpha=2"], ["exact mode's alpha (2) must be a number in [0, 1]"]),
    (["--policy", "libra", "--router", "rebalance", "--two-stage"], ["--two-stage runs the router beside the local "
                                                                      "phase", "drop one of them"]),
])
def test_run_command_exact_mode_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
                                       fragments: list[str]) -> None:
    plans = _write_plans(tmp_path)
    assert_user_error(["run", "--world-size", 2, "--plan", plans[2], "--domain", "code", "--tokens", 256, *extra],
                      capsys, *fragments)
