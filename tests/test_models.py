"""Real-model specs: lookup, validation, agreement with the synthetic traces, and ``LoadMatrix.model``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import tiny_model_spec

from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix, read_load
from moebalance.models import MODELS, ModelSpec, get_model
from moebalance.workloads.synth import PROFILES, synthesize


def test_spot_checks_against_config_json() -> None:
    v3 = get_model("deepseek-v3")
    assert (v3.num_layers, v3.num_dense_layers, v3.num_experts, v3.top_k) == (58, 3, 256, 8)
    assert (v3.hidden_size, v3.moe_intermediate_size, v3.num_shared_experts, v3.num_groups) == (7168, 2048, 1, 8)
    r1 = get_model("deepseek-r1")
    assert dataclasses.replace(r1, name=v3.name, display_name=v3.display_name, source=v3.source) == v3
    k2 = get_model("kimi-k2")
    assert (k2.num_layers, k2.num_dense_layers, k2.num_experts, k2.top_k, k2.num_groups) == (60, 1, 384, 8, 1)
    glm = get_model("glm-4.5")
    assert (glm.num_layers, glm.num_experts, glm.hidden_size, glm.moe_intermediate_size) == (89, 160, 5120, 1536)
    mix = get_model("mixtral-8x7b")
    assert (mix.num_layers, mix.num_dense_layers, mix.num_experts, mix.top_k) == (32, 0, 8, 2)
    assert mix.moe_intermediate_size == 14336
    lite = get_model("deepseek-v2-lite")
    assert (lite.num_layers, lite.num_dense_layers, lite.num_experts, lite.top_k) == (26, 1, 64, 6)
    assert lite.num_shared_experts == 2
    assert get_model("qwen3-235b-a22b").num_layers == 94
    assert get_model("qwen3-30b-a3b").hidden_size == 2048
    assert get_model("olmoe-1b-7b").moe_intermediate_size == 1024


def test_registry_is_consistent() -> None:
    assert set(PROFILES) <= set(MODELS)
    for name, spec in MODELS.items():
        assert isinstance(spec, ModelSpec) and spec.name == name
        assert spec.source.startswith("https://huggingface.co/")
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.top_k = 1  # type: ignore[misc]


def test_unknown_model_is_one_line_naming_the_known_ones() -> None:
    with pytest.raises(InputError) as info:
        get_model("gpt-oss")
    message = str(info.value)
    assert "\n" not in message and "'gpt-oss'" in message and "known models:" in message
    assert all(name in message for name in MODELS)


@pytest.mark.parametrize(("changes", "needle"), [
    ({"top_k": 9}, "top_k (9) must be at most num_experts (8)"),
    ({"num_groups": 3}, "num_experts (8) must be divisible by num_groups (3)"),
    ({"num_layers": 0}, "num_layers (0)"),
    ({"num_dense_layers": -1}, "num_dense_layers (-1) must be an integer >= 0"),
    ({"num_shared_experts": -1}, "num_shared_experts"),
    ({"name": ""}, "ModelSpec.name"),
    ({"num_experts": 8.0}, "num_experts (8.0)"),
])
def test_spec_validation(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(InputError) as info:
        tiny_model_spec(**changes)
    assert needle in str(info.value)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_synthetic_trace_has_its_spec_shape(name: str) -> None:
    spec = get_model(name)
    out = synthesize(name, num_batches=1, tokens_per_batch=32, num_gpus=2, seed=0)
    assert out["counts"].shape == (1, spec.num_layers, spec.num_experts)
    assert np.all(out["counts"].sum(axis=2) == 32 * spec.top_k)
    load = LoadMatrix.from_arrays(out)
    assert load.preset == name and load.model is spec


def test_load_model_of_a_bundled_trace() -> None:
    load = read_load("bundled:mixtral-8x7b-tokens")
    assert load.model is get_model("mixtral-8x7b")
    assert (load.num_layers, load.num_experts) == (load.model.num_layers, load.model.num_experts)
    assert load.trace is not None and load.trace.topk_ids.shape[2] == load.model.top_k
    assert read_load("bundled:deepseek-v3-8x8").model is get_model("deepseek-v3")


def test_load_model_is_none_without_a_known_name() -> None:
    counts = np.ones((1, 2, 4), dtype=np.int64)
    assert LoadMatrix(counts).model is None
    assert LoadMatrix(counts, preset="my-private-model").model is None
    # the name survives a round trip even when no spec matches
    assert LoadMatrix.from_arrays(LoadMatrix(counts, preset="x").to_arrays()).preset == "x"
