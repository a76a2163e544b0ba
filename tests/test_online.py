"""Online replay and prediction: the predictors (:mod:`moebalance.prediction.predictors`), the dynamic policy ``libra``
(:mod:`moebalance.policies.libra`), the batch-by-batch replay (:mod:`moebalance.online.replay`) and the
``predict`` / ``online`` commands.

Hand-built traces carry their expected predictions in comments. Larger checks use the bundled OLMoE-like trace
(64 batches of 256 tokens, 16 layers, 64 experts, top-8, 8 source GPUs) on a few batches, and one small capture
of the bundled MoE LM (4 batches of 256 tokens, 4 layers, 16 experts, top-2, 2 GPUs) for the lookahead
predictor.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_user_error, run_cli

from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix, read_bundled
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.online.rearrange import Replanning
from moebalance.online.replay import OnlineResult, moved_copies, replay
from moebalance.policies import get_policy, make_plan
from moebalance.policies.libra import LibraConfig, batch_plan
from moebalance.prediction.predictors import (
    HistoryPredictor,
    LookaheadPredictor,
    OraclePredictor,
    PathPredictor,
    Prediction,
    PredictorInputs,
    accuracy,
    demand_of,
    make_predictor,
    topk_accuracy,
)
from moebalance.routing.simulate import evaluate
from moebalance.runtime.gating import GateConfig

# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------


def trace_of(picks: Sequence[Sequence[Sequence[int]]], src: Sequence[int], batch: Sequence[int],
             num_experts: int, num_batches: int = -1) -> RoutingTrace:
    return RoutingTrace(np.asarray(picks, dtype=np.int64), np.asarray(src), np.asarray(batch), num_experts=num_experts,
                        num_batches=num_batches)


def load_of(trace: RoutingTrace) -> LoadMatrix:
    return LoadMatrix(trace.counts(), trace)


def random_trace(seed: int, *, batches: int, tokens: int, layers: int, experts: int, top_k: int,
                 gpus: int) -> RoutingTrace:
    """Skewed distinct top-k picks (Gumbel top-k on a Dirichlet popularity), tokens spread over ``gpus``."""
    rng = np.random.default_rng(seed)
    T = batches * tokens
    popularity = rng.dirichlet(np.full(experts, 0.4), size=layers)
    keys = np.log(popularity + 1e-12)[None] + rng.gumbel(size=(T, layers, experts))
    ids = np.argsort(-keys, axis=2)[:, :, :top_k]
    return RoutingTrace(ids, rng.integers(0, gpus, size=T), np.repeat(np.arange(batches), tokens),
                        num_experts=experts)


def mean_accuracy(predictor: Any, trace: RoutingTrace, batches: range, gpus: int) -> np.ndarray:
    """``[L]`` token-weighted accuracy over ``batches`` (nan where nothing is predicted)."""
    total, n = np.zeros(trace.num_layers), np.zeros(trace.num_layers)
    for b in batches:
        lo, hi = np.searchsorted(trace.batch, [b, b + 1])
        acc = accuracy(predictor.predict(trace, b, gpus), trace.topk_ids[lo:hi])
        ok = np.isfinite(acc)
        total[ok] += acc[ok] * (hi - lo)
        n[ok] += hi - lo
    with np.errstate(invalid="ignore"):
        return np.where(n > 0, total / np.where(n > 0, n, 1), np.nan)


@pytest.fixture(scope="module")
def olmoe() -> LoadMatrix:
    return read_bundled("olmoe-1b-7b-tokens")


@pytest.fixture(scope="module")
def captured() -> tuple[Any, Any]:
    """``(model, capture)``: the bundled MoE LM on 1024 held-out code tokens, with hidden states."""
    from moebalance.lm.capture import capture
    from moebalance.lm.data import domain_tokens
    from moebalance.lm.moe_lm import load_checkpoint

    model = load_checkpoint()
    cap = capture(model, domain_tokens("code", "heldout", 1024), num_gpus=2, batch_tokens=256, seq_len=128,
                  hidden_states=True)
    return model, cap


OLMOE_CLUSTER = Cluster(num_nodes=2, gpus_per_node=4)


# ----------------------------------------------------------------------------------------------------------
# accuracy and demand
# ----------------------------------------------------------------------------------------------------------


def test_topk_accuracy_by_hand() -> None:
    pred = np.array([[0, 1], [2, 3], [5, -1]])
    true = np.array([[1, 5], [3, 2], [4, 6]])
    assert topk_accuracy(pred, true).tolist() == [0.5, 1.0, 0.0]
    # a wider prediction can hold all of a narrower truth; order never matters
    assert topk_accuracy(np.array([[7, 5, 1]]), np.array([[1, 5]])).tolist() == [1.0]
    assert topk_accuracy(np.array([[7, 5, 1, 0]]), np.array([[1, 2, 3, 0]])).tolist() == [0.5]
    assert topk_accuracy(np.zeros((2, 1), dtype=int), np.zeros((2, 0), dtype=int)).tolist() == [0.0, 0.0]


def test_accuracy_per_layer_by_hand() -> None:
    # 2 tokens, 3 layers, top-1; layer 0 is not predicted
    true = np.array([[[0], [1], [2]], [[0], [1], [3]]])
    ids = np.array([[[-1], [1], [2]], [[-1], [1], [2]]])
    pred = Prediction(ids, np.array([False, True, True]), np.zeros((3, 1, 4)))
    acc = accuracy(pred, true)
    assert np.isnan(acc[0])
    assert acc[1:].tolist() == [1.0, 0.5]
    assert np.isnan(accuracy(pred, true[:0])).all()  # no token: nothing to score


def test_demand_of_by_hand() -> None:
    ids = np.array([[[0, 1]], [[1, -1]], [[2, 1]]])  # 3 tokens, 1 layer, top-2 (one pick unknown)
    got = demand_of(ids, np.array([0, 1, 1]), 2, 3)
    assert got.tolist() == [[[1.0, 1.0, 0.0], [0.0, 2.0, 1.0]]]


def test_oracle_predicts_the_batch() -> None:
    tr = random_trace(1, batches=3, tokens=20, layers=3, experts=8, top_k=2, gpus=3)
    for b in range(3):
        pred = OraclePredictor().predict(tr, b, 3)
        sub = tr.select_batches(b, b + 1)
        assert pred.layers.all()
        np.testing.assert_array_equal(pred.topk_ids, sub.topk_ids)
        np.testing.assert_array_equal(pred.demand, sub.demand(3))
        assert accuracy(pred, sub.topk_ids).tolist() == [1.0, 1.0, 1.0]


# ----------------------------------------------------------------------------------------------------------
# path predictor
# ----------------------------------------------------------------------------------------------------------


def test_path_deterministic_chain_is_predicted_exactly() -> None:
    # Each token's picks in layer l are (top1 + 1, top1 + 4) mod 6 of its top-1 in layer l - 1: the path decides
    # everything, so unseen tokens that follow seen paths are predicted exactly in layers 1 and 2.
    def chain(seed: int, n: int) -> RoutingTrace:
        rng = np.random.default_rng(seed)
        first = np.stack([rng.permutation(6)[:2] for _ in range(n)])  # layer 0: any distinct pair
        layers = [first]
        for _ in range(2):
            a = layers[-1][:, 0]
            layers.append(np.stack([(a + 1) % 6, (a + 4) % 6], axis=1))
        return RoutingTrace(np.stack(layers, axis=1), rng.integers(0, 2, n), np.repeat([0, 1], n // 2),
                            num_experts=6)

    build, test = chain(0, 60), chain(1, 40)
    assert set(build.topk_ids[:, 0, 0]) == set(range(6))  # every first expert seen
    for depth in (1, 2):
        pred = PathPredictor([build], depth).predict(test, 1, 2)
        lo, hi = np.searchsorted(test.batch, [1, 2])
        assert pred.layers.tolist() == [False, True, True]
        assert (pred.topk_ids[:, 0] == -1).all()
        acc = accuracy(pred, test.topk_ids[lo:hi])
        assert np.isnan(acc[0]) and acc[1:].tolist() == [1.0, 1.0]
        np.testing.assert_array_equal(pred.demand, demand_of(pred.topk_ids, test.src_gpu[lo:hi], 2, 6))
        assert pred.demand[0].sum() == 0 and pred.demand[1:].sum() == 2 * 2 * (hi - lo)


# build split for the back-off cases: (layer-0, layer-1, layer-2) picks, top-1, 8 experts
_BUILD = [(0, 1, 2)] * 2 + [(3, 1, 4)] + [(6, 0, 3)] * 3 + [(0, 2, 1), (0, 2, 5), (7, 7, 5)]
# layer-2 frequencies in the build: E3 3, E2 2, E5 2, E1 1, E4 1 -> most frequent E3
# layer-1 frequencies: E0 3, E1 3, E2 2, E7 1 -> most frequent E0 (tie with E1, lower id)


def _path_case() -> tuple[RoutingTrace, RoutingTrace]:
    build = trace_of([[[a], [b], [c]] for a, b, c in _BUILD], [0] * len(_BUILD), [0] * len(_BUILD), 8)
    queries = [(0, 1, 2), (3, 1, 4), (5, 1, 4), (0, 6, 3), (0, 2, 1)]
    test = trace_of([[[a], [b], [c]] for a, b, c in queries], [0, 1, 0, 1, 0], [0] * 5, 8)
    return build, test


def test_path_backs_off_to_shorter_paths() -> None:
    build, test = _path_case()
    pred = PathPredictor([build], depth=2).predict(test, 0, 2)
    # layer 1 (key: layer-0 top-1):
    #   0 -> followed by E1 twice and E2 twice: tie broken by build frequency (E1 3 > E2 2) -> E1
    #   3 -> E1;  5 never seen at layer 0 -> the layer's most frequent expert E0
    assert pred.topk_ids[:, 1, 0].tolist() == [1, 1, 0, 1, 1]
    # layer 2:
    #   (0, 1) seen -> E2;  (3, 1) seen -> E4 (the depth-1 key 1 alone would say E2)
    #   (5, 1) unseen -> back off to key 1: E2 (twice) over E4 (once) -> E2
    #   (0, 6) unseen and 6 never a layer-1 top-1 -> the layer's most frequent expert E3
    #   (0, 2) -> E1 once, E5 once: tie broken by build frequency (E5 2 > E1 1) -> E5
    assert pred.topk_ids[:, 2, 0].tolist() == [2, 4, 2, 3, 5]
    assert (pred.topk_ids[:, 0] == -1).all() and pred.layers.tolist() == [False, True, True]
    # depth 1 keys on the previous layer only: (3, 1) now gives E2
    pred1 = PathPredictor([build], depth=1).predict(test, 0, 2)
    assert pred1.topk_ids[:, 2, 0].tolist() == [2, 2, 2, 3, 5]
    # demand: predicted picks by source GPU (tokens 0, 2, 4 on GPU 0)
    assert pred.demand[2, 0].tolist() == [0, 0, 2, 0, 0, 1, 0, 0]
    assert pred.demand[2, 1].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]
    assert PathPredictor([build]).describe() == {"predictor": "path", "depth": 2, "build_tokens": len(_BUILD)}


def test_path_build_split_of_several_traces() -> None:
    build, test = _path_case()
    half = len(_BUILD) // 2
    parts = [trace_of(build.topk_ids[:half], build.src_gpu[:half], build.batch[:half], 8),
             trace_of(build.topk_ids[half:], build.src_gpu[half:], build.batch[half:], 8)]
    whole = PathPredictor([build]).predict(test, 0, 2)
    split = PathPredictor(parts).predict(test, 0, 2)
    np.testing.assert_array_equal(whole.topk_ids, split.topk_ids)


def test_path_build_reports_each_layer_before_the_first_batch(olmoe: LoadMatrix) -> None:
    """The path table says how far its build has come, ``(layers built, layers to build)``, from ``(0, L - 1)`` on
    (a progress bar's position), and builds the same table told or not; a libra replay passes its inputs' listener
    to the build, which ends before the first batch is served."""
    build, test = _path_case()
    told: list[tuple[int, int]] = []
    heard = PathPredictor([build], progress=lambda done, total: told.append((done, total)))
    assert told == [(0, 2), (1, 2), (2, 2)]
    quiet = PathPredictor([build])
    np.testing.assert_array_equal(heard.predict(test, 0, 2).topk_ids, quiet.predict(test, 0, 2).topk_ids)
    events: list[Any] = []
    replay(olmoe, OLMOE_CLUSTER, Budget(slots_per_gpu=8), "libra", {"predictor": "path", "n": 2}, warmup=(0, 4),
           batches=(4, 6), inputs=PredictorInputs(progress=lambda done, total: events.append((done, total))),
           progress=events.append)
    L = olmoe.num_layers
    assert events == [*((k, L - 1) for k in range(L)), 1, 1]


@pytest.mark.parametrize("depth", [0, 5, True, 1.5, "2"])
def test_path_depth_validation(depth: Any) -> None:
    build, _ = _path_case()
    with pytest.raises(InputError, match="depth"):
        PathPredictor([build], depth)


def test_path_errors() -> None:
    build, _ = _path_case()
    with pytest.raises(InputError, match="build split"):
        PathPredictor([])
    other = trace_of([[[0], [1]]], [0], [0], 8)
    with pytest.raises(InputError, match="disagree"):
        PathPredictor([build, other])
    top2 = trace_of([[[0, 1], [1, 2], [2, 3]]], [0], [0], 8)
    with pytest.raises(InputError, match=r"disagree on \[layers, experts, top-k\]"):
        PathPredictor([build, top2])
    with pytest.raises(InputError, match=r"built on \[layers, experts, top-k\] = \[3, 8, 1\]"):
        PathPredictor([build]).predict(other, 0, 1)
    with pytest.raises(InputError, match=r"but the trace has \[3, 8, 2\]"):  # a table of top-1 cannot rank 2 picks
        PathPredictor([build]).predict(top2, 0, 1)
    with pytest.raises(InputError, match="build split"):
        make_predictor("path")


# ----------------------------------------------------------------------------------------------------------
# history predictor
# ----------------------------------------------------------------------------------------------------------


def _history_trace() -> RoutingTrace:
    # 2 layers, 4 experts, top-2, 2 GPUs; batches of 4, 2 and 3 tokens
    picks = [
        [[0, 1], [2, 3]], [[0, 2], [3, 2]], [[1, 0], [2, 1]], [[3, 2], [1, 0]],  # batch 0
        [[3, 2], [0, 1]], [[3, 1], [0, 3]],  # batch 1
        [[0, 1], [0, 1]], [[0, 1], [0, 1]], [[2, 3], [2, 3]],  # batch 2
    ]
    return trace_of(picks, [0, 1, 0, 1, 0, 1, 0, 0, 1], [0, 0, 0, 0, 1, 1, 2, 2, 2], 4)


def test_history_predictor_by_hand() -> None:
    tr = _history_trace()
    # batch 0: nothing before it
    p0 = HistoryPredictor().predict(tr, 0, 2)
    assert not p0.layers.any() and (p0.topk_ids == -1).all() and not p0.demand.any()
    assert np.isnan(accuracy(p0, tr.topk_ids[:4])).all()
    # batch 1 from batch 0: layer 0 counts E0 3, E1 2, E2 2, E3 1 -> [0, 1] (E1 before E2 by id);
    # layer 1 counts E0 1, E1 2, E2 3, E3 2 -> [2, 1]
    p1 = HistoryPredictor().predict(tr, 1, 2)
    assert p1.layers.all()
    assert p1.topk_ids.tolist() == [[[0, 1], [2, 1]]] * 2
    # demand: batch 0's picks by GPU, scaled by 2 tokens / 4 tokens
    # layer 0: GPU 0 (tokens 0, 2) E0 2, E1 2; GPU 1 (tokens 1, 3) E0 1, E2 2, E3 1
    # layer 1: GPU 0 E1 1, E2 2, E3 1; GPU 1 E0 1, E1 1, E2 1, E3 1
    assert p1.demand.tolist() == [[[1, 1, 0, 0], [0.5, 0, 1, 0.5]], [[0, 0.5, 1, 0.5], [0.5, 0.5, 0.5, 0.5]]]
    # accuracy: layer 0 truths {3,2}, {3,1} against {0,1}: 0, 1/2; layer 1 {0,1}, {0,3} against {2,1}: 1/2, 0
    assert accuracy(p1, tr.topk_ids[4:6]).tolist() == [0.25, 0.25]
    # batch 2, window 1 (batch 1 only): layer 0 E3 2, E1 1, E2 1 -> [3, 1]; layer 1 E0 2, E1 1, E3 1 -> [0, 1]
    p2 = HistoryPredictor(1).predict(tr, 2, 2)
    assert p2.topk_ids[0].tolist() == [[3, 1], [0, 1]]
    np.testing.assert_allclose(p2.demand, tr.select_batches(1, 2).demand(2) * 3 / 2)
    # batch 2, window 2 (batches 0 and 1): layer 0 E0 3, E1 3, E2 3, E3 3 -> [0, 1];
    # layer 1 E0 3, E1 3, E2 3, E3 3 -> [0, 1]; demand scaled by 3 / 6
    p2w = HistoryPredictor(window=2).predict(tr, 2, 2)
    assert p2w.topk_ids[0].tolist() == [[0, 1], [0, 1]]
    np.testing.assert_allclose(p2w.demand, tr.select_batches(0, 2).demand(2) * 3 / 6)
    assert HistoryPredictor(5).predict(tr, 2, 2).topk_ids[0].tolist() == [[0, 1], [0, 1]]  # window past batch 0
    assert HistoryPredictor(2).describe() == {"predictor": "history", "window": 2}


def test_history_predict_counts_by_hand() -> None:
    counts = np.array([[[4, 0]], [[2, 2]], [[1, 3]]])  # 3 batches, 1 layer, 2 experts
    assert HistoryPredictor().predict_counts(counts, 0, 2) is None
    # batch 1 from batch 0: [4, 0] scaled to batch 1's 4 picks, spread over 2 GPUs
    assert HistoryPredictor().predict_counts(counts, 1, 2).tolist() == [[[2, 0], [2, 0]]]  # type: ignore[union-attr]
    # batch 2, window 2: [6, 2] scaled to 4 / 8 -> [3, 1], over 2 GPUs
    assert HistoryPredictor(2).predict_counts(counts, 2, 2).tolist() == [[[1.5, 0.5], [1.5, 0.5]]]  # type: ignore[union-attr]


@pytest.mark.parametrize("window", [0, -1, True, 1.5])
def test_history_window_validation(window: Any) -> None:
    with pytest.raises(InputError, match="window"):
        HistoryPredictor(window)


# ----------------------------------------------------------------------------------------------------------
# lookahead predictor
# ----------------------------------------------------------------------------------------------------------


def _lookahead_case(biases: np.ndarray | None = None) -> tuple[LookaheadPredictor, RoutingTrace, np.ndarray]:
    """3 layers, D = E = 4, top-2; gates are scaled permutations, so layer l's scores are a permutation of the
    previous layer's hidden state. Returns the predictor, a trace whose picks are what it should predict (layer 0
    arbitrary), and the expected picks ``[N, L, K]``."""
    rng = np.random.default_rng(3)
    N, L, D, E, K = 12, 3, 4, 4, 2
    perms = [np.eye(D)[rng.permutation(D)] for _ in range(L)]
    gates = np.stack([3.0 * p for p in perms]).astype(np.float32)  # [L, D, E]
    hidden = rng.normal(size=(N, L, D)).astype(np.float32)
    expected = np.full((N, L, K), -1)
    for layer in range(1, L):
        logits = hidden[:, layer - 1].astype(np.float64) @ gates[layer]
        scores = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        if biases is not None:
            scores = scores + biases[layer]
        expected[:, layer] = np.argsort(-scores, axis=1)[:, :K]
    picks = expected.copy()
    picks[:, 0] = [0, 1]
    tr = RoutingTrace(picks, np.arange(N) % 2, np.repeat([0, 1], N // 2), num_experts=E)
    return LookaheadPredictor(gates, biases, GateConfig(top_k=K), hidden), tr, expected


@pytest.mark.parametrize("bias", [False, True])
def test_lookahead_on_synthetic_gates(bias: bool) -> None:
    biases = None
    if bias:
        biases = np.zeros((3, 4), dtype=np.float32)
        biases[2, 3] = 10.0  # expert 3 always wins layer 2's selection
    predictor, tr, expected = _lookahead_case(biases)
    if bias:
        assert (expected[:, 2, 0] == 3).all()
    for b in (0, 1):
        rows = slice(6 * b, 6 * b + 6)
        pred = predictor.predict(tr, b, 2)
        assert pred.layers.tolist() == [False, True, True]
        assert (pred.topk_ids[:, 0] == -1).all()
        np.testing.assert_array_equal(pred.topk_ids[:, 1:], expected[rows, 1:])
        np.testing.assert_array_equal(pred.demand, demand_of(expected[rows], tr.src_gpu[rows], 2, 4))
        acc = accuracy(pred, tr.topk_ids[rows])
        assert np.isnan(acc[0]) and acc[1:].tolist() == [1.0, 1.0]


def test_lookahead_shape_errors() -> None:
    predictor, tr, _ = _lookahead_case()
    gates, hidden = predictor.gates, predictor.hidden
    with pytest.raises(InputError, match=r"gates must be \[L, D, E\]"):
        LookaheadPredictor(gates[0], None, GateConfig(top_k=2), hidden)
    with pytest.raises(InputError, match="do not fit the model's gates"):
        LookaheadPredictor(gates, None, GateConfig(top_k=2), hidden[:, :, :3])
    with pytest.raises(InputError, match="do not fit the model's gates"):
        LookaheadPredictor(gates, None, GateConfig(top_k=2), hidden[:, :2])
    with pytest.raises(InputError, match="do not fit the model's gates"):
        LookaheadPredictor(gates, None, GateConfig(top_k=2), hidden[:, 0])
    short = LookaheadPredictor(gates, None, GateConfig(top_k=2), hidden[:10])
    with pytest.raises(InputError, match="hidden states for 10 tokens and a trace of 12"):
        short.predict(tr, 0, 2)
    with pytest.raises(InputError, match="--hidden-states"):
        make_predictor("lookahead")
    with pytest.raises(InputError, match="--checkpoint"):
        make_predictor("lookahead", hidden=hidden)
    with pytest.raises(InputError, match="unknown predictor 'crystal'"):
        make_predictor("crystal")


def test_lookahead_on_the_bundled_model(captured: tuple[Any, Any]) -> None:
    model, cap = captured
    tr, hidden = cap.load.trace, cap.hidden_states
    assert (tr.num_batches, tr.num_layers, tr.top_k, tr.num_experts) == (4, 4, 2, 16)
    acc = mean_accuracy(LookaheadPredictor.from_model(model, hidden), tr, range(4), 2)
    # measured: about [-, 0.65, 0.79, 0.71] (0.72 over layers) against a random guess's K / E = 0.125
    assert np.isnan(acc[0])
    assert (acc[1:] > 0.45).all(), acc
    assert np.nanmean(acc) > 0.55, acc
    # the oracle check: fed each layer's own gate input (hidden states shifted by one layer), the same gates
    # reproduce the capture's routing (up to the float16 storage of the hidden states)
    shifted = np.zeros_like(hidden)
    shifted[:, :-1] = hidden[:, 1:]
    own = LookaheadPredictor.from_model(model, shifted)
    assert (mean_accuracy(own, tr, range(4), 2)[1:] > 0.99).all()
    assert (mean_accuracy(OraclePredictor(), tr, range(4), 2) == 1.0).all()


# ----------------------------------------------------------------------------------------------------------
# replay: static policies
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("router", ["uniform", "rebalance"])
def test_static_replay_equals_evaluate_per_batch(olmoe: LoadMatrix, router: str) -> None:
    budget = Budget(replicas_per_gpu=16)
    res = replay(olmoe, OLMOE_CLUSTER, budget, "eplb", warmup=(0, 8), batches=(8, 13), router=router)
    plan = make_plan("eplb", olmoe.select_batches(0, 8), OLMOE_CLUSTER, budget)[0]
    assert plan.extra_replicas > 0
    assert res.batches.tolist() == [8, 9, 10, 11, 12]
    assert res.replans == 0 and res.experts_moved == 0 and not res.per_batch_moved.any()
    assert res.replica_slots_per_gpu == plan.extra_replicas / 8
    assert res.router == router and res.per_layer_accuracy is None and res.prediction_accuracy is None
    for i, bt in enumerate(range(8, 13)):
        score = evaluate(plan, olmoe.select_batches(bt, bt + 1), router)
        assert res.per_batch_imbalance[i] == pytest.approx(score.imbalance_ratio, rel=1e-12)
        assert res.per_batch_balancedness[i] == pytest.approx(score.balancedness, rel=1e-12)
    assert res.mean_imbalance_ratio == pytest.approx(res.per_batch_imbalance.mean())
    doc = res.as_dict()
    assert "prediction_accuracy" not in doc and doc["batches"] == "8:13"
    assert doc["per_batch_imbalance_ratio"] == [round(float(v), 6) for v in res.per_batch_imbalance]
    # the default served batches are every batch after the warm-up
    assert replay(olmoe, OLMOE_CLUSTER, budget, "eplb", warmup=(0, 60)).batches.tolist() == [60, 61, 62, 63]


# hot experts change at batch 6: E0 hot before, E1 after (1 layer, 4 experts, 2 GPUs with 2 slots each)
_A, _B = [8, 4, 2, 1], [1, 8, 4, 2]
SHIFT = LoadMatrix(np.array([[_A]] * 6 + [[_B]] * 6))
TWO = Cluster(num_nodes=1, gpus_per_node=2)
# greedy (heaviest expert to the least loaded GPU with a free slot):
#   on A-batches: E0 -> GPU 0, E1 -> GPU 1, E2 -> GPU 1 (4 < 8), E3 -> GPU 0 (GPU 1 full): {0, 3} | {1, 2}
#   on B-batches: E1 -> GPU 0, E2 -> GPU 1, E3 -> GPU 1 (4 < 8), E0 -> GPU 0:            {0, 1} | {2, 3}
#   plan A on A: 9 | 6 -> 9 / 7.5 = 1.2;  plan A on B: 3 | 12 -> 1.6;  plan B on B: 9 | 6 -> 1.2
#   switching A -> B loads E1 on GPU 0 and E3 on GPU 1: 2 copies
# contiguous ({0, 1} | {2, 3}) on A: 12 | 3 -> 1.6; on B: 9 | 6 -> 1.2; it never changes
CASES = [
    # policy, replan_every, window, replans, moved per served batch (4..11), imbalance per served batch
    ("greedy", None, None, 0, [0] * 8, [1.2, 1.2] + [1.6] * 6),
    # re-plans before batches 6 (on 4, 5: A), 8 (on 6, 7: B, 2 moved) and 10 (on 8, 9: B)
    ("greedy", 2, None, 3, [0, 0, 0, 0, 2, 0, 0, 0], [1.2, 1.2, 1.6, 1.6, 1.2, 1.2, 1.2, 1.2]),
    # re-plans before batch 7 (on 4, 5, 6 = [17, 16, 8, 4]: still plan A) and 10 (on 7, 8, 9: B)
    ("greedy", 3, None, 2, [0, 0, 0, 0, 0, 0, 2, 0], [1.2, 1.2, 1.6, 1.6, 1.6, 1.6, 1.2, 1.2]),
    # every 4 on 1: before batch 8 (on 7: B)
    ("greedy", 4, 1, 1, [0, 0, 0, 0, 2, 0, 0, 0], [1.2, 1.2, 1.6, 1.6, 1.2, 1.2, 1.2, 1.2]),
    ("contiguous", 2, None, 3, [0] * 8, [1.6, 1.6] + [1.2] * 6),
]


@pytest.mark.parametrize(("policy", "every", "window", "replans", "moved", "imbalance"), CASES)
def test_periodic_replanning_by_hand(policy: str, every: int | None, window: int | None, replans: int,
                                     moved: list[int], imbalance: list[float]) -> None:
    res = replay(SHIFT, TWO, Budget(slots_per_gpu=2), policy, warmup=(0, 4),
                 replanning=Replanning(every=every, window=window))
    assert res.batches.tolist() == list(range(4, 12))
    assert res.replans == replans
    assert res.per_batch_moved.tolist() == moved
    assert res.experts_moved == pytest.approx(sum(moved) / 8)
    np.testing.assert_allclose(res.per_batch_imbalance, imbalance)
    np.testing.assert_allclose(res.per_batch_balancedness, 1 / np.array(imbalance))
    assert res.replica_slots_per_gpu == 0
    if every is not None:
        assert res.params == {"replan_every": every, "window": window or every}
        assert res.as_dict()["replans"] == replans


def test_moved_copies_by_hand() -> None:
    def plan(*layers: list[list[int]]) -> Placement:
        return Placement(gpu_experts=list(layers), num_experts=3, cluster=TWO)

    old = plan([[0, 1], [2]])
    assert moved_copies(old, old) == 0
    assert moved_copies(old, plan([[0], [1, 2]])) == 1  # E1 loaded on GPU 1; dropping E1 on GPU 0 is free
    assert moved_copies(old, plan([[0, 1, 2], [2, 0]])) == 2  # two replicas added
    assert moved_copies(plan([[0, 1, 2], [2, 0]]), old) == 0  # removing replicas loads nothing
    assert moved_copies(old, plan([[2], [0, 1]])) == 3
    assert moved_copies(old, plan([[0, 0, 1], [2]])) == 1  # a second copy on the same GPU counts
    two = plan([[0, 1], [2]], [[0], [1, 2]])
    # summed over layers: layer 0 loads E0 on GPU 1 (1), layer 1 loads E1, E2 on GPU 0 and E0 on GPU 1 (3)
    assert moved_copies(two, plan([[1], [0, 2]], [[1, 2], [0]])) == 4


# ----------------------------------------------------------------------------------------------------------
# replay: libra
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("base", ["eplb", "contiguous"])
def test_libra_oracle_on_the_bundled_trace(olmoe: LoadMatrix, base: str) -> None:
    budget = Budget(replicas_per_gpu=16)
    G, served = 8, (8, 14)
    params = {"predictor": "oracle", "n": 2, "alpha": 0.5, "base": base}
    res = replay(olmoe, OLMOE_CLUSTER, budget, "libra", params, warmup=(0, 8), batches=served)
    static = replay(olmoe, OLMOE_CLUSTER, budget, base, warmup=(0, 8), batches=served, router="rebalance")
    base_plan = make_plan(base, olmoe.select_batches(0, 8), OLMOE_CLUSTER, budget)[0]
    assert res.policy == "libra" and res.router == "rebalance"
    assert res.replica_slots_per_gpu == 2 * 2 + base_plan.extra_replicas / G
    assert res.prediction_accuracy == 1.0
    assert res.per_layer_accuracy is not None and (res.per_layer_accuracy == 1.0).all()
    assert res.replans == 0
    config = LibraConfig(predictor="oracle", n=2, alpha=0.5, base=base)
    for i, bt in enumerate(range(*served)):
        batch = olmoe.select_batches(bt, bt + 1)
        assert batch.trace is not None
        plan, extras = batch_plan(base_plan, batch.trace.demand(G).astype(float), config)
        # every extra of the batch is loaded for it, at most n per GPU and layer
        assert res.per_batch_moved[i] == (extras >= 0).sum() <= 2 * G * olmoe.num_layers
        # the batch is scored on the plan the prefetcher made from the true routing
        assert res.per_batch_imbalance[i] == pytest.approx(evaluate(plan, batch, "rebalance").imbalance_ratio)
    # Extra copies do not help every batch in general: a copy makes its GPU's own picks local, and the rebalancer
    # cannot move local picks (test_prefetch.py::test_locality_can_pin_load_on_one_gpu; on this trace alpha = 1
    # is worse than the base on some batches). With alpha = 0.5 libra is clearly better on average.
    assert res.mean_imbalance_ratio < static.mean_imbalance_ratio - 0.02
    assert res.per_batch_imbalance.max() <= static.per_batch_imbalance.max()
    doc = res.as_dict()
    assert doc["prediction_accuracy"] == 1.0 and doc["per_layer_accuracy"] == [1.0] * 16
    assert doc["params"]["phase1"] == 1 and doc["params"]["buffer_slots_per_gpu"] == 4
    assert doc["params"]["base_extra_replicas"] == base_plan.extra_replicas


def test_libra_alpha_one_and_n_zero(olmoe: LoadMatrix) -> None:
    budget = Budget(slots_per_gpu=8)  # 64 experts on 8 GPUs: no base replica
    zero = replay(olmoe, OLMOE_CLUSTER, budget, "libra", {"predictor": "oracle", "n": 0}, warmup=(0, 4),
                  batches=(4, 7))
    static = replay(olmoe, OLMOE_CLUSTER, budget, "contiguous", warmup=(0, 4), batches=(4, 7), router="rebalance")
    # n = 0: no buffer, no extra: exactly the base plan under the rebalancer
    assert zero.experts_moved == 0 and zero.replica_slots_per_gpu == 0
    np.testing.assert_allclose(zero.per_batch_imbalance, static.per_batch_imbalance)
    # alpha = 1, n = 3: phase 1 only, at most 3 extras per GPU and layer, only experts the GPU's tokens pick
    res = replay(olmoe, OLMOE_CLUSTER, budget, "libra", {"predictor": "oracle", "n": 3, "alpha": 1.0},
                 warmup=(0, 4), batches=(4, 7))
    assert 0 < res.experts_moved <= 3 * 8 * 16 and res.replica_slots_per_gpu == 6


def test_libra_on_counts_only(olmoe: LoadMatrix) -> None:
    counts = LoadMatrix(olmoe.counts)
    budget = Budget(slots_per_gpu=8)
    for predictor in ("history", "oracle"):
        res = replay(counts, OLMOE_CLUSTER, budget, "libra", {"predictor": predictor, "n": 2}, warmup=(0, 4),
                     batches=(4, 7))
        # a predictor is used but nothing is per token: the accuracy is reported as null, per layer too
        assert res.per_layer_accuracy is not None and np.isnan(res.per_layer_accuracy).all()
        assert res.prediction_accuracy is None
        doc = res.as_dict()
        assert doc["prediction_accuracy"] is None and doc["per_layer_accuracy"] == [None] * olmoe.num_layers
        assert res.experts_moved > 0 and len(res.per_batch_imbalance) == 3
    for predictor in ("lookahead", "path"):
        with pytest.raises(InputError, match="predictor=history or predictor=exact"):
            replay(counts, OLMOE_CLUSTER, budget, "libra", {"predictor": predictor}, warmup=(0, 4))


def test_libra_history_and_path_on_a_trace(olmoe: LoadMatrix) -> None:
    budget = Budget(slots_per_gpu=8)
    hist = replay(olmoe, OLMOE_CLUSTER, budget, "libra", {"predictor": "history", "n": 2}, warmup=(0, 4),
                  batches=(4, 7))
    expected = mean_accuracy(HistoryPredictor(1), olmoe.trace, range(4, 7), 8)
    assert hist.per_layer_accuracy is not None
    np.testing.assert_allclose(hist.per_layer_accuracy, expected)
    assert hist.prediction_accuracy == pytest.approx(float(expected.mean()))
    assert 0 < hist.prediction_accuracy < 1
    # path: built on the warm-up batches unless a build split is given; layer 0 unpredicted
    path = replay(olmoe, OLMOE_CLUSTER, budget, "libra", {"predictor": "path", "n": 2}, warmup=(0, 4),
                  batches=(4, 6))
    assert path.per_layer_accuracy is not None and np.isnan(path.per_layer_accuracy[0])
    warm = olmoe.select_batches(0, 4).trace
    assert warm is not None
    np.testing.assert_allclose(path.per_layer_accuracy, mean_accuracy(PathPredictor([warm]), olmoe.trace,
                                                                      range(4, 6), 8))
    build = olmoe.select_batches(40, 64)
    other = replay(olmoe, OLMOE_CLUSTER, budget, "libra", {"predictor": "path", "depth": 1}, warmup=(0, 4),
                   batches=(4, 6), inputs=PredictorInputs(build=build))
    assert build.trace is not None
    np.testing.assert_allclose(other.per_layer_accuracy,  # type: ignore[arg-type]
                               mean_accuracy(PathPredictor([build.trace], 1), olmoe.trace, range(4, 6), 8))
    with pytest.raises(InputError, match="token-level build split"):
        replay(olmoe, OLMOE_CLUSTER, budget, "libra", {"predictor": "path"}, warmup=(0, 4),
               inputs=PredictorInputs(build=LoadMatrix(build.counts)))


def test_libra_lookahead_replay(captured: tuple[Any, Any]) -> None:
    model, cap = captured
    res = replay(cap.load, TWO, Budget(slots_per_gpu=8), "libra", {"predictor": "lookahead", "n": 2},
                 warmup=(0, 1), inputs=PredictorInputs(hidden=cap.hidden_states, model=model))
    assert res.batches.tolist() == [1, 2, 3]
    expected = mean_accuracy(LookaheadPredictor.from_model(model, cap.hidden_states), cap.load.trace, range(1, 4), 2)
    assert res.per_layer_accuracy is not None
    np.testing.assert_allclose(res.per_layer_accuracy, expected)
    assert np.isnan(res.per_layer_accuracy[0]) and res.prediction_accuracy is not None
    assert res.prediction_accuracy > 0.5


# ----------------------------------------------------------------------------------------------------------
# replay and policy errors
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "fragments"), [
    ({"warmup": (0, 0)}, ("warm-up batches 0:0",)),
    ({"warmup": (-1, 3)}, ("warm-up",)),
    ({"warmup": (0, 13)}, ("warm-up batches 0:13", "12 batches")),
    ({"warmup": (5, 3)}, ("warm-up",)),
    ({"warmup": (0, 12)}, ("served batches 12:12",)),
    ({"warmup": (0, 4), "batches": (2, 6)}, ("served batches 2:6", "after the warm-up")),
    ({"warmup": (0, 4), "batches": (6, 13)}, ("served batches 6:13",)),
    ({"warmup": (0, 4), "batches": (6, 6)}, ("served batches 6:6",)),
    ({"warmup": (0, 4), "replanning": {"every": 0}}, ("replan_every (0)", "positive number of batches")),
    ({"warmup": (0, 4), "replanning": {"every": 2, "window": 0}}, ("window (0)", "positive number of batches")),
    ({"warmup": (0, 4), "policy": "foo"}, ("unknown policy 'foo'", "libra")),
    ({"warmup": (0, 4), "policy": "libra", "replanning": {"every": 2}}, ("--replan-every",)),
    ({"warmup": (0, 4), "policy": "libra", "params": {"n": -1}}, ("n",)),
    ({"warmup": (0, 4), "policy": "libra", "params": {"alpha": 2}}, ("alpha (2)",)),
    ({"warmup": (0, 4), "policy": "libra", "params": {"base": "libra"}}, ("base",)),
    ({"warmup": (0, 4), "policy": "libra", "params": {"predictor": "crystal"}}, ("crystal",)),
    ({"warmup": (0, 4), "policy": "libra", "params": {"depth": 5}}, ("depth (5)",)),
    ({"warmup": (0, 4), "policy": "libra", "params": {"window": 0}}, ("window",)),
    ({"warmup": (0, 4), "policy": "libra", "params": {"foo": 1}}, ("'foo'",)),
])
def test_replay_errors(kwargs: dict[str, Any], fragments: tuple[str, ...]) -> None:
    kwargs = dict(kwargs)
    policy = kwargs.pop("policy", "greedy")
    params = kwargs.pop("params", {"predictor": "oracle"} if policy == "libra" else None)
    replanning = kwargs.pop("replanning", None)
    with pytest.raises(InputError) as info:  # a bad re-plan is refused by Replanning itself
        if replanning is not None:
            kwargs["replanning"] = Replanning(**replanning)
        replay(SHIFT, TWO, Budget(slots_per_gpu=2), policy, params, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_libra_has_no_single_plan() -> None:
    with pytest.raises(InputError, match="moebalance online --policy libra"):
        get_policy("libra")
    with pytest.raises(InputError, match="moebalance online"):
        make_plan("libra", SHIFT, TWO, Budget(slots_per_gpu=2))
    base = make_plan("contiguous", SHIFT, TWO, Budget(slots_per_gpu=2))[0]
    with pytest.raises(InputError, match=r"\[L, G, E\] = \[1, 2, 4\]"):
        batch_plan(base, np.zeros((1, 3, 4)), LibraConfig())


def test_batch_plan_appends_extras_to_the_base() -> None:
    base = make_plan("contiguous", SHIFT, TWO, Budget(slots_per_gpu=2))[0]  # {0, 1} | {2, 3}
    # GPU 0's tokens want E2 (5) and E3 (1); GPU 1's want E0 (2): phase 1 with n = 1, alpha = 1
    demand = np.array([[[0, 0, 5, 1], [2, 0, 0, 0]]], dtype=float)
    plan, extras = batch_plan(base, demand, LibraConfig(n=1, alpha=1.0, predictor="oracle"))
    assert extras.tolist() == [[[2], [0]]]
    assert [list(g) for g in plan.gpu_experts[0]] == [[0, 1, 2], [2, 3, 0]]
    assert plan.policy == "libra" and plan.params == {"base": "contiguous", "n": 1, "alpha": 1.0}
    assert moved_copies(base, plan) == 2


# ----------------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------------

NODES, GPN = 2, 2
CLUSTER = ["--nodes", str(NODES), "--gpus-per-node", str(GPN)]


def run_json(argv: Sequence[Any], capsys: pytest.CaptureFixture[str]) -> Any:
    rc, out, err = run_cli([*argv, "--json"], capsys)
    assert rc == 0, err
    return json.loads(out)


def _write_trace(path: Path, seed: int) -> Path:
    tr = random_trace(seed, batches=6, tokens=32, layers=3, experts=16, top_k=2, gpus=NODES * GPN)
    np.savez(path, counts=tr.counts(), topk_ids=tr.topk_ids, src_gpu=tr.src_gpu, batch=tr.batch)
    return path


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    return _write_trace(tmp_path / "trace.npz", 0)


@pytest.fixture
def build_file(tmp_path: Path) -> Path:
    return _write_trace(tmp_path / "build.npz", 1)


def online(trace: Path, policy: str, *extra: Any) -> list[Any]:
    return ["online", "--load", trace, "--policy", policy, *CLUSTER, "--warmup", "0:2", *extra]


def test_cli_online_static_json(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(online(trace_file, "eplb", "--slots-per-gpu", "5"), capsys)
    for key in ("balancedness", "mean_imbalance_ratio", "per_batch_imbalance_ratio", "experts_moved",
                "replica_slots_per_gpu", "replans", "batches", "router", "policy"):
        assert key in doc
    assert "prediction_accuracy" not in doc
    assert doc["batches"] == "2:6" and len(doc["per_batch_imbalance_ratio"]) == 4
    assert doc["experts_moved"] == 0 and doc["router"] == "uniform" and doc["policy"] == "eplb"
    from moebalance.core.load import read_load

    res = replay(read_load(trace_file), Cluster(num_nodes=NODES, gpus_per_node=GPN), Budget(slots_per_gpu=5),
                 "eplb", warmup=(0, 2))
    assert doc["per_batch_imbalance_ratio"] == [round(float(v), 6) for v in res.per_batch_imbalance]
    assert doc["replica_slots_per_gpu"] == res.replica_slots_per_gpu == 3  # 1 extra slot per GPU in 3 layers
    # periodic re-planning on the command line
    doc = run_json(online(trace_file, "greedy", "--slots-per-gpu", "4", "--replan-every", "2", "--window", "1",
                          "--batches", "2:5"), capsys)
    assert doc["replans"] == 1 and doc["batches"] == "2:5"
    assert doc["params"] == {"replan_every": 2, "window": 1}


def test_cli_online_libra_json(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(online(trace_file, "libra", "--slots-per-gpu", "4", "--set", "predictor=oracle", "--set",
                          "n=2"), capsys)
    assert doc["prediction_accuracy"] == 1.0 and doc["per_layer_accuracy"] == [1.0, 1.0, 1.0]
    assert doc["replica_slots_per_gpu"] == 4.0  # 2 n, no base replica (16 experts in 4 slots on 4 GPUs)
    assert 0 < doc["experts_moved"] <= 2 * 4 * 3
    assert doc["router"] == "rebalance" and len(doc["per_batch_imbalance_ratio"]) == 4
    doc = run_json(online(trace_file, "libra", "--slots-per-gpu", "4", "--set", "predictor=history",
                          "--router", "uniform"), capsys)
    assert doc["router"] == "uniform" and 0 < doc["prediction_accuracy"] < 1


def test_cli_online_several_policies_and_out_dir(trace_file: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    doc = run_json(online(trace_file, "eplb,libra", "--slots-per-gpu", "5", "--set", "libra.predictor=oracle",
                          "--set", "libra.n=1", "--out-dir", out), capsys)
    assert list(doc) == ["results"]
    eplb, libra = doc["results"]
    assert eplb["policy"] == "eplb" and libra["policy"] == "libra"
    assert "prediction_accuracy" not in eplb and libra["prediction_accuracy"] == 1.0
    assert libra["params"]["n"] == 1 and libra["params"]["predictor"] == "oracle"
    assert sorted(p.name for p in out.iterdir()) == [".moebalance-out", "online.json", "online.md", "online.png",
                                                     "report.html"]
    written = json.loads((out / "online.json").read_text())
    assert written["results"] == doc["results"] and "title" in written
    md = (out / "online.md").read_text()
    assert "| eplb |" in md and "| libra (oracle, n=1, alpha=0.5) |" in md and "online.png" in md
    assert (out / "online.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, text, _ = run_cli(online(trace_file, "eplb,libra", "--slots-per-gpu", "5", "--set",
                                 "libra.predictor=oracle"), capsys)
    assert rc == 0 and "libra (oracle, n=8, alpha=0.5)" in text and "eplb" in text
    # Figure 9 in one command: the re-plan knobs go to the static policies; libra replans every batch anyway
    doc = run_json(online(trace_file, "eplb,libra", "--slots-per-gpu", "5", "--set", "libra.predictor=oracle",
                          "--replan-every", "2"), capsys)
    eplb, libra = doc["results"]
    assert eplb["replans"] == 1 and eplb["params"]["replan_every"] == 2 and libra["replans"] == 0
    # one --set rule in every command: later items win, whichever form they take
    doc = run_json(online(trace_file, "libra", "--slots-per-gpu", "4", "--set", "libra.n=1", "--set", "n=3",
                          "--set", "predictor=oracle"), capsys)
    assert doc["params"]["n"] == 3
    doc = run_json(online(trace_file, "libra", "--slots-per-gpu", "4", "--set", "n=3", "--set", "libra.n=1",
                          "--set", "predictor=oracle"), capsys)
    assert doc["params"]["n"] == 1
    # a plain option goes to every listed policy that has it, here libra only
    doc = run_json(online(trace_file, "eplb,libra", "--slots-per-gpu", "5", "--set", "n=2", "--set",
                          "predictor=oracle"), capsys)
    eplb, libra = doc["results"]
    assert libra["params"]["n"] == 2 and "n" not in eplb["params"]
    # --groups is a first --set num_groups: a later --set wins, as in compare
    doc = run_json(online(trace_file, "eplb", "--slots-per-gpu", "5", "--groups", "2", "--set", "num_groups=1"),
                   capsys)
    assert doc["params"]["num_groups"] == 1
    # an option no listed policy has: one line naming what they have
    assert_user_error(online(trace_file, "eplb,libra", "--slots-per-gpu", "5", "--set", "speed=2"), capsys,
                      "no policy among --policy eplb,libra has parameter 'speed'", "eplb: num_groups")


def test_cli_predict_json(trace_file: Path, build_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(["predict", "--load", trace_file, "--predictor", "oracle"], capsys)
    assert doc["accuracy"] == 1.0 and doc["per_layer_accuracy"] == [1.0, 1.0, 1.0]
    assert doc["tokens"] == 6 * 32 and doc["top_k"] == 2
    # history: batch 0 has no prediction; batches 1..5 are scored, independently computed here
    doc = run_json(["predict", "--load", trace_file, "--predictor", "history"], capsys)
    tr = random_trace(0, batches=6, tokens=32, layers=3, experts=16, top_k=2, gpus=4)
    hits = []
    for b in range(1, 6):
        prev = tr.counts()[b - 1]  # [L, E]
        top = np.argsort(-prev, axis=1, kind="stable")[:, :2]  # [L, 2]
        now = tr.topk_ids[tr.batch == b]  # [T, L, 2]
        hits.append((now[:, :, :, None] == top[None, :, None, :]).any(axis=3).mean(axis=2))  # [T, L]
    per_layer = np.concatenate(hits).mean(axis=0)
    assert doc["per_layer_accuracy"] == pytest.approx(per_layer.tolist(), abs=1e-6)
    assert doc["accuracy"] == pytest.approx(per_layer.mean(), abs=1e-6)
    assert doc["tokens"] == 5 * 32
    doc = run_json(["predict", "--load", trace_file, "--predictor", "history", "--set", "window=2", "--batches",
                    "2:4"], capsys)
    assert doc["window"] == 2 and doc["batches"] == "2:4" and doc["tokens"] == 64
    # path: layer 0 has no prediction
    doc = run_json(["predict", "--load", trace_file, "--predictor", "path", "--build", build_file, "--set",
                    "depth=1"], capsys)
    assert doc["per_layer_accuracy"][0] is None and all(0 <= v <= 1 for v in doc["per_layer_accuracy"][1:])
    assert doc["depth"] == 1 and doc["build_tokens"] == 6 * 32
    rc, text, _ = run_cli(["predict", "--load", trace_file, "--predictor", "path", "--build", build_file], capsys)
    assert rc == 0 and "no prediction" in text


def test_cli_predict_and_online_lookahead(captured: tuple[Any, Any], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from moebalance.lm.capture import write_capture

    model, cap = captured
    path = tmp_path / "cap.npz"
    write_capture(path, cap)
    doc = run_json(["predict", "--load", path, "--predictor", "lookahead"], capsys)
    expected = mean_accuracy(LookaheadPredictor.from_model(model, cap.hidden_states), cap.load.trace, range(4), 2)
    assert doc["per_layer_accuracy"][0] is None
    assert doc["per_layer_accuracy"][1:] == pytest.approx(expected[1:].tolist(), abs=1e-6)
    doc = run_json(["online", "--load", path, "--policy", "libra", "--nodes", "1", "--gpus-per-node", "2",
                    "--slots-per-gpu", "8", "--warmup", "0:1", "--set", "n=2"], capsys)
    assert doc["params"]["predictor"] == "lookahead" and doc["prediction_accuracy"] > 0.5


@pytest.mark.parametrize(("args", "fragments"), [
    (["--policy", "foo", "--slots-per-gpu", "4"], ("unknown policy 'foo'", "libra")),
    (["--policy", "eplb,", "--slots-per-gpu", "4", "--window", "2"], ("--window needs --replan-every",)),
    # fresh, the default, is refused as plan refuses --migration without --previous: not silently dropped
    (["--policy", "eplb", "--slots-per-gpu", "4", "--migration", "fresh"], ("--migration fresh", "--replan-every K")),
    (["--policy", "libra", "--slots-per-gpu", "4", "--replan-every", "2", "--set", "predictor=oracle"],
     ("--replan-every",)),
    (["--policy", "libra", "--slots-per-gpu", "4", "--set", "predictor=lookahead"], ("hidden states",
                                                                                     "--hidden-states")),
    (["--policy", "libra", "--slots-per-gpu", "4", "--set", "predictor=crystal"], ("crystal",)),
    (["--policy", "libra", "--slots-per-gpu", "4", "--set", "predictor=oracle", "--set", "speed=3"], ("'speed'",)),
    (["--policy", "eplb,libra", "--slots-per-gpu", "4", "--set", "foo.n=4"], ("foo.n", "'foo'", "eplb,libra")),
    (["--policy", "eplb", "--slots-per-gpu", "4", "--set", "libra.n=4"], ("'libra' is not among --policy eplb",)),
    (["--policy", "eplb", "--slots-per-gpu", "4", "--batches", "1:4"], ("served batches 1:4", "after the warm-up")),
    (["--policy", "eplb", "--slots-per-gpu", "4", "--batches", "9:12"], ("batch range '9:12' is empty",)),
    (["--policy", "eplb", "--slots-per-gpu", "4", "--batches", "4:3"], ("batch range '4:3' is empty",)),
    (["--policy", "", "--slots-per-gpu", "4"], ("--policy is empty",)),
    (["--policy", "libra", "--slots-per-gpu", "4", "--set", "predictor=path", "--build", "missing.npz"],
     ("missing.npz", "does not exist")),
])
def test_cli_online_errors(args: list[str], fragments: tuple[str, ...], trace_file: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["online", "--load", trace_file, *CLUSTER, "--warmup", "0:2", *args]
    assert_user_error(argv, capsys, *fragments)


@pytest.mark.parametrize(("warmup", "fragments"), [
    ("3:3", ("batch range '3:3' is empty",)),
    ("0:9", ("served batches 6:6",)),  # clipped to 0:6, which leaves nothing to serve
    ("x:2", ("must hold integers",)),
])
def test_cli_online_bad_warmup(warmup: str, fragments: tuple[str, ...], trace_file: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["online", "--load", trace_file, "--policy", "eplb", *CLUSTER, "--slots-per-gpu", "4", "--warmup", warmup]
    assert_user_error(argv, capsys, *fragments)


@pytest.mark.parametrize(("args", "fragments"), [
    (["--predictor", "crystal"], ("unknown predictor 'crystal'", "lookahead, path, history, oracle")),
    (["--predictor", "lookahead"], ("has no hidden states", "--hidden-states")),
    (["--predictor", "path"], ("needs a build split", "--build")),
    (["--predictor", "oracle", "--set", "depth=2"], ("predictor 'oracle' has no option 'depth'", "it takes none")),
    (["--predictor", "path", "--set", "window=2"], ("has no option 'window'", "its options: depth")),
    (["--predictor", "path", "--set", "depth=7", "--build", "BUILD"], ("depth (7)",)),
    (["--predictor", "history", "--set", "window=0"], ("window (0)",)),
    (["--predictor", "history", "--batches", "0:1"], ("predicts nothing", "0:1")),
    (["--predictor", "oracle", "--batches", "4:2"], ("batch range '4:2' is empty",)),
    (["--predictor", "oracle", "--batches", "7:9"], ("is empty",)),
])
def test_cli_predict_errors(args: list[str], fragments: tuple[str, ...], trace_file: Path, build_file: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    args = [str(build_file) if a == "BUILD" else a for a in args]
    assert_user_error(["predict", "--load", trace_file, *args], capsys, *fragments)


@pytest.mark.parametrize("shape", [(2, 2), (3, 3)])  # (layers, top-k) of the second build trace
@pytest.mark.parametrize("command", ["online", "predict"])
def test_cli_build_traces_of_different_shapes(shape: tuple[int, int], command: str, trace_file: Path,
                                              build_file: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    layers, top_k = shape
    tr = random_trace(2, batches=2, tokens=8, layers=layers, experts=16, top_k=top_k, gpus=4)
    other = tmp_path / "other.npz"
    np.savez(other, counts=tr.counts(), topk_ids=tr.topk_ids, src_gpu=tr.src_gpu, batch=tr.batch)
    if command == "online":
        argv = online(trace_file, "libra", "--slots-per-gpu", "4", "--set", "predictor=path")
    else:
        argv = ["predict", "--load", trace_file, "--predictor", "path"]
    assert_user_error([*argv, "--build", build_file, "--build", other], capsys,
                      "--build traces disagree on [layers, experts, top-k]")


def test_cli_predict_needs_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = tmp_path / "counts.npy"
    np.save(counts, np.ones((3, 2, 4), dtype=np.int64))
    assert_user_error(["predict", "--load", counts, "--predictor", "oracle"], capsys, "counts only")
    assert_user_error(["online", "--load", counts, "--policy", "libra", *CLUSTER, "--slots-per-gpu", "1",
                       "--warmup", "0:1", "--set", "predictor=path"], capsys, "predictor=history")


def test_cli_plan_libra_is_an_error(trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert_user_error(["plan", "--load", trace_file, "--policy", "libra", *CLUSTER, "--slots-per-gpu", "4",
                       "--out", out], capsys, "dynamic", "moebalance online --policy libra")
    assert not out.exists()


def test_online_result_is_what_the_cli_reports() -> None:
    # as_dict rounds and names every field the CLI prints
    res = OnlineResult(policy="p", router="uniform", batches=np.array([3, 4]), per_batch_imbalance=np.array([1.5, 1.25]),
                       per_batch_balancedness=np.array([2 / 3, 0.8]), per_batch_moved=np.array([0.0, 3.0]),
                       replica_slots_per_gpu=1.0, replans=1, per_layer_accuracy=np.array([np.nan, 0.5]), params={},
                       balancedness=0.7333333333, mean_imbalance_ratio=1.375)
    doc = res.as_dict()
    assert doc["batches"] == "3:5" and doc["max_imbalance_ratio"] == 1.5 and doc["experts_moved"] == 1.5
    assert doc["prediction_accuracy"] == 0.5 and doc["per_layer_accuracy"] == [None, 0.5]
    assert doc["balancedness"] == 0.733333


# ----------------------------------------------------------------------------------------------------------
# no predictor sees what a server would not yet have


@pytest.mark.parametrize("seed", range(4))
def test_predictors_do_not_see_the_future(seed: int) -> None:
    """The prediction of layer ``l`` of batch ``b`` must not change when the routing it predicts changes: for
    path, the batch's picks in layers ``>= l`` (and later batches); for history, batch ``b`` and later; for
    lookahead, the picks anywhere and the hidden states of layers ``>= l``. Scrambling exactly those must leave
    the prediction bit for bit alone, and scrambling what the predictor may see must (here) change it."""
    L, E, K, G, B, T = 4, 12, 2, 3, 4, 40
    tr = random_trace(seed, batches=B, tokens=T, layers=L, experts=E, top_k=K, gpus=G)
    build = random_trace(seed + 100, batches=2, tokens=200, layers=L, experts=E, top_k=K, gpus=G)
    rng = np.random.default_rng(seed)
    b = 2
    lo, hi = b * T, (b + 1) * T

    def scrambled(ids: np.ndarray, rows: slice, layers: slice) -> RoutingTrace:
        out = ids.copy()
        part = out[rows, layers]
        out[rows, layers] = np.argsort(rng.random((*part.shape[:2], E)), axis=2)[:, :, :K]
        return RoutingTrace(out, tr.src_gpu, tr.batch, num_experts=E)

    D = 5
    hidden = rng.standard_normal((B * T, L, D)).astype(np.float16)
    gates = rng.standard_normal((L, D, E)).astype(np.float32)
    look = LookaheadPredictor(gates, None, GateConfig(top_k=K), hidden)
    for layer in range(1, L):
        path = PathPredictor([build], depth=2)
        base = path.predict(tr, b, G).topk_ids[:, layer]
        future = scrambled(tr.topk_ids, slice(lo, None), slice(layer, None))  # this layer and later, later batches
        assert np.array_equal(path.predict(future, b, G).topk_ids[:, layer], base)
        past = scrambled(tr.topk_ids, slice(lo, hi), slice(layer - 1, layer))  # the previous layer: what it keys on
        assert not np.array_equal(path.predict(past, b, G).topk_ids[:, layer], base)

        want = look.predict(tr, b, G).topk_ids[:, layer]
        h2 = hidden.copy()
        h2[:, layer:] = rng.standard_normal(h2[:, layer:].shape)
        other = LookaheadPredictor(gates, None, GateConfig(top_k=K), h2)
        anything = scrambled(tr.topk_ids, slice(None), slice(None))
        assert np.array_equal(other.predict(anything, b, G).topk_ids[:, layer], want)
        h3 = hidden.copy()
        h3[lo:hi, layer - 1] = rng.standard_normal((hi - lo, D))
        assert not np.array_equal(LookaheadPredictor(gates, None, GateConfig(top_k=K), h3)
                                  .predict(tr, b, G).topk_ids[:, layer], want)
    hist = HistoryPredictor(window=2)
    base_pred = hist.predict(tr, b, G)
    now_and_later = scrambled(tr.topk_ids, slice(lo, None), slice(None))
    again = hist.predict(now_and_later, b, G)
    assert np.array_equal(again.topk_ids, base_pred.topk_ids) and np.array_equal(again.demand, base_pred.demand)
    earlier = scrambled(tr.topk_ids, slice(0, lo), slice(None))
    assert not np.array_equal(hist.predict(earlier, b, G).demand, base_pred.demand)


def test_cli_online_libra_predicts_with_what_the_trace_has(trace_file: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # an engine's trace records no hidden states: libra given no predictor uses the path table, and says so
    rc, out, err = run_cli([*online(trace_file, "libra", "--slots-per-gpu", "4"), "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["params"]["predictor"] == "path" and "records no hidden states" in doc["predictor_note"]
    assert "note: libra predicts with path" in err and 0 <= doc["prediction_accuracy"] <= 1
    rc, text, err = run_cli(online(trace_file, "libra", "--slots-per-gpu", "4"), capsys)
    assert rc == 0 and "libra (path, n=8, alpha=0.5)" in text
    # counts only: history
    counts = tmp_path / "counts.npy"
    np.save(counts, np.random.default_rng(0).integers(1, 9, size=(4, 3, 16)))
    doc = run_json(["online", "--load", counts, "--policy", "libra", *CLUSTER, "--slots-per-gpu", "4", "--warmup",
                    "0:2"], capsys)
    assert doc["params"]["predictor"] == "history" and "counts only" in doc["predictor_note"]
    # a predictor given is used as given, without a note
    doc = run_json(online(trace_file, "libra", "--slots-per-gpu", "4", "--set", "predictor=oracle"), capsys)
    assert doc["params"]["predictor"] == "oracle" and "predictor_note" not in doc


def test_cli_online_shows_the_modelled_prefetch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["online", "--load", "bundled:olmoe-1b-7b-tokens", "--policy", "libra", "--nodes", "1", "--gpus-per-node",
            "8", "--slots-per-gpu", "10", "--warmup", "0:8", "--batches", "8:10", "--set", "predictor=oracle",
            "--model", "olmoe-1b-7b", "--intra-link", "pcie4"]
    doc = run_json(argv, capsys)["modelled_prefetch"]
    rc, text, err = run_cli([*argv, "--out-dir", tmp_path / "o"], capsys)
    assert rc == 0, err
    cells = f"{doc['gb_per_batch']:.3f}", f"{doc['mean_ms_per_gpu_and_layer']:.3f}"
    assert text.count("prefetch") == 2 and all(c in text for c in cells)  # the two columns' headers and cells
    md = (tmp_path / "o" / "online.md").read_text()
    assert "| prefetch GiB / batch | prefetch ms / GPU and layer |" in md and f"| {cells[0]} | {cells[1]} |" in md
    assert_user_error([*argv[:-4], "--intra-link", "pcie4"], capsys, "--intra-link is used by online only with --model")


def test_a_mistake_in_online_libra_is_one_line_without_the_predictor_note(capsys: pytest.CaptureFixture[str]) -> None:
    """"note: libra predicts with path ..." came on stderr before the error line of a warm-up over all 64 batches
    (none left to serve)."""
    assert_user_error(["online", "--load", "bundled:olmoe-1b-7b-tokens", "--policy", "libra", "--nodes", 1,
                       "--gpus-per-node", 8, "--slots-per-gpu", 10, "--warmup", "0:64"], capsys, "warm-up (0:64)")
