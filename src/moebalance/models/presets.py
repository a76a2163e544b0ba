"""The real MoE models we name, each read from its ``config.json`` on Hugging Face (as of 2025), with its source.

These are published numbers, not modelling choices: how each model's routing is imitated (skew, co-activation,
drift) is calibrated separately in :mod:`moebalance.workloads.synth` (``docs/synth.md``).

Fields from ``config.json``: ``num_layers`` is ``num_hidden_layers`` minus the ``first_k_dense_replace`` dense
layers (Qwen3: ``decoder_sparse_step`` 1 and no ``mlp_only_layers``; Mixtral and OLMoE: every layer is MoE);
``num_experts`` is ``n_routed_experts`` / ``num_experts`` / ``num_local_experts``; ``top_k``
``num_experts_per_tok``; ``moe_intermediate_size`` (Mixtral's and OLMoE's ``intermediate_size``, each expert a
full FFN); ``num_shared_experts`` ``n_shared_experts`` (none in Qwen3, Mixtral, OLMoE); ``num_groups`` ``n_group``
(1 where routing is not group-limited); ``num_mtp_layers`` ``num_nextn_predict_layers`` (0 where the config has
no such field); the attention's ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``q_lora_rank``,
``kv_lora_rank``, ``qk_*_head_dim``, ``v_head_dim``; ``vocab_size``, ``intermediate_size`` (a dense layer's MLP)
and ``tie_word_embeddings``. ``served_precision`` is ``fp8`` where ``config.json`` has a ``quantization_config`` of
``quant_method`` ``fp8`` (DeepSeek-V3/R1 and Kimi-K2: ``e4m3`` weights in 128 x 128 blocks), else ``bf16``
(``torch_dtype`` ``bfloat16``; FP8 variants published as separate repositories are not the default). ``total_params`` is the model card's total (DeepSeek-V3/R1: 671B main model, the
multi-token-prediction module excluded; Kimi-K2: 1.04T, "1T total"; Qwen3: 235B and 30.5B; GLM-4.5: 355B;
Mixtral: 46.7B; OLMoE: 6.9B; DeepSeek-V2-Lite: 15.7B).
"""

from __future__ import annotations

import dataclasses

from moebalance.core.errors import InputError
from moebalance.models.specs import Attention, ModelSpec

__all__ = ["MODELS", "get_model"]


