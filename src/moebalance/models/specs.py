"""Published shape facts of real MoE models, read from each model's ``config.json`` on Hugging Face.

``L`` MoE layers, ``E`` routed experts per layer, ``K`` experts picked per token (top-k). Example:
``get_model("mixtral-8x7b")`` has ``num_layers=32, num_experts=8, top_k=2``. These are facts, not modelling
choices: how each model's routing is imitated (skew, co-activation, drift) is calibrated separately in
:mod:`moebalance.workloads.synth` (``docs/synth.md``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from moebalance.core.errors import InputError

__all__ = ["MODELS", "ModelSpec", "get_model"]


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelSpec:
    """The routing shape of one MoE model, from its ``config.json``.

    Example: ``MODELS["mixtral-8x7b"]`` has ``num_layers=32, num_experts=8, top_k=2``.
    """

    #: Registry key, e.g. ``"deepseek-v3"``; stored in traces as ``preset``.
    name: str
    #: Human name, e.g. ``"DeepSeek-V3"``.
    display_name: str
    #: ``L``: MoE layers only (dense layers such as DeepSeek's ``first_k_dense_replace`` ones excluded).
    num_layers: int
    #: Dense (non-MoE) decoder layers, e.g. DeepSeek's ``first_k_dense_replace``; 0 where every layer is MoE.
    num_dense_layers: int
    #: ``E``: routed experts per MoE layer (shared experts excluded).
    num_experts: int
    #: ``K``: routed experts each token picks per layer.
    top_k: int
    #: Model (token) dimension: bytes per dispatched token are ``hidden_size * dtype_bytes``.
    hidden_size: int
    #: FFN intermediate size of one routed expert.
    moe_intermediate_size: int
    #: Shared experts per MoE layer (every token uses them; they need no placement).
    num_shared_experts: int
    #: Expert groups of group-limited routing (DeepSeek-V3 ``n_group``); 1 where the model has none.
    num_groups: int
    #: Where the numbers come from (model card / ``config.json`` URL).
    source: str

    def __post_init__(self) -> None:
        for field in ("name", "display_name", "source"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise InputError(f"ModelSpec.{field} ({value!r}) must be a non-empty string")
        for field in ("num_layers", "num_experts", "top_k", "hidden_size", "moe_intermediate_size", "num_groups"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                raise InputError(f"ModelSpec.{field} ({value!r}) must be a positive integer")
        for field in ("num_dense_layers", "num_shared_experts"):
            value = getattr(self, field)
            if not _is_int(value) or value < 0:
                raise InputError(f"ModelSpec.{field} ({value!r}) must be an integer >= 0")
        if self.top_k > self.num_experts:
            raise InputError(f"ModelSpec.top_k ({self.top_k}) must be at most num_experts ({self.num_experts})")
        if self.num_experts % self.num_groups:
            raise InputError(f"ModelSpec.num_experts ({self.num_experts}) must be divisible by "
                             f"num_groups ({self.num_groups})")


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


_HF = "https://huggingface.co"

# Each number below is the named field of the model's config.json (Hugging Face), read as of 2025.
MODELS: dict[str, ModelSpec] = {
    "deepseek-v3": ModelSpec(
        name="deepseek-v3",
        display_name="DeepSeek-V3",
        num_layers=58,  # num_hidden_layers 61 - first_k_dense_replace 3 (moe_layer_freq 1); MTP layer excluded
        num_dense_layers=3,  # first_k_dense_replace
        num_experts=256,  # n_routed_experts
        top_k=8,  # num_experts_per_tok
        hidden_size=7168,  # hidden_size
        moe_intermediate_size=2048,  # moe_intermediate_size
        num_shared_experts=1,  # n_shared_experts
        num_groups=8,  # n_group (topk_group 4)
        source=f"{_HF}/deepseek-ai/DeepSeek-V3/blob/main/config.json",
    ),
    "kimi-k2": ModelSpec(
        name="kimi-k2",
        display_name="Kimi-K2",
        num_layers=60,  # num_hidden_layers 61 - first_k_dense_replace 1
        num_dense_layers=1,  # first_k_dense_replace
        num_experts=384,  # n_routed_experts
        top_k=8,  # num_experts_per_tok
        hidden_size=7168,  # hidden_size
        moe_intermediate_size=2048,  # moe_intermediate_size
        num_shared_experts=1,  # n_shared_experts
        num_groups=1,  # n_group
        source=f"{_HF}/moonshotai/Kimi-K2-Instruct/blob/main/config.json",
    ),
    "qwen3-235b-a22b": ModelSpec(
        name="qwen3-235b-a22b",
        display_name="Qwen3-235B-A22B",
        num_layers=94,  # num_hidden_layers 94, decoder_sparse_step 1, mlp_only_layers []
        num_dense_layers=0,  # mlp_only_layers []
        num_experts=128,  # num_experts
        top_k=8,  # num_experts_per_tok
        hidden_size=4096,  # hidden_size
        moe_intermediate_size=1536,  # moe_intermediate_size
        num_shared_experts=0,  # Qwen3-MoE has no shared expert
        num_groups=1,  # no group-limited routing
        source=f"{_HF}/Qwen/Qwen3-235B-A22B/blob/main/config.json",
    ),
    "qwen3-30b-a3b": ModelSpec(
        name="qwen3-30b-a3b",
        display_name="Qwen3-30B-A3B",
        num_layers=48,  # num_hidden_layers 48, decoder_sparse_step 1, mlp_only_layers []
        num_dense_layers=0,  # mlp_only_layers []
        num_experts=128,  # num_experts
        top_k=8,  # num_experts_per_tok
        hidden_size=2048,  # hidden_size
        moe_intermediate_size=768,  # moe_intermediate_size
        num_shared_experts=0,  # Qwen3-MoE has no shared expert
        num_groups=1,  # no group-limited routing
        source=f"{_HF}/Qwen/Qwen3-30B-A3B/blob/main/config.json",
    ),
    "glm-4.5": ModelSpec(
        name="glm-4.5",
        display_name="GLM-4.5",
        num_layers=89,  # num_hidden_layers 92 - first_k_dense_replace 3; MTP layer (num_nextn_predict_layers) excluded
        num_dense_layers=3,  # first_k_dense_replace
        num_experts=160,  # n_routed_experts
        top_k=8,  # num_experts_per_tok
        hidden_size=5120,  # hidden_size
        moe_intermediate_size=1536,  # moe_intermediate_size
        num_shared_experts=1,  # n_shared_experts
        num_groups=1,  # n_group
        source=f"{_HF}/zai-org/GLM-4.5/blob/main/config.json",
    ),
    "mixtral-8x7b": ModelSpec(
        name="mixtral-8x7b",
        display_name="Mixtral-8x7B",
        num_layers=32,  # num_hidden_layers (every layer is MoE)
        num_dense_layers=0,  # every layer is MoE
        num_experts=8,  # num_local_experts
        top_k=2,  # num_experts_per_tok
        hidden_size=4096,  # hidden_size
        moe_intermediate_size=14336,  # intermediate_size (each expert is a full FFN)
        num_shared_experts=0,
        num_groups=1,
        source=f"{_HF}/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json",
    ),
    "olmoe-1b-7b": ModelSpec(
        name="olmoe-1b-7b",
        display_name="OLMoE-1B-7B",
        num_layers=16,  # num_hidden_layers (every layer is MoE)
        num_dense_layers=0,  # every layer is MoE
        num_experts=64,  # num_experts
        top_k=8,  # num_experts_per_tok
        hidden_size=2048,  # hidden_size
        moe_intermediate_size=1024,  # intermediate_size (per expert)
        num_shared_experts=0,
        num_groups=1,
        source=f"{_HF}/allenai/OLMoE-1B-7B-0924/blob/main/config.json",
    ),
    "deepseek-v2-lite": ModelSpec(
        name="deepseek-v2-lite",
        display_name="DeepSeek-V2-Lite",
        num_layers=26,  # num_hidden_layers 27 - first_k_dense_replace 1
        num_dense_layers=1,  # first_k_dense_replace
        num_experts=64,  # n_routed_experts
        top_k=6,  # num_experts_per_tok
        hidden_size=2048,  # hidden_size
        moe_intermediate_size=1408,  # moe_intermediate_size
        num_shared_experts=2,  # n_shared_experts
        num_groups=1,  # n_group (topk_method "greedy")
        source=f"{_HF}/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json",
    ),
}
# DeepSeek-R1 is DeepSeek-V3's architecture (same config.json fields), post-trained differently.
MODELS["deepseek-r1"] = dataclasses.replace(
    MODELS["deepseek-v3"], name="deepseek-r1", display_name="DeepSeek-R1",
    source=f"{_HF}/deepseek-ai/DeepSeek-R1/blob/main/config.json",
)


def get_model(name: str) -> ModelSpec:
    """The model called ``name`` (a key of :data:`MODELS`); an unknown name raises :class:`InputError`."""
    spec = MODELS.get(name)
    if spec is None:
        raise InputError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return spec
