"""Real-model specs: lookup, validation (the shared field checker, also used by the trained LM's config),
agreement with the synthetic traces, and ``LoadMatrix.model``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import tiny_model_spec

from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix, read_load
from moebalance.models import MODELS, Attention, ModelSpec, get_model
from moebalance.models.fields import check_fields
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
    assert v3.attention == Attention(kind="mla", num_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                                     qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    assert (v3.vocab_size, v3.dense_intermediate_size, v3.num_decoder_layers) == (129280, 18432, 61)
    assert get_model("qwen3-30b-a3b").attention == Attention(kind="gqa", num_heads=32, num_kv_heads=4, head_dim=128)


def test_mtp_layers_from_num_nextn_predict_layers() -> None:
    # config.json num_nextn_predict_layers: DeepSeek-V3 and R1 ship 1 MTP module, numbered after the 61 decoder
    # layers (its README_WEIGHTS.md: layer 61); GLM-4.5 1 (layer 92); the others have none
    for name in ("deepseek-v3", "deepseek-r1"):
        assert get_model(name).num_mtp_layers == 1 and get_model(name).mtp_layer_ids == (61,)
    assert get_model("glm-4.5").mtp_layer_ids == (92,)
    assert {name for name, spec in MODELS.items() if spec.num_mtp_layers} == {"deepseek-v3", "deepseek-r1", "glm-4.5"}


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
    ({"num_mtp_layers": -1}, "ModelSpec.num_mtp_layers (-1) must be an integer >= 0"),
    ({"vocab_size": 100}, "ModelSpec.vocab_size is given without attention"),
    ({"attention": "mla"}, "ModelSpec.attention ('mla') must be an Attention or None"),
    ({"attention": Attention(kind="gqa", num_heads=4, num_kv_heads=2, head_dim=8)},
     "ModelSpec.vocab_size (0) must be a positive integer"),
    ({"attention": Attention(kind="gqa", num_heads=4, num_kv_heads=2, head_dim=8), "vocab_size": 10,
      "num_dense_layers": 1}, "ModelSpec.dense_intermediate_size (0) must be a positive integer"),
    ({"tie_word_embeddings": 1}, "ModelSpec.tie_word_embeddings (1) must be true or false"),
    ({"total_params": float("nan")}, "ModelSpec.total_params (nan) must be a finite number >= 0"),
])
def test_spec_validation(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(InputError) as info:
        tiny_model_spec(**changes)
    assert needle in str(info.value)


@pytest.mark.parametrize(("fields", "needle"), [
    ({"kind": "mha", "num_heads": 4}, "Attention.kind ('mha') must be 'mla' or 'gqa'"),
    ({"kind": "gqa", "num_heads": 4, "head_dim": 8}, "Attention.num_kv_heads (0) must be a positive integer"),
    ({"kind": "gqa", "num_heads": 6, "num_kv_heads": 4, "head_dim": 8},
     "Attention.num_heads (6) must be divisible by num_kv_heads (4)"),
    ({"kind": "gqa", "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "kv_lora_rank": 512},
     "Attention.kv_lora_rank (512) is not a size of GQA attention"),
    ({"kind": "mla", "num_heads": 4, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
      "v_head_dim": 8, "head_dim": 8}, "Attention.head_dim (8) is not a size of MLA attention"),
    ({"kind": "mla", "num_heads": 4, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
      "v_head_dim": 8, "q_lora_rank": -1}, "Attention.q_lora_rank (-1) must be an integer >= 0"),
])
def test_attention_validation(fields: dict[str, object], needle: str) -> None:
    with pytest.raises(InputError) as info:
        Attention(**fields)  # type: ignore[arg-type]
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_numpy_integers_are_stored_as_python_ints() -> None:
    spec = tiny_model_spec(num_layers=np.int64(3), num_experts=np.int32(8))
    assert type(spec.num_layers) is int and type(spec.num_experts) is int and spec.num_layers == 3
    with pytest.raises(InputError, match=r"ModelSpec.num_layers \(True\) must be a positive integer"):
        tiny_model_spec(num_layers=True)


def test_the_field_checker_on_its_own() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Thing:
        n: object = 1
        x: object = 1.0
        flag: object = False
        kind: object = "a"

    check_fields(Thing(n=10**400, x=10**400), positive=("n",), positive_reals=("x",), flags=("flag",),
                 choices={"kind": ("a", None)})  # a huge int is finite: no OverflowError
    check_fields(Thing(kind=None), choices={"kind": ("a", None)})
    for thing, needle in ((Thing(x=float("-inf")), "Thing.x (-inf) must be a finite number > 0"),
                          (Thing(kind=np.array([1, 2])), "Thing.kind (array([1, 2])) must be 'a' or None"),
                          (Thing(flag=np.int64(1)), "Thing.flag (np.int64(1)) must be true or false")):
        with pytest.raises(InputError) as info:
            check_fields(thing, positive_reals=("x",), flags=("flag",), choices={"kind": ("a", None)})
        assert str(info.value) == needle
    with pytest.raises(InputError, match=r"^n \(0\) must be a positive integer$"):
        check_fields(Thing(n=0), positive=("n",), label="")


@pytest.mark.parametrize(("config", "needle"), [
    ({"d_model": "128"}, "d_model ('128') must be a positive integer"),
    ({"d_model": 128.5}, "d_model (128.5) must be a positive integer"),
    ({"top_k": None}, "top_k (None) must be a positive integer"),
    ({"balance_bias": "yes"}, "balance_bias ('yes') must be true or false"),
    ({"depth": 4}, "unknown model config keys ['depth']"),
])
def test_trained_lm_config_from_a_checkpoint_is_checked_not_converted(config: dict[str, object], needle: str) -> None:
    """The trained LM's network config goes through the same field checker; a checkpoint's JSON config with a
    string or a fraction is refused in one line (it was converted with ``int``: ``'abc'`` gave a ValueError and
    ``128.5`` silently became 128)."""
    from moebalance.lm.moe_lm import ModelConfig

    with pytest.raises(InputError) as info:
        ModelConfig.from_dict({**ModelConfig().as_dict(), **config})
    assert needle in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(InputError, match="must be a JSON object of its fields, not list"):
        ModelConfig.from_dict([1, 2])  # type: ignore[arg-type]
    assert ModelConfig.from_dict(ModelConfig(num_layers=2).as_dict()) == ModelConfig(num_layers=2)


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


def test_load_model_is_none_without_a_served_models_spec() -> None:
    from moebalance.core.load import LM_PRESET

    counts = np.ones((1, 2, 4), dtype=np.int64)
    assert LoadMatrix(counts).model is None
    # the trained LM's traces name it, but it is a network config (moebalance.lm), not a served model's spec
    assert LoadMatrix(counts, preset=LM_PRESET).model is None
    assert LoadMatrix.from_arrays(LoadMatrix(counts, preset=LM_PRESET).to_arrays()).preset == LM_PRESET
