"""Replay simulator, metrics and traffic accounting."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import random_replica_layers
from hypothesis import given

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.routing import ROUTERS
from moebalance.routing.simulate import evaluate, gpu_loads, layer_metrics
from moebalance.routing.touched import pick_tally

#: Every registered router ready to run: metro models expert time, so it gets a GPU and a model.
READY = {n: r.with_params(gpu="h100-80gb", model="deepseek-v3") if n == "metro" else r for n, r in ROUTERS.items()}


def test_uniform_replay_by_hand() -> None:
    # GPU 0 hosts {0, 1}, GPU 1 hosts {0, 2, 3}; load [2, 1, 1, 2].
    # Expert 0 splits 1 + 1: GPU 0 = 1 + 1 = 2, GPU 1 = 1 + 1 + 2 = 4; mean 3, max 4.
    plan = Placement([[[0, 1], [0, 2, 3]]], 4, Cluster(num_nodes=1, gpus_per_node=2))
    load = LoadMatrix(np.array([[[2, 1, 1, 2]]]))
    assert gpu_loads(plan, load.counts).tolist() == [[[2.0, 4.0]]]
    s = evaluate(plan, load)
    assert s.balancedness == pytest.approx(0.75)
    assert s.imbalance_ratio == pytest.approx(4 / 3)
    # lower bound max(6 / 2, max(2/2, 1, 1, 2/1)) = 3, so the gap is 4 / 3 - 1
    assert s.lower_bound_gap == pytest.approx(1 / 3)
    assert s.per_layer_balancedness.tolist() == [pytest.approx(0.75)]


def test_zero_load_layers_are_skipped() -> None:
    plan = Placement([[[0], [1]], [[0], [1]]], 2, Cluster(num_nodes=1, gpus_per_node=2))
    load = LoadMatrix(np.array([[[3, 1], [0, 0]], [[2, 2], [0, 0]]]))
    s = evaluate(plan, load)
    # layer 0: batch 0 -> 2/3, batch 1 -> 1; layer 1 has no load
    assert s.balancedness == pytest.approx((2 / 3 + 1) / 2)
    assert np.isnan(s.per_layer_balancedness[1])
    assert s.as_dict()["per_layer_balancedness"][1] is None
    with pytest.raises(InputError, match="nothing to score"):
        evaluate(plan, LoadMatrix(np.zeros((1, 2, 2), int)))


def test_mismatched_plan_and_load() -> None:
    plan = Placement([[[0], [1]]], 2, Cluster(num_nodes=1, gpus_per_node=2))
    with pytest.raises(PlanError, match="1 layers x 2 experts but the load has 1 x 3"):
        evaluate(plan, LoadMatrix(np.ones((1, 1, 3), int)))


def test_traffic_by_hand() -> None:
    # 2 nodes x 2 GPUs; 4 experts, expert e on GPU e; expert 0 also on GPU 3.
    cluster = Cluster(num_nodes=2, gpus_per_node=2)
    plan = Placement([[[0], [1], [2], [3, 0]]], 4, cluster)
    # token 0 on GPU 0 picks {0, 1}: expert 0's first use goes to replica 0 (GPU 0, local), 1 -> GPU 1 (intra)
    # token 1 on GPU 0 picks {0, 2}: expert 0's second use -> replica 1 (GPU 3, inter), 2 -> GPU 2 (inter);
    #   GPUs 2 and 3 are both on node 1: two inter-node copies, one per destination node
    # token 2 on GPU 3 picks {3, 0}: 3 -> GPU 3 (local); expert 0 third use -> replica 0 (GPU 0, inter)
    tr = RoutingTrace([[[0, 1]], [[0, 2]], [[3, 0]]], src_gpu=[0, 0, 3], batch=[0, 0, 0], num_experts=4)
    s = evaluate(plan, LoadMatrix(tr.counts(), tr))
    t = s.traffic
    assert t is not None
    assert (t.local, t.intra_node, t.inter_node, t.inter_node_dedup) == (2, 1, 3, 2)
    assert t.matrix[0].tolist() == [1, 1, 1, 1] and t.matrix[3].tolist() == [1, 0, 0, 1]
    assert s.as_dict(
    )["traffic"] == {"local": 2, "intra_node": 1, "inter_node": 3, "inter_node_dedup": 2}
    s2 = evaluate(plan, LoadMatrix(tr.counts(), tr), bytes_per_copy=10)
    assert s2.as_dict()["traffic"]["bytes"]["inter_node"] == 2 * 3 * 10


def test_same_gpu_picks_cost_one_copy() -> None:
    cluster = Cluster(num_nodes=1, gpus_per_node=2)
    plan = Placement([[[0, 1], [2, 3]]], 4, cluster)
    tr = RoutingTrace([[[0, 1]], [[2, 3]]], src_gpu=[1, 1], batch=[0, 0], num_experts=4)
    t = evaluate(plan, LoadMatrix(tr.counts(), tr)).traffic
    assert t is not None and (t.local, t.intra_node, t.inter_node) == (1, 1, 0)


@st.composite
def plan_and_load(draw: st.DrawFn) -> tuple[Placement, np.ndarray]:
    nodes, gpn = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    G = nodes * gpn
    E, L, B = draw(st.integers(1, 9)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    layers = random_replica_layers(rng, L, E, G)
    counts = rng.integers(0, 50, size=(B, L, E)) * (rng.random((B, L, E)) < 0.8)
    return Placement(layers, E, Cluster(num_nodes=nodes, gpus_per_node=gpn)), counts


@pytest.mark.parametrize("router", sorted(ROUTERS))
@given(case=plan_and_load())
def test_router_conserves_load_and_only_uses_hosting_gpus(router: str, case) -> None:
    plan, counts = case
    if router == "locality":  # it needs each token's GPU: bare counts are refused (tested in test_routers)
        return
    loads = gpu_loads(plan, counts, READY[router], np.random.default_rng(1))
    assert np.allclose(loads.sum(axis=2), counts.sum(axis=2))
    # a GPU gets load only if it hosts some expert with load
    hosts = (np.einsum("ble,leg->blg", counts, plan.copies) > 0)
    assert np.all(loads[~hosts] == 0)
    m = layer_metrics(loads, counts, plan.replica_counts())
    active = counts.sum(axis=2) > 0
    assert np.all((m.balancedness[active] > 0) & (m.balancedness[active] <= 1 + 1e-12))
    assert np.allclose(m.imbalance[active] * m.balancedness[active], 1)
    assert np.all(m.max_load[active] >= m.lower_bound[active] - 1e-9)


@pytest.mark.parametrize("router", sorted(ROUTERS))
@given(case=plan_and_load())
def test_token_routers_pick_hosting_gpus(router: str, case) -> None:
    plan, _counts = case
    rng = np.random.default_rng(0)
    L, E = plan.num_layers, plan.num_experts
    T, K = 30, min(2, E)
    topk = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(T)])
    tr = RoutingTrace(topk, rng.integers(0, plan.num_gpus, T), np.zeros(T, int), num_experts=E)
    dest = READY[router].assign_tokens(plan, tr, rng)
    layer = np.arange(L)[None, :, None]
    assert np.all(plan.copies[layer, topk, dest] > 0)


def test_round_robin_realises_the_equal_split() -> None:
    # expert 0 on 3 GPUs, 7 tokens: the round-robin split is 3, 2, 2.
    plan = Placement([[[0], [0, 1], [0]]], 2, Cluster(num_nodes=1, gpus_per_node=3))
    tr = RoutingTrace(np.zeros((7, 1, 1), int), np.zeros(7, int), np.zeros(7, int), num_experts=2)
    dest = ROUTERS["uniform"].assign_tokens(plan, tr, np.random.default_rng(0))
    assert np.bincount(dest.ravel(), minlength=3).tolist() == [3, 2, 2]


def test_random_router_is_unbiased() -> None:
    plan = Placement([[[0], [0, 1], [0]]], 2, Cluster(num_nodes=1, gpus_per_node=3))
    counts = np.full((400, 1, 2), [300, 0])
    loads = gpu_loads(plan, counts, "random", np.random.default_rng(5))
    assert np.allclose(loads.mean(axis=0)[0], [100, 100, 100], rtol=0.02)
    assert loads.std(axis=0)[0, 0] > 1  # it really samples


def test_a2a_seconds_hand_computed() -> None:
    from moebalance.cost.a2a import a2a_seconds

    # 2 nodes x 2 GPUs, 100 GB/s inside a node, 10 GB/s across; 1000-byte copies.
    # GPU 0 sends 50 copies to GPU 1 (intra) and 20 to GPU 2 (inter); GPU 3 sends 30 to GPU 2 (intra).
    # Links: GPU 0 intra 50 / 100, inter 20 / 10 -> 2.0 us-units; GPU 2 receives 20 inter (2.0) and 30 intra.
    # Busiest link: 20 copies * 1000 B / 10 GB/s = 2 us per phase, 4 us for dispatch + combine.
    cluster = Cluster(num_nodes=2, gpus_per_node=2, intra_node_bandwidth=100.0, inter_node_bandwidth=10.0)
    m = np.zeros((4, 4), int)
    m[0, 1], m[0, 2], m[3, 2] = 50, 20, 30
    assert a2a_seconds(m, cluster, 1000) == pytest.approx(4e-6)
    m[3, 2] = 3000  # now GPU 2's intra-node receive dominates: 3000 * 1000 / 100e9 * 2 = 60 us
    assert a2a_seconds(m, cluster, 1000) == pytest.approx(60e-6)
    m[2, 2] = 10**9  # local copies are free
    assert a2a_seconds(m[None], cluster, 1000).tolist() == pytest.approx([60e-6])


def test_evaluate_reports_idle_std_and_a2a_time() -> None:
    # 2 GPUs (2 nodes x 1), expert 0 on GPU 0 and expert 1 on GPU 1; batch 0: 3 tokens pick expert 0 from
    # GPU 1 -> loads [3, 0]: idle 3, std 1.5; every copy crosses nodes: 3 copies * 8 B / 1 GB/s * 2
    plan = Placement([[[0], [1]]], 2, Cluster(num_nodes=2, gpus_per_node=1, inter_node_bandwidth=1.0))
    tr = RoutingTrace(np.zeros((3, 1, 1), int), np.ones(3, int), np.zeros(3, int), num_experts=2)
    load = LoadMatrix(tr.counts(), tr)
    s = evaluate(plan, load, bytes_per_copy=8)
    assert s.gpu_idle == 3 and s.load_std == 1.5
    assert s.traffic is not None and s.traffic.a2a_seconds is not None
    assert np.allclose(s.traffic.a2a_seconds, [[2 * 3 * 8 / 1e9]])
    no_bytes = evaluate(plan, load).traffic
    assert no_bytes is not None and no_bytes.a2a_seconds is None  # no bytes, no time


def test_node_forwarding_sends_a_token_once_per_node() -> None:
    """2 nodes x 2 GPUs; one token on GPU 0 picks experts served by GPUs 2 and 3 (both on node 1). A copy per GPU
    sends 2 copies over GPU 0's NIC; node forwarding sends 1 (to GPU 2, the same local index on node 1), which GPU 2
    forwards to GPU 3 over the node's link: half the network time when the network is the slow link."""
    from moebalance.core.trace import RoutingTrace
    from moebalance.routing.copies import traffic

    cluster = Cluster(num_nodes=2, gpus_per_node=2, intra_node_bandwidth=100.0, inter_node_bandwidth=1.0)
    plan = Placement([[[0], [1], [2], [3]]], 4, cluster)
    trace = RoutingTrace(np.array([[[2, 3]]]), [0], [0], num_experts=4)
    dest = np.array([[[2, 3]]])
    per_gpu = traffic(plan, trace, dest, bytes_per_copy=1000)
    by_node = traffic(plan, trace, dest, bytes_per_copy=1000, kernel="normal")
    assert (per_gpu.inter_node, per_gpu.inter_node_dedup) == (by_node.inter_node, by_node.inter_node_dedup) == (2, 1)
    assert per_gpu.a2a_seconds[0, 0] == pytest.approx(2 * 1000 * 2 / 1.0 / 1e9)  # 2 copies over GPU 0's NIC, twice
    assert by_node.a2a_seconds[0, 0] == pytest.approx(2 * 1000 * 1 / 1.0 / 1e9)  # 1 copy; the forward is fast


