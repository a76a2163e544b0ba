"""Capture a token-level routing trace (docs/design.md, "Data formats") by running the MoE LM on text.

Legend: ``N`` tokens captured, ``S`` tokens per sequence, ``P`` sequences per batch, ``G`` data-parallel
ranks (GPUs), ``L`` MoE layers, ``K`` picks per token, ``D`` model width.

Layout (shared with :mod:`moebalance.lm.run`, so a capture and a run of the same text see the same
batches): the text is cut into consecutive sequences of ``S`` tokens (a tail shorter than ``S`` is left out);
batch ``b`` holds sequences ``b * P .. (b + 1) * P - 1`` with ``P = batch_tokens / S`` (the last batch may
hold fewer); sequence ``j`` of a batch lives on rank ``j % G`` (round-robin, as a data-parallel server
spreads requests). Within a batch, tokens are listed **rank-major** (all of rank 0's tokens, then rank 1's,
...), each rank's sequences in order, positions in order: the order in which the expert-parallel runtime
gathers a batch's routing, so a router that depends on token order (``uniform``'s round-robin) gives the
same GPU to every pick in the simulator and at run time.

Each batch is one forward of the single-process model (its own sparse MoE path), every sequence starting
from position 0: sequences do not see each other.

The file holds ``counts [B, L, E]``, ``topk_ids [N, L, K]``, ``src_gpu [N]``, ``batch [N]``,
``preset`` = ``"moebalance-moe-lm"``, plus ``token_ids [N]`` (``uint16``, the tokens themselves) and, with
``hidden_states=True``, ``hidden_states [N, L, D]`` (``float16``: each MoE layer's input, the gate's input).
:func:`moebalance.core.load.read_load` reads it (it ignores the extra keys).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from moebalance.core.errors import InputError
from moebalance.core.io import write_npz
from moebalance.core.load import LM_PRESET, LoadMatrix
from moebalance.core.trace import RoutingTrace
from moebalance.lm.moe_lm import MoELM

__all__ = ["PRESET", "Capture", "Layout", "capture", "make_layout", "write_capture"]

#: The ``preset`` string of a capture (a load of this name has no served-model spec).
PRESET = LM_PRESET


@dataclass(frozen=True, slots=True)
class Layout:
    """Which sequence goes to which batch and rank.

    Example: 5 sequences of 4 tokens, ``batch_tokens = 12`` (3 per batch), 2 ranks:
    ``ranks = [[[0, 2], [1]], [[3], [4]]]`` (batch 0: rank 0 holds sequences 0 and 2, rank 1 sequence 1).
    """

    seq_len: int
    num_gpus: int
    #: ``[B][G]`` lists of sequence indices.
    ranks: list[list[list[int]]]

    @property
    def num_batches(self) -> int:
        return len(self.ranks)

    def token_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(sequence [N], src_gpu [N], batch [N])``, ``int64``, tokens in trace order (positions implied)."""
        seq, src, bat = [], [], []
        for b, per_rank in enumerate(self.ranks):
            for g, seqs in enumerate(per_rank):
                for s in seqs:
                    seq.append(s)
                    src.append(g)
                    bat.append(b)
        rep = self.seq_len
        return (np.repeat(np.asarray(seq, dtype=np.int64), rep), np.repeat(np.asarray(src, dtype=np.int64), rep),
                np.repeat(np.asarray(bat, dtype=np.int64), rep))


def make_layout(num_tokens: int, *, seq_len: int, batch_tokens: int, num_gpus: int) -> Layout:
    """The layout of ``num_tokens`` tokens (see the module docstring)."""
    for name, v in (("seq_len", seq_len), ("batch_tokens", batch_tokens), ("num_gpus", num_gpus)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} ({v!r}) must be a positive integer")
    if batch_tokens % seq_len:
        raise InputError(f"batch_tokens ({batch_tokens}) must be a multiple of the sequence length ({seq_len})")
    num_seqs = num_tokens // seq_len
    if num_seqs < 1:
        raise InputError(f"{num_tokens} tokens are fewer than one sequence of {seq_len}; give more tokens")
    per_batch = batch_tokens // seq_len
    ranks = []
    for lo in range(0, num_seqs, per_batch):
        seqs = range(lo, min(num_seqs, lo + per_batch))
        ranks.append([[s for j, s in enumerate(seqs) if j % num_gpus == g] for g in range(num_gpus)])
    return Layout(seq_len=seq_len, num_gpus=num_gpus, ranks=ranks)


@dataclass(frozen=True, slots=True)
class Capture:
    """A captured trace: the load (with its token-level trace) and the extra arrays."""

    load: LoadMatrix
    #: ``uint16 [N]``: the token ids, in trace order.
    token_ids: np.ndarray
    #: ``float16 [N, L, D]`` MoE-layer inputs, if captured.
    hidden_states: np.ndarray | None
    layout: Layout

    def arrays(self) -> dict[str, np.ndarray]:
        out = {**self.load.to_arrays(), "token_ids": self.token_ids}
        if self.hidden_states is not None:
            out["hidden_states"] = self.hidden_states
        return out


@torch.no_grad()
def capture(model: MoELM, tokens: np.ndarray, *, num_gpus: int, batch_tokens: int, seq_len: int | None = None,
            hidden_states: bool = False, progress: Callable[[int], None] | None = None) -> Capture:
    """Run ``model`` over ``tokens`` (``int [n]``) batch by batch and record every token's routing.

    ``progress(k)`` is called after each batch with the number of tokens it held.
    """
    S = model.config.max_seq_len if seq_len is None else seq_len
    if S > model.config.max_seq_len:
        raise InputError(f"seq_len ({S}) exceeds the model's max_seq_len ({model.config.max_seq_len})")
    layout = make_layout(int(np.asarray(tokens).size), seq_len=S, batch_tokens=batch_tokens, num_gpus=num_gpus)
    toks = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    model.eval()
    ids_parts, hid_parts, tok_parts = [], [], []
    for per_rank in layout.ranks:
        order = [s for seqs in per_rank for s in seqs]  # rank-major
        idx = torch.stack([toks[s * S:(s + 1) * S] for s in order])
        out = model(idx, keep_inputs=hidden_states)
        assert out.topk_ids is not None
        ids_parts.append(out.topk_ids.numpy())
        tok_parts.append(idx.reshape(-1).numpy())
        if out.moe_inputs is not None:
            hid_parts.append(out.moe_inputs.to(torch.float16).numpy())
        if progress is not None:
            progress(idx.numel())
    _, src, bat = layout.token_order()
    trace = RoutingTrace(np.concatenate(ids_parts), src, bat, num_experts=model.config.num_experts)
    load = LoadMatrix(trace.counts(), trace, PRESET)
    return Capture(load=load, token_ids=np.concatenate(tok_parts).astype(np.uint16),
                   hidden_states=np.concatenate(hid_parts) if hidden_states else None, layout=layout)


def write_capture(path: str | os.PathLike[str], cap: Capture) -> None:
    """Write a capture as a compressed ``.npz``, atomically."""
    write_npz(path, cap.arrays())
