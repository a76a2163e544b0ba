"""Synthetic routing traces: presets, invariants of the trace format, and calibration to the papers.

The calibration tests fail if the generator loses a property the papers report: CRAFT's balanced and
high-skew layers, MoETuner's Mixtral top-2 share and cross-layer dependency, GRACE-MoE's co-activation,
Libra's per-GPU locality, and batch-to-batch drift.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import tiny_model_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moebalance.core.errors import InputError
from moebalance.models import MODELS, ModelSpec, get_model
from moebalance.workloads.stats import coactivation_strength, layer_skew, locality, transition_strength
from moebalance.workloads.synth import PROFILES, RoutingProfile, routing_profile, synthesize

# ----- models and profiles ---------------------------------------------------------------------------------


def test_every_model_has_a_routing_profile() -> None:
    required = {"deepseek-v3", "deepseek-r1", "kimi-k2", "qwen3-235b-a22b", "qwen3-30b-a3b", "glm-4.5",
                "mixtral-8x7b", "olmoe-1b-7b", "deepseek-v2-lite"}
    assert required <= set(MODELS)
    assert set(PROFILES) <= set(MODELS)
    for spec in MODELS.values():
        assert isinstance(routing_profile(spec), RoutingProfile)


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(InputError, match="known models: deepseek-r1, deepseek-v2-lite"):
        synthesize("nope", num_batches=1, tokens_per_batch=8, num_gpus=1, seed=0)


def test_routing_profile_validation() -> None:
    with pytest.raises(InputError, match="high_skew_fraction"):
        RoutingProfile(high_skew_fraction=1.5)
    with pytest.raises(InputError, match="pinned_hot"):
        RoutingProfile(pinned_hot=(0.99, 0.5))
    with pytest.raises(InputError, match="num_topics"):
        RoutingProfile(num_topics=0)


# ----- arguments -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"num_batches": 0}, "num_batches (0) must be a positive integer"),
    ({"tokens_per_batch": -5}, "tokens_per_batch (-5) must be a positive integer"),
    ({"num_gpus": 0}, "num_gpus (0) must be a positive integer"),
    ({"num_gpus": True}, "num_gpus (True)"),
    ({"seed": -1}, "seed (-1) must be an integer >= 0"),
    ({"seed": 1.5}, "seed (1.5)"),
])
def test_bad_arguments_teach(kwargs: dict[str, object], needle: str) -> None:
    args: dict[str, object] = dict(num_batches=2, tokens_per_batch=16, num_gpus=2, seed=0)
    args.update(kwargs)
    with pytest.raises(InputError) as info:
        synthesize("mixtral-8x7b", **args)  # type: ignore[arg-type]
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_huge_token_level_trace_is_refused() -> None:
    with pytest.raises(InputError, match="use fewer batches"):
        synthesize("deepseek-v3", num_batches=3000, tokens_per_batch=4096, num_gpus=8, seed=0, token_level=True)


# ----- invariants ------------------------------------------------------------------------------------------


def _check_counts(out: dict[str, np.ndarray], preset: ModelSpec, batches: int, tokens: int) -> None:
    counts = out["counts"]
    assert counts.dtype == np.int64
    assert counts.shape == (batches, preset.num_layers, preset.num_experts)
    assert np.all(counts.sum(axis=2) == tokens * preset.top_k)
    assert counts.min() >= 0 and counts.max() <= tokens
    assert out["preset"].shape == () and out["preset"].dtype.kind == "U" and str(out["preset"]) == preset.name


def _check_tokens(out: dict[str, np.ndarray], preset: ModelSpec, batches: int, tokens: int, gpus: int) -> None:
    ids, src, batch = out["topk_ids"], out["src_gpu"], out["batch"]
    n = batches * tokens
    assert ids.shape == (n, preset.num_layers, preset.top_k)
    assert ids.dtype == (np.int16 if preset.num_experts < 32768 else np.int32)
    assert ids.min() >= 0 and ids.max() < preset.num_experts
    ordered = np.sort(ids, axis=2)
    assert np.all(ordered[..., 1:] != ordered[..., :-1]), "a token picked one expert twice"
    assert src.dtype == np.int32 and src.shape == (n,) and src.min() >= 0 and src.max() < gpus
    assert batch.dtype == np.int32 and batch.shape == (n,) and np.all(np.diff(batch) >= 0)
    assert np.array_equal(np.bincount(batch, minlength=batches), np.full(batches, tokens))
    implied = np.zeros_like(out["counts"])
    np.add.at(implied, (batch[:, None, None], np.arange(preset.num_layers)[None, :, None], ids), 1)
    assert np.array_equal(implied, out["counts"])


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "mixtral-8x7b", "deepseek-v2-lite"])
def test_count_level_invariants(name: str) -> None:
    out = synthesize(name, num_batches=5, tokens_per_batch=96, num_gpus=4, seed=3)
    assert set(out) == {"counts", "preset"}
    _check_counts(out, get_model(name), 5, 96)


@pytest.mark.parametrize(("name", "batches", "tokens", "gpus"), [
    ("olmoe-1b-7b", 3, 100, 3),
    ("mixtral-8x7b", 2, 64, 64),
    ("deepseek-v2-lite", 1, 33, 5),
])
def test_token_level_invariants(name: str, batches: int, tokens: int, gpus: int) -> None:
    preset = get_model(name)
    out = synthesize(name, num_batches=batches, tokens_per_batch=tokens, num_gpus=gpus, seed=1, token_level=True)
    _check_counts(out, preset, batches, tokens)
    _check_tokens(out, preset, batches, tokens, gpus)
    # Token i of a batch lives on rank i * G // T: ranks are contiguous blocks of near-equal size.
    assert np.array_equal(out["src_gpu"][:tokens], np.arange(tokens) * gpus // tokens)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    experts=st.integers(1, 40),
    data=st.data(),
    layers=st.integers(1, 3),
    batches=st.integers(1, 3),
    tokens=st.integers(1, 40),
    gpus=st.integers(1, 6),
    seed=st.integers(0, 2**32),
    token_level=st.booleans(),
)
def test_invariants_hold_for_any_shape(experts: int, data: st.DataObject, layers: int, batches: int, tokens: int,
                                       gpus: int, seed: int, token_level: bool) -> None:
    top_k = data.draw(st.integers(1, experts), label="top_k")
    preset = tiny_model_spec(num_layers=layers, num_experts=experts, top_k=top_k)
    out = synthesize(preset, num_batches=batches, tokens_per_batch=tokens, num_gpus=gpus, seed=seed,
                     token_level=token_level)
    _check_counts(out, preset, batches, tokens)
    if token_level:
        _check_tokens(out, preset, batches, tokens, gpus)


@pytest.mark.parametrize("token_level", [False, True])
def test_deterministic_by_seed(token_level: bool) -> None:
    def run(seed: int) -> dict[str, np.ndarray]:
        return synthesize("olmoe-1b-7b", num_batches=3, tokens_per_batch=64, num_gpus=4, seed=seed,
                          token_level=token_level)

    first, again, other = run(7), run(7), run(8)
    assert first.keys() == again.keys()
    for key in first:
        assert np.array_equal(first[key], again[key])
    assert not np.array_equal(first["counts"], other["counts"])


@pytest.mark.parametrize("token_level", [False, True])
def test_progress_reports_every_batch(token_level: bool) -> None:
    done: list[int] = []
    synthesize("olmoe-1b-7b", num_batches=70, tokens_per_batch=16, num_gpus=2, seed=0, token_level=token_level,
               progress=done.append)
    assert sum(done) == 70 and all(n > 0 for n in done)


def test_per_layer_skew_depends_on_seed_only() -> None:
    """The layer classes and hot experts come from the seed, not from the trace length or GPU count."""
    a = synthesize("deepseek-v3", num_batches=4, tokens_per_batch=2048, num_gpus=8, seed=11)["counts"]
    b = synthesize("deepseek-v3", num_batches=9, tokens_per_batch=1024, num_gpus=32, seed=11)["counts"]
    hottest_a, hottest_b = a.sum(axis=0).argmax(axis=1), b.sum(axis=0).argmax(axis=1)
    skew_a, skew_b = layer_skew(a), layer_skew(b)
    high = skew_a.high_skew & skew_b.high_skew
    assert high.sum() >= 3
    assert np.array_equal(hottest_a[high], hottest_b[high])


# ----- calibration -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek_counts() -> np.ndarray:
    return synthesize("deepseek-v3", num_batches=32, tokens_per_batch=2048, num_gpus=64, seed=0)["counts"]


def test_deepseek_has_craft_layer_types(deepseek_counts: np.ndarray) -> None:
    """CRAFT Section 3.2, Observation 1: a balanced layer at ~2.5x peak/mean, a skewed one at >27x with the
    top two experts at ~20% of the load; high-skew (>10x) layers are a minority."""
    skew = layer_skew(deepseek_counts)
    assert skew.peak_to_mean.min() <= 3.0
    craft_51 = (skew.peak_to_mean >= 27.0) & (skew.top2_share >= 0.15) & (skew.top2_share <= 0.3)
    assert craft_51.any()
    num_layers = len(skew.peak_to_mean)
    assert 2 <= skew.high_skew.sum() <= num_layers // 3
    moderate = (skew.peak_to_mean > 3.0) & (skew.peak_to_mean <= 10.0)
    assert moderate.sum() > num_layers // 2


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_deepseek_calibration_holds_for_other_seeds(seed: int) -> None:
    skew = layer_skew(synthesize("deepseek-v3", num_batches=8, tokens_per_batch=1024, num_gpus=16,
                                 seed=seed)["counts"])
    assert skew.peak_to_mean.min() <= 3.0
    assert np.any((skew.peak_to_mean >= 27.0) & (skew.top2_share >= 0.15) & (skew.top2_share <= 0.3))


def test_kimi_has_craft_layer_51() -> None:
    """CRAFT's Figure 8(b) layers are Kimi-K2 (KE8): hottest expert >27x the mean, top two ~20%."""
    skew = layer_skew(synthesize("kimi-k2", num_batches=8, tokens_per_batch=2048, num_gpus=64, seed=0)["counts"])
    assert np.any((skew.peak_to_mean > 27.0) & (np.abs(skew.top2_share - 0.2) < 0.05))
    assert skew.peak_to_mean.min() <= 3.0


