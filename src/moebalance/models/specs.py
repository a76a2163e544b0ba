"""One description of a real MoE model, from its ``config.json``: the routing shape and the architecture's sizes.

Legend: ``L`` MoE layers, ``E`` routed experts per layer, ``K`` experts a token picks per layer (top-k), ``H``
hidden size, ``F`` a routed expert's FFN size, ``V`` vocabulary, ``n_h`` attention heads.

The synthetic generator (:mod:`moebalance.workloads.synth`) and the policies read the routing shape (``L``, ``E``,
``K``, expert groups); the cost model (:mod:`moebalance.cost`) reads the rest, and the parameter counts below are
built from it:

- a routed or shared expert, and a dense layer's MLP, are gated FFNs: ``3 * H * F`` parameters (gate, up, down);
- attention is multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) or grouped-query attention (GQA);
  MLA caches one compressed vector of ``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer, GQA
  caches keys and values, ``2 * n_kv * head_dim``;
- embeddings ``V * H``, and a separate LM head of the same size unless the embeddings are tied;
- the router ``H * E`` per MoE layer. Norms and biases (a few thousand parameters per layer) are left out;
- a multi-token-prediction (MTP) module, as DeepSeek-V3 ships it, is one more MoE decoder layer and a ``2H x H``
  projection, sharing the embeddings and the LM head with the main model. DeepSeek-V3's weights
  (``model.layers.61``) and TensorRT-LLM's load balancer number it after the decoder layers:
  ``num_decoder_layers + i``;
- a decoder layer's attention is full (it caches every token of a request), a window (gpt-oss's sliding window,
  Llama 4's chunks: at most ``W`` tokens, ``attention_window``) or linear (Qwen3-Next's Gated DeltaNet: a state
  of fixed size per request, :class:`LinearAttention`), one kind per layer in ``layer_kinds``. A request of ``c``
  tokens caches ``c`` tokens in a full layer, ``min(c, W)`` in a window layer and the state in a linear one
  (:meth:`ModelSpec.kv_cache_bytes`, the one formula); a linear layer's parameters are its own
  (:meth:`LinearAttention.params`), the others' the attention's.

A spec without :class:`Attention` gives the routing shape only (enough for a synthetic trace or a plan); the
parameter counts beyond one expert's, and the KV cache, then refuse in one line. Every field is checked by
:func:`moebalance.models.fields.check_fields`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from moebalance.core.errors import InputError
from moebalance.models.fields import check_fields

__all__ = ["LAYER_KINDS", "Attention", "LinearAttention", "ModelSpec", "layer_span"]


def layer_span(ids: Sequence[int]) -> str:
    """Layer ids in words: ``"5..20"`` for a run, else the first eight listed (``"1, 2, 70"``)."""
    ids = [int(i) for i in ids]
    if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}"
    return ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")


#: The architecture fields of :class:`ModelSpec` besides ``attention``: zero (not given) without it.
_ARCH_FIELDS = ("vocab_size", "dense_intermediate_size", "total_params", "layer_kinds", "attention_window",
                "linear_attention")

#: A decoder layer's attention (:attr:`ModelSpec.layer_kinds`): ``full`` caches every token of a request, ``window``
#: at most ``attention_window`` of them, ``linear`` a state of fixed size (:class:`LinearAttention`).
LAYER_KINDS = ("full", "window", "linear")

#: Bytes per number of a linear-attention layer's state, by default as SGLang keeps it: the convolution's inputs in
#: bf16 (``SGLANG_MAMBA_CONV_DTYPE`` default; vLLM's ``mamba_cache_dtype`` ``auto``, the model's bf16) and the
#: recurrent state in float32 (``mamba2_state_dtype``'s default where the config names no ``mamba_ssm_dtype``);
#: vLLM's ``mamba_ssm_cache_dtype`` ``auto`` keeps the recurrent state in the model's bf16 (2 bytes: an engine's
#: :attr:`moebalance.engines.base.EngineRule.recurrent_state_bytes`). The KV cache's dtype (``--kv-cache-dtype``)
#: changes neither.
CONV_STATE_BYTES, RECURRENT_STATE_BYTES = 2, 4


@dataclass(kw_only=True, frozen=True, slots=True)
class Attention:
    """A decoder layer's attention: its kind and sizes. Example: DeepSeek-V3 is
    ``Attention(kind="mla", num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128)``; Qwen3-30B-A3B is ``Attention(kind="gqa", num_heads=32,
    num_kv_heads=4, head_dim=128)``."""

    kind: Literal["mla", "gqa"]
    #: ``n_h``: query heads (``num_attention_heads``).
    num_heads: int
    #: GQA: key/value heads (``num_key_value_heads``) and the head size; 0 for MLA.
    num_kv_heads: int = 0
    head_dim: int = 0
    #: MLA: query compression rank (0: no compression, DeepSeek-V2-Lite), KV compression rank, head sizes; 0 for GQA.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    #: GQA: whether the query projection also makes a gate for the output (Qwen3-Next's ``attn_output_gate``), a
    #: second query-sized output.
    output_gate: bool = False

    def __post_init__(self) -> None:
        check_fields(self, choices={"kind": ("mla", "gqa")})
        if not isinstance(self.output_gate, bool) or (self.output_gate and self.kind != "gqa"):
            raise InputError(f"Attention.output_gate ({self.output_gate!r}) must be True or False, and True only for "
                             "GQA attention")
        needs = ("num_kv_heads", "head_dim") if self.kind == "gqa" else \
            ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        check_fields(self, positive=("num_heads", *needs),
                     non_negative=("num_kv_heads", "head_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                   "qk_rope_head_dim", "v_head_dim"))
        others = ("num_kv_heads", "head_dim") if self.kind == "mla" else \
            ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for name in others:
            if getattr(self, name):
                raise InputError(f"Attention.{name} ({getattr(self, name)}) is not a size of {self.kind.upper()} "
                                 f"attention; leave it out (0)")
        if self.kind == "gqa" and self.num_heads % self.num_kv_heads:
            raise InputError(f"Attention.num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                             f"({self.num_kv_heads})")

    def widths(self, absorbed: bool) -> tuple[int, int]:
        """``(score, value)``: the numbers a query head multiplies per key it attends to (``q . k``) and per value it
        sums. GQA: ``head_dim`` both. MLA as its up-projections are applied (prefill): ``qk_nope + qk_rope`` and
        ``v_head_dim``; absorbed into the query and the output (decode, as engines run it): the latent vector,
        ``kv_lora + qk_rope`` and ``kv_lora``."""
        if self.kind == "gqa":
            return self.head_dim, self.head_dim
        if absorbed:
            return self.kv_lora_rank + self.qk_rope_head_dim, self.kv_lora_rank
        return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim

    def params(self, hidden_size: int) -> int:
        """One decoder layer's attention projections (query and its output gate, key/value, output)."""
        H, n = hidden_size, self.num_heads
        if self.kind == "gqa":
            q = H * n * self.head_dim * (2 if self.output_gate else 1)
            return q + 2 * H * self.num_kv_heads * self.head_dim + n * self.head_dim * H
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = H * n * qk if self.q_lora_rank == 0 else H * self.q_lora_rank + self.q_lora_rank * n * qk
        kv = H * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * n * (self.qk_nope_head_dim
                                                                                          + self.v_head_dim)
        return q + kv + n * self.v_head_dim * H

    def kv_numbers_per_layer(self) -> int:
        """Numbers one token caches in one layer: MLA's latent vector, or GQA's keys and values."""
        if self.kind == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim


