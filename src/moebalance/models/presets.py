"""The real MoE models we name, each read from its ``config.json`` on Hugging Face (as of 2025), with its source.

These are published numbers, not modelling choices: how each model's routing is imitated (skew, co-activation,
drift) is calibrated separately in :mod:`moebalance.workloads.synth` (``docs/synth.md``).

Fields from ``config.json`` (Llama 4: its ``text_config``): ``num_layers`` is ``num_hidden_layers`` minus the
``first_k_dense_replace`` dense layers (Qwen3 and Qwen3-Next: ``decoder_sparse_step`` 1 and no ``mlp_only_layers``;
Mixtral, OLMoE, gpt-oss, MiniMax-M2 and Llama 4 Scout: every layer is MoE; Llama 4 Maverick: every second,
``interleave_moe_layer_step`` 2, ``moe_layer_step``); ``num_experts`` is ``n_routed_experts`` / ``num_experts`` /
``num_local_experts``; ``top_k`` ``num_experts_per_tok``; ``moe_intermediate_size`` (Mixtral's, OLMoE's,
gpt-oss's, Llama 4's and MiniMax-M2's ``intermediate_size``, each expert a full FFN); ``num_shared_experts``
``n_shared_experts`` (none in Qwen3, Mixtral, OLMoE, gpt-oss, MiniMax-M2; Qwen3-Next's one
``shared_expert_intermediate_size``; Llama 4's one, which its config does not name); ``num_groups`` ``n_group``
(1 where routing is not group-limited); ``num_mtp_layers`` ``num_nextn_predict_layers`` (0 where the config has
no such field, but for Qwen3-Next, whose entry says why); the attention's ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_*_head_dim``, ``v_head_dim``;
``vocab_size``, ``intermediate_size`` (a dense layer's MLP; Llama 4's ``intermediate_size_mlp``) and
``tie_word_embeddings``. ``served_precision`` is ``fp8`` where
``config.json`` has a ``quantization_config`` of ``quant_method`` ``fp8`` (DeepSeek-V3/R1, Kimi-K2 and MiniMax-M2:
``e4m3`` weights in 128 x 128 blocks), ``mxfp4`` where its ``quant_method`` is ``mxfp4`` (gpt-oss: the routed
experts' weights in MXFP4, every other weight bf16, see its entry), else ``bf16`` (``torch_dtype`` ``bfloat16``; FP8
variants published as separate repositories are not the default). ``layer_kinds``
names each decoder layer's attention where not every layer is full: gpt-oss's ``layer_types`` with its
``sliding_window`` (``attention_window``), Llama 4's chunked layers (``no_rope_layers``, ``attention_chunk_size``)
and Qwen3-Next's linear-attention layers (``full_attention_interval``, the ``linear_*`` sizes:
``linear_attention``); what an entry still approximates, it says. ``total_params`` is the model card's
total (DeepSeek-V3/R1: 671B main model, the multi-token-prediction module excluded; Kimi-K2: 1.04T, "1T total";
Qwen3: 235B and 30.5B; GLM-4.5: 355B; Mixtral: 46.7B; OLMoE: 6.9B; DeepSeek-V2-Lite: 15.7B; gpt-oss: 116.83B and
20.91B; Llama 4: 109B and 400B; Qwen3-Next: 80B; MiniMax-M2: 230B).
"""

from __future__ import annotations

import dataclasses

from moebalance.core.errors import InputError
from moebalance.models.specs import Attention, LinearAttention, ModelSpec

__all__ = ["MODELS", "get_model"]


