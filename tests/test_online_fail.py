"""``online --migration`` (re-plans laid onto the plan in service) and ``online --fail G@BATCH`` (losing a GPU;
:mod:`moebalance.online.failure`). Hand-derived cases on tiny counts loads; the CLI on the bundled OLMoE-like trace.

The small model's expert is ``3 x 1000 x 1500`` parameters, 9 MB in bf16: 20 us over NVLink 4 (450 GB/s) and
140.625 us over PCIe 5 (64 GB/s).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_user_error, run_cli

from moebalance.algorithms.migration import lay_onto
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix, read_bundled
from moebalance.core.plan import Placement
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import get_gpu
from moebalance.models import get_model
from moebalance.online.failure import Failures, check_failures, parse_failure, recovery_cost
from moebalance.online.rearrange import Replanning
from moebalance.online.replay import moved_copies, replay
from moebalance.policies import make_plan
from moebalance.pricing.step import StepPricing

SMALL = dataclasses.replace(get_model("olmoe-1b-7b"), hidden_size=1000, moe_intermediate_size=1500)
US = 1e-6
FOUR = Cluster(num_nodes=1, gpus_per_node=4)


def drifting(batches: int = 8, layers: int = 2, experts: int = 16, seed: int = 0) -> LoadMatrix:
    """Counts whose hot experts drift: batch ``b`` favours experts around ``2 b``."""
    rng = np.random.default_rng(seed)
    e = np.arange(experts)
    counts = np.empty((batches, layers, experts), dtype=np.int64)
    for b in range(batches):
        for li in range(layers):
            w = 1.0 + 8.0 * np.exp(-0.5 * ((e - 2 * b - 3 * li) % experts) ** 2 / 2.0)
            counts[b, li] = rng.poisson(40 * w)
    return LoadMatrix(counts)


# ----------------------------------------------------------------------------------------------------------
# --migration in the replay
# ----------------------------------------------------------------------------------------------------------

def test_aligned_moves_fewer_experts_than_fresh_with_the_same_balance() -> None:
    load = drifting()
    fresh = replay(load, FOUR, Budget(slots_per_gpu=5), "eplb", warmup=(0, 2), replanning=Replanning(every=1, window=1))
    aligned = replay(load, FOUR, Budget(slots_per_gpu=5), "eplb", warmup=(0, 2),
                     replanning=Replanning(every=1, window=1, migration="aligned"))
    # a relabelling of GPUs: every batch's imbalance is the fresh plan's, and fewer copies move
    np.testing.assert_allclose(aligned.per_batch_imbalance, fresh.per_batch_imbalance, rtol=1e-12)
    assert aligned.per_batch_moved.sum() < fresh.per_batch_moved.sum()
    assert (aligned.per_batch_moved <= fresh.per_batch_moved).all()
    assert aligned.params["migration"] == "aligned" and "migration" not in fresh.params


def test_bounded_never_receives_more_than_m_per_gpu() -> None:
    load = drifting()
    budget = Budget(slots_per_gpu=5)
    # M = 0: no GPU receives an expert it lacks (a second copy of one it holds is a local clone), nothing is priced
    none = replay(load, FOUR, budget, "eplb", warmup=(0, 2),
                  replanning=Replanning(every=1, migration="bounded", max_moves=0),
                  pricing=StepPricing(deployment=Deployment(model=dataclasses.replace(SMALL, num_layers=2,
                                                                                      num_experts=16),
                                                            gpu=get_gpu("h100-80gb"))))
    assert none.time is not None and none.time["exposed_balancing_ms"] == 0 and none.time["moved_gib"] == 0
    # M = 2, the online loop's chain of re-plans: no GPU receives more than 2 copies per re-plan (summed over layers)
    prev = make_plan("eplb", load.select_batches(0, 2), FOUR, budget)[0]
    total, copies = 0, []
    for b in range(3, 8):  # the replay re-plans before served batches 3..7 on the batch before

        window = load.select_batches(b - 1, b)
        new = lay_onto(prev, make_plan("eplb", window, FOUR, budget)[0], "bounded", max_moves=2, load=window)
        received = ((new.copies > 0) & (prev.copies == 0)).sum(axis=(0, 1))
        assert received.max() <= 2
        total += int(received.sum())
        copies.append(moved_copies(prev, new))
        prev = new
    assert total > 0  # the bound binds something: moves were made
    res = replay(load, FOUR, budget, "eplb", warmup=(0, 2),
                 replanning=Replanning(every=1, migration="bounded", max_moves=2))
    assert res.per_batch_moved.tolist() == [0, *copies] and res.params["max_moves"] == 2


def test_migration_refusals() -> None:
    load = drifting()
    with pytest.raises(InputError, match="needs a static policy with --replan-every"):
        replay(load, FOUR, Budget(slots_per_gpu=5), "eplb", warmup=(0, 2), replanning=Replanning(migration="aligned"))
    with pytest.raises(InputError, match="max_moves goes with migration bounded"):  # refused by Replanning itself
        Replanning(every=1, migration="bounded")


# ----------------------------------------------------------------------------------------------------------
# losing a GPU
# ----------------------------------------------------------------------------------------------------------

def test_parse_and_check_failures_refuse_in_one_line() -> None:
    assert parse_failure("3@12") == (3, 12)
    for bad in ("3", "a@1", "1@"):
        with pytest.raises(InputError, match="give GPU@BATCH"):
            parse_failure(bad)
    assert check_failures([(1, 5), (0, 3), (2, 5)], 4, (2, 8)) == {3: (0,), 5: (1, 2)}
    cases = [([(4, 3)], "GPU 4 is not one of the cluster's 4 GPUs"), ([(0, 8)], "batch 8 is not served"),
             ([(0, 1)], "batch 1 is not served"), ([(1, 3), (1, 5)], "names GPU 1 twice"),
             ([(0, 3), (1, 3), (2, 4), (3, 5)], "takes all 4 GPUs")]
    for fails, msg in cases:
        with pytest.raises(InputError, match=msg):
            check_failures(fails, 4, (2, 8))


def test_failures_are_pairs_of_integers_and_a_positive_link() -> None:
    assert Failures(((3, 4), [1, np.int64(2)])).events == ((3, 4), (1, 2))
    for bad in (((1.7, 2),), ((1,),), (3,), ((True, 2),)):
        with pytest.raises(InputError, match=r"must be a \(GPU, batch\) pair of integers"):
            Failures(bad)  # type: ignore[arg-type]
    for link in (0.0, -1.0, float("nan"), True):
        with pytest.raises(InputError, match="reload link"):
            Failures((), reload_gbps=link)


def test_recovery_reloads_the_only_copies_then_moves_the_rest() -> None:
    cluster = FOUR
    prev = Placement([[[0, 1], [1, 2], [2, 0], [3, 4]]], 5, cluster)
    new = Placement([[[0, 3], [1, 4], [2, 3], []]], 5, cluster)
    bpe = 9_000_000
    seconds, moved, reloaded = recovery_cost(prev, new, [3], bpe, 64.0)
    # experts 3 and 4 lived only on GPU 3: 3 is reloaded on GPU 0 (its first host), 4 on GPU 1, in parallel over
    # each GPU's PCIe 5 (140.625 us); GPU 2 then takes expert 3 from GPU 0 over NVLink 4 (20 us)
    assert reloaded == 2 and moved == 3 * bpe
    assert seconds == pytest.approx(140.625 * US + 20 * US, rel=1e-12)


def test_a_lost_gpu_serves_nothing_and_balance_is_over_the_survivors() -> None:
    # 1 layer, 4 experts of 10 picks per batch on 4 GPUs of 2 slots: EPLB's plan is [[0, 0], [1, 1], [2, 2], [3, 3]]
    # (its packing's ties), every GPU at 10 picks
    load = LoadMatrix(np.full((6, 1, 4), 10, dtype=np.int64))
    pricing = StepPricing(deployment=Deployment(model=dataclasses.replace(SMALL, num_layers=1, num_experts=4, top_k=2),
                                                gpu=get_gpu("h100-80gb")))
    res = replay(load, FOUR, Budget(slots_per_gpu=2), "eplb", warmup=(0, 2), replanning=Replanning(overhead_ms=5.0),
                 failures=Failures(((1, 4),)), pricing=pricing)
    # batches 2, 3 balanced; from 4 on 3 survivors x 2 slots hold the 4 experts twice for two of them:
    # copies of 10, 10, 5, 5, 5, 5 packed 15, 15, 10: imbalance 15 / (40 / 3) = 1.125, balancedness 0.8889
    np.testing.assert_allclose(res.per_batch_imbalance, [1.0, 1.0, 1.125, 1.125], rtol=1e-12)
    (f,) = res.failures
    assert f["gpus"] == [1] and f["batch"] == 4 and f["imbalance_before"] == 1.0
    assert f["recovery_batches"] is None  # never back within 2% of 1.0
    assert f["mean_imbalance_after"] == 1.125 and f["balancedness_after"] == pytest.approx(0.888889, abs=1e-6)
    # expert 1 lived only on GPU 1: reloaded over PCIe 5 (140.625 us); the stall is the host's 5 ms, the reload and
    # the survivors' moves, and the steps' exposed time holds exactly it
    assert f["reloaded_experts"] == 1 and f["stall_ms"] >= 5.140625
    assert res.time is not None and res.time["exposed_balancing_ms"] == pytest.approx(f["stall_ms"], rel=1e-9)
    assert res.as_dict()["failures"] == [f]


def test_libra_after_a_failure_prefetches_for_the_survivors_only() -> None:
    """The prefetcher plans on the survivors: an idle lost GPU would draw phase 2's copies, which then go nowhere
    (the balance Libra bought with them lost: on this load the mean imbalance after rose from 1.002 to 1.039)."""
    load = drifting(batches=12, layers=2, experts=16)
    cluster = Cluster(num_nodes=2, gpus_per_node=4)
    kw: dict[str, Any] = {"warmup": (0, 2), "router": "rebalance"}
    params = {"predictor": "oracle", "n": 2, "base": "eplb"}
    whole = replay(load, cluster, Budget(slots_per_gpu=3), "libra", params, **kw)
    failed = replay(load, cluster, Budget(slots_per_gpu=3), "libra", params, failures=Failures(((1, 6),)), **kw)
    f = failed.failures[0]
    assert f["imbalance_before"] == pytest.approx(whole.per_batch_imbalance[:4].mean())
    assert f["mean_imbalance_after"] <= f["imbalance_before"] * 1.02 and f["recovery_batches"] == 0


def test_three_experts_recover_at_once() -> None:
    # 3 experts on 4 GPUs of 2 slots; after GPU 0 fails the 3 survivors hold each expert twice: 5 + 5 each
    load = LoadMatrix(np.full((6, 1, 3), 10, dtype=np.int64))
    res = replay(load, FOUR, Budget(slots_per_gpu=2), "eplb", warmup=(0, 2), failures=Failures(((0, 3),)))
    (f,) = res.failures
    assert f["recovery_batches"] == 0 and f["mean_imbalance_after"] == 1.0 and f["stall_ms"] is None


def test_survivors_that_cannot_hold_every_expert_are_refused() -> None:
    load = LoadMatrix(np.full((6, 1, 8), 10, dtype=np.int64))
    # 4 GPUs x 2 slots hold the 8 experts once; 3 survivors hold 6 < 8: each would need ceil(8 / 3) = 3
    with pytest.raises(InputError, match=r"3 surviving GPUs hold 2 expert slots each.*each would need 3 slots"):
        replay(load, FOUR, Budget(slots_per_gpu=2), "eplb", warmup=(0, 2), failures=Failures(((2, 4),)))


# ----------------------------------------------------------------------------------------------------------
# the CLI
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def olmoe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sub = read_bundled("olmoe-1b-7b-tokens").select_batches(0, 6)
    assert sub.trace is not None
    path = tmp_path_factory.mktemp("fail") / "olmoe.npz"
    np.savez(path, counts=sub.counts, topk_ids=sub.trace.topk_ids, src_gpu=sub.trace.src_gpu, batch=sub.trace.batch)
    return path


def online(load: Path, policy: str, *extra: Any) -> list[Any]:
    return ["online", "--load", load, "--policy", policy, "--nodes", "2", "--gpus-per-node", "4", "--warmup", "0:2",
            "--model", "olmoe-1b-7b", "--slots-per-gpu", "10", *extra]


def test_cli_fail_reports_every_policy(olmoe_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = online(olmoe_file, "eplb,libra", "--set", "libra.predictor=oracle", "--set", "libra.n=1", "--set", "libra.base=eplb", "--fail", "5@3",
                  "--gpu", "h100-80gb", "--reload-link", "pcie4")
    rc, text, err = run_cli([*argv, "--json"], capsys)
    assert rc == 0, err
    for doc in json.loads(text)["results"]:
        (f,) = doc["failures"]
        assert f["gpus"] == [5] and f["batch"] == 3 and f["stall_ms"] >= 1000.0  # the host's default second
        assert set(f) == {"gpus", "batch", "stall_ms", "reloaded_experts", "imbalance_before", "recovery_batches",
                          "mean_imbalance_after", "balancedness_after"}
    rc, text, _ = run_cli(argv, capsys)
    assert rc == 0 and "failure: eplb: GPU 5 lost at batch 3" in text and "failure: libra" in text


def test_cli_refusals(olmoe_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [(("--fail", "8@3"), "GPU 8 is not one of"), (("--fail", "1@9"), "batch 9 is not served"),
             (("--fail", "1@3", "--fail", "1@4"), "names GPU 1 twice"),
             (tuple(x for g in range(8) for x in ("--fail", f"{g}@3")), "takes all 8 GPUs"),
             (("--fail", "x"), "give GPU@BATCH"), (("--reload-link", "pcie5"), "--reload-link prices"),
             (("--migration", "aligned"), "give --replan-every"),
             (("--replan-every", "1", "--migration", "bounded"), "needs --max-moves"),
             (("--replan-every", "1", "--max-moves", "2"), "--max-moves is used only by --migration bounded")]
    for extra, msg in cases:
        assert_user_error(online(olmoe_file, "eplb", *extra), capsys, msg)
    # 8 GPUs x 8 slots hold OLMoE's 64 experts once; 7 survivors cannot
    argv = online(olmoe_file, "eplb", "--fail", "2@3")
    argv[argv.index("--slots-per-gpu") + 1] = "8"
    assert_user_error(argv, capsys, "each would need 10 slots")