def _config(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


def _mla(heads: int, q_lora_rank: int) -> Attention:
    """DeepSeek's MLA sizes (``kv_lora_rank`` 512, ``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64,
    ``v_head_dim`` 128), shared by DeepSeek-V2-Lite, DeepSeek-V3/R1 and Kimi-K2."""
    return Attention(kind="mla", num_heads=heads, q_lora_rank=q_lora_rank, kv_lora_rank=512, qk_nope_head_dim=128,
                     qk_rope_head_dim=64, v_head_dim=128)


def _gqa(heads: int, kv_heads: int) -> Attention:
    """GQA with 128-wide heads (every GQA model here)."""
    return Attention(kind="gqa", num_heads=heads, num_kv_heads=kv_heads, head_dim=128)


_PRESETS = (
    # num_hidden_layers 61 = 3 dense + 58 MoE; num_nextn_predict_layers 1: the MTP module is layer 61 (its
    # README_WEIGHTS.md, https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/README_WEIGHTS.md, says the
    # released weights include 1 MTP module of 11.5B parameters besides the shared embeddings and head).
    ModelSpec(name="deepseek-v3", display_name="DeepSeek-V3", num_layers=58, num_dense_layers=3, num_experts=256,
              top_k=8, hidden_size=7168, moe_intermediate_size=2048, num_shared_experts=1, num_groups=8,
              num_mtp_layers=1, attention=_mla(128, 1536), vocab_size=129280, dense_intermediate_size=18432,
              total_params=671e9, served_precision="fp8", source=_config("deepseek-ai/DeepSeek-V3")),
    # num_hidden_layers 61 = 1 dense + 60 MoE; num_nextn_predict_layers 0 (no MTP module released).
    ModelSpec(name="kimi-k2", display_name="Kimi-K2", num_layers=60, num_dense_layers=1, num_experts=384, top_k=8,
              hidden_size=7168, moe_intermediate_size=2048, num_shared_experts=1, num_groups=1,
              attention=_mla(64, 1536), vocab_size=163840, dense_intermediate_size=18432, total_params=1.04e12,
              served_precision="fp8", source=_config("moonshotai/Kimi-K2-Instruct")),
    # num_hidden_layers 94, decoder_sparse_step 1, mlp_only_layers []: every layer is MoE.
    ModelSpec(name="qwen3-235b-a22b", display_name="Qwen3-235B-A22B", num_layers=94, num_dense_layers=0,
              num_experts=128, top_k=8, hidden_size=4096, moe_intermediate_size=1536, num_shared_experts=0,
              num_groups=1, attention=_gqa(64, 4), vocab_size=151936, dense_intermediate_size=12288,
              total_params=235e9, source=_config("Qwen/Qwen3-235B-A22B")),
    # num_hidden_layers 48, decoder_sparse_step 1, mlp_only_layers []: every layer is MoE.
    ModelSpec(name="qwen3-30b-a3b", display_name="Qwen3-30B-A3B", num_layers=48, num_dense_layers=0,
              num_experts=128, top_k=8, hidden_size=2048, moe_intermediate_size=768, num_shared_experts=0,
              num_groups=1, attention=_gqa(32, 4), vocab_size=151936, dense_intermediate_size=6144,
              total_params=30.5e9, source=_config("Qwen/Qwen3-30B-A3B")),
    # num_hidden_layers 92 = 3 dense + 89 MoE; num_nextn_predict_layers 1: the MTP layer is layer 92.
    ModelSpec(name="glm-4.5", display_name="GLM-4.5", num_layers=89, num_dense_layers=3, num_experts=160, top_k=8,
              hidden_size=5120, moe_intermediate_size=1536, num_shared_experts=1, num_groups=1, num_mtp_layers=1,
              attention=_gqa(96, 8), vocab_size=151552, dense_intermediate_size=12288, total_params=355e9,
              source=_config("zai-org/GLM-4.5")),
    # num_hidden_layers 32, every layer MoE; each expert a full FFN of intermediate_size 14336.
    ModelSpec(name="mixtral-8x7b", display_name="Mixtral-8x7B", num_layers=32, num_dense_layers=0, num_experts=8,
              top_k=2, hidden_size=4096, moe_intermediate_size=14336, num_shared_experts=0, num_groups=1,
              attention=_gqa(32, 8), vocab_size=32000, dense_intermediate_size=14336, total_params=46.7e9,
              source=_config("mistralai/Mixtral-8x7B-v0.1")),
    # num_hidden_layers 16, every layer MoE; each expert a full FFN of intermediate_size 1024.
    ModelSpec(name="olmoe-1b-7b", display_name="OLMoE-1B-7B", num_layers=16, num_dense_layers=0, num_experts=64,
              top_k=8, hidden_size=2048, moe_intermediate_size=1024, num_shared_experts=0, num_groups=1,
              attention=_gqa(16, 16), vocab_size=50304, dense_intermediate_size=1024, total_params=6.9e9,
              source=_config("allenai/OLMoE-1B-7B-0924")),
    # num_hidden_layers 27 = 1 dense + 26 MoE; q_lora_rank null (queries not compressed).
    ModelSpec(name="deepseek-v2-lite", display_name="DeepSeek-V2-Lite", num_layers=26, num_dense_layers=1,
              num_experts=64, top_k=6, hidden_size=2048, moe_intermediate_size=1408, num_shared_experts=2,
              num_groups=1, attention=_mla(16, 0), vocab_size=102400, dense_intermediate_size=10944,
              total_params=15.7e9, source=_config("deepseek-ai/DeepSeek-V2-Lite")),
)

#: Every named model by its registry key.
MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in _PRESETS}
# DeepSeek-R1 is DeepSeek-V3's architecture (the same config.json fields, num_nextn_predict_layers 1 included),
# post-trained differently.
MODELS["deepseek-r1"] = dataclasses.replace(MODELS["deepseek-v3"], name="deepseek-r1", display_name="DeepSeek-R1",
                                            source=_config("deepseek-ai/DeepSeek-R1"))


def get_model(name: str) -> ModelSpec:
    """The model called ``name`` (a key of :data:`MODELS`); an unknown name raises :class:`InputError`."""
    spec = MODELS.get(name)
    if spec is None:
        raise InputError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return spec
