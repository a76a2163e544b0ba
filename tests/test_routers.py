"""GRACE's routers (GRACE-MoE Alg. 3-4): weights from the plan, locality tiers, conservation."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import random_replica_layers
from hypothesis import given

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.routing import ROUTERS
from moebalance.routing.grace import replica_weights, weighted_index
from moebalance.routing.simulate import gpu_loads


@st.composite
def weighted_plans(draw: st.DrawFn) -> Placement:
    nodes, gpn = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    G = nodes * gpn
    E, L = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    layers = random_replica_layers(rng, L, E, G)
    # positive weights, so every replica can be drawn
    weights = [[[float(rng.integers(1, 5)) for _ in g] for g in gpus] for gpus in layers]
    return Placement(layers, E, Cluster(num_nodes=nodes, gpus_per_node=gpn), weights=weights)


def _trace(plan: Placement, T: int, seed: int) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    L, E = plan.num_layers, plan.num_experts
    K = min(2, E)
    topk = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(T)])
    return RoutingTrace(topk, rng.integers(0, plan.num_gpus, T), np.zeros(T, int), num_experts=E)


@given(plan=weighted_plans(), seed=st.integers(0, 2**31))
def test_wrr_conserves_counts_and_uses_hosting_gpus(plan: Placement, seed: int) -> None:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 40, size=(3, plan.num_layers, plan.num_experts))
    loads = gpu_loads(plan, counts, "wrr", rng)
    assert np.allclose(loads.sum(axis=2), counts.sum(axis=2))
    hosts = np.einsum("ble,leg->blg", counts, plan.copies) > 0
    assert np.all(loads[~hosts] == 0) and np.all(loads == np.round(loads))  # whole tokens


@given(plan=weighted_plans(), seed=st.integers(0, 2**31))
def test_locality_prefers_own_gpu_then_own_node(plan: Placement, seed: int) -> None:
    tr = _trace(plan, 40, seed)
    dest = ROUTERS["locality"].assign_tokens(plan, tr, np.random.default_rng(seed))
    gpn = plan.cluster.gpus_per_node
    L = plan.num_layers
    layer = np.arange(L)[None, :, None]
    ids, src = tr.topk_ids, tr.src_gpu[:, None, None]
    assert np.all(plan.copies[layer, ids, dest] > 0)  # never a GPU without a replica
    on_own = plan.copies[layer, ids, np.broadcast_to(src, ids.shape)] > 0
    assert np.all(dest[on_own] == np.broadcast_to(src, ids.shape)[on_own])  # own GPU whenever it has one
    node_copies = plan.copies.reshape(L, plan.num_experts, -1, gpn).sum(axis=3)  # [L, E, nodes]
    on_node = node_copies[layer, ids, np.broadcast_to(src // gpn, ids.shape)] > 0
    assert np.all((dest // gpn == src // gpn)[on_node])  # else its own node whenever that has one


def test_locality_refuses_bare_counts() -> None:
    plan = Placement([[[0], [0, 1]]], 2, Cluster(num_nodes=1, gpus_per_node=2))
    with pytest.raises(InputError, match="locality router needs to know which GPU each token lives on"):
        gpu_loads(plan, np.ones((1, 1, 2), int), "locality")


def test_locality_refuses_a_token_on_a_gpu_the_plan_lacks() -> None:
    # locality indexes its tables by the token's GPU (the others ignore it; evaluate checks every trace)
    plan = Placement([[[0], [0, 1]]], 2, Cluster(num_nodes=1, gpus_per_node=2))
    trace = RoutingTrace(np.array([[[0]], [[1]]]), np.array([0, 5]), np.zeros(2, int), num_experts=2)
    with pytest.raises(InputError, match=r"src_gpu holds rank 5 but the cluster has 2 GPUs"):
        ROUTERS["locality"].assign_tokens(plan, trace, np.random.default_rng(0))


def test_replica_weights_follow_the_plan() -> None:
    # expert 0 on GPUs 0, 1, 2 with weights 2 : 1 : 1; expert 1 twice on GPU 1 (weights 1 and 3, shared equally)
    plan = Placement([[[0], [0, 1, 1], [0]]], 2, Cluster(num_nodes=1, gpus_per_node=3),
                     weights=[[[2.0], [1.0, 1.0, 3.0], [1.0]]])
    w = replica_weights(plan)
    assert w[0, 0].tolist() == [0.5, 0.25, 0.25]
    assert w[0, 1].tolist() == [0.5, 0.5, 0.0]
    unweighted = Placement([[[0], [0, 1], [0]]], 2, Cluster(num_nodes=1, gpus_per_node=3))
    assert replica_weights(unweighted)[0, 0].tolist() == pytest.approx([1 / 3] * 3)


def test_wrr_follows_the_weights_on_counts_and_tokens() -> None:
    plan = Placement([[[0], [0, 1], [0]]], 2, Cluster(num_nodes=1, gpus_per_node=3),
                     weights=[[[2.0], [1.0, 1.0], [1.0]]])
    counts = np.full((400, 1, 2), [400, 0])
    loads = gpu_loads(plan, counts, "wrr", np.random.default_rng(5))
    assert np.allclose(loads.mean(axis=0)[0], [200, 100, 100], rtol=0.02)
    assert loads.std(axis=0)[0, 0] > 1  # it really samples
    T = 20000
    tr = RoutingTrace(np.zeros((T, 1, 1), int), np.zeros(T, int), np.zeros(T, int), num_experts=2)
    dest = ROUTERS["wrr"].assign_tokens(plan, tr, np.random.default_rng(0))
    assert np.bincount(dest.ravel(), minlength=3) / T == pytest.approx([0.5, 0.25, 0.25], abs=0.01)


def test_locality_draws_by_weight_within_the_node_tier() -> None:
    # 2 nodes x 2 GPUs; expert 0 on GPUs 1, 2, 3 with weights 1, 3, 1; tokens on GPU 0 (node 0) must all go
    # to GPU 1 (the only same-node replica), tokens on GPU 2 stay, tokens on GPU 3 stay
    plan = Placement([[[1], [0], [0], [0]]], 2, Cluster(num_nodes=2, gpus_per_node=2),
                     weights=[[[1.0], [1.0], [3.0], [1.0]]])
    T = 3000
    src = np.repeat([0, 2, 3], T // 3)
    tr = RoutingTrace(np.zeros((T, 1, 1), int), src, np.zeros(T, int), num_experts=2)
    dest = ROUTERS["locality"].assign_tokens(plan, tr, np.random.default_rng(0))[:, 0, 0]
    assert np.all(dest[src == 0] == 1) and np.all(dest[src == 2] == 2) and np.all(dest[src == 3] == 3)


def test_locality_weighs_several_replicas_in_the_node_tier() -> None:
    # 2 nodes x 3 GPUs; expert 0 on GPUs 1 and 2 (node 0, weights 3 : 1) and on GPU 4 (node 1, weight 4).
    # Tokens on GPU 0 hold no replica; node 0 has two: they split 3 : 1 = 0.75 / 0.25, never to GPU 4.
    # (Equal weights within the tier would give 0.5 / 0.5; drawing by all weights would send half to GPU 4.)
    plan = Placement([[[1], [0], [0], [1], [0], [1]]], 2, Cluster(num_nodes=2, gpus_per_node=3),
                     weights=[[[1.0], [3.0], [1.0], [1.0], [4.0], [1.0]]])
    T = 20000
    tr = RoutingTrace(np.zeros((T, 1, 1), int), np.zeros(T, int), np.zeros(T, int), num_experts=2)
    dest = ROUTERS["locality"].assign_tokens(plan, tr, np.random.default_rng(2)).ravel()
    share = np.bincount(dest, minlength=6) / T
    assert share[1:3] == pytest.approx([0.75, 0.25], abs=0.01) and share[4] == 0 and share[[0, 3, 5]].sum() == 0


def test_weighted_index_inverts_the_cumulative_weights() -> None:
    # weights 1 : 3 : 0 -> cumulative 1, 4, 4: u * 4 in [0, 1) -> 0, in [1, 4) -> 1; column 2 (weight 0) never
    w = np.array([[1.0, 3.0, 0.0]] * 5)
    u = np.array([0.0, 0.2, 0.25, 0.5, 0.999])
    assert weighted_index(w, u).tolist() == [0, 0, 1, 1, 1]
    # u * total rounding up to the total (u = 1.0 stands for the 2^-53 case) lands on the last column of
    # positive weight, not on padding or outside the tier: [1, 1, 0] -> 1, [0, 3, 1, 0, 0] -> 2, [0, 0, 2] -> 2
    assert weighted_index(np.array([[1.0, 1.0, 0.0]]), np.array([1.0])).tolist() == [1]
    assert weighted_index(np.array([[0.0, 3.0, 1.0, 0.0, 0.0]]), np.array([1.0])).tolist() == [2]
    assert weighted_index(np.array([[0.0, 0.0, 2.0]]), np.array([1.0])).tolist() == [2]
    # leading zero weights are skipped at u = 0; batch shapes [..., R] work
    assert weighted_index(np.array([[0.0, 0.0, 2.0, 1.0]]), np.array([0.0])).tolist() == [2]
    assert weighted_index(np.ones((2, 3, 4)), np.full((2, 3), 0.6)).tolist() == [[2, 2, 2]] * 2


def test_locality_remote_tier_uses_all_weights() -> None:
    # expert 0 only on node 1 (GPUs 2, 3, weights 3 : 1); tokens from node 0 split 3 : 1
    plan = Placement([[[1], [1], [0], [0]]], 2, Cluster(num_nodes=2, gpus_per_node=2),
                     weights=[[[1.0], [1.0], [3.0], [1.0]]])
    T = 20000
    tr = RoutingTrace(np.zeros((T, 1, 1), int), np.zeros(T, int), np.zeros(T, int), num_experts=2)
    dest = ROUTERS["locality"].assign_tokens(plan, tr, np.random.default_rng(1)).ravel()
    assert np.bincount(dest, minlength=4)[2:] / T == pytest.approx([0.75, 0.25], abs=0.01)


def test_simulator_refuses_a_custom_router_that_sends_a_pick_nowhere() -> None:
    from moebalance.core.load import LoadMatrix
    from moebalance.routing.base import Router
    from moebalance.routing.simulate import evaluate

    # 2 GPUs, 4 experts, expert e on GPU e // 2; every pick is sent to GPU 0, which lacks experts 2 and 3
    cluster = Cluster(num_nodes=1, gpus_per_node=2)
    plan = Placement([[[0, 1], [2, 3]]], 4, cluster)
    trace = RoutingTrace(np.array([[[0, 2]], [[1, 3]]]), np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64),
                         num_experts=4)
    load = LoadMatrix(trace.counts(), trace)
    bad = Router("to-gpu-0", ROUTERS["uniform"].split_counts, lambda p, t, rng: np.zeros_like(t.topk_ids))
    with pytest.raises(InputError, match=r"router 'to-gpu-0' sent pick 1 of token 0 \(expert 2\) to GPU 0, which "
                                         r"holds no copy of it; expert 2 is on GPUs \[1\]"):
        evaluate(plan, load, bad)


def test_uniform_round_robin_on_tokens_by_hand() -> None:
    """Expert 0 has copies on GPUs 1 and 3, expert 1 on GPUs 0 and 2; in each batch an expert's picks alternate over
    its copies in (token, pick) order, starting over at a new batch."""
    from moebalance.routing import get_router

    plan = Placement([[[1], [0], [1], [0]]], 2, Cluster(num_nodes=1, gpus_per_node=4))
    trace = RoutingTrace(np.array([[[0, 1]], [[0, 1]], [[1, 0]], [[0, 1]], [[0, 1]]]), [0, 0, 0, 0, 0],
                         [0, 0, 0, 1, 1], num_experts=2)
    dest = get_router("uniform").assign_tokens(plan, trace, np.random.default_rng(0))
    assert dest[:, 0, :].tolist() == [[1, 0], [3, 2], [0, 1], [1, 0], [3, 2]]  # batch 1 starts over