@pytest.mark.parametrize("token_level", [False, True])
def test_mixtral_top2_share_matches_moetuner(token_level: bool) -> None:
    """MoETuner Figure 4: in Mixtral's layer 14, experts 0 and 1 process 64% of the tokens."""
    counts = synthesize("mixtral-8x7b", num_batches=8, tokens_per_batch=512, num_gpus=8, seed=0,
                        token_level=token_level)["counts"]
    skew = layer_skew(counts)
    assert skew.top2_share.max() >= 0.55
    assert skew.top2_share.min() < 0.45  # not every layer is skewed


def test_token_level_matches_count_level_skew() -> None:
    """The count-only path is the mean-field of the token path: per-layer skew agrees."""
    kwargs = dict(num_batches=16, tokens_per_batch=512, num_gpus=8, seed=5)
    fast = layer_skew(synthesize("olmoe-1b-7b", **kwargs)["counts"])  # type: ignore[arg-type]
    slow = layer_skew(synthesize("olmoe-1b-7b", token_level=True, **kwargs)["counts"])  # type: ignore[arg-type]
    assert np.allclose(fast.top2_share, slow.top2_share, atol=0.03)
    assert np.corrcoef(fast.peak_to_mean, slow.peak_to_mean)[0, 1] > 0.9


def _greedy_placement(load: np.ndarray, num_gpus: int) -> np.ndarray:
    """GPU of every expert ``[L, E]``: heaviest expert to the least-loaded GPU with a free slot."""
    num_layers, num_experts = load.shape
    slots = num_experts // num_gpus
    gpu_of = np.empty(load.shape, dtype=np.int64)
    for layer in range(num_layers):
        gpu_load, used = np.zeros(num_gpus), np.zeros(num_gpus, dtype=np.int64)
        for expert in np.argsort(-load[layer], kind="stable"):
            g = int(np.argmin(np.where(used < slots, gpu_load, np.inf)))
            gpu_of[layer, expert] = g
            gpu_load[g] += load[layer, expert]
            used[g] += 1
    return gpu_of


