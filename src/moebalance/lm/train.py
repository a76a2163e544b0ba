"""Train the small MoE language model on the two offline domains (CPU, a few minutes).

``python -m moebalance.lm.train --out src/moebalance/lm/weights/moe_lm.safetensors`` reproduces the bundled
checkpoint: it writes the weights (float16 safetensors) and, next to them, ``moe_lm.json`` with the model
config, the training command and settings, the data provenance, the seed, the loss curve and the final bits
per byte. With ``--plot`` it also draws the loss curve.

Recipe: every step draws ``batch_size / 2`` windows of ``seq_len + 1`` tokens from each domain's training
split (uniform random starts from a seeded generator, so the data order is a function of the seed), next-token
cross-entropy plus ``aux_loss_coef`` times the Switch balancing loss (0 by default: skewed routing is the
point), AdamW (weight decay on the attention and expert matrices only, never on the gate, so that decay does
not flatten the routing), linear warm-up then cosine decay to 10 %, gradients clipped to norm 1. The global
torch generator is seeded before the weights are initialised, so one seed gives one set of weights on one
machine (bit-exact there for a fixed thread count; not promised across machines or torch builds). The command
runs on one thread by default: the result does not depend on the core count, and it does not collapse when
other jobs share the cores (several processes with several OpenMP threads each on few cores slow down many
times over, from spinning threads).

Metrics: bits per byte on each domain's held-out split (non-overlapping windows of ``seq_len`` predicted
tokens, targets that are special tokens left out), and the **unigram** baseline: the cross-entropy of the
held-out bytes under the training split's byte frequencies (add-one smoothed). The final numbers are computed
with the weights as stored (rounded to float16).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from moebalance.core.errors import InputError, MoebalanceError
from moebalance.core.io import atomic_write_text, dumps, save_png
from moebalance.lm.data import DOMAINS, domain_tokens, provenance
from moebalance.lm.moe_lm import ModelConfig, MoELM, load_checkpoint, save_checkpoint

__all__ = ["TrainConfig", "TrainResult", "bits_per_byte", "main", "train", "unigram_bits_per_byte"]


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainConfig:
    """How to train. Example: ``TrainConfig(steps=20, batch_size=4, seq_len=32)`` is a seconds-long smoke run."""

    steps: int = 1500
    #: Sequences per step, half from each domain (so it must be even).
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    aux_loss_coef: float = 0.0
    #: Auxiliary-loss-free balancing (needs ``ModelConfig.balance_bias``): after every step each layer's bias
    #: moves by ``bias_update * sign(mean load - load of e)`` (the update speed ``u`` of arXiv:2408.15664).
    bias_update: float = 0.0
    seed: int = 0
    #: Training tokens read from each domain (``None``: the whole training split).
    code_tokens: int | None = 1_500_000
    prose_tokens: int | None = None
    #: Held-out tokens per domain for the final bits per byte (``None``: all).
    eval_tokens: int | None = 32768
    #: Record the mean training loss every ``log_every`` steps, held-out bits per byte every ``eval_every``.
    log_every: int = 25
    eval_every: int = 200
    #: Held-out tokens per domain for the curve's evaluations (the same text as the final numbers by default;
    #: one evaluation of 2 x 32,768 tokens costs about as much as 10 training steps).
    curve_eval_tokens: int = 32768

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "curve_eval_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{name} ({v!r}) must be a positive integer")
        if self.batch_size % 2:
            raise InputError(f"batch_size ({self.batch_size}) must be even: half the sequences come from each domain")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise InputError(f"lr ({self.lr}) must be a positive number")
        for name in ("aux_loss_coef", "bias_update", "weight_decay", "warmup"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise InputError(f"{name} ({v!r}) must be a finite number >= 0")


@dataclass(frozen=True, slots=True)
class TrainResult:
    """A trained model and its record (the ``moe_lm.json`` document)."""

    model: MoELM
    record: dict[str, Any]


def _windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, length]`` windows of ``stream`` at uniform random starts."""
    if stream.numel() < length + 1:
        raise InputError(f"a training split has {stream.numel()} tokens, fewer than one window of {length}")
    starts = torch.randint(0, stream.numel() - length + 1, (n,), generator=gen)
    return stream[starts[:, None] + torch.arange(length)]


