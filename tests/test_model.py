"""The MoE language model (``moebalance.lm``): EP forward == dense forward on real gloo groups, capture writes
valid traces, the committed checkpoint routes with skew that differs by domain, training is reproducible, and
the ``capture`` / ``run`` commands work end to end and reject bad inputs in one line.

Distributed tests launch real gloo process groups (:func:`moebalance.runtime.launch`) through
:func:`moebalance.lm.run.run_model`; nothing is mocked. Token counts are kept small (1,024 tokens a run).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_cli

from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix, read_load
from moebalance.core.plan import Placement, write_plan
from moebalance.lm.capture import PRESET, capture, make_layout, write_capture
from moebalance.lm.data import CHUNK, DOMAINS, domain_tokens
from moebalance.lm.moe_lm import (
    BOS,
    CAPTURE_CHECKPOINT,
    EOS,
    ModelConfig,
    MoELM,
    bundled_checkpoint,
    load_checkpoint,
)
from moebalance.lm.run import dense_reference, run_model
from moebalance.lm.train import TrainConfig, bits_per_byte, train
from moebalance.lm.train import main as train_main
from moebalance.policies import Budget, make_plan
from moebalance.runtime import topk_gating
from moebalance.workloads.stats import layer_skew

RUN_TOKENS, RUN_BATCH = 1024, 512  # 8 sequences of 128 in 2 forward steps


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch thread here: two pytest processes with two spinning OpenMP threads each on two cores ran this
    module's forwards 10-70x slower; the gloo ranks use one thread each anyway."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> MoELM:
    return load_checkpoint()


def _captured(model: MoELM, domain: str, num_gpus: int, tokens: int = 4096) -> LoadMatrix:
    return capture(model, domain_tokens(domain, "heldout", tokens), num_gpus=num_gpus, batch_tokens=1024).load  # type: ignore[arg-type]


def _distribution(load: LoadMatrix) -> np.ndarray:
    """``[L, E]``: each layer's share of picks per expert."""
    total = load.total().astype(np.float64)
    return total / total.sum(axis=1, keepdims=True)


