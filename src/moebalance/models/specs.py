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

# One row per model, read from its config.json on Hugging Face (as of 2025). Columns: name, display name,
# L (num_hidden_layers minus first_k_dense_replace dense layers; Qwen3: decoder_sparse_step 1 and no
# mlp_only_layers; GLM-4.5's multi-token-prediction layer excluded), dense layers (first_k_dense_replace),
# E (n_routed_experts / num_experts / num_local_experts), K (num_experts_per_tok), hidden_size,
# expert FFN size (moe_intermediate_size; Mixtral's and OLMoE's intermediate_size, each expert a full FFN),
# shared experts (n_shared_experts; 0 for Qwen3, Mixtral, OLMoE), expert groups (n_group; 1 where routing is
# not group-limited), and the Hugging Face repository.
_ROWS: tuple[tuple[str, str, int, int, int, int, int, int, int, int, str], ...] = (
    ("deepseek-v3", "DeepSeek-V3", 58, 3, 256, 8, 7168, 2048, 1, 8, "deepseek-ai/DeepSeek-V3"),
    # deepseek-v3: L = num_hidden_layers 61 - first_k_dense_replace 3 (moe_layer_freq 1); MTP layer excluded
    ("kimi-k2", "Kimi-K2", 60, 1, 384, 8, 7168, 2048, 1, 1, "moonshotai/Kimi-K2-Instruct"),
    # kimi-k2: L = num_hidden_layers 61 - first_k_dense_replace 1
    ("qwen3-235b-a22b", "Qwen3-235B-A22B", 94, 0, 128, 8, 4096, 1536, 0, 1, "Qwen/Qwen3-235B-A22B"),
    # qwen3-235b-a22b: L = num_hidden_layers 94, decoder_sparse_step 1, mlp_only_layers []
    ("qwen3-30b-a3b", "Qwen3-30B-A3B", 48, 0, 128, 8, 2048, 768, 0, 1, "Qwen/Qwen3-30B-A3B"),
    # qwen3-30b-a3b: L = num_hidden_layers 48, decoder_sparse_step 1, mlp_only_layers []
    ("glm-4.5", "GLM-4.5", 89, 3, 160, 8, 5120, 1536, 1, 1, "zai-org/GLM-4.5"),
    # glm-4.5: L = num_hidden_layers 92 - first_k_dense_replace 3; MTP layer (num_nextn_predict_layers) excluded
    ("mixtral-8x7b", "Mixtral-8x7B", 32, 0, 8, 2, 4096, 14336, 0, 1, "mistralai/Mixtral-8x7B-v0.1"),
    # mixtral-8x7b: L = num_hidden_layers (every layer is MoE)
    ("olmoe-1b-7b", "OLMoE-1B-7B", 16, 0, 64, 8, 2048, 1024, 0, 1, "allenai/OLMoE-1B-7B-0924"),
    # olmoe-1b-7b: L = num_hidden_layers (every layer is MoE)
    ("deepseek-v2-lite", "DeepSeek-V2-Lite", 26, 1, 64, 6, 2048, 1408, 2, 1, "deepseek-ai/DeepSeek-V2-Lite"),
    # deepseek-v2-lite: L = num_hidden_layers 27 - first_k_dense_replace 1
)

MODELS: dict[str, ModelSpec] = {
    row[0]: ModelSpec(name=row[0], display_name=row[1], num_layers=row[2], num_dense_layers=row[3],
                      num_experts=row[4], top_k=row[5], hidden_size=row[6], moe_intermediate_size=row[7],
                      num_shared_experts=row[8], num_groups=row[9], source=f"{_HF}/{row[10]}/blob/main/config.json")
    for row in _ROWS
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
