"""A small byte-level decoder-only MoE language model whose MoE layers the expert-parallel runtime can execute.

Legend (torchtitan's): ``B`` sequences, ``S`` positions, ``T = B * S`` tokens, ``D`` model width (the MoE
layer's hidden size ``H``), ``V`` vocabulary, ``E`` experts per MoE layer, ``K`` picks per token, ``F``
expert FFN size, ``L`` MoE layers (every block is one).

Architecture: token + learned position embeddings; ``L`` pre-norm blocks of causal multi-head self-attention
and an MoE FFN, each added to the residual stream; a final LayerNorm and an output head tied to the token
embedding. The vocabulary is the 256 byte values plus :data:`SPECIALS` (no tokenizer to download).

The MoE FFN is the runtime's layer, not a copy of it:

- the gate is ``logits = h @ gate [D, E]`` through :func:`moebalance.runtime.gating.topk_gating` (docs/papers/routing.md:
  softmax over all experts, top-k with ties to the lowest index, the ``K`` kept gates renormalised to 1);
- the experts are :class:`~moebalance.runtime.experts.ExpertWeights` (SwiGLU ``w1, w3 [E, D, F]``,
  ``w2 [E, F, D]``) run by :func:`~moebalance.runtime.experts.expert_ffn`.

So :meth:`MoELM.moe_parts` hands the runtime exactly the gate and experts the model trains, and
:meth:`MoELM.forward` takes an optional ``moe`` callable that replaces every MoE layer's computation (given the
layer index and the layer's input ``h [T, D]``, it returns the layer's output ``[T, D]``): that is how the
expert-parallel runtime and the dense reference run the model's MoE layers unchanged.

No auxiliary balancing loss by default: routing skew is what this model is for. ``aux_loss_coef > 0`` adds
Switch Transformer's load-balancing loss (Fedus et al. 2021, Eq. 4), ``E * sum_e f_e * P_e`` per layer, with
``f_e`` the fraction of the ``T * K`` picks that chose ``e`` and ``P_e`` the mean gate probability of ``e``;
the layers' losses are averaged. ``balance_bias=True`` instead gives every MoE layer DeepSeek-V3's
auxiliary-loss-free bias (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts",
arXiv:2408.15664): a per-expert term added to the scores only when choosing the top-k, raised for
under-loaded experts and lowered for over-loaded ones after every training step, so routing spreads over the
experts without a loss term pulling on the gate.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moebalance.core.errors import InputError
from moebalance.core.io import atomic_path
from moebalance.models.fields import check_fields
from moebalance.runtime.experts import ExpertWeights, expert_ffn
from moebalance.runtime.gating import GateConfig, GateOutput, topk_gating

__all__ = ["BOS", "BUNDLED_CHECKPOINT", "BUNDLED_CHECKPOINTS", "CAPTURE_CHECKPOINT", "CHECKPOINT_FORMAT", "EOS", "PAD", "SPECIALS",
           "VOCAB_SIZE", "ForwardOutput", "MoEFFN", "MoELM", "ModelConfig", "MoeFn", "bundled_checkpoint", "bundled_for",
           "checkpoint_config", "decode", "encode", "load_checkpoint", "save_checkpoint"]

#: ``format`` in a checkpoint's safetensors metadata.
CHECKPOINT_FORMAT = "moebalance.moe_lm"

#: Special tokens after the 256 byte values: document start, document end, padding.
SPECIALS = ("<bos>", "<eos>", "<pad>")
BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 256 + len(SPECIALS)

#: ``(layer, h [T, D]) -> out [T, D]``: a replacement for the computation of MoE layer ``layer``.
MoeFn = Callable[[int, torch.Tensor], torch.Tensor]


def encode(data: bytes) -> torch.Tensor:
    """``int64 [n]``: the byte values of ``data`` (token ids 0..255)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def decode(ids: torch.Tensor) -> bytes:
    """The bytes of ``ids``, special tokens left out."""
    return bytes(int(i) for i in ids.reshape(-1).tolist() if 0 <= i < 256)


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelConfig:
    """The network config of the small LM this package trains: the shape of the ``nn.Module`` to build.

    Example: ``ModelConfig(d_model=128, num_layers=4, num_experts=16, top_k=2)`` is 4 blocks, each an MoE
    layer of 16 SwiGLU experts of which every token uses 2.

    Not a :class:`moebalance.models.ModelSpec`: a spec describes a published model that engines serve (its
    ``config.json``: MoE and dense layers, shared experts, MLA or GQA, expert groups, MTP layers, sources) so that
    traces can imitate it and the cost model can weigh it; this config builds and checkpoints our own network
    (every block MoE, learned positions, the balancing bias), and nothing here is published. Both check their
    fields with :func:`moebalance.models.fields.check_fields`.
    """

    vocab_size: int = VOCAB_SIZE
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 4
    num_experts: int = 16
    top_k: int = 2
    #: Hidden size of each expert's SwiGLU FFN.
    ffn_size: int = 64
    #: Longest sequence (learned position embeddings).
    max_seq_len: int = 128
    #: DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias ``[E]`` added to the scores when choosing
    #: the top-k (never to the mixing weights), nudged during training towards equal loads
    #: (:class:`moebalance.lm.train.TrainConfig` ``bias_update``) and frozen afterwards.
    balance_bias: bool = False

    def __post_init__(self) -> None:
        check_fields(self, flags=("balance_bias",), label="",
                     positive=("vocab_size", "d_model", "num_heads", "num_layers", "num_experts", "top_k", "ffn_size",
                               "max_seq_len"))
        if self.vocab_size < VOCAB_SIZE:
            raise InputError(f"vocab_size ({self.vocab_size}) must hold the 256 bytes and {len(SPECIALS)} specials")
        if self.d_model % self.num_heads:
            raise InputError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if not 1 <= self.top_k <= min(8, self.num_experts):
            raise InputError(f"top_k ({self.top_k}) must be between 1 and min(8, num_experts={self.num_experts})")

    def gate_config(self) -> GateConfig:
        """Page 002's gating: softmax, top-k, renormalised, no capacity (no pick is ever dropped)."""
        return GateConfig(top_k=self.top_k, score_fn="softmax", renormalize=True, capacity_factor=None)

    def as_dict(self) -> dict[str, int | bool]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """The config from its JSON form (a checkpoint's metadata); each value is checked as given, never
        converted (``1.5`` or ``"128"`` is refused, not read as ``1`` or ``128``)."""
        if not isinstance(d, dict):
            raise InputError(f"a model config must be a JSON object of its fields, not {type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InputError(f"unknown model config keys {unknown}; known: {sorted(known)}")
        return cls(**d)


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """What one forward computed.

    Example: 2 sequences of 8 tokens through 4 MoE layers, top-2: ``logits [2, 8, V]``,
    ``topk_ids [16, 4, 2]`` (token ``t = b * 8 + s``), ``aux_loss`` a scalar (0 without the balancing loss).
    """

    #: ``float32 [B, S, V]``.
    logits: torch.Tensor
    #: ``int64 [T, L, K]``: the experts each token picked in each MoE layer (tokens sequence-major);
    #: ``None`` when a ``moe`` callable replaced the layers (it sees the routing itself).
    topk_ids: torch.Tensor | None
    #: Switch load-balancing loss averaged over layers (0-d; zero unless asked for).
    aux_loss: torch.Tensor
    #: ``[T, L, D]``: each MoE layer's input (the gate's input), if asked for.
    moe_inputs: torch.Tensor | None = None


class MoEFFN(nn.Module):
    """One MoE FFN: the gate ``[D, E]`` and ``E`` SwiGLU experts, trained sparsely (each expert sees its picks)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D, E, Fd = config.d_model, config.num_experts, config.ffn_size
        self.gate_config = config.gate_config()
        self.gate = nn.Parameter(torch.empty(D, E))
        self.w1 = nn.Parameter(torch.empty(E, D, Fd))
        self.w2 = nn.Parameter(torch.empty(E, Fd, D))
        self.w3 = nn.Parameter(torch.empty(E, D, Fd))
        #: ``[E]`` selection bias (a buffer: trained by the balancing rule, not by gradients), or ``None``.
        self.bias: torch.Tensor | None
        if config.balance_bias:
            self.register_buffer("bias", torch.zeros(E))
        else:
            self.bias = None

    def experts(self) -> ExpertWeights:
        """The experts as the runtime holds them (views of the parameters)."""
        return ExpertWeights(self.w1, self.w2, self.w3)

    def forward(self, h_TD: torch.Tensor, aux: bool = False) -> tuple[torch.Tensor, GateOutput, torch.Tensor]:
        """``(out [T, D], gate output, Switch balancing loss)``; the loss is 0 unless ``aux``."""
        T, D = h_TD.shape
        E, K = self.gate.shape[1], self.gate_config.top_k
        gate = topk_gating(h_TD @ self.gate, self.gate_config, selection_bias_E=self.bias)
        ids = gate.topk_ids.reshape(-1)
        weight = gate.topk_weights.reshape(-1)
        token = torch.arange(T, device=h_TD.device).repeat_interleave(K)
        order = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids, minlength=E)
        experts = self.experts()
        out = torch.zeros((T, D), dtype=torch.float32, device=h_TD.device)
        for e, picks in enumerate(torch.split(order, counts.tolist())):
            if picks.numel() == 0:
                continue
            t = token[picks]
            y = expert_ffn(h_TD.index_select(0, t), experts, e).float()
            out.index_add_(0, t, y * weight[picks, None])
        loss = h_TD.new_zeros(())
        if aux and T:
            frac = counts.float() / (T * K)
            loss = E * (frac * gate.scores.mean(dim=0)).sum()
        return out.to(h_TD.dtype), gate, loss


class Block(nn.Module):
    """Pre-norm causal self-attention, then the MoE FFN."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D = config.d_model
        self.num_heads = config.num_heads
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        self.ln2 = nn.LayerNorm(D)
        self.moe = MoEFFN(config)

    def attention(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(self.ln1(x_BSD)).split(D, dim=-1)
        q, k, v = (t.view(B, S, self.num_heads, D // self.num_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, S, D))


@dataclass(slots=True)
class _Record:
    ids: list[torch.Tensor] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)


class MoELM(nn.Module):
    """The language model. ``forward(idx [B, S])`` returns :class:`ForwardOutput`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Parameter(torch.empty(config.max_seq_len, config.d_model))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2-style init from the global torch generator (seed it first): normal(0, 0.02), output
        projections scaled by ``1 / sqrt(2 L)``, experts ``1 / sqrt(fan_in)``, the gate normal(0, 0.02)."""
        c = self.config
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb, std=0.01)
        for blk in self.blocks:
            assert isinstance(blk, Block)
            nn.init.normal_(blk.qkv.weight, std=0.02)
            nn.init.normal_(blk.proj.weight, std=0.02 / math.sqrt(2 * c.num_layers))
            nn.init.normal_(blk.moe.gate, std=0.02)
            nn.init.normal_(blk.moe.w1, std=1 / math.sqrt(c.d_model))
            nn.init.normal_(blk.moe.w3, std=1 / math.sqrt(c.d_model))
            nn.init.normal_(blk.moe.w2, std=1 / math.sqrt(c.ffn_size) / math.sqrt(2 * c.num_layers))

    def moe_parts(self, layer: int) -> tuple[torch.Tensor, ExpertWeights, GateConfig, torch.Tensor | None]:
        """``(gate [D, E], experts, gate config, selection bias [E] or None)`` of MoE layer ``layer``, detached:
        what the runtime runs."""
        blk = self.blocks[layer]
        assert isinstance(blk, Block)
        ex = blk.moe.experts()
        return (blk.moe.gate.detach(), ExpertWeights(ex.w1_SHF.detach(), ex.w2_SFH.detach(),
                                                      None if ex.w3_SHF is None else ex.w3_SHF.detach()),
                blk.moe.gate_config, None if blk.moe.bias is None else blk.moe.bias.detach().clone())

    def forward(self, idx_BS: torch.Tensor, *, moe: MoeFn | None = None, aux: bool = False,
                keep_inputs: bool = False) -> ForwardOutput:
        """Logits for ``idx [B, S]``; ``moe`` replaces the MoE layers' computation (see the module docstring)."""
        B, S = idx_BS.shape
        if S > self.config.max_seq_len:
            raise InputError(f"sequences of {S} tokens exceed the model's max_seq_len ({self.config.max_seq_len})")
        x = self.tok_emb(idx_BS) + self.pos_emb[:S]
        rec = _Record()
        aux_total = x.new_zeros(())
        for layer, blk in enumerate(self.blocks):
            assert isinstance(blk, Block)
            x = x + blk.attention(x)
            h_TD = blk.ln2(x).reshape(B * S, self.config.d_model)
            if keep_inputs:
                rec.inputs.append(h_TD.detach())
            if moe is None:
                y, gate, loss = blk.moe(h_TD, aux)
                rec.ids.append(gate.topk_ids)
                aux_total = aux_total + loss
            else:
                y = moe(layer, h_TD)
            x = x + y.reshape(B, S, self.config.d_model)
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)
        L = self.config.num_layers
        return ForwardOutput(
            logits=logits,
            topk_ids=torch.stack(rec.ids, dim=1) if rec.ids else None,
            aux_loss=aux_total / L,
            moe_inputs=torch.stack(rec.inputs, dim=1) if keep_inputs else None)


# ----- checkpoints ---------------------------------------------------------------------------------------------

#: The first checkpoint shipped in the package (4 MoE layers of 16 experts, top-2; trained by
#: ``python -m moebalance.lm.train``).
BUNDLED_CHECKPOINT = "moe_lm.safetensors"
#: Every checkpoint shipped in the package: the first, and 8 MoE layers of 32 experts, top-4, trained with the
#: auxiliary-loss-free balancing bias (docs/results/libra.md, "The model").
BUNDLED_CHECKPOINTS = (BUNDLED_CHECKPOINT, "moe_lm_8x32.safetensors")
#: What ``moebalance capture`` runs by default: the model with enough layers, experts and balance to study
#: prediction on (``run`` and the lookahead predictor pick the bundled model of a plan's or capture's shape).
CAPTURE_CHECKPOINT = "moe_lm_8x32.safetensors"


def bundled_checkpoint(name: str = BUNDLED_CHECKPOINT) -> Path:
    """Path of a bundled checkpoint (``moebalance/lm/weights/NAME``)."""
    from importlib import resources

    if name not in BUNDLED_CHECKPOINTS:
        raise InputError(f"no bundled checkpoint {name!r}; bundled: {', '.join(BUNDLED_CHECKPOINTS)}")
    return Path(str(resources.files("moebalance.lm") / "weights" / name))


def checkpoint_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The model config stored in a checkpoint's metadata (the weights are not read)."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    try:
        with safe_open(str(p), framework="pt") as fh:
            meta = fh.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"cannot read checkpoint {str(p)!r}: {exc}") from None
    if meta.get("format") != CHECKPOINT_FORMAT or "config" not in meta:
        raise InputError(f"{str(p)!r} is not a moebalance MoE LM checkpoint (no {CHECKPOINT_FORMAT!r} metadata)")
    return stored_config(meta, p)


