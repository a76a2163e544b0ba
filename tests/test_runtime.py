"""The expert-parallel runtime on real gloo process groups (docs/design.md, "Runtime"): EP output == dense reference for every
registered policy and router, per-rank work == the simulator's, local-first == plain, weight moves on plan
changes. One 4-rank launch (per test process) runs every case, the 2-rank ones in a subgroup of ranks 0 and 1;
the checks run here, in the test process, against references computed here.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import pytest
import torch

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, MoebalanceError, PlanError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.policies import POLICIES, Budget, make_plan
from moebalance.routing import ROUTERS, Router
from moebalance.routing.copies import traffic
from moebalance.routing.simulate import gpu_loads
from moebalance.runtime import (
    DISPATCHERS,
    EPConfig,
    ExpertParallelMoE,
    ExpertWeights,
    GateConfig,
    all_gather_v,
    build_dispatch,
    dense_moe,
    exchange_counts,
    launch,
    make_dispatcher,
    plan_transfers,
    random_experts,
    rearrange,
    route_picks,
    slot_table,
)

E, H, FFN, K, L, LAYER, SEED = 8, 16, 24, 2, 2, 1, 7
CLUSTERS = {2: [(1, 2), (2, 1)], 4: [(2, 2), (1, 4)]}
TOKENS = {2: [11, 9], 4: [12, 0, 9, 7]}  # rank 1 of 4 has no tokens
EXTRA_PLANS = ("all-on-gpu0", "everywhere")
ROUTER_NAMES = sorted(ROUTERS)
#: Every registered router ready to run: metro models expert time, so it gets a GPU and a model of E experts.
READY = {n: r.with_params(gpu="h100-80gb", model="mixtral-8x7b") if n == "metro" else r for n, r in ROUTERS.items()}
#: Routers whose choice depends on the load (they implement ``Router.assign_kept``).
LOAD_AWARE = sorted(n for n, r in ROUTERS.items() if r.assign_kept is not None)
POLICY_NAMES = sorted(POLICIES)
#: Every registered static policy (test_layout.py checks the registries equal docs/design.md's table). Dynamic
#: policies (``libra``) have no single plan; their per-batch plans run in tests/test_runtime_libra.py.
PLAN_NAMES = sorted(POLICIES)


# ---------------------------------------------------------------- inputs, identical in every process
def _inputs(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` of all ranks (rank order) and the gate ``[H, E]``; skewed towards a few experts."""
    g = torch.Generator().manual_seed(SEED + world_size)
    x = torch.randn(sum(TOKENS[world_size]), H, generator=g)
    gate = torch.randn(H, E, generator=g)
    return x + 1.5 * gate[:, 0] - gate[:, 3], gate


def _experts(activation: str = "swiglu") -> ExpertWeights:
    return random_experts(E, H, FFN, activation=activation, seed=SEED)  # type: ignore[arg-type]


def _identity_experts(layer: int) -> ExpertWeights:
    """Fake weights that name themselves: every entry of expert ``e`` of ``layer`` is ``1000 * layer + e``."""
    ident = (1000.0 * layer + torch.arange(E, dtype=torch.float32))[:, None, None]
    return ExpertWeights(ident.expand(E, H, FFN).clone(), -ident.expand(E, FFN, H).clone(),
                         ident.expand(E, H, FFN).clone() + 0.5)


