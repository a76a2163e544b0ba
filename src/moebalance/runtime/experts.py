"""Expert weights, the expert FFN, and the single-process dense reference of the MoE layer.

Legend (torchtitan's): ``T`` tokens, ``H`` hidden size, ``F`` expert FFN size, ``E`` logical experts,
``S`` experts a rank holds (its physical slots), ``K`` picks per token.

An expert is a two-layer MLP without biases, as in Mixtral / DeepSeek / Qwen MoE layers:

- ``swiglu``: ``y = (silu(x @ w1) * (x @ w3)) @ w2``,
- ``gelu``: ``y = gelu(x @ w1) @ w2`` (``w3`` is ``None``),

with ``w1, w3 [E, H, F]`` and ``w2 [E, F, H]``. The gate is ``logits = x @ gate [H, E]``, replicated on
every rank. :func:`dense_moe` is the reference the expert-parallel layer must equal (docs/design.md, "Runtime"): every
expert on every token in one process, mixed by the gate weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from moebalance.core.errors import InputError
from moebalance.runtime.gating import GateConfig, GateOutput, topk_gating

__all__ = ["Activation", "ExpertWeights", "dense_moe", "expert_ffn", "random_experts"]

Activation = Literal["swiglu", "gelu"]


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """The weights of ``S`` experts (all ``E`` logical ones, or the physical slots one rank holds).

    Example: 8 SwiGLU experts with ``H = 16, F = 32``: ``w1, w3 [8, 16, 32]``, ``w2 [8, 32, 16]``.
    """

    #: ``[S, H, F]``: input projection (SwiGLU's gate projection).
    w1_SHF: torch.Tensor
    #: ``[S, F, H]``: output projection.
    w2_SFH: torch.Tensor
    #: ``[S, H, F]``: SwiGLU's up projection; ``None`` for GELU.
    w3_SHF: torch.Tensor | None = None

    def __post_init__(self) -> None:
        S, H, Fd = self.w1_SHF.shape
        if tuple(self.w2_SFH.shape) != (S, Fd, H):
            raise InputError(f"w2 has shape {tuple(self.w2_SFH.shape)}; with w1 [{S}, {H}, {Fd}] it must be "
                             f"[{S}, {Fd}, {H}]")
        if self.w3_SHF is not None and self.w3_SHF.shape != self.w1_SHF.shape:
            raise InputError(f"w3 has shape {tuple(self.w3_SHF.shape)}; it must match w1 {tuple(self.w1_SHF.shape)}")

    @property
    def activation(self) -> Activation:
        return "gelu" if self.w3_SHF is None else "swiglu"

    @property
    def num_experts(self) -> int:
        return int(self.w1_SHF.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.w1_SHF.shape[1])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The weight tensors in a fixed order (``w1, w2[, w3]``), for packing and moving."""
        return (self.w1_SHF, self.w2_SFH) if self.w3_SHF is None else (self.w1_SHF, self.w2_SFH, self.w3_SHF)

    def select(self, experts: Sequence[int]) -> ExpertWeights:
        """Copies of experts ``experts`` (repeats allowed), in that order: what a rank of a plan holds."""
        idx = torch.as_tensor(list(experts), dtype=torch.long, device=self.w1_SHF.device)
        return ExpertWeights(self.w1_SHF.index_select(0, idx), self.w2_SFH.index_select(0, idx),
                             None if self.w3_SHF is None else self.w3_SHF.index_select(0, idx))

    def bytes_per_expert(self) -> int:
        """Bytes of one expert's weights (also for a rank that holds none: the shape is known)."""
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self.tensors())


def random_experts(num_experts: int, hidden_size: int, ffn_size: int, *, activation: Activation = "swiglu",
                   seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   ) -> ExpertWeights:
    """Seeded random weights (scaled ``1 / sqrt(fan_in)``), identical on every rank for the same seed."""
    if activation not in ("swiglu", "gelu"):
        raise InputError(f"activation ({activation!r}) must be 'swiglu' or 'gelu'")
    gen = torch.Generator().manual_seed(seed)
    E, H, Fd = num_experts, hidden_size, ffn_size
    w1 = torch.randn(E, H, Fd, generator=gen) / H**0.5
    w2 = torch.randn(E, Fd, H, generator=gen) / Fd**0.5
    w3 = torch.randn(E, H, Fd, generator=gen) / H**0.5 if activation == "swiglu" else None
    return ExpertWeights(w1.to(device, dtype), w2.to(device, dtype), None if w3 is None else w3.to(device, dtype))


def expert_ffn(x_TH: torch.Tensor, experts: ExpertWeights, slot: int) -> torch.Tensor:
    """``[T, H]``: expert ``slot`` of ``experts`` applied to every row of ``x``."""
    h = x_TH @ experts.w1_SHF[slot]
    if experts.w3_SHF is None:
        h = F.gelu(h)
    else:
        h = F.silu(h) * (x_TH @ experts.w3_SHF[slot])
    return h @ experts.w2_SFH[slot]


def dense_moe(x_TH: torch.Tensor, gate_HE: torch.Tensor, experts: ExpertWeights, config: GateConfig, *,
              group_sizes: Sequence[int] | None = None, selection_bias_E: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, GateOutput]:
    """The MoE layer in one process: ``(out [T, H], gate output)``.

    Every expert runs on every token; token ``t``'s output is ``sum_k w[t, k] * expert_{ids[t, k]}(x[t])``,
    summed over ``k`` in pick order (dropped picks have ``w = 0``). ``group_sizes`` splits the tokens into
    consecutive capacity groups (one per rank in the expert-parallel layer; the whole batch by default).
    """
    T = x_TH.shape[0]
    sizes = [T] if group_sizes is None else list(group_sizes)
    if sum(sizes) != T or any(s < 0 for s in sizes):
        raise InputError(f"group_sizes {sizes} must be non-negative and sum to the {T} tokens")
    outs = [topk_gating(xg @ gate_HE, config, selection_bias_E=selection_bias_E) for xg in x_TH.split(sizes)]
    gate = GateOutput(topk_ids=torch.cat([o.topk_ids for o in outs]),
                      topk_weights=torch.cat([o.topk_weights for o in outs]),
                      kept=torch.cat([o.kept for o in outs]), scores=torch.cat([o.scores for o in outs]))
    y_ETH = torch.stack([expert_ffn(x_TH, experts, e) for e in range(experts.num_experts)])  # [E, T, H]
    tok = torch.arange(T, device=x_TH.device)
    out = torch.zeros_like(x_TH, dtype=torch.float32)
    for k in range(config.top_k):
        out += gate.topk_weights[:, k, None] * y_ETH[gate.topk_ids[:, k], tok].float()
    return out.to(x_TH.dtype), gate
