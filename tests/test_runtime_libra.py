"""The runtime's part of Libra on real gloo process groups (docs/design.md, "Runtime"): per-batch plans with a
prefetch buffer (dense equality over several batches and layers, the buffer holding exactly the planned experts),
two-stage execution with the router in a CPU thread (bit-identical, the local set equal to the router's), and
input errors agreed by every rank. One 4-rank launch (per test process) runs everything, the 2-rank jobs in a
subgroup of ranks 0 and 1; the checks run here, against references computed here.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np
import pytest
import torch

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, MoebalanceError, PlanError
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.routing import ROUTERS, get_router
from moebalance.runtime import (
    KEEPS_LOCAL,
    EPConfig,
    ExpertParallelMoE,
    ExpertPrefetcher,
    ExpertWeights,
    GateConfig,
    batch_extras,
    build_dispatch,
    build_local,
    dense_moe,
    launch,
    layer_placement,
    plan_fetches,
    random_experts,
    route_picks,
    slot_table,
)

E, H, FFN, K, L, N, SEED, BATCHES = 8, 16, 24, 2, 3, 2, 11, 4
CLUSTER = {2: (1, 2), 4: (2, 2)}
TOKENS = {2: [24, 16], 4: [20, 0, 14, 10]}  # rank 1 of 4 has no tokens
#: (router, local_first, router_thread, max_tokens_per_rank): the runs compared with the dense reference.
VARIANTS = [("rebalance", False, False, False), ("rebalance", True, False, False), ("rebalance", False, True, False),
            ("rebalance", False, True, True), ("locality", False, True, False), ("uniform", False, True, False)]


# ---------------------------------------------------------------- inputs, identical in every process
def _base(world_size: int) -> Placement:
    """Contiguous experts, plus in layer 1 a second copy of expert 0 on the last GPU (another node on 4 GPUs)."""
    G = world_size
    per = E // G
    layer = [list(range(g * per, (g + 1) * per)) for g in range(G)]
    with_copy = [list(x) for x in layer]
    with_copy[-1].append(0)
    return Placement([layer, with_copy, layer], E, Cluster(num_nodes=CLUSTER[G][0], gpus_per_node=CLUSTER[G][1]))


def _batch_plans(world_size: int) -> list[Placement]:
    """``BATCHES`` per-batch plans: 0..N random extras per GPU and layer, different every batch."""
    base = _base(world_size)
    rng = np.random.default_rng(SEED + world_size)
    plans = []
    for _ in range(BATCHES):
        layers = []
        for li in range(L):
            row = []
            for g in range(world_size):
                have = base.gpu_experts[li][g]
                free = [e for e in range(E) if e not in have]
                n = int(rng.integers(1 if g == 0 else 0, N + 1))  # GPU 0 always gains one
                row.append([*have, *(int(e) for e in rng.choice(free, size=n, replace=False))])
            layers.append(row)
        plans.append(Placement(layers, E, base.cluster))
    return plans


def _x(world_size: int, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED * 100 + 10 * world_size + batch)
    return torch.randn(sum(TOKENS[world_size]), H, generator=g)


def _gates() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return [torch.randn(H, E, generator=g) for _ in range(L)]


def _experts() -> list[ExpertWeights]:
    return [random_experts(E, H, FFN, seed=SEED + li) for li in range(L)]


def _identity_experts(layer: int) -> ExpertWeights:
    """Weights that name themselves: every entry of expert ``e`` of ``layer`` is ``1000 * layer + e`` (w2
    negated, w3 plus a half), so a buffer slot shows which expert of which layer it holds."""
    ident = (1000.0 * layer + torch.arange(E, dtype=torch.float32))[:, None, None]
    return ExpertWeights(ident.expand(E, H, FFN).clone(), -ident.expand(E, FFN, H).clone(),
                         ident.expand(E, H, FFN).clone() + 0.5)


def _ident(w: ExpertWeights, slot: int) -> tuple[float, ...]:
    assert w.w3_SHF is not None
    return tuple(float(v) for v in (w.w1_SHF[slot].min(), w.w1_SHF[slot].max(), -w.w2_SFH[slot].min(),
                                    -w.w2_SFH[slot].max(), w.w3_SHF[slot].min() - 0.5, w.w3_SHF[slot].max() - 0.5))


def _with_extra(base: Placement, layer: int, gpu: int, experts: list[int], reorder: bool = False) -> Placement:
    """``base`` with ``experts`` appended to ``gpu``'s list in ``layer`` (and its base order swapped)."""
    layers = [[list(x) for x in row] for row in base.gpu_experts]
    if reorder:
        layers[layer][gpu][:2] = layers[layer][gpu][1::-1]
    layers[layer][gpu] += experts
    return Placement(layers, E, base.cluster)


