"""The vLLM plug-in: moebalance behind vLLM's EPLB policy interface.

vLLM cannot be installed here (its wheels pin another torch and need CUDA packages), so its interface is pinned
from the source read (vllm-project/vllm ``vllm/distributed/eplb/policy/abstract.py``, ``default.py``,
``__init__.py``; ``vllm/plugins/__init__.py``): the classmethod ``rebalance_experts(weight [L, E], num_replicas,
num_groups, num_nodes, num_ranks, old_global_expert_indices=None) -> phy2log [L, P]`` of newer releases, the
five-argument form returning ``(phy2log, log2phy, logcnt)`` of older ones, the ``EPLB_POLICIES`` registry whose
``"default"`` entry vLLM's EPLB uses, and the ``vllm.general_plugins`` entry-point group. The registry tests
build a module of that shape under ``vllm.distributed.eplb.policy``.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import types
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from moebalance.core.errors import InputError
from moebalance.engines import vllm_plugin
from moebalance.engines.vllm_plugin import (
    balancedness,
    fill_empty,
    keep_slots,
    make_policy,
    move_aware,
    returns_tuple,
)
from moebalance.eplb import rebalance_experts

L, E, P, R = 3, 16, 24, 4  # 3 MoE layers of 16 experts, 24 slots on 4 ranks


def _weight(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(L, E, generator=g) ** 4 * 1000).round()


def _moves(old: np.ndarray, new: np.ndarray) -> int:
    """Copies a rank must load: experts in a rank's new block that its old block lacks (multisets)."""
    S = P // R
    total = 0
    for a, b in zip(old.reshape(-1, S), new.reshape(-1, S), strict=True):
        have = list(a)
        for e in b:
            if e in have:
                have.remove(e)
            else:
                total += 1
    return total


def test_signature_is_vllms() -> None:
    cls = make_policy("eplb")
    params = list(inspect.signature(cls.rebalance_experts).parameters)
    assert params == ["weight", "num_replicas", "num_groups", "num_nodes", "num_ranks", "old_global_expert_indices"]
    assert inspect.signature(cls.rebalance_experts).parameters["old_global_expert_indices"].default is None


def test_eplb_variant_is_the_reference() -> None:
    w = _weight(0)
    got = make_policy("eplb").rebalance_experts(w, P, 4, 1, R)
    assert got.dtype == torch.int64 and got.shape == (L, P)
    assert torch.equal(got, rebalance_experts(w, P, 4, 1, R)[0])


def test_no_duplicates_variant() -> None:
    w = _weight(1)
    plain = make_policy("eplb").rebalance_experts(w, P, 1, 1, R).numpy()
    fixed = make_policy("eplb-no-duplicates").rebalance_experts(w, P, 1, 1, R).numpy()
    S = P // R

    def dups(m: np.ndarray) -> int:
        return sum(len(b) - len(set(b)) for b in m.reshape(-1, S).tolist())

    assert dups(fixed) < dups(plain) or dups(plain) == 0
    assert dups(fixed) == 0
    for layer in range(L):  # the same copies of every expert, moved between GPUs only
        assert np.array_equal(np.bincount(fixed[layer], minlength=E), np.bincount(plain[layer], minlength=E))


def test_move_aware_keeps_a_good_placement_and_moves_little_otherwise() -> None:
    w = _weight(2)
    policy = make_policy("move-aware")
    fresh = policy.rebalance_experts(w, P, 1, 1, R)
    # the current placement is the fresh plan with ranks relabelled: as balanced, so nothing moves
    relabelled = fresh.reshape(L, R, -1)[:, [2, 0, 3, 1]].reshape(L, P)
    assert torch.equal(policy.rebalance_experts(w, P, 1, 1, R, relabelled), relabelled)
    # a poor placement (experts in id order, redundant slots on the hottest experts of layer 0 only) is replaced
    old = np.tile(np.concatenate([np.arange(E), np.arange(P - E)]), (L, 1))
    assert (balancedness(old, w.double().numpy(), R) < 0.9 * balancedness(fresh.numpy(), w.double().numpy(), R)).all()
    got = policy.rebalance_experts(w, P, 1, 1, R, torch.from_numpy(old)).numpy()
    wn = w.double().numpy()
    np.testing.assert_allclose(balancedness(got, wn, R), balancedness(fresh.numpy(), wn, R))  # as balanced as fresh
    assert _moves(old, got) <= _moves(old, fresh.numpy())  # and no more moves than taking the fresh plan as it is
    for layer in range(L):  # an expert that stays on its rank stays in its slot
        for r in range(R):
            o, n = old[layer, r * 6:(r + 1) * 6], got[layer, r * 6:(r + 1) * 6]
            for i in range(6):
                if o[i] in n:
                    assert n[i] == o[i] or list(n).count(o[i]) < list(o).count(o[i])