def _planning_load(num_gpus: int) -> LoadMatrix:
    """A skewed token-level load (4 batches x 64 tokens), so that every policy, grace included, can plan."""
    rng = np.random.default_rng(num_gpus)
    p = 1.0 / np.arange(1, E + 1) ** 1.2
    T = 256
    ids = np.stack([np.stack([rng.choice(E, size=K, replace=False, p=np.roll(p, 3 * layer) / p.sum())
                              for layer in range(L)]) for _ in range(T)])
    trace = RoutingTrace(ids, rng.integers(0, num_gpus, T), np.repeat(np.arange(4), T // 4), num_experts=E)
    return LoadMatrix(trace.counts(), trace)


def _budget(policy: str, num_gpus: int) -> Budget:
    """A budget every registered policy accepts on every cluster under test (a refusal fails the tests)."""
    base = math.ceil(E / num_gpus)
    if policy == "craft":
        return Budget(replicas_per_gpu=2)
    if policy in ("contiguous", "greedy", "moetuner"):
        return Budget(slots_per_gpu=base)
    return Budget(slots_per_gpu=base + 1)  # eplb, grace and newcomers: room for replicas


def _extra_plan(name: str, cluster: Cluster) -> Placement:
    G = cluster.num_gpus
    if name == "all-on-gpu0":  # every expert on GPU 0 with a second copy of expert 3; the others host nothing
        layer = [[*range(E), 3]] + [[] for _ in range(G - 1)]
    else:  # every expert on every GPU: nothing needs to move with the locality router
        layer = [list(range(E)) for _ in range(G)]
    return Placement([[list(range(E))] + [[] for _ in range(G - 1)], layer], E, cluster, policy=name)


@functools.cache
def _plans(nodes: int, gpn: int) -> dict[str, Placement]:
    """Plans by policy name for one cluster.

    Nothing is caught: every policy's dependencies are the package's own, ``_budget`` picks budgets the
    policies accept, so a missing import, an unregistered documented policy or a refused budget is a bug and
    fails every test that uses this cluster (never a skip).
    """
    cluster = Cluster(num_nodes=nodes, gpus_per_node=gpn)
    load = _planning_load(cluster.num_gpus)
    out: dict[str, Placement] = {}
    for name in PLAN_NAMES:
        out[name] = make_plan(name, load, cluster, _budget(name, cluster.num_gpus))[0]
    for name in EXTRA_PLANS:
        out[name] = _extra_plan(name, cluster)
    return out


def _cases(world_size: int) -> list[dict[str, Any]]:
    cases = []
    for nodes, gpn in CLUSTERS[world_size]:
        for pname, plan in _plans(nodes, gpn).items():
            for router in ROUTER_NAMES:
                for local_first in (False, True):
                    cases.append({"id": (nodes, gpn, pname, router, local_first, "plain"), "plan": plan.to_json_dict(),
                                  "router": router, "local_first": local_first})
        plan = _plans(nodes, gpn)["eplb"].to_json_dict()
        variants: list[tuple[str, dict[str, Any]]] = [
            ("p2p", {"impl": "p2p"}), ("gelu", {"activation": "gelu"}),
            ("drop", {"capacity": 0.5, "overflow": "drop"}), ("spill", {"capacity": 0.5, "overflow": "spill"}),
            ("fixed", {"max_tokens": max(TOKENS[world_size])}),  # one fixed-size routing gather, no count round
        ]
        for label, extra in variants:
            for local_first in (False, True):
                cases.append({"id": (nodes, gpn, "eplb", "random", local_first, label), "plan": plan,
                              "router": "random", "local_first": local_first, **extra})
        for router in LOAD_AWARE:  # routers that balance load must see only the picks a capacity kept
            for local_first in (False, True):
                cases.append({"id": (nodes, gpn, "eplb", router, local_first, "drop"), "plan": plan,
                              "router": router, "local_first": local_first, "capacity": 0.5, "overflow": "drop"})
    return cases


def _rearrange_pairs(world_size: int) -> list[tuple[tuple[int, int], str, str]]:
    """Old and new plan names: a cycle through every plan of every cluster (names only: no planning here)."""
    names = [*POLICY_NAMES, *EXTRA_PLANS]
    return [(cl, old, new) for cl in CLUSTERS[world_size] for old, new in zip(names, names[1:] + names[:1], strict=True)]


# ---------------------------------------------------------------- what every rank runs
def _worker(rank: int, world_size: int, jobs: list[tuple[int, list[dict[str, Any]], list[Any]]],
            device: str = "cpu") -> dict[int, Any]:
    """Run every job ``(ranks, cases, plan pairs)``; a 2-rank job runs on ranks 0 and 1 in a subgroup."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    pair_group = torch.distributed.new_group([0, 1]) if world_size > 2 else None  # every rank must create it
    out = {}
    for ws, cases, pairs in jobs:
        if rank < ws:
            out[ws] = _run_cases(rank, ws, cases, pairs, None if ws == world_size else pair_group, device)
    return out


def _run_cases(rank: int, world_size: int, cases: list[dict[str, Any]], pairs: list[Any], group: Any,
               device: str) -> dict[str, Any]:
    x_all, gate = _inputs(world_size)
    off = np.concatenate([[0], np.cumsum(TOKENS[world_size])])
    x = x_all[off[rank]:off[rank + 1]].to(device)
    results: dict[Any, Any] = {}
    for case in cases:
        plan = Placement.from_json_dict(case["plan"])
        full = ExpertWeights(*(t.to(device) for t in _experts(case.get("activation", "swiglu")).tensors()))
        gcfg = GateConfig(top_k=K, capacity_factor=case.get("capacity"), overflow=case.get("overflow", "drop"))
        cfg = EPConfig(router=READY[case["router"]], router_seed=SEED, local_first=case["local_first"],
                       a2a_impl=case.get("impl", "auto"), max_tokens_per_rank=case.get("max_tokens"))
        layer = ExpertParallelMoE.from_full(plan, LAYER, gate.to(device), full, gcfg, cfg, group=group)
        res = layer(x, step=0)
        s = res.stats
        results[case["id"]] = {"out": res.out.cpu().numpy(), "dest": res.dest, "tokens": s.tokens_computed,
                               "per_slot": s.tokens_per_slot, "send": s.send_rows, "recv": s.recv_rows,
                               "bytes": s.bytes(), "dropped": s.dropped_picks}
    moves = {}
    for key, old_doc, new_doc in pairs:
        old, new = Placement.from_json_dict(old_doc), Placement.from_json_dict(new_doc)
        shards = [_identity_experts(layer).select(old.gpu_experts[layer][rank]) for layer in range(L)]
        new_shards, report = rearrange(old, new, shards, group)
        ids = [[tuple(float(v) for v in (w.w1_SHF[s].min(), w.w1_SHF[s].max(), -w.w2_SFH[s].min(),
                                          -w.w2_SFH[s].max(), w.w3_SHF[s].min() - 0.5, w.w3_SHF[s].max() - 0.5))  # type: ignore[index]
                for s in range(w.num_experts)] for w in new_shards]
        # the moved weights serve the new plan: forward with real weights moved the same way
        moved, _ = rearrange(old, new, [_experts().select(old.gpu_experts[layer][rank]) for layer in range(L)], group)
        layer = ExpertParallelMoE(new, LAYER, gate, moved[LAYER], GateConfig(top_k=K), EPConfig(router="uniform"),
                                  group=group)
        moves[key] = {"ids": ids, "num_moved": report.num_moved, "sent": report.bytes_sent,
                      "received": report.bytes_received, "bpe": report.bytes_per_expert,
                      "transfers": report.transfers, "out": layer(x, step=0).out.numpy()}
    counts = {impl: exchange_counts(torch.arange(world_size) + 10 * rank, group, impl).tolist()
              for impl in ("native", "p2p")}
    # a fixed-size gather with one rank over the bound: every rank raises (none is left in a collective)
    over = []
    for bound in (2, 3):
        try:
            all_gather_v(torch.arange(rank + 2, dtype=torch.float64), group, max_rows=bound)
            over.append("")
        except MoebalanceError as exc:
            over.append(str(exc))
    try:  # bfloat16 counts exactly only up to 256: a larger bound is refused on every rank alike
        all_gather_v(torch.zeros(3, 2, dtype=torch.bfloat16), group, max_rows=300)
        over.append("")
    except MoebalanceError as exc:
        over.append(str(exc))
    return {"cases": results, "moves": moves, "counts": counts, "over": over}


@functools.cache
def _run() -> dict[int, list[dict[str, Any]]]:
    """One 4-rank launch per test process runs the 4-rank cases and, in a subgroup, the 2-rank ones."""
    jobs = []
    for ws in sorted(CLUSTERS):
        pairs = []
        for cl, a, b in _rearrange_pairs(ws):
            old, new = _plans(*cl)[a], _plans(*cl)[b]
            pairs.append(((cl, a, b), old.to_json_dict(), new.to_json_dict()))
        jobs.append((ws, _cases(ws), pairs))
    per_rank = launch(_worker, max(CLUSTERS), jobs)
    return {ws: [r[ws] for r in per_rank[:ws]] for ws in CLUSTERS}


def _case(world_size: int, case_id: tuple[Any, ...]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    per_rank = [r["cases"][case_id] for r in _run()[world_size]]
    spec = next(c for c in _cases(world_size) if c["id"] == case_id)
    return per_rank, spec


def _reference(world_size: int, spec: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    x, gate = _inputs(world_size)
    gcfg = GateConfig(top_k=K, capacity_factor=spec.get("capacity"), overflow=spec.get("overflow", "drop"))
    return dense_moe(x, gate, _experts(spec.get("activation", "swiglu")), gcfg, group_sizes=TOKENS[world_size])


def _expected_dest(world_size: int, plan: Placement, router: str, ids: np.ndarray) -> np.ndarray:
    """The simulator's router on this forward's tokens: layer ``LAYER`` as a one-layer plan, same seed."""
    one = Placement([plan.gpu_experts[LAYER]], E, plan.cluster,
                    weights=None if plan.weights is None else [plan.weights[LAYER]])
    src = np.repeat(np.arange(world_size), TOKENS[world_size])
    trace = RoutingTrace(ids[:, None, :], src, np.zeros(len(src), int), num_experts=E)
    return READY[router].assign_tokens(one, trace, np.random.default_rng((SEED, LAYER, 0)))[:, 0, :]


@pytest.mark.parametrize(("nodes", "gpn"), [c for cls in CLUSTERS.values() for c in cls])
def test_plans_under_test_have_replicas(nodes: int, gpn: int) -> None:
    plans = _plans(nodes, gpn)
    replicated = [n for n, p in plans.items() if p.extra_replicas > 0]
    assert {"eplb", "craft"} <= set(replicated), replicated
    assert plans["all-on-gpu0"].warnings  # two copies of expert 3 on GPU 0


def test_every_documented_static_policy_is_registered() -> None:
    """A documented policy that is not registered is a regression, never a skip."""
    assert set(PLAN_NAMES) <= set(POLICIES), sorted(set(PLAN_NAMES) - set(POLICIES))


MAIN_IDS = [(ws, (n, g, p, r)) for ws, cls in CLUSTERS.items() for n, g in cls
            for p in (*PLAN_NAMES, *EXTRA_PLANS) for r in ROUTER_NAMES]


@pytest.mark.parametrize(("world_size", "key"), MAIN_IDS, ids=[f"{ws}ranks-{n}x{g}-{p}-{r}" for ws, (n, g, p, r) in MAIN_IDS])
def test_expert_parallel_equals_dense_and_simulator(world_size: int, key: tuple[Any, ...]) -> None:
    nodes, gpn, policy, router = key
    plan = _plans(nodes, gpn)[policy]
    ranks, spec = _case(world_size, (*key, False, "plain"))
    ranks_lf, _ = _case(world_size, (*key, True, "plain"))
    ref, gate = _reference(world_size, spec)
    out = np.concatenate([r["out"] for r in ranks])
    torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(ranks, ranks_lf, strict=True):  # Libra's two phases change when, not what
        assert np.array_equal(a["out"], b["out"]) and np.array_equal(a["dest"], b["dest"])
    # every rank routed every token identically, and as the simulator's router does
    dest = _expected_dest(world_size, plan, router, gate.topk_ids.numpy())
    for r in ranks:
        assert np.array_equal(r["dest"], dest)
    per_gpu = np.bincount(dest.ravel(), minlength=world_size)
    assert [r["tokens"] for r in ranks] == per_gpu.tolist()
    assert all(int(r["per_slot"].sum()) == r["tokens"] for r in ranks)
    # dispatch rows == the simulator's traffic matrix (diagonal: local copies)
    one = Placement([plan.gpu_experts[LAYER]], E, plan.cluster)
    src = np.repeat(np.arange(world_size), TOKENS[world_size])
    tr = RoutingTrace(gate.topk_ids.numpy()[:, None, :], src, np.zeros(len(src), int), num_experts=E)
    sim = traffic(one, tr, dest[:, None, :])
    assert np.array_equal(np.stack([r["send"] for r in ranks]), sim.matrix)
    assert np.array_equal(np.stack([r["recv"] for r in ranks]), sim.matrix.T)
    kinds = plan.cluster.link_kind()
    sent_inter = sum(r["bytes"]["dispatch_sent_inter_node"] for r in ranks)
    assert sent_inter == int(sim.matrix[kinds == 2].sum()) * H * 4
    if router == "uniform":  # round-robin realises the simulator's equal split to within a token per replica
        counts = tr.counts()
        split = gpu_loads(one, counts, "uniform")[0, 0]
        assert np.all(np.abs(per_gpu - split) <= one.slots()[0] + 1e-9)


VARIANT_IDS = [(ws, (n, g, lf, v)) for ws, cls in CLUSTERS.items() for n, g in cls for lf in (False, True)
               for v in ("p2p", "gelu", "drop", "spill", "fixed")]


@pytest.mark.parametrize(("world_size", "key"), VARIANT_IDS,
                         ids=[f"{ws}ranks-{n}x{g}-{v}-{'local_first' if lf else 'plain'}" for ws, (n, g, lf, v) in VARIANT_IDS])
def test_variants_equal_dense(world_size: int, key: tuple[Any, ...]) -> None:
    nodes, gpn, local_first, variant = key
    ranks, spec = _case(world_size, (nodes, gpn, "eplb", "random", local_first, variant))
    ref, gate = _reference(world_size, spec)
    out = np.concatenate([r["out"] for r in ranks])
    torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-5, atol=1e-6)
    kept = gate.kept.numpy()
    dest = ranks[0]["dest"]
    assert np.array_equal(dest < 0, ~kept)  # dropped picks go nowhere
    assert [r["tokens"] for r in ranks] == np.bincount(dest[kept], minlength=world_size).tolist()
    assert sum(r["dropped"] for r in ranks) == gate.num_dropped
    if variant == "drop":
        assert gate.num_dropped > 0  # capacity 0.5 must bite
    if variant in ("p2p", "fixed"):
        plain, _ = _case(world_size, (nodes, gpn, "eplb", "random", local_first, "plain"))
        assert all(np.array_equal(a["out"], b["out"]) for a, b in zip(plain, ranks, strict=True))  # same bits


DROP_IDS = [(ws, (n, g, r, lf)) for ws, cls in CLUSTERS.items() for n, g in cls for r in LOAD_AWARE
            for lf in (False, True)]


@pytest.mark.parametrize(("world_size", "key"), DROP_IDS,
                         ids=[f"{ws}ranks-{n}x{g}-{r}-{'local_first' if lf else 'plain'}" for ws, (n, g, r, lf) in DROP_IDS])
def test_load_aware_routers_balance_only_the_kept_picks(world_size: int, key: tuple[Any, ...]) -> None:
    from moebalance.routing.minmax import least_max_load

    nodes, gpn, router, local_first = key
    assert {"minmax", "rebalance"} <= set(LOAD_AWARE)
    ranks, spec = _case(world_size, (nodes, gpn, "eplb", router, local_first, "drop"))
    ref, gate = _reference(world_size, spec)
    out = np.concatenate([r["out"] for r in ranks])
    torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-5, atol=1e-6)
    kept = gate.kept.numpy()
    assert gate.num_dropped > 0  # capacity 0.5 must bite
    dest = ranks[0]["dest"]
    assert all(np.array_equal(r["dest"], dest) for r in ranks) and np.array_equal(dest < 0, ~kept)
    # the simulator's router, told which picks were kept, routes them identically
    plan = Placement.from_json_dict(spec["plan"])
    one = Placement([plan.gpu_experts[LAYER]], E, plan.cluster)
    src = np.repeat(np.arange(world_size), TOKENS[world_size])
    tr = RoutingTrace(gate.topk_ids.numpy()[:, None, :], src, np.zeros(len(src), int), num_experts=E)
    expected = READY[router].assign_kept(one, tr, kept[:, None, :], np.random.default_rng((SEED, LAYER, 0)))
    assert np.array_equal(dest, expected[:, 0, :])
    per_gpu = np.bincount(dest[kept], minlength=world_size)
    assert [r["tokens"] for r in ranks] == per_gpu.tolist()
    if router == "minmax":  # the busiest rank carries the least any split of the kept picks allows
        kept_counts = np.bincount(gate.topk_ids.numpy()[kept], minlength=E)[None, None, :]
        assert per_gpu.max() == least_max_load(one, kept_counts, integral=True)[0, 0]


REARRANGE_IDS = [(ws, pair) for ws in CLUSTERS for pair in _rearrange_pairs(ws)]


@pytest.mark.parametrize(("world_size", "pair"), REARRANGE_IDS,
                         ids=[f"{ws}ranks-{n}x{g}-{a}-to-{b}" for ws, ((n, g), a, b) in REARRANGE_IDS])
def test_rearrange_moves_exactly_the_new_copies(world_size: int, pair: tuple[Any, ...]) -> None:
    cluster, old_name, new_name = pair
    old, new = _plans(*cluster)[old_name], _plans(*cluster)[new_name]
    moves = [r["moves"][pair] for r in _run()[world_size]]
    for rank, m in enumerate(moves):
        for layer in range(L):
            want = new.gpu_experts[layer][rank]
            got = m["ids"][layer]
            assert len(got) == len(want)
            for e, ident in zip(want, got, strict=True):  # every tensor of every slot is the right expert
                assert ident == (1000.0 * layer + e,) * 6, (rank, layer, e, ident)
    fresh = int(((new.copies > 0) & (old.copies == 0)).sum())
    assert all(m["num_moved"] == fresh for m in moves)
    assert len(moves[0]["transfers"]) == fresh
    assert sum(m["sent"] for m in moves) == sum(m["received"] for m in moves) == fresh * moves[0]["bpe"]
    # after the move the layer serves the new plan correctly
    x, gate = _inputs(world_size)
    ref, _ = dense_moe(x, gate, _experts(), GateConfig(top_k=K), group_sizes=TOKENS[world_size])
    out = np.concatenate([m["out"] for m in moves])
    torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", sorted(CLUSTERS))
def test_fixed_size_gather_over_the_bound_raises_on_every_rank(world_size: int) -> None:
    # rank r sends r + 2 rows: with a bound of 2 rank 1 is over it, and with 3 rank 2 (when there is one)
    for r in _run()[world_size]:
        assert r["over"][0] == "rank 1 has 3 tokens but max_tokens_per_rank is 2; raise it or send fewer tokens per forward"
        assert (r["over"][1] != "") == (world_size > 2)
        assert r["over"][2].startswith("max_rows (300) is more than torch.bfloat16 holds exactly (256)")


@pytest.mark.parametrize("world_size", sorted(CLUSTERS))
def test_exchange_counts_transposes(world_size: int) -> None:
    # rank r sends 10 r + g rows to rank g, so rank g hears 10 r + g from every r, in both implementations
    for rank, r in enumerate(_run()[world_size]):
        for impl in ("native", "p2p"):
            assert r["counts"][impl] == [10 * src + rank for src in range(world_size)]


# ---------------------------------------------------------------- single-process pieces
def test_plan_transfers_hand_example() -> None:
    # 2 nodes x 2 GPUs (node 0: GPUs 0, 1), one layer of 4 experts; transfers go by destination GPU:
    # GPU 1 gains expert 3, held only by GPU 2: (3, 2 -> 1). GPU 3 gains expert 0, held by GPU 0 (other
    # node, no sends yet) and GPU 2 (its node, one send already): the node wins, (0, 2 -> 3).
    cl = Cluster(num_nodes=2, gpus_per_node=2)
    old = Placement([[[0, 1], [1], [0, 3], [2]]], 4, cl)
    new = Placement([[[0, 1], [1, 3], [0, 3], [2, 0]]], 4, cl)
    assert [(t.expert, t.src, t.dst) for t in plan_transfers(old, new)] == [(3, 2, 1), (0, 2, 3)]
    assert plan_transfers(new, new) == ()
    # one node: GPU 0 gains 1 (from 2), GPU 1 gains 2 (from 3), GPU 2 gains 0 from GPU 0 (holders 0 and 1 tie
    # at no sends: lowest id), GPU 3 gains 0 from GPU 1 (GPU 0 has sent once, GPU 1 not yet)
    cl1 = Cluster(num_nodes=1, gpus_per_node=4)
    old1 = Placement([[[0], [0], [1], [2, 3]]], 4, cl1)
    new1 = Placement([[[0, 1], [0, 2], [1, 0], [2, 3, 0]]], 4, cl1)
    assert [(t.expert, t.src, t.dst) for t in plan_transfers(old1, new1)] == [(1, 2, 0), (2, 3, 1), (0, 0, 2), (0, 1, 3)]


def test_plan_transfers_counts_new_copies_and_rejects_other_models() -> None:
    cl = Cluster(num_nodes=1, gpus_per_node=4)
    plans = list(_plans(1, 4).values())
    for a in plans:
        for b in plans:
            t = plan_transfers(a, b)
            assert len(t) == int(((b.copies > 0) & (a.copies == 0)).sum())
            assert all(a.copies[x.layer, x.expert, x.src] > 0 and b.copies[x.layer, x.expert, x.dst] > 0 for x in t)
    with pytest.raises(PlanError, match="same model and cluster"):
        plan_transfers(plans[0], Placement([[[0], [1], [2], [3]]], 4, cl))


def test_build_dispatch_hand_example() -> None:
    # 2 ranks; rank 0 has tokens 0, 1 and rank 1 token 2; top-2 over 3 experts
    # token 0 -> GPUs (0, 1), token 1 -> (1, 1), token 2 -> (0, 1); expert e sits in slot e of each GPU here
    dest = np.array([[0, 1], [1, 1], [0, 1]])
    ids = np.array([[0, 1], [2, 0], [1, 2]])
    w = np.array([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    slot = np.arange(3)
    m0 = build_dispatch(dest, ids, w, [2, 1], 0, slot)
    assert m0.send_token.tolist() == [0, 1] and m0.send_counts == (0, 2) and m0.recv_counts == (0, 1)
    assert m0.local_token.tolist() == [0] and m0.local.pick_slot.tolist() == [0]
    assert m0.remote.pick_row.tolist() == [0] and m0.remote.pick_slot.tolist() == [1]  # token 2's pick of 1
    m1 = build_dispatch(dest, ids, w, [2, 1], 1, slot)
    assert m1.send_token.tolist() == [0] and m1.send_counts == (1, 0) and m1.recv_counts == (2, 0)
    # token 1's two picks on GPU 1 arrive as one row (row 1) and come back as one
    assert m1.remote.pick_row.tolist() == [0, 1, 1] and m1.remote.pick_slot.tolist() == [1, 2, 0]
    assert np.allclose(m1.remote.pick_weight.numpy(), [0.4, 0.7, 0.3])


def test_build_dispatch_refuses_bad_routes() -> None:
    ids = np.array([[0, 1], [2, 0], [1, 2]])
    w = np.full((3, 2), 0.5)
    slot = np.arange(3)
    cases = [
        (np.array([[0, 2], [1, 1], [0, 1]]), [2, 1], 0, slot,
         r"^pick 1 of token 0 is routed to GPU 2; valid GPUs are 0\.\.1 \(-1 for a dropped pick\)$"),
        (np.array([[0, 1], [-2, 1], [0, 1]]), [2, 1], 0, slot, r"pick 0 of token 1 is routed to GPU -2"),
        (np.array([[0, 1], [1, 1], [0, 1]]), [2, 2], 0, slot, r"tokens_per_rank \[2, 2\] sums to 4, but the routing has 3"),
        (np.array([[0, 1], [1, 1], [0, 1]]), [2, 1], 2, slot, r"rank 2 is not one of the 2 ranks 0\.\.1"),
        # rank 0 holds experts 0 and 1 only, but token 1's pick 0 (expert 2) is sent to it
        (np.array([[0, 1], [0, 1], [0, 1]]), [2, 1], 0, np.array([0, 1, -1]),
         r"^pick 0 of token 1 \(expert 2\) is routed to rank 0, which holds no copy of it$"),
    ]
    for dest, tokens, rank, slot_of, message in cases:
        with pytest.raises(InputError, match=message) as info:
            build_dispatch(dest, ids, w, tokens, rank, slot_of)
        assert "\n" not in str(info.value)


def _fixed_router(name: str, answer: Any) -> Router:
    """A plug-in router that answers ``answer(trace)`` whatever the plan."""
    def assign(plan: Placement, trace: RoutingTrace, rng: np.random.Generator) -> np.ndarray:
        return answer(trace)

    def split(plan: Placement, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        raise AssertionError("not used")

    return Router(name=name, split_counts=split, assign_tokens=assign)


def test_custom_router_output_is_checked() -> None:
    # 2 GPUs: GPU 0 holds experts 0 and 1, GPU 1 holds experts 2 and 3
    plan = Placement([[[0, 1], [2, 3]]], 4, Cluster(num_nodes=1, gpus_per_node=2))
    ids = np.array([[0, 2], [1, 3], [3, 0]])
    kept = np.ones_like(ids, dtype=bool)
    rng = np.random.default_rng(0)
    good = _fixed_router("good", lambda tr: tr.topk_ids // 2)
    assert route_picks(plan, good, ids, kept, [2, 1], rng).tolist() == [[0, 1], [0, 1], [1, 0]]
    bad = [
        (_fixed_router("far", lambda tr: np.full(tr.topk_ids.shape, 5)),
         r"^router 'far' sent pick 0 of token 0 to GPU 5; valid GPUs are 0\.\.1$"),
        (_fixed_router("negative", lambda tr: tr.topk_ids // 2 - 2 * (tr.topk_ids == 3)),
         r"^router 'negative' sent pick 1 of token 1 to GPU -1;"),
        (_fixed_router("no-copy", lambda tr: np.zeros(tr.topk_ids.shape, dtype=np.int64)),
         r"^router 'no-copy' sent pick 1 of token 0 \(expert 2\) to GPU 0, which holds no copy of it; "
         r"expert 2 is on GPUs \[1\]$"),
        (_fixed_router("flat", lambda tr: (tr.topk_ids // 2)[:, 0, :]),
         r"^router 'flat' returned GPUs of shape \(3, 2\); expected \[T, 1, K\] for one layer$"),
        (_fixed_router("floats", lambda tr: (tr.topk_ids // 2).astype(np.float64)),
         r"^router 'floats' returned GPUs of dtype float64; it must return integer GPU ids$"),
    ]
    for router, message in bad:
        with pytest.raises(InputError, match=message) as info:
            route_picks(plan, router, ids, kept, [2, 1], rng)
        assert "\n" not in str(info.value)


def test_local_dispatcher_refuses_to_send() -> None:
    dest = np.array([[0, 1], [1, 1], [0, 1]])
    meta = build_dispatch(dest, np.array([[0, 1], [2, 0], [1, 2]]), np.full((3, 2), 0.5), [2, 1], 0, np.arange(3))
    with pytest.raises(PlanError, match=r"local dispatcher has one rank.* sends 2 rows and receives 1"):
        make_dispatcher("local").dispatch(torch.zeros(2, H), meta)


def test_slot_table_uses_the_first_copy() -> None:
    plan = Placement([[[2, 0, 2], [1]]], 3, Cluster(num_nodes=1, gpus_per_node=2))
    assert slot_table(plan).tolist() == [[1, -1, 0], [-1, 0, -1]]


def test_local_dispatcher_runs_without_a_process_group() -> None:
    plan = Placement([[[0, 1, 2, 3, 1]]], 4, Cluster(num_nodes=1, gpus_per_node=1))
    g = torch.Generator().manual_seed(0)
    x, gate = torch.randn(10, H, generator=g), torch.randn(H, 4, generator=g)
    full = random_experts(4, H, FFN, seed=1)
    for local_first in (False, True):
        layer = ExpertParallelMoE.from_full(plan, 0, gate, full, GateConfig(top_k=2),
                                           EPConfig(dispatcher="local", local_first=local_first))
        res = layer(x)
        ref, _ = dense_moe(x, gate, full, GateConfig(top_k=2))
        torch.testing.assert_close(res.out, ref, rtol=1e-5, atol=1e-6)
        assert res.stats.tokens_computed == 20 and res.stats.tokens_per_slot[4] == 0  # second copy idle


def test_names_are_checked() -> None:
    with pytest.raises(MoebalanceError, match="choose one of: all_to_all, local"):
        ExpertParallelMoE(Placement([[[0]]], 1, Cluster(num_nodes=1, gpus_per_node=1)), 0, torch.zeros(H, 1),
                          random_experts(1, H, FFN), GateConfig(top_k=1), EPConfig(dispatcher="deepep"))
    with pytest.raises(MoebalanceError, match="unknown router"):
        EPConfig(router="nearest")
    with pytest.raises(PlanError, match="2 GPUs but the process group has 1"):
        ExpertParallelMoE(Placement([[[0], [0]]], 1, Cluster(num_nodes=1, gpus_per_node=2)), 0, torch.zeros(H, 1),
                          random_experts(1, H, FFN), GateConfig(top_k=1), EPConfig(dispatcher="local"))
    assert sorted(DISPATCHERS) == ["all_to_all", "local"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for NCCL")
def test_nccl_equals_dense() -> None:
    world_size = 2 if torch.cuda.device_count() >= 2 else 1
    if world_size == 1:
        pytest.skip("one GPU: the NCCL path needs two ranks to exchange anything")
    cases = [c for c in _cases(world_size) if c["id"][0:2] == CLUSTERS[world_size][0] and c["id"][5] == "plain"]
    res = launch(_worker, world_size, [(world_size, cases[:16], [])], "cuda", backend="nccl")
    for case in cases[:16]:
        ref, _ = _reference(world_size, case)
        out = np.concatenate([r[world_size]["cases"][case["id"]]["out"] for r in res])
        torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-4, atol=1e-5)


def test_errors_travel_between_ranks_as_class_and_one_line() -> None:
    """What a rank's error becomes on the others (moebalance.runtime.errors): its class and one line."""
    from moebalance.core.errors import BudgetError
    from moebalance.runtime import GroupError
    from moebalance.runtime.errors import agreed_message, error_code, one_line, raise_coded

    assert error_code(None) == 0
    missing = FileNotFoundError(2, "No such file or directory", "plan.json")
    assert error_code(missing) == error_code(InputError("x"))  # a missing file is the user's to fix
    assert one_line(missing) == "No such file or directory: plan.json"
    assert one_line(ValueError("a\n  b")) == "ValueError: a b" and one_line(PlanError("p")) == "p"
    assert agreed_message({2: "bad", 1: "bad"}) == "rank 1: bad (the same on ranks 2)"
    assert agreed_message({3: "x", 1: "y"}) == "rank 1: y (ranks 3 failed too)"
    assert agreed_message({0: "rank 0 is over"}) == "rank 0 is over"
    for cls in (InputError, PlanError, BudgetError, GroupError, MoebalanceError):
        with pytest.raises(cls) as info:
            raise_coded(error_code(cls("m")), "m")
        assert type(info.value) is cls
    with pytest.raises(RuntimeError, match=r"^m$"):
        raise_coded(error_code(KeyError("k")), "m")