def stored_config(meta: dict[str, str], path: Path) -> ModelConfig:
    """The config a checkpoint's metadata holds as JSON; corrupt JSON is one line naming the file."""
    try:
        doc = json.loads(meta["config"])
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise InputError(f"checkpoint {str(path)!r} holds a corrupt config in its metadata ({exc}); write it again "
                         "with moebalance.lm.train") from None
    return ModelConfig.from_dict(doc)


def bundled_for(num_layers: int, num_experts: int, top_k: int) -> Path:
    """The bundled checkpoint with this many MoE layers, experts and picks (the model a capture came from)."""
    for name in BUNDLED_CHECKPOINTS:
        p = bundled_checkpoint(name)
        c = checkpoint_config(p)
        if (c.num_layers, c.num_experts, c.top_k) == (num_layers, num_experts, top_k):
            return p
    raise InputError(f"no bundled model has {num_layers} MoE layers of {num_experts} experts, top-{top_k}; give "
                     "the checkpoint that made the capture with --checkpoint")


def save_checkpoint(path: str | os.PathLike[str], model: MoELM, dtype: torch.dtype = torch.float16) -> None:
    """Write the weights as safetensors (``dtype``; the config in the metadata), atomically."""
    from safetensors.torch import save_file

    p = Path(path)
    if p.suffix != ".safetensors":
        raise InputError(f"checkpoint {str(p)!r} must end in .safetensors")
    # The balancing biases stay float32: rounding them would move near-tied picks between the model as
    # trained and as stored.
    tensors = {k: v.detach().to(torch.float32 if k.endswith("moe.bias") else dtype).contiguous()
               for k, v in model.state_dict().items()}
    with atomic_path(p) as tmp:
        save_file(tensors, str(tmp), metadata={"format": CHECKPOINT_FORMAT,
                                               "config": json.dumps(model.config.as_dict())})


def load_checkpoint(path: str | os.PathLike[str] | None = None) -> MoELM:
    """The model stored at ``path`` (default: the bundled one) in float32, in eval mode."""
    from safetensors import SafetensorError, safe_open

    p = bundled_checkpoint() if path is None else Path(path)
    if not p.is_file():
        raise InputError(f"checkpoint {str(p)!r} does not exist")
    try:
        with safe_open(str(p), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"cannot read checkpoint {str(p)!r}: {exc}") from None
    if meta.get("format") != CHECKPOINT_FORMAT or "config" not in meta:
        raise InputError(f"{str(p)!r} is not a moebalance MoE LM checkpoint (no {CHECKPOINT_FORMAT!r} metadata)")
    model = MoELM(stored_config(meta, p))
    want = model.state_dict()
    if set(want) != set(tensors) or any(want[k].shape != tensors[k].shape for k in want):
        raise InputError(f"checkpoint {str(p)!r} does not match its config (tensor names or shapes differ)")
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    return model.eval()