def _placement(phy2log: np.ndarray, num_ranks: int) -> Any:
    """The plan ``phy2log [L, P]`` as a :class:`Placement`: rank ``r`` holds its block of ``P / R`` slots."""
    from moebalance.core.cluster import Cluster
    from moebalance.core.plan import Placement

    return Placement(phy2log.reshape(phy2log.shape[0], num_ranks, -1).tolist(), int(phy2log.max()) + 1,
                     Cluster(num_nodes=1, gpus_per_node=num_ranks))


def test_move_aware_lays_the_fresh_plan_as_align_does() -> None:
    """4 experts of load 1, 2 ranks of 3 slots. Old map [2, 0, 3 | 1, 0, 0] (copies 3, 1, 1, 1: rank loads
    1/3 + 1 + 1 = 7/3 and 2/3 + 1 = 5/3, balancedness 2 / (7/3) = 6/7). Fresh [1, 2, 1 | 3, 0, 0] (copies 2, 2, 1, 1:
    loads 2 and 2, balancedness 1), so the old map is replaced. Experts kept: rank 0 ({0, 2, 3}) taking block 0
    ({1, 2}) keeps 1, rank 1 ({0, 1}) taking block 1 ({0, 3}) keeps 1: 2; exchanged, rank 0 keeps {0, 3} and rank 1
    keeps {1}: 3, the best, not the identity. Rank 0 gets [3, 0, 0] with 0 in its old slot 1, 3 in its old slot 2
    and the second 0 in slot 0: [0, 0, 3]; rank 1 gets [1, 2, 1] with 1 in slot 0: [1, 2, 1]. One expert is
    received (2 on rank 1). Before: the plug-in counted copies (rank 1 "keeps" both 0s), found a tie and kept the
    identity [2, 1, 1 | 3, 0, 0], receiving 1 on rank 0 and 3 on rank 1."""
    from moebalance.algorithms.migration import align

    old, fresh, w = np.array([[2, 0, 3, 1, 0, 0]]), np.array([[1, 2, 1, 3, 0, 0]]), np.ones((1, 4))
    np.testing.assert_allclose(balancedness(old, w, 2), [6 / 7])
    np.testing.assert_allclose(balancedness(fresh, w, 2), [1.0])
    got = move_aware(old, fresh, w, 2, 0.02)
    assert got.tolist() == [[0, 0, 3, 1, 2, 1]]
    aligned = align(_placement(old, 2), _placement(fresh, 2))
    assert [[list(r) for r in layer] for layer in aligned.gpu_experts] == [[[0, 0, 3], [1, 2, 1]]]
    # through vLLM's interface, with the fresh plan EPLB's: every layer replaced is align's
    wt = _weight(8)
    fresh = make_policy("eplb").rebalance_experts(wt, P, 1, 1, R).numpy()
    old = np.tile(np.concatenate([np.arange(E), np.arange(P - E)]), (L, 1))
    assert (balancedness(old, wt.double().numpy(), R) < 0.98 * balancedness(fresh, wt.double().numpy(), R)).all()
    got = make_policy("move-aware").rebalance_experts(wt, P, 1, 1, R, torch.from_numpy(old)).numpy()
    want = np.array(align(_placement(old, R), _placement(fresh, R)).gpu_experts).reshape(L, P)
    assert np.array_equal(got, want) and not np.array_equal(got, keep_slots(old, fresh, R))