@dataclass(kw_only=True, frozen=True, slots=True)
class LinearAttention:
    """A linear-attention layer (Gated DeltaNet) and the state one request keeps in it, whatever its length.
    Example: Qwen3-Next-80B-A3B's is ``LinearAttention(num_key_heads=16, num_value_heads=32, key_head_dim=128,
    value_head_dim=128, conv_kernel=4)`` (``linear_num_key_heads``, ``linear_num_value_heads``,
    ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    #: The causal convolution's width over the query, key and value channels.
    conv_kernel: int

    def __post_init__(self) -> None:
        check_fields(self, positive=("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim",
                                     "conv_kernel"))

    def params(self, hidden_size: int) -> int:
        """One linear-attention layer's projections, as vLLM's Gated DeltaNet layer holds them: the query, key,
        value and gate projection ``H (2 n_k d_k + 2 n_v d_v)``, the decay and beta projection ``H 2 n_v``, the
        convolution ``(2 n_k d_k + n_v d_v) conv_kernel`` and the output projection ``n_v d_v H`` (norms and the
        per-head decay constants left out, as for every layer)."""
        H, key, value = hidden_size, self.num_key_heads * self.key_head_dim, self.num_value_heads * self.value_head_dim
        return H * (2 * key + 2 * value) + H * 2 * self.num_value_heads + (2 * key + value) * self.conv_kernel + value * H

    def state_bytes(self, recurrent_bytes: int = RECURRENT_STATE_BYTES) -> int:
        """Bytes one request's state takes in one layer, as vLLM and SGLang shape it: the convolution's last
        ``conv_kernel - 1`` inputs of the query, key and value channels, ``(2 n_k d_k + n_v d_v) (conv_kernel - 1)``
        numbers at :data:`CONV_STATE_BYTES`, and the recurrent state, ``n_v d_v d_k`` numbers at ``recurrent_bytes``
        (default :data:`RECURRENT_STATE_BYTES`). Qwen3-Next: ``8192 x 3 x 2 + 524288 x 4`` = 2,146,304."""
        channels = 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
        recurrent = self.num_value_heads * self.value_head_dim * self.key_head_dim
        return channels * (self.conv_kernel - 1) * CONV_STATE_BYTES + recurrent * recurrent_bytes


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelSpec:
    """One MoE model as its ``config.json`` describes it (module docstring).

    Example: ``MODELS["mixtral-8x7b"]`` has ``num_layers=32, num_experts=8, top_k=2``;
    ``MODELS["deepseek-v3"].kv_bytes_per_request(4096)`` is ``4096 * 61 * (512 + 64) * 2`` bytes in bf16 (MLA).
    """

    #: Registry key, e.g. ``"deepseek-v3"``; stored in traces as ``preset``.
    name: str
    #: Human name, e.g. ``"DeepSeek-V3"``.
    display_name: str
    #: ``L``: MoE layers only (dense layers such as DeepSeek's ``first_k_dense_replace`` ones excluded).
    num_layers: int
    #: Dense (non-MoE) decoder layers, e.g. DeepSeek's ``first_k_dense_replace``; 0 where every layer is MoE.
    #: They come first, unless ``moe_layer_step`` interleaves them.
    num_dense_layers: int
    #: ``E``: routed experts per MoE layer (shared experts excluded).
    num_experts: int
    #: ``K``: routed experts each token picks per layer.
    top_k: int
    #: ``H``, the model (token) dimension: bytes per dispatched token are ``hidden_size * dtype_bytes``.
    hidden_size: int
    #: ``F``: FFN intermediate size of one routed expert.
    moe_intermediate_size: int
    #: Shared experts per MoE layer (every token uses them; they need no placement).
    num_shared_experts: int
    #: Expert groups of group-limited routing (DeepSeek-V3 ``n_group``); 1 where the model has none.
    num_groups: int
    #: Where the numbers come from (model card / ``config.json`` URL).
    source: str
    #: Multi-token-prediction modules (``num_nextn_predict_layers``), each one more MoE layer after the main
    #: model's, not counted in ``num_layers``; 0 where the config has none.
    num_mtp_layers: int = 0
    #: 1: the ``num_dense_layers`` dense layers come first, the MoE layers after them (DeepSeek's
    #: ``first_k_dense_replace``); ``s > 1``: every ``s``-th decoder layer is MoE, layers ``s - 1, 2s - 1, ...``, and
    #: the others dense (Llama 4's ``interleave_moe_layer_step``: Llama 4 Maverick's 2 makes layers 1, 3, ..., 47 MoE).
    moe_layer_step: int = 1
    #: The attention's kind and sizes; ``None``: the routing shape only (no parameter counts, no KV cache).
    attention: Attention | None = None
    #: ``V`` (``vocab_size``); 0 without ``attention``.
    vocab_size: int = 0
    #: FFN size of a dense layer's MLP (``intermediate_size``); unused for a model without dense layers.
    dense_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    #: The precision its released weights are served in (``config.json``'s ``quantization_config``): ``fp8`` where the
    #: checkpoint is FP8; ``mxfp4`` where its routed experts are MXFP4 and every other weight bf16 (gpt-oss); else
    #: ``bf16``.
    served_precision: Literal["bf16", "fp8", "mxfp4"] = "bf16"
    #: Total parameters the model card publishes for the main model (DeepSeek-V3: its MTP module excluded), to
    #: check :meth:`total` against; 0: not published.
    total_params: float = 0.0
    #: Each decoder layer's attention, in order (:data:`LAYER_KINDS`; gpt-oss's ``layer_types``); empty: every
    #: layer ``full``.
    layer_kinds: tuple[str, ...] = ()
    #: ``W``: the tokens a ``window`` layer caches per request at most (gpt-oss's ``sliding_window``, Llama 4's
    #: ``attention_chunk_size``); 0 without window layers.
    attention_window: int = 0
    #: The ``linear`` layers' sizes; ``None`` without linear layers.
    linear_attention: LinearAttention | None = None

    def __post_init__(self) -> None:
        check_fields(self, text=("name", "display_name", "source"),
                     positive=("num_layers", "num_experts", "top_k", "hidden_size", "moe_intermediate_size",
                               "num_groups", "moe_layer_step"),
                     non_negative=("num_dense_layers", "num_shared_experts", "num_mtp_layers", "vocab_size",
                                   "dense_intermediate_size"),
                     flags=("tie_word_embeddings",), non_negative_reals=("total_params",))
        if self.served_precision not in ("bf16", "fp8", "mxfp4"):
            raise InputError(f"ModelSpec.served_precision ({self.served_precision!r}) must be 'bf16', 'fp8' or "
                             "'mxfp4'")
        if self.top_k > self.num_experts:
            raise InputError(f"ModelSpec.top_k ({self.top_k}) must be at most num_experts ({self.num_experts})")
        if self.num_experts % self.num_groups:
            raise InputError(f"ModelSpec.num_experts ({self.num_experts}) must be divisible by "
                             f"num_groups ({self.num_groups})")
        step = self.moe_layer_step
        if step > 1 and self.num_dense_layers != self.num_layers * (step - 1):
            raise InputError(f"ModelSpec.num_dense_layers ({self.num_dense_layers}) must be num_layers x "
                             f"(moe_layer_step - 1) = {self.num_layers * (step - 1)} when every {step}th layer is MoE")
        if self.attention is None:
            given = [name for name in _ARCH_FIELDS if getattr(self, name)]
            if given:
                raise InputError(f"ModelSpec.{given[0]} is given without attention: give attention=Attention(...) "
                                 "with the other architecture sizes, or leave them out")
            return
        if not isinstance(self.attention, Attention):
            raise InputError(f"ModelSpec.attention ({self.attention!r}) must be an Attention or None")
        check_fields(self, positive=("vocab_size", *(("dense_intermediate_size",) if self.num_dense_layers else ())))
        self._check_layer_kinds()

    def _check_layer_kinds(self) -> None:
        """``layer_kinds`` names one kind per decoder layer, with ``attention_window`` exactly when a layer is a
        window and ``linear_attention`` exactly when one is linear."""
        kinds = self.layer_kinds
        if not isinstance(kinds, tuple):
            raise InputError(f"ModelSpec.layer_kinds ({kinds!r}) must be a tuple of {', '.join(LAYER_KINDS)}, one per "
                             "decoder layer")
        bad = next((i for i, k in enumerate(kinds) if k not in LAYER_KINDS), None)
        if bad is not None:
            raise InputError(f"ModelSpec.layer_kinds[{bad}] ({kinds[bad]!r}) must be one of {', '.join(LAYER_KINDS)}")
        if kinds and len(kinds) != self.num_decoder_layers:
            raise InputError(f"ModelSpec.layer_kinds names {len(kinds)} layer{'s' * (len(kinds) != 1)}, but the model "
                             f"has {self.num_decoder_layers} decoder layers: give one kind per layer, or none (all full)")
        check_fields(self, non_negative=("attention_window",))
        if ("window" in kinds) != (self.attention_window > 0):
            raise InputError(f"ModelSpec.attention_window ({self.attention_window}) must be positive exactly when "
                             "layer_kinds has window layers: give the window (sliding_window, attention_chunk_size) "
                             "with them, 0 without")
        linear = self.linear_attention
        if linear is not None and not isinstance(linear, LinearAttention):
            raise InputError(f"ModelSpec.linear_attention ({linear!r}) must be a LinearAttention or None")
        if ("linear" in kinds) != (linear is not None):
            raise InputError("ModelSpec.linear_attention must be given exactly when layer_kinds has linear layers: "
                             "give LinearAttention(...) with them, None without")

    @property
    def has_architecture(self) -> bool:
        """Whether the attention and vocabulary are given (what the parameter counts and the KV cache need)."""
        return self.attention is not None

    @property
    def num_decoder_layers(self) -> int:
        """``num_hidden_layers``: MoE and dense decoder layers (MTP modules excluded)."""
        return self.num_layers + self.num_dense_layers

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """The decoder-layer ids of the MoE layers, as engines number them: ``D .. H - 1`` (DeepSeek-V3: 3..60), or
        every ``moe_layer_step``-th layer (Llama 4 Maverick: 1, 3, ..., 47)."""
        step = self.moe_layer_step
        return tuple(range(self.num_dense_layers if step == 1 else step - 1, self.num_decoder_layers, step))

    def moe_layers_text(self) -> str:
        """:attr:`moe_layer_ids` in words: ``"3..60"``, or ``"1, 3, ..., 47"``."""
        ids = self.moe_layer_ids
        if self.moe_layer_step == 1:
            return f"{ids[0]}..{ids[-1]}"
        return f"{ids[0]}, {ids[1]}, ..., {ids[-1]}" if len(ids) > 2 else ", ".join(map(str, ids))

    @property
    def mtp_layer_ids(self) -> tuple[int, ...]:
        """The layer index engines give each MTP module: right after the decoder layers (DeepSeek-V3: ``(61,)``)."""
        return tuple(range(self.num_decoder_layers, self.num_decoder_layers + self.num_mtp_layers))

    def shape_text(self) -> str:
        """The layers an engine numbers and the experts, in words: ``"61 decoder layers (3 dense, then 58 MoE) and 1
        MTP layer of 256 experts"``."""
        H, D, M = self.num_decoder_layers, self.num_dense_layers, self.num_mtp_layers
        parts = f"{H} MoE layers" if not D else f"{H} decoder layers ({D} dense, then {self.num_layers} MoE)" \
            if self.moe_layer_step == 1 else f"{H} decoder layers ({D} dense, {self.num_layers} MoE: layers " \
            f"{self.moe_layers_text()})"
        return parts + (f" and {M} MTP layer{'s' * (M > 1)}" if M else "") + f" of {self.num_experts} experts"

    def misfit(self, num_rows: int, num_experts: int, layer_ids: Sequence[int] | None = None,
               loaded: Sequence[bool] | None = None) -> str | None:
        """Why a load or plan of ``num_rows`` layers x ``num_experts`` experts is not this model's, or ``None`` when
        it fits: the one rule every command applies (``layer_ids``: the engine layer ids its rows recorded;
        ``loaded``: which rows carry load).

        Rows fit when there are ``E`` experts and the rows are the MoE layers alone (``L``, or the recorded ids
        ``D .. H - 1``, or Llama 4 Maverick's every second, :attr:`moe_layer_ids`; MTP ids ``H .. H + M - 1``
        allowed) or the engine's numbering (``H`` decoder layers, or ``H + M`` with the MTP layers), whose ``D``
        dense rows carry no load.

        Example: ``MODELS["deepseek-v3"].misfit(58, 256) is None``; ``misfit(60, 256)`` says ``"60 layers, but
        DeepSeek-V3 has 61 decoder layers (3 dense, then 58 MoE) and 1 MTP layer of 256 experts"``.
        """
        H, D, M = self.num_decoder_layers, self.num_dense_layers, self.num_mtp_layers
        if num_experts != self.num_experts:
            return f"{num_experts} experts per layer, but {self.display_name} has {self.num_experts}"
        if layer_ids is not None:
            ids, moe = {int(x) for x in layer_ids}, set(self.moe_layer_ids)
            outside = sorted(i for i in ids if i not in moe and not H <= i < H + M)
            if outside:
                return f"layer{'s' * (len(outside) > 1)} {layer_span(outside)}, which {self.display_name} lacks: " \
                       f"its MoE layers are {self.moe_layers_text()}" + \
                    (f" and its MTP layers {H}..{H + M - 1}" if M else "")
            if not moe <= ids:
                return f"layers {min(ids)}..{max(ids)} ({len(ids)}), not every MoE layer {self.moe_layers_text()} of " \
                       f"{self.display_name}"
            return None
        if num_rows not in {H, H + M, self.num_layers}:
            return f"{num_rows} layers, but {self.display_name} has {self.shape_text()}"
        if num_rows != self.num_layers and loaded is not None and self.moe_layer_step > 1:
            dense = [i for i, x in enumerate(list(loaded)[:H]) if x and i not in self.moe_layer_ids]
            if dense:
                return f"load in layer {dense[0]}, which is dense in {self.display_name} (its MoE layers are " \
                       f"{self.moe_layers_text()})"
        elif num_rows != self.num_layers and loaded is not None and any(bool(x) for x in list(loaded)[:D]):
            first = next(i for i, x in enumerate(loaded) if x)
            return f"load in layer {first}, which is dense in {self.display_name} (layers 0..{D - 1})"
        return None

    def check_fits(self, num_rows: int, num_experts: int, layer_ids: Sequence[int] | None = None,
                   loaded: Sequence[bool] | None = None, *, what: str = "the load",
                   fix: str = "give the load's --model") -> None:
        """Raise a one-line :class:`InputError` where :meth:`misfit` says ``what`` is not this model's."""
        why = self.misfit(num_rows, num_experts, layer_ids, loaded)
        if why is not None:
            raise InputError(f"{what} does not fit model {self.name!r}: it has {why}; {fix}")

    def architecture(self) -> Attention:
        """The attention, or a one-line :class:`InputError` when the spec gives the routing shape only."""
        if self.attention is None:
            raise InputError(f"model {self.name!r} gives only its routing shape; the cost model needs its attention "
                             "and vocab_size too: use a preset model or give them")
        return self.attention

    def expert_params(self) -> int:
        """One routed expert: ``3 * H * F``."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def attention_params(self) -> int:
        """One decoder layer's attention projections."""
        return self.architecture().params(self.hidden_size)

    def non_expert_params(self) -> dict[str, int]:
        """Every parameter that is not a routed expert, by part: ``attention``, ``dense_mlp``, ``shared_experts``,
        ``router``, ``embeddings`` (with the LM head). MTP modules excluded."""
        return {
            "attention": (self.num_decoder_layers - self.layer_count("linear")) * self.attention_params()
            + (0 if self.linear_attention is None else
               self.layer_count("linear") * self.linear_attention.params(self.hidden_size)),
            "dense_mlp": self.num_dense_layers * 3 * self.hidden_size * self.dense_intermediate_size,
            "shared_experts": self.num_layers * self.num_shared_experts * self.expert_params(),
            "router": self.num_layers * self.hidden_size * self.num_experts,
            "embeddings": self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2),
        }

    def routed_params(self) -> int:
        """Every routed expert of every MoE layer: ``L * E * 3 * H * F``."""
        return self.num_layers * self.num_experts * self.expert_params()

    def total(self) -> int:
        """The parameter count of the main model (norms, biases and MTP modules left out)."""
        return self.routed_params() + sum(self.non_expert_params().values())

    def mtp_params(self) -> int:
        """Parameters of the MTP modules besides the shared embeddings and LM head: per module one MoE decoder
        layer (attention, routed and shared experts, router) and the ``2H x H`` projection."""
        H, E = self.hidden_size, self.num_experts
        layer = self.attention_params() + (E + self.num_shared_experts) * self.expert_params() + H * E
        return self.num_mtp_layers * (layer + 2 * H * H)

    def kv_shards(self, attention_tp: int) -> int:
        """GPUs of a tensor-parallel attention group that split a token's KV cache: GQA splits its KV heads (copied
        when the group is larger than the heads, as engines do), MLA's one latent vector is whole on every GPU."""
        att = self.architecture()
        return 1 if att.kind == "mla" else max(1, min(attention_tp, att.num_kv_heads))

    def layer_count(self, kind: str) -> int:
        """Decoder layers of attention ``kind`` (:data:`LAYER_KINDS`): gpt-oss-120b has 18 ``window`` layers."""
        return self.layer_kinds.count(kind) if self.layer_kinds else self.num_decoder_layers * (kind == "full")

    def attended_pairs(self, context: float, *, prompt: bool) -> float:
        """The (query, key) pairs one token attends to, summed over the decoder layers: a decode token with
        ``context`` tokens before it (``prompt=False``), or a token of a prompt of ``context`` tokens, on average over
        the prompt (causal: token ``i`` attends to ``i`` tokens, ``1 <= i <= P``). A full layer attends to all of
        them, a window layer to at most ``W`` (the prompt's mean of ``min(i, W)``), a linear layer to none (its
        recurrence's work per token is fixed, like a projection's, and is not counted). Example: a 4,096-token prompt
        of gpt-oss-120b, ``18 x 4097 / 2 + 18 x (128 x 129 / 2 + 3968 x 128) / 4096``."""
        if context < 0:
            raise InputError(f"context ({context}) must be >= 0 tokens")
        W = self.attention_window
        if prompt:  # an empty prompt attends nothing
            m = min(context, W)
            full = (context + 1) / 2 if context > 0 else 0.0
            window = (m * (m + 1) / 2 + max(context - W, 0) * W) / context if context > 0 else 0.0
        else:
            full, window = context, min(context, W)
        return self.layer_count("full") * full + self.layer_count("window") * window

    def kv_cache_bytes(self, tokens: float, requests: float = 1.0, kv_bytes: int = 2, attention_tp: int = 1,
                       state_bytes: int = RECURRENT_STATE_BYTES) -> float:
        """KV-cache bytes ``requests`` requests of ``tokens / requests`` tokens each take on one GPU of a
        tensor-parallel attention group of ``attention_tp`` GPUs (1: all of it), over all decoder layers; the one
        formula of the KV cache (module docstring).

        A full layer caches every token, a window layer ``min(tokens / requests, W)`` of each request, both
        ``kv_numbers_per_layer`` numbers of ``kv_bytes`` per token, split over :meth:`kv_shards` GPUs; a linear layer
        holds :meth:`LinearAttention.state_bytes` per request (its recurrent state at ``state_bytes`` a number),
        split over its key heads' GPUs (vLLM divides the key heads by the group). Example: gpt-oss-120b, one request of 4096 tokens in bf16: ``(18 x 4096 + 18 x 128) x
        1024 x 2`` bytes."""
        if tokens < 0 or requests < 0 or (tokens > 0 and requests == 0):
            raise InputError(f"{tokens} tokens of {requests} requests: give tokens >= 0 held by requests > 0")
        att = self.architecture()
        shards, per_token = self.kv_shards(attention_tp), att.kv_numbers_per_layer() * kv_bytes
        total = tokens * (self.layer_count("full") * per_token) / shards  # full layers: every token
        windows, lin = self.layer_count("window"), self.linear_attention
        if windows and requests:
            total += requests * (windows * min(tokens / requests, self.attention_window) * per_token) / shards
        if lin is not None and requests:
            total += requests * (self.layer_count("linear") * lin.state_bytes(state_bytes)) / max(
                1, min(attention_tp, lin.num_key_heads))
        return total

    def kv_bytes_per_request(self, context_tokens: float, kv_bytes: int = 2, attention_tp: int = 1,
                             state_bytes: int = RECURRENT_STATE_BYTES) -> float:
        """KV-cache bytes one request of ``context_tokens`` tokens takes on one GPU of an attention group of
        ``attention_tp`` GPUs (:meth:`kv_cache_bytes`)."""
        return self.kv_cache_bytes(context_tokens, 1.0, kv_bytes, attention_tp, state_bytes)
