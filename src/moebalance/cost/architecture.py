"""What a model's weights and KV cache weigh: the parameter counts the memory model needs, from ``config.json``.

Legend: ``H`` hidden size, ``F`` a routed expert's FFN size, ``V`` vocabulary, ``n_h`` attention heads.

:class:`moebalance.models.ModelSpec` holds the routing shape (layers, experts, top-k); :class:`ModelArch` adds the
rest of the architecture, read from the same ``config.json`` files:

- a routed or shared expert, and a dense layer's MLP, are gated FFNs: ``3 * H * F`` parameters (gate, up, down);
- attention is multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) or grouped-query attention (GQA);
  MLA caches one compressed vector of ``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer, GQA
  caches keys and values, ``2 * n_kv * head_dim``;
- embeddings ``V * H``, and a separate LM head of the same size unless the embeddings are tied;
- the router ``H * E`` per MoE layer. Norms and biases (a few thousand parameters per layer) are left out.

``total_params`` is the total the model card publishes; the tests check the count above against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moebalance.core.errors import InputError
from moebalance.models import MODELS, ModelSpec

__all__ = ["ARCHS", "ModelArch", "get_arch"]


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelArch:
    """The parts of a model's architecture that weigh memory. Example: ``ARCHS["deepseek-v3"].kv_bytes_per_token()``
    is ``61 * (512 + 64) * 2`` bytes in bf16 (MLA)."""

    spec: ModelSpec
    vocab_size: int
    #: FFN size of a dense layer's MLP (``intermediate_size``); unused for a model without dense layers.
    dense_intermediate_size: int
    attention: Literal["mla", "gqa"]
    num_attention_heads: int
    #: GQA: key/value heads and the head size.
    num_kv_heads: int = 0
    head_dim: int = 0
    #: MLA: query compression rank (0: no compression, DeepSeek-V2-Lite), KV compression rank, head sizes.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    tie_word_embeddings: bool = False
    #: Total parameters the model card publishes (multi-token-prediction modules excluded).
    total_params: float = 0.0
    source: str = ""

    @property
    def num_decoder_layers(self) -> int:
        """``num_hidden_layers``: MoE and dense decoder layers."""
        return self.spec.num_layers + self.spec.num_dense_layers

    def expert_params(self) -> int:
        """One routed expert: ``3 * H * F``."""
        return 3 * self.spec.hidden_size * self.spec.moe_intermediate_size

    def attention_params(self) -> int:
        """One decoder layer's attention projections."""
        H, n = self.spec.hidden_size, self.num_attention_heads
        if self.attention == "gqa":
            return H * n * self.head_dim + 2 * H * self.num_kv_heads * self.head_dim + n * self.head_dim * H
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = H * n * qk if self.q_lora_rank == 0 else H * self.q_lora_rank + self.q_lora_rank * n * qk
        kv = H * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * n * (self.qk_nope_head_dim
                                                                                          + self.v_head_dim)
        return q + kv + n * self.v_head_dim * H

    def non_expert_params(self) -> dict[str, int]:
        """Every parameter that is not a routed expert, by part: ``attention``, ``dense_mlp``, ``shared_experts``,
        ``router``, ``embeddings`` (with the LM head)."""
        s = self.spec
        return {
            "attention": self.num_decoder_layers * self.attention_params(),
            "dense_mlp": s.num_dense_layers * 3 * s.hidden_size * self.dense_intermediate_size,
            "shared_experts": s.num_layers * s.num_shared_experts * self.expert_params(),
            "router": s.num_layers * s.hidden_size * s.num_experts,
            "embeddings": self.vocab_size * s.hidden_size * (1 if self.tie_word_embeddings else 2),
        }

    def routed_params(self) -> int:
        """Every routed expert of every MoE layer: ``L * E * 3 * H * F``."""
        return self.spec.num_layers * self.spec.num_experts * self.expert_params()

    def total(self) -> int:
        """The parameter count of this architecture (norms and biases left out)."""
        return self.routed_params() + sum(self.non_expert_params().values())

    def kv_shards(self, attention_tp: int) -> int:
        """GPUs of a tensor-parallel attention group that split a token's KV cache: GQA splits its KV heads (copied
        when the group is larger than the heads, as engines do), MLA's one latent vector is whole on every GPU."""
        return 1 if self.attention == "mla" else max(1, min(attention_tp, self.num_kv_heads))

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token takes over all decoder layers."""
        if self.attention == "mla":
            per_layer = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            per_layer = 2 * self.num_kv_heads * self.head_dim
        return self.num_decoder_layers * per_layer * dtype_bytes


def _mla(name: str, *, vocab: int, dense_ffn: int, heads: int, q_rank: int, total: float) -> ModelArch:
    return ModelArch(spec=MODELS[name], vocab_size=vocab, dense_intermediate_size=dense_ffn, attention="mla",
                     num_attention_heads=heads, q_lora_rank=q_rank, kv_lora_rank=512, qk_nope_head_dim=128,
                     qk_rope_head_dim=64, v_head_dim=128, total_params=total, source=MODELS[name].source)


def _gqa(name: str, *, vocab: int, dense_ffn: int, heads: int, kv_heads: int, head_dim: int, total: float,
         tied: bool = False) -> ModelArch:
    return ModelArch(spec=MODELS[name], vocab_size=vocab, dense_intermediate_size=dense_ffn, attention="gqa",
                     num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=tied,
                     total_params=total, source=MODELS[name].source)


# From each model's config.json (vocab_size, intermediate_size, num_attention_heads, num_key_value_heads,
# head_dim, q_lora_rank, kv_lora_rank, qk_*_head_dim, v_head_dim, tie_word_embeddings) and the total its model
# card gives (DeepSeek-V3/R1: 671B main model, the 14B multi-token-prediction module excluded; Kimi-K2: 1.04T,
# "1T total"; Qwen3: 235B and 30.5B; GLM-4.5: 355B; Mixtral: 46.7B; OLMoE: 6.9B; DeepSeek-V2-Lite: 15.7B).
ARCHS: dict[str, ModelArch] = {a.spec.name: a for a in (
    _mla("deepseek-v3", vocab=129280, dense_ffn=18432, heads=128, q_rank=1536, total=671e9),
    _mla("deepseek-r1", vocab=129280, dense_ffn=18432, heads=128, q_rank=1536, total=671e9),
    _mla("kimi-k2", vocab=163840, dense_ffn=18432, heads=64, q_rank=1536, total=1.04e12),
    _mla("deepseek-v2-lite", vocab=102400, dense_ffn=10944, heads=16, q_rank=0, total=15.7e9),
    _gqa("qwen3-235b-a22b", vocab=151936, dense_ffn=12288, heads=64, kv_heads=4, head_dim=128, total=235e9),
    _gqa("qwen3-30b-a3b", vocab=151936, dense_ffn=6144, heads=32, kv_heads=4, head_dim=128, total=30.5e9),
    _gqa("glm-4.5", vocab=151552, dense_ffn=12288, heads=96, kv_heads=8, head_dim=128, total=355e9),
    _gqa("mixtral-8x7b", vocab=32000, dense_ffn=14336, heads=32, kv_heads=8, head_dim=128, total=46.7e9),
    _gqa("olmoe-1b-7b", vocab=50304, dense_ffn=1024, heads=16, kv_heads=16, head_dim=128, total=6.9e9),
)}


def get_arch(name: str) -> ModelArch:
    """The architecture of model ``name``; an unknown name raises :class:`InputError`."""
    arch = ARCHS.get(name)
    if arch is None:
        raise InputError(f"the cost model has no architecture for {name!r}; known: {', '.join(sorted(ARCHS))}")
    return arch