# ---------------------------------------------------------------- what every rank runs
def _worker(rank: int, world_size: int, jobs: list[int]) -> dict[int, Any]:
    pair = torch.distributed.new_group([0, 1]) if world_size > 2 else None  # every rank must create it
    return {ws: _run(rank, ws, None if ws == world_size else pair) for ws in jobs if rank < ws}


def _layers(rank: int, base: Placement, full: list[ExpertWeights], cfg: EPConfig, group: Any,
            ) -> tuple[list[ExpertParallelMoE], ExpertPrefetcher]:
    pf = ExpertPrefetcher(N, group=group)
    gates = _gates()
    return [ExpertParallelMoE.from_full(base, li, gates[li], full[li], GateConfig(top_k=K), cfg, group=group,
                                        prefetcher=pf) for li in range(L)], pf


def _run(rank: int, world_size: int, group: Any) -> dict[str, Any]:
    base, plans = _base(world_size), _batch_plans(world_size)
    off = np.concatenate([[0], np.cumsum(TOKENS[world_size])])
    xs = [_x(world_size, b)[off[rank]:off[rank + 1]] for b in range(BATCHES)]
    out: dict[str, Any] = {"runs": {}, "ident": [], "errors": {}}
    for router, local_first, thread, fixed in VARIANTS:
        cfg = EPConfig(router=router, router_seed=SEED, local_first=local_first, router_thread=thread,
                       max_tokens_per_rank=max(TOKENS[world_size]) if fixed else None)
        layers, pf = _layers(rank, base, _experts(), cfg, group)
        run = []
        for b in range(BATCHES):  # a residual chain, so layer l + 1's copies overlap layer l
            h, per_layer = xs[b], []
            for li in range(L):
                res = layers[li](h, step=b, batch_plan=plans[b])
                s = res.stats
                per_layer.append({"dest": res.dest, "per_slot": s.tokens_per_slot, "received": s.prefetch_received,
                                  "hidden": s.rebalancer_hidden, "local_s": s.local_seconds})
                h = h + res.out
            run.append({"h": h.numpy(), "layers": per_layer})
        pf.drain()
        out["runs"][(router, local_first, thread, fixed)] = run

    # the buffer holds exactly the planned experts: weights that name themselves, inspected after each layer
    layers, pf = _layers(rank, base, [_identity_experts(li) for li in range(L)], EPConfig(router="rebalance"), group)
    for b in range(BATCHES):
        for li in range(L):
            s = layers[li](xs[b], step=b, batch_plan=plans[b]).stats
            buf = pf.views(li % 2)
            n = len(plans[b].gpu_experts[li][rank]) - len(base.gpu_experts[li][rank])
            out["ident"].append({"slots": [_ident(buf, j) for j in range(n)], "received": s.prefetch_received,
                                 "bytes": s.prefetch_bytes_received, "sent": s.prefetch_sent,
                                 "bytes_sent": s.prefetch_bytes_sent, "bpe": layers[li].experts.bytes_per_expert()})
    pf.drain()

    # input errors: every rank must raise the same one-line error, and the group must stay usable
    good = plans[0]
    cases: dict[str, tuple[Any, Any, Any]] = {  # name: (x, step, batch plan) of this rank
        "shape": (torch.zeros(xs[0].shape[0], H + 1) if rank == 1 else xs[0], 0, None),
        "over_n_rank1": (xs[0], 0, _with_extra(base, 0, 0, [4, 5, 6]) if rank == 1 else good),
        "hosted": (xs[0], 0, _with_extra(base, 0, 0, [1])),
        "order": (xs[0], 0, _with_extra(base, 0, 0, [E - 1], reorder=True)),
        "step": (xs[0], 7 if rank == 1 else 0, None),
        "plans_differ": (xs[0], 0, _with_extra(base, 0, 0, [E - 1]) if rank == 1 else _with_extra(base, 0, 0, [E - 2])),
        # layer 0 starts layer 1's copies: ranks whose plans differ only there must fail before posting them
        "next_differs": (xs[0], 0, _with_extra(base, 1, 0, [E - 1]) if rank == 1 else _with_extra(base, 1, 0, [E - 2])),
    }
    for fixed in (False, True):
        cfg = EPConfig(router="rebalance", max_tokens_per_rank=max(TOKENS[world_size]) if fixed else None)
        layers, pf = _layers(rank, base, _experts(), cfg, group)
        for name, (x, step, plan) in cases.items():
            try:
                layers[0](x, step=step, batch_plan=plan)
                out["errors"][name, fixed] = ("", "")
            except MoebalanceError as exc:
                out["errors"][name, fixed] = (type(exc).__name__, str(exc))
        too_many = torch.zeros(max(TOKENS[world_size]) + 1, H) if rank == 1 else xs[0]
        try:
            layers[0](too_many, step=0)
            out["errors"]["too_many", fixed] = ("", "")
        except MoebalanceError as exc:
            out["errors"]["too_many", fixed] = (type(exc).__name__, str(exc))
        out["errors"]["after", fixed] = layers[0](xs[0], step=0, batch_plan=good).out.numpy()  # still in step
        pf.drain()
    return out