def test_low_latency_sends_a_message_per_pick() -> None:
    """2 nodes x 2 GPUs, 2 experts per GPU; a token on GPU 0 picks experts 4 and 5 (both on GPU 2) and expert 1 (its
    own GPU). A copy per GPU crosses GPU 0's NIC once; DeepEP's low-latency kernels send one message per pick: twice,
    and nothing for the pick on the token's own GPU."""
    from moebalance.core.trace import RoutingTrace
    from moebalance.routing.copies import traffic

    cluster = Cluster(num_nodes=2, gpus_per_node=2, intra_node_bandwidth=100.0, inter_node_bandwidth=1.0)
    plan = Placement([[[0, 1], [2, 3], [4, 5], [6, 7]]], 8, cluster)
    trace = RoutingTrace(np.array([[[4, 5, 1]]]), [0], [0], num_experts=8)
    dest = np.array([[[2, 2, 0]]])
    per_gpu = traffic(plan, trace, dest, bytes_per_copy=1000)
    per_pick = traffic(plan, trace, dest, bytes_per_copy=1000, kernel="low-latency")
    assert per_gpu.a2a_seconds[0, 0] == pytest.approx(2 * 1000 * 1 / 1.0 / 1e9)
    assert per_pick.a2a_seconds[0, 0] == pytest.approx(2 * 1000 * 2 / 1.0 / 1e9)
    with pytest.raises(InputError, match="not auto"):
        traffic(plan, trace, dest, bytes_per_copy=1000, kernel="auto")