def _balancedness(counts: np.ndarray, gpu_of: np.ndarray, num_gpus: int) -> float:
    """Mean over batches and layers of mean/max GPU load (docs/design.md, "Metrics")."""
    num_batches, num_layers, _ = counts.shape
    gpu_load = np.zeros((num_batches, num_layers, num_gpus))
    for layer in range(num_layers):
        for g in range(num_gpus):
            gpu_load[:, layer, g] = counts[:, layer, gpu_of[layer] == g].sum(axis=1)
    return float(np.mean(gpu_load.mean(axis=2) / gpu_load.max(axis=2)))


def test_drift_makes_stale_plans_worse() -> None:
    """A plan made on the first half of the batches loses balance on the second half; without drift it
    loses (almost) nothing, so the loss is the drift's doing, not sampling noise."""
    preset, gpus = get_model("deepseek-v2-lite"), 8
    gaps = {}
    for sigma in (0.3, 0.0):
        profile = dataclasses.replace(routing_profile(preset), drift_sigma=sigma)
        counts = synthesize(preset, num_batches=400, tokens_per_batch=512, num_gpus=8, seed=0,
                            profile=profile)["counts"]
        first, second = counts[:200], counts[200:]
        stale = _balancedness(second, _greedy_placement(first.sum(axis=0), gpus), gpus)
        fresh = _balancedness(second, _greedy_placement(second.sum(axis=0), gpus), gpus)
        gaps[sigma] = fresh - stale
        if sigma > 0:
            assert layer_skew(counts).drift.min() > 0
            assert not np.array_equal(first.sum(axis=0) / 200, second.sum(axis=0) / 200)
    assert gaps[0.3] > 0.01
    assert gaps[0.3] > 3 * max(gaps[0.0], 0.001)


