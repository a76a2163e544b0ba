"""Real-model specs: lookup, validation (the shared field checker, also used by the trained LM's config),
agreement with the synthetic traces, and ``LoadMatrix.model``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import tiny_model_spec

from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix, read_load
from moebalance.models import MODELS, Attention, LinearAttention, ModelSpec, get_model
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
    # layers (its README_WEIGHTS.md: layer 61); GLM-4.5 1 (layer 92); Qwen3-Next's one MTP layer (mtp.layers.0, no
    # config key: presets.py) is layer 48; the others have none (MiniMax-M2's num_mtp_modules no engine runs)
    for name in ("deepseek-v3", "deepseek-r1"):
        assert get_model(name).num_mtp_layers == 1 and get_model(name).mtp_layer_ids == (61,)
    assert get_model("glm-4.5").mtp_layer_ids == (92,)
    assert get_model("qwen3-next-80b-a3b").mtp_layer_ids == (48,)
    assert {name for name, spec in MODELS.items() if spec.num_mtp_layers} == \
        {"deepseek-v3", "deepseek-r1", "glm-4.5", "qwen3-next-80b-a3b"}


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


_ARCH: dict[str, object] = {"attention": Attention(kind="gqa", num_heads=4, num_kv_heads=2, head_dim=8),
                             "vocab_size": 10}  # what tiny_model_spec needs to have attention kinds


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
    ({"moe_layer_step": 0}, "ModelSpec.moe_layer_step (0) must be a positive integer"),
    # every 2nd layer MoE: 2 MoE layers need 2 dense ones between them
    ({"moe_layer_step": 2, "num_dense_layers": 1}, "num_dense_layers (1) must be num_layers x (moe_layer_step - 1) = 2"),
    # the attention kind of each of the 2 decoder layers
    ({"layer_kinds": ("window", "full"), "attention_window": 4}, "ModelSpec.layer_kinds is given without attention"),
    ({**_ARCH, "layer_kinds": ("full",)},
     "ModelSpec.layer_kinds names 1 layer, but the model has 2 decoder layers: give one kind per layer"),
    ({**_ARCH, "layer_kinds": ("full", "sliding")},
     "ModelSpec.layer_kinds[1] ('sliding') must be one of full, window, linear"),
    ({**_ARCH, "layer_kinds": ["full", "full"]}, "ModelSpec.layer_kinds (['full', 'full']) must be a tuple"),
    ({**_ARCH, "layer_kinds": ("window", "full")},
     "ModelSpec.attention_window (0) must be positive exactly when layer_kinds has window layers"),
    ({**_ARCH, "attention_window": 128},
     "ModelSpec.attention_window (128) must be positive exactly when layer_kinds has window layers"),
    ({**_ARCH, "layer_kinds": ("window", "full"), "attention_window": -1},
     "ModelSpec.attention_window (-1) must be an integer >= 0"),
    ({**_ARCH, "layer_kinds": ("linear", "full")},
     "ModelSpec.linear_attention must be given exactly when layer_kinds has linear layers"),
    ({**_ARCH, "linear_attention": "gdn"}, "ModelSpec.linear_attention ('gdn') must be a LinearAttention or None"),
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


def test_linear_attention_validation() -> None:
    with pytest.raises(InputError) as info:
        LinearAttention(num_key_heads=0, num_value_heads=32, key_head_dim=128, value_head_dim=128, conv_kernel=4)
    assert str(info.value) == "LinearAttention.num_key_heads (0) must be a positive integer"
    spec = tiny_model_spec(**_ARCH)
    with pytest.raises(InputError, match=r"^5 tokens of 0 requests: give tokens >= 0 held by requests > 0$"):
        spec.kv_cache_bytes(5, 0)


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


# ----- the models of 2025-2026: gpt-oss, Llama 4, Qwen3-Next, MiniMax-M2 ----------------------------------------


def _active(spec: ModelSpec) -> int:
    """Parameters a token uses: every non-expert one and ``top_k`` routed experts per MoE layer."""
    return spec.total() - spec.routed_params() + spec.num_layers * spec.top_k * spec.expert_params()


def test_gpt_oss_against_its_config_and_model_card() -> None:
    # config.json: num_hidden_layers 36 / 24, num_local_experts 128 / 32, experts_per_token 4, hidden_size and
    # intermediate_size 2880, 64 query heads and 8 KV heads of head_dim 64, vocab_size 201088, untied embeddings
    big, small = get_model("gpt-oss-120b"), get_model("gpt-oss-20b")
    assert (big.num_layers, big.num_dense_layers, big.num_experts, big.top_k) == (36, 0, 128, 4)
    assert (small.num_layers, small.num_experts, small.top_k) == (24, 32, 4)
    assert big.attention == Attention(kind="gqa", num_heads=64, num_kv_heads=8, head_dim=64)
    assert big.expert_params() == 3 * 2880 * 2880 == 24_883_200
    assert big.attention_params() == 2 * 2880 * 64 * 64 + 2 * 2880 * 8 * 64 == 26_542_080
    # the model card's Table 1 (arXiv:2508.10925): attention 0.96B, embeddings and unembedding 1.16B, totals
    # 116.83B and 20.91B; active 5.13B and 3.61B, the unembedding counted but not the embedding table
    assert big.non_expert_params()["attention"] == pytest.approx(0.96e9, rel=0.015)
    assert big.non_expert_params()["embeddings"] == pytest.approx(1.16e9, rel=0.015)
    assert big.total() == pytest.approx(116.83e9, rel=0.015)
    assert small.total() == pytest.approx(20.91e9, rel=0.015)
    assert _active(big) - 201088 * 2880 == pytest.approx(5.13e9, rel=0.015)
    assert _active(small) - 201088 * 2880 == pytest.approx(3.61e9, rel=0.015)
    # quantization_config quant_method mxfp4: the routed experts MXFP4, the rest bf16; no other model's checkpoint
    assert big.served_precision == small.served_precision == "mxfp4"
    assert {m.name for m in MODELS.values() if m.served_precision == "mxfp4"} == {"gpt-oss-120b", "gpt-oss-20b"}


def test_llama_4_against_its_config_and_model_card() -> None:
    # text_config: hidden_size 5120, intermediate_size 8192 (an expert), intermediate_size_mlp 16384 (a dense MLP),
    # 48 layers, 40 query and 8 KV heads of 128, vocab_size 202048; one shared expert per MoE layer
    scout, maverick = get_model("llama-4-scout"), get_model("llama-4-maverick")
    assert (scout.num_layers, scout.num_dense_layers, scout.num_experts, scout.top_k) == (48, 0, 16, 1)
    assert (maverick.num_layers, maverick.num_dense_layers, maverick.num_experts, maverick.top_k) == (24, 24, 128, 1)
    assert scout.num_shared_experts == maverick.num_shared_experts == 1
    assert (maverick.hidden_size, maverick.moe_intermediate_size, maverick.dense_intermediate_size) == \
        (5120, 8192, 16384)
    # interleave_moe_layer_step 2: transformers' moe_layers range(1, 48, 2)
    assert maverick.moe_layer_ids == (1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37, 39, 41,
                                      43, 45, 47)
    assert scout.moe_layer_ids == tuple(range(48)) and scout.num_decoder_layers == maverick.num_decoder_layers == 48
    # model cards: 109B and 400B total, 17B active each
    assert scout.total() == pytest.approx(109e9, rel=0.015)
    assert maverick.total() == pytest.approx(400e9, rel=0.015)
    assert _active(scout) == pytest.approx(17e9, rel=0.015)
    assert _active(maverick) == pytest.approx(17e9, rel=0.015)


def test_qwen3_next_and_minimax_m2_against_their_configs_and_model_cards() -> None:
    # Qwen3-Next-80B-A3B: 48 layers, num_experts 512, num_experts_per_tok 10, moe_intermediate_size 512, one shared
    # expert, 16 query and 2 KV heads of head_dim 256; model card: 80B total, 3B activated (a rounded figure)
    nxt = get_model("qwen3-next-80b-a3b")
    assert (nxt.num_layers, nxt.num_experts, nxt.top_k, nxt.num_shared_experts) == (48, 512, 10, 1)
    assert nxt.attention == Attention(kind="gqa", num_heads=16, num_kv_heads=2, head_dim=256, output_gate=True)
    assert nxt.expert_params() == 3 * 2048 * 512
    # its 12 full layers: the query and its gate (attn_output_gate), keys, values and the output; its 36 Gated
    # DeltaNet layers: qkvz 2048 x (2 x 16 x 128 + 2 x 32 x 128), ba 2048 x 64, conv (2 x 2048 + 4096) x 4, out 4096 x 2048
    full = 2048 * 16 * 256 * 2 + 2 * 2048 * 2 * 256 + 16 * 256 * 2048
    linear = 2048 * 12288 + 2048 * 64 + 8192 * 4 + 4096 * 2048
    assert nxt.non_expert_params()["attention"] == 12 * full + 36 * linear
    assert nxt.total() == pytest.approx(80e9, rel=0.005)
    # "3B activated" rounds the weights a token uses besides the embeddings and LM head (3.25B here; 3.87B with them)
    assert 2.5e9 <= _active(nxt) - nxt.non_expert_params()["embeddings"] < 3.5e9
    # MiniMax-M2: 62 layers, num_local_experts 256, top-8, intermediate_size 1536, hidden_size 3072, 48 query and
    # 8 KV heads of 128, vocab_size 200064, FP8 checkpoint; model card: 230B total
    mm = get_model("minimax-m2")
    assert (mm.num_layers, mm.num_dense_layers, mm.num_experts, mm.top_k, mm.num_shared_experts) == (62, 0, 256, 8, 0)
    assert mm.expert_params() == 3 * 3072 * 1536 == 14_155_776
    assert mm.kv_bytes_per_request(1) == 62 * 2 * 8 * 128 * 2 and mm.layer_count("full") == 62  # attn_type_list 1
    assert mm.served_precision == "fp8" and mm.num_mtp_layers == 0
    assert mm.total() == pytest.approx(230e9, rel=0.015)


def test_attention_kinds_of_each_layer_from_their_configs() -> None:
    # gpt-oss layer_types: sliding_attention (sliding_window 128) in layers 0, 2, ..., full_attention in 1, 3, ...
    big, small = get_model("gpt-oss-120b"), get_model("gpt-oss-20b")
    assert big.layer_kinds == ("window", "full") * 18 and small.layer_kinds == ("window", "full") * 12
    assert big.attention_window == small.attention_window == 128
    # Llama 4 no_rope_layers [1, 1, 1, 0] x 12: layers 3, 7, ..., 47 global, the others chunks of 8192
    for name in ("llama-4-scout", "llama-4-maverick"):
        spec = get_model(name)
        assert [i for i, k in enumerate(spec.layer_kinds) if k == "full"] == list(range(3, 48, 4))
        assert spec.layer_count("window") == 36 and spec.attention_window == 8192
    # Qwen3-Next full_attention_interval 4 and its Gated DeltaNet sizes; MiniMax-M2 attn_type_list all 1 (full)
    nxt = get_model("qwen3-next-80b-a3b")
    assert [i for i, k in enumerate(nxt.layer_kinds) if k == "full"] == list(range(3, 48, 4))
    assert nxt.layer_count("linear") == 36 and nxt.attention_window == 0
    assert nxt.linear_attention == LinearAttention(num_key_heads=16, num_value_heads=32, key_head_dim=128,
                                                   value_head_dim=128, conv_kernel=4)
    mm = get_model("minimax-m2")
    assert mm.layer_kinds == () and mm.layer_count("full") == 62 and mm.layer_count("window") == 0


def test_kv_bytes_of_a_request_by_kind_of_layer() -> None:
    """By hand: a window layer caches min(context, W) tokens, a linear layer its state whatever the context."""
    gpt = get_model("gpt-oss-120b")  # 18 full + 18 window layers of 8 KV heads x 64: 2 x 512 numbers, 2048 bytes
    assert gpt.kv_bytes_per_request(100) == 36 * 100 * 2048 == 7_372_800  # below the window: as if all full
    assert gpt.kv_bytes_per_request(4096) == (18 * 4096 + 18 * 128) * 2048 == 155_713_536
    assert gpt.kv_bytes_per_request(4096, kv_bytes=1, attention_tp=8) == 155_713_536 / 2 / 8  # fp8, 8 KV heads
    assert gpt.kv_cache_bytes(3 * 4096, 3) == 3 * 155_713_536  # three requests of 4096 tokens
    # Llama 4 Scout: 12 global layers + 36 chunked layers of 8192 tokens, 8 KV heads x 128: 4096 bytes a token
    scout = get_model("llama-4-scout")
    assert scout.kv_bytes_per_request(5000) == 48 * 5000 * 4096  # within one chunk
    assert scout.kv_bytes_per_request(100_000) == (12 * 100_000 + 36 * 8192) * 4096
    # Qwen3-Next: 12 gated-attention layers (2 KV heads x 256: 2048 bytes a token) + 36 Gated DeltaNet layers, each
    # (2 x 16 x 128 + 32 x 128) x (4 - 1) convolution inputs in bf16 and 32 x 128 x 128 recurrent numbers in float32
    nxt = get_model("qwen3-next-80b-a3b")
    state = 8192 * 3 * 2 + 524_288 * 4
    assert nxt.linear_attention is not None and nxt.linear_attention.state_bytes() == state == 2_146_304
    assert nxt.kv_bytes_per_request(1) == 12 * 2048 + 36 * state
    assert nxt.kv_bytes_per_request(4096) == 12 * 4096 * 2048 + 36 * state
    # attention split over 8 GPUs: the 2 KV heads over 2 of them, the state over 8 (its 16 key heads)
    assert nxt.kv_bytes_per_request(4096, attention_tp=8) == 12 * 4096 * 2048 / 2 + 36 * state / 8
    assert nxt.kv_bytes_per_request(4096, kv_bytes=1) == 12 * 4096 * 1024 + 36 * state  # fp8 KV: not the state
    # vLLM keeps the recurrent numbers in bf16: 524,288 x 2 bytes
    bf16_state = 8192 * 3 * 2 + 524_288 * 2
    assert nxt.linear_attention.state_bytes(2) == bf16_state == 1_097_728
    assert nxt.kv_bytes_per_request(4096, state_bytes=2) == 12 * 4096 * 2048 + 36 * bf16_state


def test_qwen3_next_mtp_layer_is_numbered_after_its_decoder_layers() -> None:
    """A load in the engines' numbering with Qwen3-Next's MTP layer (49 rows of 512 experts) fits it, and the
    layer of row 48 is its MTP layer (TensorRT-LLM's model.layers.48)."""
    from moebalance.core.cluster import Cluster
    from moebalance.core.plan import Placement
    from moebalance.engines.layers import plan_layers

    nxt = get_model("qwen3-next-80b-a3b")
    assert nxt.misfit(49, 512) is None and nxt.misfit(48, 512) is None
    assert nxt.shape_text() == "48 MoE layers and 1 MTP layer of 512 experts"
    assert nxt.mtp_params() == nxt.attention_params() + 513 * 3 * 2048 * 512 + 2048 * 512 + 2 * 2048 * 2048
    plan = Placement([[list(range(256)), list(range(256, 512))]] * 49, 512, Cluster(num_nodes=1, gpus_per_node=2))
    layers = plan_layers(plan, model="qwen3-next-80b-a3b")
    assert layers.layer_ids == tuple(range(49)) and layers.num_hidden_layers == 48 and layers.mtp_rows == (48,)


def test_llama_4_maverick_layers_are_numbered_as_engines_number_them() -> None:
    """Maverick's MoE layers are every second one, 1, 3, ..., 47, not the last 24: a load in the engine's numbering
    has load in the odd rows, and a load of the MoE layers alone is given those ids (a dense-first reading placed
    its experts in layers 24..47)."""
    from moebalance.core.cluster import Cluster
    from moebalance.core.plan import Placement
    from moebalance.engines.layers import choose_model, moe_layer_ids, plan_layers

    mav = get_model("llama-4-maverick")
    odd = [i % 2 == 1 for i in range(48)]
    assert mav.misfit(48, 128, loaded=odd) is None
    assert mav.misfit(48, 128, loaded=[True] * 48) == \
        "load in layer 0, which is dense in Llama-4-Maverick (its MoE layers are 1, 3, ..., 47)"
    assert mav.misfit(24, 128, layer_ids=range(1, 48, 2)) is None
    assert mav.misfit(24, 128, layer_ids=range(24, 48)) == \
        "layers 24, 26, 28, 30, 32, 34, 36, 38, ..., which Llama-4-Maverick lacks: its MoE layers are 1, 3, ..., 47"
    assert mav.misfit(47, 128) == \
        "47 layers, but Llama-4-Maverick has 48 decoder layers (24 dense, 24 MoE: layers 1, 3, ..., 47) of 128 experts"
    # 48 rows x 128 experts fit Qwen3-30B-A3B too (48 MoE layers), but its even layers would see no token
    assert choose_model(48, 128, loaded=odd).spec is mav
    assert choose_model(48, 128, loaded=[True] * 48).preset == "qwen3-30b-a3b"
    assert choose_model(48, 128).spec is None  # without the rows' load both fit
    assert choose_model(24, 128).spec is mav  # 24 rows are Maverick's alone
    load = LoadMatrix(np.ones((1, 24, 128), dtype=np.int64), preset="llama-4-maverick")
    assert moe_layer_ids(load).tolist() == list(range(1, 48, 2))
    cluster = Cluster(num_nodes=1, gpus_per_node=2)
    plan = Placement([[list(range(64)), list(range(64, 128))]] * 24, 128, cluster)
    layers = plan_layers(plan, model="llama-4-maverick")
    assert layers.layer_ids == tuple(range(1, 48, 2)) and layers.num_hidden_layers == 48
    assert "Llama-4-Maverick's MoE layers 1, 3, ..., 47" in layers.notes[0]


def test_a_62_layer_load_is_deepseek_v3_with_its_mtp_layer_not_minimax_m2() -> None:
    """MiniMax-M2 has 62 MoE layers of 256 experts, DeepSeek-V3 61 decoder layers and 1 MTP layer of 256: a load
    whose rows 0-2 carry no load is DeepSeek-V3's (a MoE layer sees every token), one with load in every row
    MiniMax-M2's."""
    from moebalance.engines.layers import choose_model

    assert choose_model(62, 256, loaded=[i >= 3 for i in range(62)]).preset == "deepseek-v3"
    assert choose_model(62, 256, loaded=[True] * 62).preset == "minimax-m2"
    assert choose_model(62, 256).spec is None  # without the rows' load both fit