@pytest.mark.parametrize("forwarding", ["per-gpu", "normal", "low-latency"])
def test_traffic_seconds_only_times_as_the_full_count(forwarding: str) -> None:
    """The priced replay's shortcut: the same all-to-all seconds per (batch, layer), copy counts left at zero."""
    from moebalance.routing.copies import traffic

    rng = np.random.default_rng(3)
    cluster = Cluster(num_nodes=2, gpus_per_node=4)
    plan = Placement(random_replica_layers(rng, 3, 16, 8), 16, cluster)
    T, K = 200, 4
    for batches in (1, 3):
        topk = np.stack([np.stack([rng.choice(16, K, replace=False) for _ in range(3)]) for _ in range(T)])
        batch = np.sort(rng.integers(0, batches, T))
        batch[0] = 0
        batch[-1] = batches - 1
        trace = RoutingTrace(topk, rng.integers(0, 8, T), batch, num_experts=16)
        dest = ROUTERS["random"].assign_tokens(plan, trace, rng)
        full = traffic(plan, trace, dest, bytes_per_copy=4096, kernel=forwarding)
        fast = traffic(plan, trace, dest, bytes_per_copy=4096, kernel=forwarding, seconds_only=True)
        assert full.a2a_seconds is not None and fast.a2a_seconds is not None
        assert np.array_equal(full.a2a_seconds, fast.a2a_seconds)
        assert full.inter_node > 0 and fast.inter_node == 0


@given(seed=st.integers(0, 10_000), T=st.integers(1, 30), B=st.integers(1, 4))
def test_pick_tally_counts_distinct_experts_per_gpu(seed: int, T: int, B: int) -> None:
    """Picks and distinct experts per (batch, layer, GPU) against sets built by hand; batches interleaved in token
    order, dropped picks (-1) counted nowhere, int16 ids."""
    rng = np.random.default_rng(seed)
    L, K, E, G = 2, 3, 5, 4
    ids = rng.integers(0, E, (T, L, K)).astype(np.int16)
    dest = rng.integers(-1, G, (T, L, K))
    batch = rng.integers(0, B, T)
    picks, touched = pick_tally(dest, ids, batch, B, E, G)
    assert touched is not None
    for b in range(B):
        for layer in range(L):
            for g in range(G):
                here = (dest[batch == b, layer] == g)
                assert picks[b, layer, g] == here.sum()
                assert touched[b, layer, g] == len(set(ids[batch == b, layer][here].tolist()))