@torch.no_grad()
def bits_per_byte(model: MoELM, tokens: np.ndarray, seq_len: int, max_tokens: int | None = None) -> float:
    """Mean next-token cross-entropy in bits over the byte targets of ``tokens`` (windows of ``seq_len``)."""
    toks = torch.as_tensor(tokens[: None if max_tokens is None else max_tokens + 1], dtype=torch.int64)
    n = (toks.numel() - 1) // seq_len
    if n < 1:
        raise InputError(f"{toks.numel()} tokens are fewer than one evaluation window of {seq_len + 1}")
    model.eval()
    total, count = 0.0, 0
    for lo in range(0, n, 64):
        hi = min(n, lo + 64)
        idx = torch.stack([toks[i * seq_len:(i + 1) * seq_len + 1] for i in range(lo, hi)])
        logits = model(idx[:, :-1]).logits
        target = idx[:, 1:]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        byte = target.reshape(-1) < 256
        total += float(nll[byte].sum())
        count += int(byte.sum())
    return total / max(count, 1) / math.log(2)


def unigram_bits_per_byte(train_tokens: np.ndarray, heldout_tokens: np.ndarray) -> float:
    """Cross-entropy in bits of the held-out bytes under the training bytes' add-one-smoothed frequencies."""
    freq = np.bincount(train_tokens[train_tokens < 256], minlength=256).astype(np.float64) + 1.0
    logp = np.log2(freq / freq.sum())
    held = heldout_tokens[1:]
    held = held[held < 256]
    return float(-logp[held].mean())