@functools.cache
def _results() -> dict[int, list[dict[str, Any]]]:
    per_rank = launch(_worker, 4, [2, 4])
    return {ws: [r[ws] for r in per_rank[:ws]] for ws in (2, 4)}


def _dense(world_size: int, batch: int) -> torch.Tensor:
    """The residual chain of the ``L`` layers in one process (per-batch plans change where, not what)."""
    h = _x(world_size, batch)
    for gate, full in zip(_gates(), _experts(), strict=True):
        out, _ = dense_moe(h, gate, full, GateConfig(top_k=K), group_sizes=TOKENS[world_size])
        h = h + out
    return h


# ---------------------------------------------------------------- checks
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS, ids=["-".join(map(str, v)) for v in VARIANTS])
def test_per_batch_plans_equal_dense(world_size: int, variant: tuple[Any, ...]) -> None:
    ranks = _results()[world_size]
    plans = _batch_plans(world_size)
    assert len({p.gpu_experts for p in plans}) == BATCHES  # different extras every batch
    router = variant[0]
    for b in range(BATCHES):
        got = np.concatenate([r["runs"][variant][b]["h"] for r in ranks])
        torch.testing.assert_close(torch.from_numpy(got), _dense(world_size, b), rtol=1e-4, atol=1e-4)  # 3 layers deep
        for li in range(L):
            layers = [r["runs"][variant][b]["layers"][li] for r in ranks]
            dest = layers[0]["dest"]
            assert all(np.array_equal(x["dest"], dest) for x in layers)
            # the router saw the per-batch layer plan: every pick on a GPU holding a copy there, extras included
            one = layer_placement(plans[b], li)
            assert [int(x["per_slot"].sum()) for x in layers] == np.bincount(dest.ravel(), minlength=world_size).tolist()
            assert all(len(x["per_slot"]) == len(one.gpu_experts[0][g]) for g, x in enumerate(layers))
            hidden = [x["hidden"] for x in layers]
            assert all(v is None for v in hidden) if not (variant[2] and router in KEEPS_LOCAL) else \
                all(isinstance(v, bool) for v in hidden)
    if router == "rebalance":  # the extra copies take load
        base = _base(world_size)
        on_extras = 0
        for g, r in enumerate(ranks):
            for b in range(BATCHES):
                for li, x in enumerate(r["runs"][variant][b]["layers"]):
                    on_extras += int(x["per_slot"][len(base.gpu_experts[li][g]):].sum())
        assert on_extras > 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_router_thread_and_local_first_are_bit_identical(world_size: int) -> None:
    ranks = _results()[world_size]
    ref = VARIANTS[0]
    for variant in VARIANTS[1:4]:
        for r in ranks:
            for b in range(BATCHES):
                assert np.array_equal(r["runs"][variant][b]["h"], r["runs"][ref][b]["h"]), (variant, b)
                for x, y in zip(r["runs"][variant][b]["layers"], r["runs"][ref][b]["layers"], strict=True):
                    assert np.array_equal(x["dest"], y["dest"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_routes_match_the_simulator_on_the_per_batch_plan(world_size: int) -> None:
    ranks = _results()[world_size]
    plans = _batch_plans(world_size)
    for b in range(BATCHES):
        h = _x(world_size, b)
        for li, (gate, full) in enumerate(zip(_gates(), _experts(), strict=True)):
            out, g = dense_moe(h, gate, full, GateConfig(top_k=K), group_sizes=TOKENS[world_size])
            src = np.repeat(np.arange(world_size), TOKENS[world_size])
            tr = RoutingTrace(g.topk_ids.numpy()[:, None, :], src, np.zeros(len(src), int), num_experts=E)
            want = ROUTERS["rebalance"].assign_tokens(layer_placement(plans[b], li), tr,
                                                      np.random.default_rng((SEED, li, b)))[:, 0, :]
            assert np.array_equal(ranks[0]["runs"][VARIANTS[0]][b]["layers"][li]["dest"], want)
            h = h + out


@pytest.mark.parametrize("world_size", [2, 4])
def test_prefetch_moves_exactly_the_planned_experts(world_size: int) -> None:
    ranks = _results()[world_size]
    base, plans = _base(world_size), _batch_plans(world_size)
    for b in range(BATCHES):
        for li in range(L):
            i = b * L + li
            extras = [list(plans[b].gpu_experts[li][g][len(base.gpu_experts[li][g]):]) for g in range(world_size)]
            for g, r in enumerate(ranks):
                got = r["ident"][i]
                assert got["slots"] == [(1000.0 * li + e,) * 6 for e in extras[g]], (b, li, g)
                assert got["received"] == len(extras[g])
                assert got["bytes"] == len(extras[g]) * got["bpe"]
            fetches = plan_fetches(base, li, extras)
            assert [r["ident"][i]["sent"] for r in ranks] == \
                np.bincount([f.src for f in fetches], minlength=world_size).tolist()
            assert sum(r["ident"][i]["bytes_sent"] for r in ranks) == sum(r["ident"][i]["bytes"] for r in ranks)


ERRORS = {
    "shape": ("InputError", r"^rank 1: x must be \[T, 16\], got \(\d+, 17\)$"),
    "over_n_rank1": ("PlanError", r"^rank 1: the per-batch plan adds 3 experts \[4, 5, 6\] to GPU 0 in layer 0; the "
                                  r"prefetch buffer holds at most 2 .*$"),
    "hosted": ("PlanError", r"^rank 0: the per-batch plan adds expert 1 to GPU 0 in layer 0, which already holds it; "
                            r".* \(the same on ranks 1(, 2, 3)?\)$"),
    "order": ("PlanError", r"^rank 0: the per-batch plan's layer 0, GPU 0 lists \[1, 0, .*\], which does not start "
                           r"with the base plan's \[0, 1(, \d+)*\]; "),
    "step": ("PlanError", r"^the ranks disagree on the step: rank 0 is at step 0 but rank 1 at step 7; "),
    "plans_differ": ("PlanError", r"^the ranks disagree on the plan: rank 1's plan of this layer .*differs from rank 0's"),
    "next_differs": ("PlanError", r"^the ranks disagree on the plan: rank 1's plan of this layer \(or of the next"),
    "too_many": ("InputError", r"^rank 1 has \d+ tokens but max_tokens_per_rank is \d+; raise it or send fewer"),
}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("fixed", [False, True], ids=["counts", "fixed_size"])
@pytest.mark.parametrize("case", sorted(ERRORS))
def test_one_ranks_bad_input_fails_every_rank_alike(world_size: int, fixed: bool, case: str) -> None:
    ranks = _results()[world_size]
    if case == "too_many" and not fixed:
        assert all(r["errors"][case, fixed] == ("", "") for r in ranks)  # no bound: any count goes
        return
    got = {r["errors"][case, fixed] for r in ranks}
    assert len(got) == 1, got
    (cls, message), = got
    assert cls == ERRORS[case][0]
    assert "\n" not in message
    assert re.search(ERRORS[case][1], message), message
    # after the errors every rank is still in step: a good forward equals the dense reference
    out = np.concatenate([r["errors"]["after", fixed] for r in ranks])
    ref, _ = dense_moe(_x(world_size, 0), _gates()[0], _experts()[0], GateConfig(top_k=K), group_sizes=TOKENS[world_size])
    torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- single-process pieces
def test_batch_plan_checks_give_one_line_errors() -> None:
    base = _base(2)
    assert batch_extras(base, _with_extra(base, 1, 0, [5, 6]), 2)[1] == ((5, 6), ())
    bad = [
        (_with_extra(base, 0, 1, [0, 1, 2]), 2, r"adds 3 experts \[0, 1, 2\] to GPU 1 in layer 0; the prefetch buffer "
                                               r"holds at most 2"),
        (_with_extra(base, 2, 1, [5]), 2, r"adds expert 5 to GPU 1 in layer 2, which already holds it"),
        (_with_extra(base, 0, 0, [6, 6]), 2, r"adds expert 6 to GPU 0 in layer 0, which already holds it"),
        (_with_extra(base, 0, 0, [], reorder=True), 2, r"layer 0, GPU 0 lists \[1, 0, 2, 3\], which does not start "
                                                       r"with the base plan's \[0, 1, 2, 3\]"),
        (_with_extra(base, 0, 0, [5]), 0, r"no prefetch buffer; build them with prefetcher=ExpertPrefetcher\(N\)"),
        (_base(4), 2, r"the per-batch plan has 3 layers x 8 experts on 4 GPUs but the base plan 3 x 8 on 2"),
    ]
    for plan, slots, message in bad:
        with pytest.raises(PlanError, match=message) as info:
            batch_extras(base, plan, slots)
        assert "\n" not in str(info.value)
    with pytest.raises(InputError, match=r"batch_plan must be a moebalance\.core\.plan\.Placement, got dict"):
        batch_extras(base, base.to_json_dict(), 2)
    with pytest.raises(InputError, match="num_slots"):
        ExpertPrefetcher(-1)


def test_plan_fetches_prefers_the_node_then_the_home_holder() -> None:
    # 2 nodes x 2 GPUs; layer 1 of the base: expert 0 on GPUs 0 (home) and 3, expert 2 on GPU 1 only
    base = _base(4)
    assert base.gpu_experts[1] == ((0, 1), (2, 3), (4, 5), (6, 7, 0))
    fetches = plan_fetches(base, 1, [(2,), (0,), (0, 3), ()])
    # GPU 1 takes 0 from its node's GPU 0; GPU 2 takes 0 from its node's GPU 3 and 3 from GPU 1 (no holder on
    # node 1); slots follow the per-batch order
    assert [(f.expert, f.src, f.dst, f.slot) for f in fetches] == [(2, 1, 0, 0), (0, 0, 1, 0), (0, 3, 2, 0),
                                                                   (3, 1, 2, 1)]
    # within a tier the holder that has sent least: two GPUs of node 0 both need expert 6 (held on node 1 by 3)
    one = Placement([[[0, 1], [2, 3], [4, 5, 6], [6, 7]]], E, Cluster(num_nodes=2, gpus_per_node=2))
    assert [f.src for f in plan_fetches(one, 0, [(6,), (6,), (), ()])] == [2, 3]


@pytest.mark.parametrize("router", sorted(KEEPS_LOCAL))
def test_local_picks_without_the_router_equal_the_routers(router: str) -> None:
    # a plan with replicas; random picks with some dropped: what build_local derives equals build_dispatch's local
    cl = Cluster(num_nodes=2, gpus_per_node=2)
    plan = Placement([[[0, 1, 2], [2, 3, 4], [4, 5, 6, 0], [6, 7, 1]]], E, cl)
    rng = np.random.default_rng(3)
    tokens = [30, 0, 21, 25]
    T = sum(tokens)
    ids = np.stack([rng.choice(E, size=K, replace=False, p=np.r_[0.4, np.full(E - 1, 0.6 / (E - 1))]) for _ in range(T)])
    kept = rng.random((T, K)) > 0.1
    w = rng.random((T, K))
    dest = route_picks(plan, router, ids, kept, tokens, np.random.default_rng(0))
    has = plan.copies[0] > 0
    off = np.concatenate([[0], np.cumsum(tokens)])
    for g in range(4):
        lo, hi = off[g], off[g + 1]
        slot = slot_table(plan)[g]
        meta = build_dispatch(dest, ids, w, tokens, g, slot)
        token, work = build_local(kept[lo:hi] & has[ids[lo:hi], g], ids[lo:hi], w[lo:hi], slot)
        assert torch.equal(token, meta.local_token)
        for a, b in ((work.pick_row, meta.local.pick_row), (work.pick_slot, meta.local.pick_slot),
                     (work.pick_weight, meta.local.pick_weight)):
            assert torch.equal(a, b)


def test_minmax_may_move_local_picks_so_it_routes_first() -> None:
    # both GPUs hold expert 0 and GPU 0's four tokens all pick it: the least straggler moves two of them
    plan = Placement([[[0, 1], [0, 2]]], 3, Cluster(num_nodes=1, gpus_per_node=2))
    ids = np.array([[0, 1]] * 4)
    dest = route_picks(plan, "minmax", ids, np.ones_like(ids, dtype=bool), [4, 0], np.random.default_rng(0))
    assert (dest[:, 0] == 1).sum() > 0
    assert "minmax" not in KEEPS_LOCAL and get_router("rebalance").name in KEEPS_LOCAL


def test_local_dispatcher_takes_per_batch_plans() -> None:
    plan = Placement([[[0, 1, 2, 3]]], 4, Cluster(num_nodes=1, gpus_per_node=1))
    g = torch.Generator().manual_seed(0)
    x, gate = torch.randn(10, H, generator=g), torch.randn(H, 4, generator=g)
    full = random_experts(4, H, FFN, seed=1)
    layer = ExpertParallelMoE.from_full(plan, 0, gate, full, GateConfig(top_k=2), EPConfig(dispatcher="local",
                                                                                          router="rebalance",
                                                                                          router_thread=True))
    res = layer(x, batch_plan=plan)
    torch.testing.assert_close(res.out, dense_moe(x, gate, full, GateConfig(top_k=2))[0], rtol=1e-5, atol=1e-6)
    assert res.stats.rebalancer_hidden is not None and res.stats.prefetch_received == 0
    with pytest.raises(InputError, match=r"^x must be \[T, 16\], got \(10, 3\)$"):  # one process: raised as it is
        layer(torch.zeros(10, 3))
