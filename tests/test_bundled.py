"""The bundled real trace ``bundled:esft-law``: DeepSeek's ESFT routing of a DeepSeek-V2-Lite-architecture model.

Only the bundled file is read here (``bench/make_bundled_esft.py`` makes it from ESFT's files, which CI does
not have). The pinned picks and digest below were read from ESFT's ``law_topk.npz`` with plain numpy (picks
sorted by gate weight, stable, layers to the middle axis, first 8,192 tokens) when the file was made.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix, bundled_names, read_load
from moebalance.core.plan import read_plan
from moebalance.models import get_model
from moebalance.policies import Budget, make_plan
from moebalance.routing.simulate import evaluate

NAME = "esft-law"
BATCHES, LAYERS, EXPERTS, TOP_K, RANKS, BATCH_TOKENS = 16, 26, 64, 6, 8, 512


@pytest.fixture(scope="module")
def esft() -> LoadMatrix:
    return read_load(f"bundled:{NAME}")


def test_esft_law_is_listed_with_its_licence_beside_it() -> None:
    assert NAME in bundled_names()
    data = resources.files("moebalance.workloads") / "data"
    assert (data / "esft_law.npz").is_file()
    text = (data / "esft_law.LICENSE.txt").read_text()
    for fragment in ("github.com/deepseek-ai/ESFT", "579a7711e4b332b4c57b47e378a0cf240d85caa6",
                     "results/expert_scores/law/expert_weights_{1..26}.txt", "arXiv:2407.01906", "MIT License",
                     "Copyright (c) 2024 DeepSeek", "could not be read", "batches of 512 tokens",
                     "8 data-parallel ranks", "135"):
        assert fragment in text, fragment


def test_esft_law_shape_model_and_layer_ids(esft: LoadMatrix) -> None:
    assert esft.shape == (BATCHES, LAYERS, EXPERTS)
    assert esft.preset == "deepseek-v2-lite"
    spec = esft.model
    assert spec is get_model("deepseek-v2-lite")
    assert (spec.num_layers, spec.num_experts, spec.top_k) == (LAYERS, EXPERTS, TOP_K)
    assert esft.layer_ids is not None and esft.layer_ids.tolist() == list(range(1, 27))  # layer 0 is dense
    assert esft.layer_ids.tolist() == list(range(spec.num_dense_layers, spec.num_dense_layers + spec.num_layers))


def test_esft_law_tokens_ranks_and_batches(esft: LoadMatrix) -> None:
    tr = esft.trace
    assert tr is not None
    assert tr.topk_ids.shape == (BATCHES * BATCH_TOKENS, LAYERS, TOP_K) and tr.top_k == TOP_K
    assert tr.num_experts == EXPERTS and tr.num_batches == BATCHES
    ids = tr.topk_ids.astype(np.int64)
    assert ids.min() >= 0 and ids.max() < EXPERTS
    # a token picks 6 distinct experts in every layer
    assert np.all(np.diff(np.sort(ids, axis=2), axis=2) > 0)
    # batch b holds tokens 512 b .. 512 b + 511; within it ranks 0..7 hold contiguous blocks of 64
    assert tr.batch.tolist() == np.repeat(np.arange(BATCHES), BATCH_TOKENS).tolist()
    assert tr.src_gpu.tolist() == np.tile(np.repeat(np.arange(RANKS), BATCH_TOKENS // RANKS), BATCHES).tolist()
    per_rank = np.zeros((BATCHES, RANKS), dtype=np.int64)
    np.add.at(per_rank, (tr.batch, tr.src_gpu), 1)
    assert np.all(per_rank == 64)


def test_esft_law_counts_are_the_picks(esft: LoadMatrix) -> None:
    tr = esft.trace
    assert tr is not None
    assert np.all(esft.counts.sum(axis=2) == BATCH_TOKENS * TOP_K)
    # counted here by brute force, not by the trace's own tally
    ids = tr.topk_ids.astype(np.int64)
    mine = np.zeros((BATCHES, LAYERS, EXPERTS), dtype=np.int64)
    b = np.broadcast_to(tr.batch[:, None, None], ids.shape)
    layer = np.broadcast_to(np.arange(LAYERS)[None, :, None], ids.shape)
    np.add.at(mine, (b, layer, ids), 1)
    assert np.array_equal(mine, esft.counts)


def test_esft_law_holds_the_source_picks_in_gate_order(esft: LoadMatrix) -> None:
    tr = esft.trace
    assert tr is not None
    ids = tr.topk_ids
    # first token of the first law sequence, model layers 1 and 2 (top-1 pick first); last kept token, layer 26
    assert ids[0, 0].tolist() == [57, 60, 26, 56, 8, 11]
    assert ids[0, 1].tolist() == [3, 62, 60, 50, 38, 63]
    assert ids[-1, -1].tolist() == [58, 44, 40, 41, 10, 42]
    digest = hashlib.sha256(np.ascontiguousarray(ids, dtype="<i2").tobytes()).hexdigest()
    assert digest == "62c47fd867ca34f009185bd8bceb5cedd2884e1025f62e390be94e602b1574ad"
    # real routing is skewed, far from the 2-3% of picks per expert a uniform router gives
    total = esft.total()
    assert total[0].argmax() == 12 and total[0].max() == 1573
    assert total[25].argmax() == 37 and total[25].max() == 2612


def test_esft_law_stats_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(["stats", "--load", f"bundled:{NAME}"], capsys)
    assert rc == 0, err
    assert "deepseek-v2-lite: 16 batches x 26 layers x 64 experts" in out
    assert "8,192 tokens on 8 GPUs, top-6" in out
    rows = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert rows == [str(i) for i in range(1, 27)]  # the model's layer numbers, not 0..25
    rc, out, err = run_cli(["stats", "--load", f"bundled:{NAME}", "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["shape"] == [BATCHES, LAYERS, EXPERTS] and doc["preset"] == "deepseek-v2-lite"
    assert doc["layer_ids"] == list(range(1, 27)) and doc["dense_layers"] == []
    # peak/mean of model layer 1 over all batches, by hand from the pinned totals: 1573 / (8192 * 6 / 64)
    assert doc["peak_to_mean"][0] == pytest.approx(1573 / 768)


def test_esft_law_eplb_plan_on_one_node_of_8_evaluates(esft: LoadMatrix, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # the library: EPLB on the first 8 batches with one spare slot per GPU, scored on the other 8
    train, test = esft.split(0.5)
    plan = make_plan("eplb", train, Cluster(num_nodes=1, gpus_per_node=8), Budget(slots_per_gpu=9),
                     num_groups=1)[0]
    assert (plan.num_layers, plan.num_experts) == (LAYERS, EXPERTS)
    assert plan.params["layer_ids"] == list(range(1, 27))
    contiguous = make_plan("contiguous", train, Cluster(num_nodes=1, gpus_per_node=8), Budget(slots_per_gpu=8))[0]
    eplb, base = evaluate(plan, test, "rebalance"), evaluate(contiguous, test, "uniform")
    assert eplb.num_batches == 8 and 0 < base.balancedness < eplb.balancedness <= 1
    # the command line, on all 16 batches
    dest = tmp_path / "plan.json"
    rc, _, err = run_cli(["plan", "--load", f"bundled:{NAME}", "--policy", "eplb", "--nodes", 1,
                          "--gpus-per-node", 8, "--slots-per-gpu", 9, "--out", dest], capsys)
    assert rc == 0, err
    assert read_plan(dest).params["layer_ids"] == list(range(1, 27))
    rc, out, err = run_cli(["evaluate", "--plan", dest, "--load", f"bundled:{NAME}", "--json"], capsys)
    assert rc == 0, err
    result = json.loads(out)
    assert 0 < result["balancedness"] <= 1 and result["num_batches"] == BATCHES
    assert result["traffic"]["inter_node"] == 0  # one node
    # the same 8 ranks fit 2 nodes of 4: rank g is GPU g, so ranks 4..7 sit on node 1 and some picks cross nodes
    two = make_plan("eplb", train, Cluster(num_nodes=2, gpus_per_node=4), Budget(slots_per_gpu=9))[0]
    score = evaluate(two, test, "rebalance")
    assert 0 < score.balancedness <= 1 and score.traffic is not None and score.traffic.inter_node > 0