def _config(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


def _mla(heads: int, q_lora_rank: int) -> Attention:
    """DeepSeek's MLA sizes (``kv_lora_rank`` 512, ``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64,
    ``v_head_dim`` 128), shared by DeepSeek-V2-Lite, DeepSeek-V3/R1 and Kimi-K2."""
    return Attention(kind="mla", num_heads=heads, q_lora_rank=q_lora_rank, kv_lora_rank=512, qk_nope_head_dim=128,
                     qk_rope_head_dim=64, v_head_dim=128)


def _gqa(heads: int, kv_heads: int, head_dim: int = 128) -> Attention:
    """GQA with ``head_dim``-wide heads (``head_dim`` 128 but for gpt-oss's 64 and Qwen3-Next's 256)."""
    return Attention(kind="gqa", num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


def _every(layers: int, step: int, kind: str) -> tuple[str, ...]:
    """``layer_kinds`` of ``layers`` decoder layers whose every ``step``-th one (``step - 1``, ``2 step - 1``, ...) is
    full and the others ``kind``: gpt-oss's ``layer_types`` (step 2), Llama 4's ``no_rope_layers`` and Qwen3-Next's
    ``full_attention_interval`` (step 4)."""
    return tuple("full" if (i + 1) % step == 0 else kind for i in range(layers))


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
    # gpt-oss (num_local_experts, experts_per_token; intermediate_size is an expert's FFN): num_hidden_layers 36,
    # every layer MoE; head_dim 64. layer_types alternates sliding_attention (layers 0, 2, ...: a window of
    # sliding_window 128 tokens; vLLM's gpt_oss.py windows the even layers, SGLang's reads layer_types) and
    # full_attention (1, 3, ...). The attention sinks (a learned logit per head, no cached token) and the biases of the
    # projections and experts are left out (as every model's). Its quantization_config is quant_method mxfp4, with
    # modules_to_not_convert naming the attention, the router, the embeddings and the LM head: the routed experts'
    # weights are MXFP4 (transformers' Mxfp4GptOssExperts: 32 4-bit E2M1 values in 16 bytes, *_blocks, and one 8-bit
    # E8M0 scale, *_scales, per block of 32: 4.25 bits a weight), the rest bf16; served_precision mxfp4 (the cost
    # model's pricing of it: moebalance.cost.time, EXPERT_WEIGHT_BYTES). Totals: the gpt-oss model card
    # (arXiv:2508.10925), Table 1: 116.83B (5.13B active, the unembedding counted but not the embeddings).
    ModelSpec(name="gpt-oss-120b", display_name="gpt-oss-120b", num_layers=36, num_dense_layers=0, num_experts=128,
              top_k=4, hidden_size=2880, moe_intermediate_size=2880, num_shared_experts=0, num_groups=1,
              attention=_gqa(64, 8, 64), vocab_size=201088, total_params=116.83e9, served_precision="mxfp4",
              layer_kinds=_every(36, 2, "window"), attention_window=128, source=_config("openai/gpt-oss-120b")),
    # As gpt-oss-120b with num_hidden_layers 24 (layer_types alternating alike) and num_local_experts 32, its
    # quantization_config the same (MXFP4 experts); model card Table 1: 20.91B (3.61B active).
    ModelSpec(name="gpt-oss-20b", display_name="gpt-oss-20b", num_layers=24, num_dense_layers=0, num_experts=32,
              top_k=4, hidden_size=2880, moe_intermediate_size=2880, num_shared_experts=0, num_groups=1,
              attention=_gqa(64, 8, 64), vocab_size=201088, total_params=20.91e9, served_precision="mxfp4",
              layer_kinds=_every(24, 2, "window"), attention_window=128, source=_config("openai/gpt-oss-20b")),
    # Llama 4 (text_config; num_local_experts, intermediate_size an expert's FFN, intermediate_size_mlp a dense
    # layer's): num_hidden_layers 48, interleave_moe_layer_step 1, every layer MoE; each MoE layer also has one shared
    # expert of intermediate_size (transformers' Llama4TextMoe.shared_expert: the config names none). no_rope_layers
    # [1, 1, 1, 0] x 12 (transformers' default of no_rope_layer_interval 4): layers 3, 7, ..., 47 are global (NoPE)
    # full attention, the others attend within chunks of attention_chunk_size 8192 (vLLM's llama4.py:
    # ChunkedLocalAttention). A chunked layer's cache is taken as a window of 8192 tokens, as vLLM sizes it (at most a
    # chunk per request); the current chunk, context mod 8192 tokens, can be fewer. The vision encoder is not
    # counted. Model card: 109B total, 17B active.
    ModelSpec(name="llama-4-scout", display_name="Llama-4-Scout", num_layers=48, num_dense_layers=0, num_experts=16,
              top_k=1, hidden_size=5120, moe_intermediate_size=8192, num_shared_experts=1, num_groups=1,
              attention=_gqa(40, 8), vocab_size=202048, dense_intermediate_size=16384, total_params=109e9,
              layer_kinds=_every(48, 4, "window"), attention_window=8192,
              source=_config("meta-llama/Llama-4-Scout-17B-16E-Instruct")),
    # As Llama 4 Scout with num_local_experts 128 and interleave_moe_layer_step 2: of num_hidden_layers 48 the odd
    # ones 1, 3, ..., 47 are MoE (transformers' Llama4TextConfig.moe_layers), the even ones dense MLPs of
    # intermediate_size_mlp 16384 (moe_layer_step 2). Its attention as Scout's. Model card: 400B total, 17B active.
    ModelSpec(name="llama-4-maverick", display_name="Llama-4-Maverick", num_layers=24, num_dense_layers=24,
              num_experts=128, top_k=1, hidden_size=5120, moe_intermediate_size=8192, num_shared_experts=1,
              num_groups=1, moe_layer_step=2, attention=_gqa(40, 8), vocab_size=202048,
              dense_intermediate_size=16384, total_params=400e9, layer_kinds=_every(48, 4, "window"),
              attention_window=8192, source=_config("meta-llama/Llama-4-Maverick-17B-128E-Instruct")),
    # num_hidden_layers 48, decoder_sparse_step 1, mlp_only_layers []: every layer MoE, with one shared expert of
    # shared_expert_intermediate_size 512 (= moe_intermediate_size). full_attention_interval 4: layers 3, 7, ..., 47
    # are gated attention (16 query heads, 2 KV heads of head_dim 256), the others Gated DeltaNet linear attention
    # (linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim and linear_value_head_dim 128,
    # linear_conv_kernel_dim 4), each keeping a fixed state per request; attn_output_gate true (output_gate: the
    # query projection's second half). Each kind's parameters are its own (LinearAttention.params, from vLLM's Gated
    # DeltaNet layer); a linear layer's recurrence FLOPs are not counted (ModelSpec.attended_pairs). MTP: config.json names none of
    # its layers (no num_nextn_predict_layers), but the checkpoint ships one MTP layer (mtp.layers.0: a full-attention
    # MoE decoder layer of the 512 experts), which vLLM's qwen3_next_mtp.py builds (num_nextn_predict_layers, default
    # 1), SGLang's builds as its one layer and TensorRT-LLM numbers model.layers.48 (H + i, as DeepSeek-V3's). Model
    # card: 80B total, 3B activated.
    ModelSpec(name="qwen3-next-80b-a3b", display_name="Qwen3-Next-80B-A3B", num_layers=48, num_dense_layers=0,
              num_experts=512, top_k=10, hidden_size=2048, moe_intermediate_size=512, num_shared_experts=1,
              num_groups=1, num_mtp_layers=1, attention=dataclasses.replace(_gqa(16, 2, 256), output_gate=True), vocab_size=151936,
              dense_intermediate_size=5120, total_params=80e9, layer_kinds=_every(48, 4, "linear"),
              linear_attention=LinearAttention(num_key_heads=16, num_value_heads=32, key_head_dim=128,
                                               value_head_dim=128, conv_kernel=4),
              source=_config("Qwen/Qwen3-Next-80B-A3B-Instruct")),
    # num_hidden_layers 62, every layer MoE (num_local_experts; intermediate_size an expert's FFN;
    # shared_intermediate_size 0: no shared expert); quantization_config quant_method fp8 (float8_e4m3fn in 128 x 128
    # blocks). attn_type_list is 1 for all 62 layers: full attention everywhere (MiniMax's 0 is linear attention,
    # as in MiniMax-Text-01; vLLM's and SGLang's minimax_m2.py give no layer a window). MTP: use_mtp true,
    # num_mtp_modules 3, mtp_transformer_layers 1, but no engine runs them: vLLM (0.33) and SGLang (0.5.23) have no
    # MTP model for MiniMax-M2, and their minimax_m2.py drop the weights of layers 62..64 on load: 0, no MTP layer to
    # place. Model card: 230B total, 10B activated.
    ModelSpec(name="minimax-m2", display_name="MiniMax-M2", num_layers=62, num_dense_layers=0, num_experts=256,
              top_k=8, hidden_size=3072, moe_intermediate_size=1536, num_shared_experts=0, num_groups=1,
              attention=_gqa(48, 8), vocab_size=200064, total_params=230e9, served_precision="fp8",
              source=_config("MiniMaxAI/MiniMax-M2")),
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