@pytest.fixture(scope="module")
def olmoe_trace() -> dict[str, np.ndarray]:
    return synthesize("olmoe-1b-7b", num_batches=32, tokens_per_batch=512, num_gpus=8, seed=0, token_level=True)


def test_coactivation_above_shuffled_control(olmoe_trace: dict[str, np.ndarray]) -> None:
    """GRACE-MoE Section 3: experts are co-activated, not picked independently. Shuffling each top-k slot
    across tokens keeps the loads and destroys the affinity."""
    ids = olmoe_trace["topk_ids"]
    rng = np.random.default_rng(0)
    control = np.stack([ids[rng.permutation(len(ids)), :, j] for j in range(ids.shape[2])], axis=2)
    mi, mi_control = coactivation_strength(ids, 64), coactivation_strength(control, 64)
    assert np.all(mi > 3 * mi_control)
    assert mi.mean() > 10 * mi_control.mean()


def test_cross_layer_dependency_above_shuffled_control(olmoe_trace: dict[str, np.ndarray]) -> None:
    """MoETuner Section 3.2: a token's expert in layer l makes some experts of layer l+1 more likely.
    Shuffling tokens independently per layer keeps every layer's picks and destroys the dependency."""
    ids = olmoe_trace["topk_ids"]
    rng = np.random.default_rng(0)
    control = np.stack([ids[rng.permutation(len(ids)), layer] for layer in range(ids.shape[1])], axis=1)
    mi, mi_control = transition_strength(ids, 64), transition_strength(control, 64)
    assert mi.shape == (ids.shape[1] - 1,)
    assert np.all(mi > 3 * mi_control)
    assert mi.mean() > 10 * mi_control.mean()


def test_mixtral_transitions_are_predominant() -> None:
    """MoETuner Figure 6: tokens of one Mixtral expert in layer 14 go predominantly to one expert of 15."""
    ids = synthesize("mixtral-8x7b", num_batches=8, tokens_per_batch=512, num_gpus=8, seed=0,
                     token_level=True)["topk_ids"]
    joint = np.zeros((8, 8))
    np.add.at(joint, (ids[:, 14, 0], ids[:, 15, 0]), 1)
    follow = joint / joint.sum(axis=1, keepdims=True)
    assert follow.max(axis=1).max() > 0.5  # uniform would be 1/8; the most likely next expert dominates


def test_per_gpu_locality_above_shuffled_control(olmoe_trace: dict[str, np.ndarray]) -> None:
    """Libra: each GPU has its own local hot experts. Shuffling tokens across GPUs removes that."""
    ids, src = olmoe_trace["topk_ids"], olmoe_trace["src_gpu"]
    shuffled = np.random.default_rng(0).permutation(src)
    loc, loc_control = locality(ids, src, 64), locality(ids, shuffled, 64)
    assert np.all(loc > 2 * loc_control)
    assert loc.mean() > 4 * loc_control.mean()