def _tv(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``[L]`` total variation distance between per-layer expert distributions."""
    return 0.5 * np.abs(a - b).sum(axis=1)


# ----- data ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("domain", DOMAINS)
def test_splits_partition_the_domain_and_budgets_take_prefixes(domain: str) -> None:
    """Every tenth chunk of 4,096 tokens is held out; a budget (which reads only the files it needs) gives a
    prefix of the full split."""
    train_all, held_all = (domain_tokens(domain, s) for s in ("train", "heldout"))  # type: ignore[arg-type]
    stream = np.empty(train_all.size + held_all.size, dtype=np.int64)
    held = (np.arange(stream.size) // CHUNK) % 10 == 9
    stream[held], stream[~held] = held_all, train_all
    assert stream[0] == BOS and np.sum(stream == BOS) == np.sum(stream == EOS) > 10
    for budget in (1, 4097, 40000, 10**7):
        np.testing.assert_array_equal(domain_tokens(domain, "heldout", budget), held_all[:budget])  # type: ignore[arg-type]
        np.testing.assert_array_equal(domain_tokens(domain, "train", budget), train_all[:budget])  # type: ignore[arg-type]


# ----- the model's MoE layers on the expert-parallel runtime ----------------------------------------------------

def test_sparse_forward_equals_dense_reference(model: MoELM) -> None:
    """The model's own (training) MoE path and the runtime's dense_moe give the same logits and picks."""
    toks = domain_tokens("code", "heldout", 512)
    layout = make_layout(toks.size, seq_len=128, batch_tokens=512, num_gpus=1)
    idx = torch.as_tensor(toks[:512].reshape(4, 128))
    with torch.no_grad():
        own = model(idx)
    ref_logits, ref_ids = dense_reference(model, [[idx.numpy()]])
    assert layout.num_batches == 1
    assert own.topk_ids is not None
    np.testing.assert_array_equal(own.topk_ids.numpy(), ref_ids[0])
    np.testing.assert_allclose(own.logits.numpy(), ref_logits[0], rtol=0, atol=1e-4)


CASES = [  # (world size, policy, budget, cluster (nodes, GPUs per node), router)
    (2, "contiguous", Budget(slots_per_gpu=8), (1, 2), "uniform"),
    (2, "eplb", Budget(slots_per_gpu=10), (2, 1), "random"),
    (4, "contiguous", Budget(slots_per_gpu=4), (2, 2), "uniform"),
    (4, "craft", Budget(replicas_per_gpu=4), (2, 2), "locality"),
]


@pytest.mark.parametrize(("world_size", "policy", "budget", "shape", "router"), CASES,
                         ids=[f"{c[0]}ranks-{c[1]}-{c[4]}" for c in CASES])
def test_ep_forward_equals_dense(model: MoELM, world_size: int, policy: str, budget: Budget,
                                 shape: tuple[int, int], router: str) -> None:
    """Every MoE layer on ``world_size`` gloo ranks under a plan made on a capture == the dense forward; each
    rank's picks per batch and layer == the simulator's; bytes split by link as the cluster says."""
    cluster = Cluster(num_nodes=shape[0], gpus_per_node=shape[1])
    plan, _ = make_plan(policy, _captured(model, "code", world_size), cluster, budget)
    if policy != "contiguous":
        assert plan.extra_replicas > 0  # a replicated plan: the router has choices to make
    tokens = domain_tokens("prose", "heldout", RUN_TOKENS)
    report = run_model(None, plan, tokens, world_size=world_size, router=router, batch_tokens=RUN_BATCH)
    assert report.max_abs_logit_diff < 1e-4
    assert report.routing_mismatches == 0
    assert report.counts_match
    np.testing.assert_array_equal(report.computed, report.predicted)
    L, K = model.config.num_layers, model.config.top_k
    assert report.computed.sum() == RUN_TOKENS * L * K  # every pick computed exactly once
    assert [r.tokens for r in report.ranks] == [RUN_TOKENS // world_size] * world_size
    if shape[0] == 1:
        assert all(r.inter_node_bytes == 0 and r.intra_node_bytes > 0 for r in report.ranks)
    if shape[1] == 1:
        assert all(r.intra_node_bytes == 0 and r.inter_node_bytes > 0 for r in report.ranks)


# ----- capture ----------------------------------------------------------------------------------------------

def test_capture_writes_a_valid_trace(model: MoELM, tmp_path: Path) -> None:
    G, N = 3, 2048
    toks = domain_tokens("code", "heldout", N)
    cap = capture(model, toks, num_gpus=G, batch_tokens=1024, hidden_states=True)
    path = tmp_path / "trace.npz"
    write_capture(path, cap)
    load = read_load(path)  # validates counts against topk_ids
    tr = load.trace
    assert tr is not None and load.preset == PRESET
    L, K, E, D = (model.config.num_layers, model.config.top_k, model.config.num_experts, model.config.d_model)
    assert tr.topk_ids.shape == (N, L, K) and load.counts.shape == (2, L, E)
    np.testing.assert_array_equal(load.counts, tr.counts())
    assert load.counts.sum() == N * L * K
    assert tr.src_gpu.min() == 0 and tr.src_gpu.max() == G - 1
    assert np.all(np.diff(tr.batch) >= 0)
    # rank-major within a batch: batch 0 holds sequences 0..7; rank 0 has 0, 3, 6, rank 1 has 1, 4, 7
    with np.load(path) as f:
        token_ids, hidden = f["token_ids"], f["hidden_states"]
    S = 128
    expect = np.concatenate([toks[s * S:(s + 1) * S] for s in (0, 3, 6, 1, 4, 7, 2, 5)])
    np.testing.assert_array_equal(token_ids[:8 * S], expect)
    np.testing.assert_array_equal(tr.src_gpu[:8 * S], np.repeat([0, 1, 2], [3 * S, 3 * S, 2 * S]))
    # the hidden states are the gate's input: gating them again gives the recorded picks (float16 rounding
    # may flip a near-tie)
    assert hidden.shape == (N, L, D) and hidden.dtype == np.float16
    for layer in range(L):
        gate, _, config, bias = model.moe_parts(layer)
        ids = topk_gating(torch.as_tensor(hidden[:, layer]).float() @ gate, config,
                          selection_bias_E=bias).topk_ids.numpy()
        assert np.mean(np.all(ids == tr.topk_ids[:, layer], axis=1)) > 0.97


def test_committed_checkpoint_routes_with_skew_that_differs_by_domain(model: MoELM) -> None:
    """No balancing loss: every layer's hottest expert takes well over its share. And the two domains use the
    experts differently: two disjoint held-out parts A, B of 16,384 tokens per domain; code A against prose A
    differ (total variation per layer) by more than twice what A and B of one domain differ (the control:
    sampling noise plus the drift between source files). Measured on CPython 3.11: cross 0.07-0.18 per layer
    (mean 0.12), within code mean 0.04, within prose 0.01; peak/mean 3.8-7.7. The thresholds leave room for
    another Python's standard library (other held-out text)."""
    n = 16384
    both = {d: _captured(model, d, 2, 2 * n) for d in DOMAINS}  # batches of 1,024 tokens
    loads = {(d, half): both[d].select_batches(*span) for d in DOMAINS
             for half, span in (("A", (0, n // 1024)), ("B", (n // 1024, 2 * n // 1024)))}
    for d in DOMAINS:
        ptm = layer_skew(both[d].counts).peak_to_mean
        assert ptm.min() > 2.0 and ptm.max() > 4.0, (d, ptm)
    dist = {k: _distribution(v) for k, v in loads.items()}
    cross = _tv(dist["code", "A"], dist["prose", "A"])
    within = [_tv(dist[d, "A"], dist[d, "B"]) for d in DOMAINS]
    assert cross.max() > 0.12, cross
    assert cross.mean() > 2 * max(w.mean() for w in within), (cross, within)


def test_committed_checkpoint_beats_unigram(model: MoELM) -> None:
    record = json.loads(bundled_checkpoint().with_suffix(".json").read_text())
    assert ModelConfig.from_dict(record["model"]) == model.config
    results = record["results"]
    for d in DOMAINS:
        assert results["bits_per_byte"][d] < results["unigram_bits_per_byte"][d] - 1.5
        assert bits_per_byte(model, domain_tokens(d, "heldout", 2049), 128) < results["unigram_bits_per_byte"][d] - 1.0
    assert record["data"]["python_version"] and record["loss_curve"]


# ----- training ---------------------------------------------------------------------------------------------

TINY = ModelConfig(d_model=32, num_heads=2, num_layers=2, num_experts=4, top_k=2, ffn_size=32, max_seq_len=32)


def _tiny_train(**kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(steps=40, batch_size=8, seq_len=32, lr=1e-2, warmup=5, code_tokens=20000,
                                prose_tokens=20000, eval_tokens=2048, log_every=10, eval_every=40,
                                curve_eval_tokens=512)
    return TrainConfig(**{**base, **kw})


def test_training_reduces_loss_and_is_reproducible() -> None:
    a = train(TINY, _tiny_train(seed=3))
    curve = a.record["loss_curve"]
    assert curve[-1]["train_loss"] < curve[0]["train_loss"] - 0.5
    b = train(TINY, _tiny_train(seed=3))
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c = train(TINY, _tiny_train(seed=4, steps=5, aux_loss_coef=0.01))
    assert not torch.equal(c.model.state_dict()["blocks.0.moe.gate"], sa["blocks.0.moe.gate"])
    aux = c.record["loss_curve"][-1]["aux_loss"]
    assert 0.5 < aux < TINY.num_experts  # E * sum_e f_e P_e: 1 at perfect balance, E at total collapse


def test_train_command_writes_checkpoint_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "lm.safetensors"
    argv = ["--out", str(out), "--plot", str(tmp_path / "loss.png"), "--d-model", "32", "--heads", "2",
            "--layers", "2", "--experts", "4", "--ffn-size", "32", "--steps", "10", "--batch-size", "4",
            "--seq-len", "32", "--code-tokens", "8000", "--prose-tokens", "8000", "--eval-tokens", "1024",
            "--log-every", "5", "--eval-every", "10"]
    assert train_main(argv) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["command"].startswith("python -m moebalance.lm.train --out")
    assert set(record["results"]["bits_per_byte"]) == set(DOMAINS)
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert load_checkpoint(out).config == ModelConfig.from_dict(record["model"])


# ----- the command line -------------------------------------------------------------------------------------

def test_capture_plan_run_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "code.npz"
    rc, out, err = run_cli(["capture", "--domain", "code", "--tokens", 2048, "--gpus", 2, "--batch-tokens", 1024,
                         "--out", trace], capsys)
    assert rc == 0, err
    assert read_load(trace).trace is not None
    plan = tmp_path / "plan.json"
    rc, _, err = run_cli(["plan", "--load", trace, "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 2,
                       "--slots-per-gpu", 17, "--out", plan], capsys)  # the default capture model: 32 experts
    assert rc == 0, err
    for router in (["random"], ["rebalance", "--router-set", "eps=0.01", "--two-stage"]):
        rc, out, err = run_cli(["run", "--world-size", 2, "--plan", plan, "--domain", "prose", "--tokens", RUN_TOKENS,
                             "--batch-tokens", RUN_BATCH, "--router", *router, "--json"], capsys)
        assert rc == 0, err
        doc = json.loads(out)
        assert doc["logits_agree"] and doc["counts_match_simulator"] and doc["routing_mismatches"] == 0
        assert [r["picks_computed"] for r in doc["ranks"]] == [r["picks_predicted"] for r in doc["ranks"]]
        assert doc["router"] == {"random": "random", "rebalance": "rebalance(eps=0.01)"}[router[0]]
        if "--two-stage" in router:  # one fraction per batch of forwards whose rebalancer beat the local phase
            per_batch = doc["rebalancer_hidden_per_batch"]
            assert doc["two_stage"] and len(per_batch) == doc["num_batches"]
            # every (batch, layer, rank) forward ran the rebalancer in the thread, none routed first
            L = load_checkpoint(bundled_checkpoint(CAPTURE_CHECKPOINT)).config.num_layers
            assert doc["two_stage_forwards"] == doc["num_batches"] * L * 2
            assert 0 <= doc["rebalancer_hidden_forwards"] <= doc["two_stage_forwards"]
            assert sum(per_batch) * L * 2 == pytest.approx(doc["rebalancer_hidden_forwards"], abs=0.01)
        else:
            assert "rebalancer_hidden_per_batch" not in doc


def test_run_command_rejects_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other.json"  # a plan for another model: 2 layers x 8 experts
    write_plan(other, Placement([[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2, 8, Cluster(num_nodes=1, gpus_per_node=2)))
    four = tmp_path / "four.json"  # this model's shape, 4 GPUs
    write_plan(four, Placement([[[g * 4 + i for i in range(4)] for g in range(4)]] * 4, 16,
                               Cluster(num_nodes=2, gpus_per_node=2)))
    for argv, fragment in (
            (["run", "--world-size", 2, "--plan", other, "--domain", "code"], "2 layers x 8 experts"),
            (["run", "--world-size", 2, "--plan", four, "--domain", "code"], "--world-size 2"),
            (["run", "--world-size", 4, "--plan", four, "--domain", "code", "--two-stage"], "--two-stage needs"),
            (["run", "--world-size", 4, "--plan", four, "--domain", "prose", "--tokens", 10**6], "--tokens"),
            (["capture", "--domain", "code", "--tokens", 1000, "--gpus", 2, "--batch-tokens", 1000, "--out",
              tmp_path / "x.npz"], "multiple of the sequence length")):
        rc, _, err = run_cli(argv, capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("moebalance: error:"), err
        assert fragment in lines[0], lines[0]
    assert not (tmp_path / "x.npz").exists()