@torch.no_grad()
def update_bias(model: MoELM, topk_ids_TLK: torch.Tensor, speed: float) -> None:
    """Auxiliary-loss-free balancing (arXiv:2408.15664, Alg. 1): each layer's bias moves by
    ``speed * sign(mean load - load_e)``, with loads counted over this step's picks ``topk_ids [T, L, K]``."""
    E = model.config.num_experts
    for layer, blk in enumerate(model.blocks):
        bias = blk.moe.bias  # type: ignore[union-attr]
        assert isinstance(bias, torch.Tensor)
        load = torch.bincount(topk_ids_TLK[:, layer].reshape(-1), minlength=E).float()
        bias += speed * torch.sign(load.mean() - load)


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def _param_groups(model: MoELM, weight_decay: float) -> list[dict[str, Any]]:
    decay: list[torch.nn.Parameter] = []
    rest: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        (decay if name.endswith(("qkv.weight", "proj.weight", "moe.w1", "moe.w2", "moe.w3")) else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def train(model_config: ModelConfig, cfg: TrainConfig, *,
          on_step: Callable[[int, float], None] | None = None) -> TrainResult:
    """Train a fresh model; returns it (float32, weights as trained) and its record without the final metrics."""
    if cfg.seq_len > model_config.max_seq_len:
        raise InputError(f"seq_len ({cfg.seq_len}) exceeds the model's max_seq_len ({model_config.max_seq_len})")
    if cfg.bias_update > 0 and not model_config.balance_bias:
        raise InputError(f"bias_update ({cfg.bias_update}) needs a model with balance_bias (--balance-bias)")
    streams = {d: torch.as_tensor(domain_tokens(d, "train", getattr(cfg, f"{d}_tokens"))) for d in DOMAINS}
    curve_eval = {d: domain_tokens(d, "heldout", cfg.curve_eval_tokens) for d in DOMAINS}
    torch.manual_seed(cfg.seed)
    model = MoELM(model_config)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    curve: list[dict[str, Any]] = []
    window: list[tuple[float, float]] = []
    half = cfg.batch_size // 2
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        model.train()
        batch = torch.cat([_windows(streams[d], half, cfg.seq_len + 1, gen) for d in DOMAINS])
        out = model(batch[:, :-1], aux=cfg.aux_loss_coef > 0)
        lm = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss = lm + cfg.aux_loss_coef * out.aux_loss
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if cfg.bias_update > 0:
            assert out.topk_ids is not None
            update_bias(model, out.topk_ids, cfg.bias_update)
        window.append((float(lm.detach()), float(out.aux_loss.detach())))
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            point: dict[str, Any] = {"step": done, "train_loss": round(float(np.mean([w[0] for w in window])), 5),
                                     "train_bits_per_token": round(float(np.mean([w[0] for w in window])) / math.log(2), 5),
                                     "aux_loss": round(float(np.mean([w[1] for w in window])), 5),
                                     "seconds": round(time.perf_counter() - t0, 2)}
            window = []
            if done % cfg.eval_every == 0 or done == cfg.steps:
                point["heldout_bits_per_byte"] = {d: round(bits_per_byte(model, curve_eval[d], cfg.seq_len), 5)
                                                  for d in DOMAINS}
            curve.append(point)
        if on_step is not None:
            on_step(done, window[-1][0] if window else float(lm.detach()))
    seconds = time.perf_counter() - t0
    record = {
        "format": "moebalance.moe_lm",
        "version": 1,
        "model": model_config.as_dict(),
        "gate": {"score_fn": "softmax", "top_k": model_config.top_k, "renormalize": True, "capacity_factor": None,
                 "balance_bias": model_config.balance_bias, "bias_update": cfg.bias_update,
                 "implementation": "moebalance.runtime.gating.topk_gating (docs/papers/routing.md)"},
        "experts": {"activation": "swiglu", "layout": "moebalance.runtime.experts.ExpertWeights w1/w3 [E, D, F], "
                                                      "w2 [E, F, D]"},
        "train": dataclasses.asdict(cfg),
        "seed": cfg.seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(seconds, 1),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loss_curve": curve,
        "data": provenance({"code": {"train": cfg.code_tokens, "heldout": cfg.eval_tokens},
                            "prose": {"train": cfg.prose_tokens, "heldout": cfg.eval_tokens}}),
    }
    return TrainResult(model.eval(), record)


@torch.no_grad()
def expert_loads(model: MoELM, tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """``int64 [L, E]``: picks of each expert in each MoE layer over ``tokens`` (windows of ``seq_len``)."""
    toks = torch.as_tensor(tokens, dtype=torch.int64)
    n = toks.numel() // seq_len
    c = model.config
    loads = torch.zeros((c.num_layers, c.num_experts), dtype=torch.int64)
    model.eval()
    for lo in range(0, n, 64):
        idx = toks[lo * seq_len:min(n, lo + 64) * seq_len].reshape(-1, seq_len)
        ids = model(idx).topk_ids
        assert ids is not None
        for layer in range(c.num_layers):
            loads[layer] += torch.bincount(ids[:, layer].reshape(-1), minlength=c.num_experts)
    return loads.numpy()


def evaluate_model(model: MoELM, cfg: TrainConfig) -> dict[str, Any]:
    """Held-out bits per byte per domain, the unigram baseline, and the routing: experts never picked and the
    hottest expert's load over the mean, per layer."""
    out: dict[str, Any] = {"bits_per_byte": {}, "unigram_bits_per_byte": {}, "unused_experts": {},
                           "peak_to_mean": {}}
    for d in DOMAINS:
        held = domain_tokens(d, "heldout", cfg.eval_tokens)
        out["bits_per_byte"][d] = round(bits_per_byte(model, held, cfg.seq_len), 4)
        loads = expert_loads(model, held, cfg.seq_len)
        out["unused_experts"][d] = [int(v) for v in (loads == 0).sum(axis=1)]
        out["peak_to_mean"][d] = [round(float(v), 3) for v in loads.max(axis=1) / loads.mean(axis=1)]
        out["unigram_bits_per_byte"][d] = round(unigram_bits_per_byte(
            domain_tokens(d, "train", getattr(cfg, f"{d}_tokens")), held), 4)
    return out


def plot_loss(record: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """PNG of the training loss (bits per token) and held-out bits per byte against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = record["loss_curve"]
    fig, ax = plt.subplots(figsize=(7.5, 4), dpi=110)
    ax.plot([p["step"] for p in curve], [p["train_bits_per_token"] for p in curve],
            label="train loss, bits per token (both domains)", linewidth=1.2)
    for d in DOMAINS:
        pts = [(p["step"], p["heldout_bits_per_byte"][d]) for p in curve if "heldout_bits_per_byte" in p]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", markersize=3,
                    label=f"held-out {d} ({record['train']['curve_eval_tokens']:,} tokens)")
    for d, style in zip(DOMAINS, (":", "--"), strict=True):
        uni = record.get("results", {}).get("unigram_bits_per_byte", {}).get(d)
        if uni is not None:
            ax.axhline(uni, linestyle=style, color="grey", linewidth=1, label=f"unigram {d} ({uni:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    m = record["model"]
    ax.set_title(f"moebalance MoE LM: {m['num_layers']} layers, d={m['d_model']}, {m['num_experts']} experts, "
                 f"top-{m['top_k']}, aux loss coef {record['train']['aux_loss_coef']}", fontsize=9)
    ax.legend(fontsize=8)
    save_png(fig, path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moebalance.lm.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint path ending in .safetensors (the .json goes next to it)")
    p.add_argument("--plot", help="also draw the loss curve to this PNG")
    m, t = ModelConfig(), TrainConfig()
    p.add_argument("--d-model", type=int, default=m.d_model)
    p.add_argument("--heads", type=int, default=m.num_heads)
    p.add_argument("--layers", type=int, default=m.num_layers)
    p.add_argument("--experts", type=int, default=m.num_experts)
    p.add_argument("--top-k", type=int, default=m.top_k)
    p.add_argument("--ffn-size", type=int, default=m.ffn_size)
    p.add_argument("--steps", type=int, default=t.steps)
    p.add_argument("--batch-size", type=int, default=t.batch_size)
    p.add_argument("--seq-len", type=int, default=t.seq_len)
    p.add_argument("--lr", type=float, default=t.lr)
    p.add_argument("--aux-loss-coef", type=float, default=t.aux_loss_coef,
                   help="Switch load-balancing loss weight (0: none, skewed routing)")
    p.add_argument("--balance-bias", action="store_true",
                   help="DeepSeek-V3's auxiliary-loss-free balancing bias on every MoE layer")
    p.add_argument("--bias-update", type=float, default=t.bias_update,
                   help="bias update speed u per step (needs --balance-bias; 0: the bias stays 0)")
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument("--code-tokens", type=int, default=t.code_tokens)
    p.add_argument("--prose-tokens", type=int, default=t.prose_tokens)
    p.add_argument("--eval-tokens", type=int, default=t.eval_tokens)
    p.add_argument("--log-every", type=int, default=t.log_every)
    p.add_argument("--eval-every", type=int, default=t.eval_every)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: the same result on any core count, and no slowdown when "
                        "other jobs share the cores)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True, highlight=False)
    threads_before = torch.get_num_threads()
    try:
        out = Path(args.out)
        if out.suffix != ".safetensors":
            raise InputError(f"--out {args.out!r} must end in .safetensors")
        if args.threads < 1:
            raise InputError(f"--threads ({args.threads}) must be at least 1")
        torch.set_num_threads(args.threads)
        mc = ModelConfig(d_model=args.d_model, num_heads=args.heads, num_layers=args.layers, num_experts=args.experts,
                         top_k=args.top_k, ffn_size=args.ffn_size, max_seq_len=max(args.seq_len, 1),
                         balance_bias=args.balance_bias)
        tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                         aux_loss_coef=args.aux_loss_coef, bias_update=args.bias_update, seed=args.seed, code_tokens=args.code_tokens,
                         prose_tokens=args.prose_tokens, eval_tokens=args.eval_tokens, log_every=args.log_every,
                         eval_every=args.eval_every)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True, disable=not err.is_terminal) as progress:
            task = progress.add_task("train", total=tc.steps)
            result = train(mc, tc, on_step=lambda n, loss: progress.update(
                task, completed=n, description=f"train (loss {loss:.3f})"))
        save_checkpoint(out, result.model)
        stored = load_checkpoint(out)  # the final metrics are those of the weights as stored (float16)
        record = {**result.record,
                  "command": "python -m moebalance.lm.train " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None
                                                                                    else argv)),
                  "checkpoint": {"file": out.name, "dtype": "float16"},
                  "results": evaluate_model(stored, tc)}
        atomic_write_text(out.with_suffix(".json"), dumps(record))
        if args.plot:
            plot_loss(record, args.plot)
    except MoebalanceError as exc:
        sys.stderr.write(f"moebalance.lm.train: error: {exc}\n")
        return 2
    finally:
        torch.set_num_threads(threads_before)  # main() may be called in-process (tests)
    r = record["results"]
    print(f"wrote {out} and {out.with_suffix('.json').name}: {record['parameters']:,} parameters, trained in "
          f"{record['train_seconds']:.0f} s; held-out bits per byte "
          + ", ".join(f"{d} {r['bits_per_byte'][d]:.3f} (unigram {r['unigram_bits_per_byte'][d]:.3f})" for d in DOMAINS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