def test_move_aware_keeps_hierarchical_node_packing() -> None:
    """2 nodes x 2 ranks of 2 slots, 8 experts of load [8, 8, 1, 1, 1, 1, 1, 1], old map [0 1 | 2 3 || 4 5 | 6 7]
    (rank 0 carries 16). The fresh hierarchical plan packs A = [0 2], B = [4 5] on node 0 and C = [1 3], D = [6 7]
    on node 1 (busiest rank 9), so the old map is replaced. Rank by rank the best matching keeps 6 in place (rank 0
    takes A or C: 1 kept, rank 1 the other: 1, rank 2 B: 2, rank 3 D: 2) but puts A and C on node 0, splitting both
    fresh nodes. Node by node, node 0 takes fresh node 0 (A, B: 1 kept) or fresh node 1 (C, D: 1 kept) and node 1
    the other (2 kept): 3 kept, and each node holds one fresh node's experts."""
    old = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])
    fresh = np.array([[0, 2, 4, 5, 1, 3, 6, 7]])
    w = np.array([[8.0, 8, 1, 1, 1, 1, 1, 1]])
    packed = sorted([[0, 2, 4, 5], [1, 3, 6, 7]])
    flat = move_aware(old, fresh, w, 4, 0.02)
    assert int((flat == old).sum()) == 6
    assert sorted([sorted(flat[0, :4].tolist()), sorted(flat[0, 4:].tolist())]) != packed
    nodes = move_aware(old, fresh, w, 4, 0.02, num_nodes=2)
    assert sorted([sorted(nodes[0, :4].tolist()), sorted(nodes[0, 4:].tolist())]) == packed
    assert int((nodes == old).sum()) == 3
    # through vLLM's interface: 2 groups on 2 nodes is hierarchical EPLB; every node holds whole groups
    wt = torch.tensor(w)
    fresh_h = make_policy("eplb").rebalance_experts(wt, 8, 2, 2, 4).numpy()
    got = make_policy("move-aware").rebalance_experts(wt, 8, 2, 2, 4, torch.from_numpy(old)).numpy()
    for half in (slice(0, 4), slice(4, 8)):
        assert sorted(got[0, half].tolist()) in (sorted(fresh_h[0, :4].tolist()), sorted(fresh_h[0, 4:].tolist()))


def test_move_aware_tolerance(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _weight(3)
    wn = w.double().numpy()
    fresh = make_policy("eplb").rebalance_experts(w, P, 1, 1, R).numpy()
    old = np.tile(np.concatenate([np.arange(E), np.arange(P - E)]), (L, 1))
    ratio = float((balancedness(old, wn, R) / balancedness(fresh, wn, R)).max())
    monkeypatch.setenv(vllm_plugin.TOLERANCE_ENV, str(1.0 - ratio + 1e-6))  # loose enough for the best layer
    got = make_policy("move-aware").rebalance_experts(w, P, 1, 1, R, torch.from_numpy(old)).numpy()
    best = int(np.argmax(balancedness(old, wn, R) / balancedness(fresh, wn, R)))
    assert np.array_equal(got[best], old[best])
    monkeypatch.setenv(vllm_plugin.TOLERANCE_ENV, "2")
    with pytest.raises(InputError, match="must be in"):
        make_policy("move-aware")
    # elastic EP changed the slot count: the old map says nothing about the new slots, the fresh plan is taken
    assert np.array_equal(move_aware(old[:, :P - 4], fresh, wn, R, 0.02), fresh)


def test_unknown_variant() -> None:
    with pytest.raises(InputError, match="MOEBALANCE_VLLM_EPLB='nope' is not a moebalance EPLB variant"):
        make_policy("nope")


def test_entry_point_is_declared() -> None:
    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "moebalance_eplb"]
    assert len(found) == 1 and found[0].value == "moebalance.engines.vllm_plugin:register"
    assert found[0].load() is vllm_plugin.register


@pytest.fixture
def vllm_registry() -> Iterator[dict[str, Any]]:
    """A module shaped as vLLM's ``vllm.distributed.eplb.policy`` (the registry and the abstract class)."""
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    mod = types.ModuleType("vllm.distributed.eplb.policy")

    class AbstractEplbPolicy:
        pass

    class DefaultEplbPolicy(AbstractEplbPolicy):
        @classmethod
        def rebalance_experts(cls, weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                              old_global_expert_indices: Any = None) -> Any:
            raise NotImplementedError

    mod.AbstractEplbPolicy = AbstractEplbPolicy  # type: ignore[attr-defined]
    mod.EPLB_POLICIES = {"default": DefaultEplbPolicy}  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.distributed", "vllm.distributed.eplb"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["vllm.distributed.eplb"].policy = mod  # type: ignore[attr-defined]
    sys.modules["vllm.distributed.eplb.policy"] = mod
    yield mod.EPLB_POLICIES  # type: ignore[attr-defined]
    for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_register_does_nothing_unless_asked(vllm_registry: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    before = vllm_registry["default"]
    vllm_plugin.register()
    assert vllm_registry["default"] is before


def test_register_replaces_the_default_policy(vllm_registry: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_plugin.ENV, "eplb")
    vllm_plugin.register()
    cls = vllm_registry["default"]
    assert cls.variant == "eplb" and issubclass(cls, sys.modules["vllm.distributed.eplb.policy"].AbstractEplbPolicy)
    w = _weight(4)
    assert torch.equal(cls.rebalance_experts(w, P, 1, 1, R), rebalance_experts(w, P, 1, 1, R)[0])


def test_register_on_an_older_vllm_returns_the_three_maps(vllm_registry: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    class Old:
        @classmethod
        def rebalance_experts(cls, weight: Any, num_replicas: int, num_groups: int, num_nodes: int,
                              num_ranks: int) -> Any:
            raise NotImplementedError

    vllm_registry["default"] = Old
    monkeypatch.setenv(vllm_plugin.ENV, "eplb")
    vllm_plugin.register()
    w = _weight(5)
    got = vllm_registry["default"].rebalance_experts(w, P, 1, 1, R)
    want = rebalance_experts(w, P, 1, 1, R)
    assert len(got) == 3
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    for layer in range(L):  # the same slots per expert (the reference orders a replica's slots by rank)
        for e in range(E):
            assert sorted(x for x in got[1][layer, e].tolist() if x >= 0) == \
                sorted(x for x in want[1][layer, e].tolist() if x >= 0)


def test_every_variant_keeps_staying_experts_in_their_slots() -> None:
    w = _weight(6)
    fresh = make_policy("eplb").rebalance_experts(w, P, 1, 1, R).numpy()
    rng = np.random.default_rng(0)
    old = fresh.copy()
    for layer in range(L):  # the same sets per rank, shuffled within each rank's block
        for r in range(R):
            rng.shuffle(old[layer, r * 6:(r + 1) * 6])
    got = make_policy("eplb").rebalance_experts(w, P, 1, 1, R, torch.from_numpy(old)).numpy()
    assert np.array_equal(got, old)  # nothing moves, not even within a GPU
    assert np.array_equal(keep_slots(old, fresh, R), old)


def test_returns_tuple_reads_the_three_forms() -> None:
    class Five:
        @classmethod
        def rebalance_experts(cls, weight: Any, num_replicas: int, num_groups: int, num_nodes: int,
                              num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            raise NotImplementedError

    class SixTuple:  # the release that passes the old map and still unpacks three tensors
        @classmethod
        def rebalance_experts(cls, weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                              old_global_expert_indices: torch.Tensor | None = None,
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            raise NotImplementedError

    class SixMap:
        @classmethod
        def rebalance_experts(cls, weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                              old_global_expert_indices: torch.Tensor | None = None) -> torch.Tensor:
            raise NotImplementedError

    assert returns_tuple(Five) and returns_tuple(SixTuple) and not returns_tuple(SixMap)


def test_register_on_the_six_argument_tuple_release(vllm_registry: dict[str, Any],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    class SixTuple:
        @classmethod
        def rebalance_experts(cls, weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                              old_global_expert_indices: Any = None) -> tuple[Any, Any, Any]:
            raise NotImplementedError

    vllm_registry["default"] = SixTuple
    monkeypatch.setenv(vllm_plugin.ENV, "eplb")
    vllm_plugin.register()
    w = _weight(7)
    old = rebalance_experts(w, P, 1, 1, R)[0]
    phy2log, log2phy, logcnt = vllm_registry["default"].rebalance_experts(w, P, 1, 1, R, old)  # positional, as called
    assert torch.equal(phy2log, old) and log2phy.shape[:2] == (L, E) and logcnt.shape == (L, E)


@pytest.fixture
def old_vllm() -> Iterator[None]:
    """An older vLLM: ``vllm.distributed.eplb`` without the policy package."""
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for name in ("vllm", "vllm.distributed", "vllm.distributed.eplb"):
        sys.modules[name] = types.ModuleType(name)
    yield
    for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_register_without_vllm_policies_says_what_is_needed(old_vllm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_plugin.ENV, "eplb")
    with pytest.raises(InputError, match="needs a vLLM whose EPLB has pluggable policies") as exc:
        vllm_plugin.register()
    assert "\n" not in str(exc.value)


def test_a_wrong_variant_is_named_whatever_vllm_is_installed(old_vllm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the import error for the old vLLM came first and never said that 'bogus' is no variant."""
    monkeypatch.setenv(vllm_plugin.ENV, "bogus")
    with pytest.raises(InputError, match="MOEBALANCE_VLLM_EPLB='bogus' is not a moebalance EPLB variant; choose one "
                                         "of: eplb, eplb-no-duplicates, move-aware"):
        vllm_plugin.register()


def test_a_policy_module_without_the_registry(monkeypatch: pytest.MonkeyPatch,
                                              vllm_registry: dict[str, Any]) -> None:
    """Before: a raw AttributeError."""
    del sys.modules["vllm.distributed.eplb.policy"].EPLB_POLICIES  # type: ignore[attr-defined]
    monkeypatch.setenv(vllm_plugin.ENV, "eplb")
    with pytest.raises(InputError, match="has no EPLB_POLICIES"):
        vllm_plugin.register()


def test_register_logs_the_variant(vllm_registry: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(vllm_plugin.ENV, "move-aware")
    with caplog.at_level(logging.INFO, logger="moebalance"):
        vllm_plugin.register()
    (record,) = [r for r in caplog.records if r.name == "moebalance"]
    assert record.levelno == logging.INFO
    assert record.getMessage() == ("vLLM's EPLB policy 'default' (DefaultEplbPolicy) replaced by moebalance's "
                                   "move-aware (MOEBALANCE_VLLM_EPLB=move-aware)")


def test_an_empty_variant_is_ignored_with_a_warning(vllm_registry: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    before = vllm_registry["default"]
    monkeypatch.setenv(vllm_plugin.ENV, "")  # set but empty: `export MOEBALANCE_VLLM_EPLB=`
    with caplog.at_level(logging.INFO, logger="moebalance"):
        vllm_plugin.register()
    assert vllm_registry["default"] is before
    (record,) = [r for r in caplog.records if r.name == "moebalance"]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == ("MOEBALANCE_VLLM_EPLB is set but empty, so it is ignored and vLLM's EPLB policy "
                                   "stays its own; set it to one of eplb, eplb-no-duplicates, move-aware, or unset it")
    caplog.clear()
    monkeypatch.delenv(vllm_plugin.ENV)  # unset: nothing to say
    with caplog.at_level(logging.INFO, logger="moebalance"):
        vllm_plugin.register()
    assert [r for r in caplog.records if r.name == "moebalance"] == []


def test_skipped_says_when_vllm_plugins_leaves_it_out() -> None:
    env = {vllm_plugin.ENV: "eplb", "VLLM_PLUGINS": "other_plugin"}
    assert "VLLM_PLUGINS='other_plugin' does not name 'moebalance_eplb'" in (vllm_plugin.skipped(env) or "")
    assert vllm_plugin.skipped({**env, "VLLM_PLUGINS": "other_plugin, moebalance_eplb"}) is None
    assert vllm_plugin.skipped({vllm_plugin.ENV: "eplb"}) is None  # unset: vLLM loads every plug-in
    assert vllm_plugin.skipped({"VLLM_PLUGINS": ""}) is None  # not asked for: nothing to say
    assert vllm_plugin.ENTRY_POINT in {ep.name for ep in entry_points(group="vllm.general_plugins")}


# ----- elastic scale-up: vLLM marks the new slots -1 ---------------------------------------------------------------
# 4 experts, 2 ranks of 2 slots scaled up to 3 ranks: the current map [0, 1, 2, 3, -1, -1].
SCALED = np.array([[0, 1, 2, 3, -1, -1]])


def test_move_aware_fills_the_new_slots_and_keeps_a_balanced_map() -> None:
    """Load [4, 3, 2, 1]. The empty slots 4 and 5 (rank 2) are filled with the most load per copy: expert 0 (4), then
    expert 1 (3 > 2 = 4/2): [0, 1, 2, 3, 0, 1], ranks loading 2 + 1.5, 2 + 1, 2 + 1.5: balancedness (10/3) / 3.5.
    A fresh EPLB plan (copies of 0 and 1; slots of 2, 1.5, 2, 1, 2, 1.5 packed in pairs) peaks at 3.5 too, so the
    current map is kept and nothing already placed moves. Before, -1 was read as expert 3 (three copies, so the
    map looked unbalanced: 7 on rank 0) and the map was replaced by the fresh plan [0, 1, 2, 1, 0, 3]."""
    w = np.array([[4.0, 3.0, 2.0, 1.0]])
    got = make_policy("move-aware").rebalance_experts(torch.from_numpy(w), 6, 1, 1, 3, torch.from_numpy(SCALED))
    assert got.tolist() == [[0, 1, 2, 3, 0, 1]]
    np.testing.assert_allclose(balancedness(got.numpy(), w, 3), [(10 / 3) / 3.5])


def test_move_aware_never_returns_an_empty_slot_on_an_idle_window() -> None:
    """No load: every map is as balanced as any other and the current one is kept, with its empty slots filled
    round the experts in id order (all have one copy: 0, then 1, as rank 2 now holds 0). Before: [0, 1, 2, 3, -1, -1]
    came back as it was."""
    got = make_policy("move-aware").rebalance_experts(torch.zeros(1, 4), 6, 1, 1, 3, torch.from_numpy(SCALED))
    assert got.tolist() == [[0, 1, 2, 3, 0, 1]]


def test_fill_empty_places_missing_experts_first() -> None:
    """[-1, -1, 2, 3] lacks experts 0 and 1 (no load): they come first, whatever the load of 2 and 3; a slot never
    takes an expert its rank holds while another is left."""
    assert fill_empty(np.array([[-1, -1, 2, 3]]), np.array([[0.0, 0.0, 1.0, 9.0]]), 2).tolist() == [[0, 1, 2, 3]]
    assert fill_empty(np.array([[3, -1, 2, 1], [0, 1, 2, 3]]), np.array([[1.0, 1.0, 1.0, 9.0]] * 2), 2).tolist() == \
        [[3, 0, 2, 1], [0, 1, 2, 3]]  # expert 0 is missing; layers without an empty slot are left as they are
    with pytest.raises(InputError, match="old_global_expert_indices holds -2"):
        make_policy("eplb").rebalance_experts(torch.ones(1, 4), 4, 1, 1, 2, torch.tensor([[0, 1, 2, -2]]))


def test_move_aware_replaces_a_scaled_up_map_keeping_what_it_holds() -> None:
    """Load [4, 3, 2, 1] on 2 ranks of 2 slots; the current map [0, 1 | 2, -1] lacks expert 3. Filled, [0, 1 | 2, 3]
    loads 7 and 3 (balancedness 5/7) against a fresh [1, 2 | 0, 3] loading 5 and 5, so the fresh plan is laid on.
    Rank 0 holds {0, 1}, rank 1 {2} (the empty slot holds nothing): as laid out they keep 1 (expert 1), exchanged 2
    (0 on rank 0, 2 on rank 1). Rank 0 gets [0, 3] (0 in its slot 0), rank 1 [2, 1] (2 in its slot 0). Through the
    policy, EPLB's fresh plan is [0, 3 | 1, 2] (0 and 3, 1 and 2 paired: 5 and 5), which keeps 0 and 2 as laid out:
    the same map."""
    w = np.array([[4.0, 3.0, 2.0, 1.0]])
    got = make_policy("move-aware").rebalance_experts(torch.from_numpy(w), 4, 1, 1, 2, torch.tensor([[0, 1, 2, -1]]))
    assert got.tolist() == [[0, 3, 2, 1]]
    assert move_aware(np.array([[0, 1, 2, -1]]), np.array([[1, 2, 0, 3]]), w, 2, 0.02).tolist() == [[0, 3, 2, 1]]


def test_a_scale_down_keeps_the_surviving_ranks_slots() -> None:
    """vLLM's elastic scale-down from 4 ranks of 2 slots to 2 passes the old map of 8 slots and asks for 4; ranks 0
    and 1 stay. Equal loads on 4 experts, old map [0, 1 | 2, 3 | 0, 1 | 2, 3]: the survivors' blocks [0, 1 | 2, 3]
    hold every expert and are perfectly balanced, so move-aware keeps them, slot for slot (a fresh plan taken as it
    is would move experts for nothing). With survivors [0, 0 | 1, 1] of 3 experts (expert 2 lived on the released
    rank), the fresh plan is laid on: each survivor keeps its expert in its old slot 0."""
    w = torch.ones(1, 4)
    old = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    assert make_policy("move-aware").rebalance_experts(w, 4, 1, 1, 2, old).tolist() == [[0, 1, 2, 3]]
    assert vllm_plugin.surviving(old.numpy(), np.zeros((1, 4), dtype=np.int64), 2).tolist() == [[0, 1, 2, 3]]
    got = make_policy("move-aware").rebalance_experts(torch.ones(1, 3), 4, 1, 1, 2,
                                                      torch.tensor([[0, 0, 1, 1, 2, 2]])).numpy()
    assert got[0, 0] == 0 and got[0, 2] == 1 and sorted(set(got[0].tolist())) == [0, 1, 2]
    # eplb keeps the survivors' slots too, as vLLM's default policy does: experts staying on a rank stay put
    kept = make_policy("eplb").rebalance_experts(w, 4, 1, 1, 2, old).numpy()
    fresh = make_policy("eplb").rebalance_experts(w, 4, 1, 1, 2).numpy()
    assert kept.tolist() == keep_slots(old.numpy()[:, :4], fresh, 2).tolist()


def test_each_call_is_recorded_for_watch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """With ``MOEBALANCE_RECORD_DIR`` set, a call writes the window, both maps and the copies received as a record;
    ``moebalance watch`` reads it, taking its new map as the placement in service."""
    from conftest import run_cli

    from moebalance.core.load import read_load

    w = _weight(3)
    old = make_policy("eplb").rebalance_experts(_weight(4), P, 1, 1, R).numpy()
    monkeypatch.setenv(vllm_plugin.RECORD_ENV, str(tmp_path))
    new = make_policy("move-aware").rebalance_experts(w, P, 1, 1, R, torch.from_numpy(old)).numpy()
    (path,) = sorted(tmp_path.glob("vllm-eplb-*.npz"))
    with np.load(path, allow_pickle=False) as doc:
        assert np.array_equal(doc["new_map"], new) and np.array_equal(doc["old_map"], old)
        received = sum(len(set(new[layer, r * 6:(r + 1) * 6]) - set(old[layer, r * 6:(r + 1) * 6]))
                       for layer in range(L) for r in range(R))
        assert int(doc["moved"]) == received and int(doc["num_ranks"]) == R and str(doc["variant"]) == "move-aware"
    assert np.array_equal(read_load(path).counts, w.numpy().astype(np.int64)[None])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    log = tmp_path / "watch.jsonl"
    rc, _, err = run_cli(["watch", tmp_path, "--nodes", 1, "--gpus-per-node", R, "--slots-per-gpu", P // R, "--once",
                          "--log", log], capsys)
    assert rc == 0, err
    (doc,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert doc["record"] == path.name and doc["drift"] == 0.0  # planned on this very window
    assert doc["balancedness_mean"] == pytest.approx(float(balancedness(new, w.numpy(), R).mean()), rel=1e-6)
