"""Time of an MoE layer and of a step: a roofline of the experts' grouped GEMM, the all-to-all, the rest.

Legend: ``H`` hidden size, ``F`` a routed expert's FFN size, ``G`` GPUs, ``n_g`` picks (token, expert pairs) a
GPU serves in a layer, ``u_g`` distinct experts those picks touch on it.

**Experts.** One pick runs a gated FFN, three ``H x F`` matrix products: ``6 H F`` FLOPs. A GPU's grouped GEMM
reads the weights of every expert it touches once, and its picks' inputs and outputs::

    flops_g = 6 H F n_g                      bytes_g = u_g * 3 H F w + 2 n_g H a
    t_g = launch + max(flops_g / (peak_flops * flops_eff), bytes_g / (bandwidth * bandwidth_eff))

(``w`` bytes per expert weight, :data:`EXPERT_WEIGHT_BYTES`: 2 in bf16, 1 in FP8, 4.25 / 8 in MXFP4; ``a`` per
activation.) Few tokens per expert (decode) leave it bound by the experts
touched; many (prefill) by FLOPs. The layer waits for its slowest GPU (the straggler model), then for the
all-to-all (:func:`moebalance.cost.a2a.a2a_seconds`: busiest link, dispatch and combine)::

    layer = max_g t_g + a2a        (two-batch overlap: moebalance.cost.Deployment.layer_seconds)

**The rest of a step** (attention, dense layers, shared experts, embeddings, router) runs on every GPU for its
data-parallel rank's tokens: a roofline of its non-expert weights' FLOPs (``2`` per weight and token) and the
attention's (``2 n_h (score + value)`` per query-key pair and layer: a prompt's causal pairs, a decode token's whole
context) against reading those weights once and, in decode, every request's KV cache.

``flops_eff``, ``bandwidth_eff`` and ``launch`` default to peak (1, 1, 0): a calibration measured on a GPU
(``bench/bench_gemm.py``, fitted by ``moebalance calibrate``) replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.core.errors import InputError
from moebalance.cost.hardware import GpuSpec
from moebalance.cost.memory import GIB, EngineMemory, non_expert_gib_per_gpu
from moebalance.models import ModelSpec
from moebalance.models.fields import check_fields

#: Bytes per number of each precision a GEMM runs in and a KV cache holds (an FP8 checkpoint's block scales are left
#: out: 1 in 16,384 weights).
PRECISION_BYTES = {"bf16": 2, "fp8": 1}
#: Bits of an MXFP4 weight (OCP Microscaling Formats (MX) v1.0): a 4-bit E2M1 value and its share of the one 8-bit
#: E8M0 scale of its block of 32, ``4 + 8 / 32`` (gpt-oss's ``*_blocks`` and ``*_scales``: models/presets.py).
MXFP4_BITS = 4 + 8 / 32
#: Bytes per routed-expert weight of each precision a deployment prices: :data:`PRECISION_BYTES`, and ``mxfp4``,
#: an MXFP4 checkpoint's experts at ``4.25 / 8`` bytes (the weights read by the grouped GEMM, held in memory and
#: moved with a copy), its other weights bf16 (:func:`gemm_precision`).
EXPERT_WEIGHT_BYTES: dict[str, float] = {**PRECISION_BYTES, "mxfp4": MXFP4_BITS / 8}

__all__ = ["EXPERT_WEIGHT_BYTES", "MXFP4_BITS", "PRECISION_BYTES", "Calibration", "expert_seconds", "gemm_precision",
           "gemm_seconds", "gemm_work", "padded_rows", "peak_rates", "prefetch_seconds", "rest_seconds",
           "roofline_terms"]


def gemm_precision(precision: str) -> str:
    """The precision a deployment in ``precision`` (:data:`EXPERT_WEIGHT_BYTES`) multiplies in, whose tensor-core
    peak its FLOPs divide by and whose bytes its non-expert weights and its activations take: ``precision`` itself,
    but ``bf16`` for ``mxfp4``. MXFP4 is weight-only there: the engines' MXFP4 MoE kernels take bf16 activations and
    dequantize the weights to bf16 for the tensor cores on Ampere, Hopper and AMD GPUs (vLLM 0.33's Marlin, Triton
    and AITER MXFP4 x BF16 backends; SGLang's triton_kernels), and vLLM's first choice on Blackwell,
    FLASHINFER_TRTLLM_MXFP4_BF16, does so too. SGLang's default there multiplies by MXFP8 activations, at the FP8
    rate; the bf16 peak is the lower of the two (conservative), and :class:`~moebalance.cost.hardware.GpuSpec`
    records no FP4 peak. Decode, bound by the weights read, does not depend on it."""
    return "bf16" if precision == "mxfp4" else precision


@dataclass(kw_only=True, frozen=True, slots=True)
class Calibration:
    """Achieved shares of the GPU's peaks and a fixed cost per grouped GEMM; defaults: the published peaks."""

    flops_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    launch_us: float = 0.0
    #: Where the numbers come from ("published peaks", or the measurement file they were fitted on).
    source: str = "published peaks"
    #: The GPU (a :data:`~moebalance.cost.hardware.GPUS` name) it was fitted on; empty: the peaks, any GPU.
    gpu: str = ""
    #: Rows of one M-tile of the grouped-GEMM kernel (0: none): a kernel runs each expert's rows in whole tiles, so
    #: its FLOPs are those of ``tile_rows * ceil(rows / tile_rows)`` rows per expert (:func:`padded_rows`).
    tile_rows: int = 0
    #: Links measured between ranks (``calibrate --measure`` under torchrun), GB/s per rank and direction inside a node
    #: and across nodes (0: not measured; the cluster's links stand), and the fixed cost of one all-to-all phase in
    #: microseconds (None: not measured; the kernel's, :data:`moebalance.cost.a2a.LATENCY_US`).
    intra_node_gbs: float = 0.0
    inter_node_gbs: float = 0.0
    a2a_latency_us: float | None = None
    #: The precision of the GEMMs it was fitted on (``bf16`` or ``fp8``; empty: the peaks, any precision). Its shares
    #: of the peaks are taken for the deployment's precision too, whose peak may differ.
    precision: str = ""

    def __post_init__(self) -> None:
        check_fields(self, positive_reals=("flops_efficiency", "bandwidth_efficiency"),
                     non_negative_reals=("launch_us", "intra_node_gbs", "inter_node_gbs"), text=("source",), label="")
        latency = self.a2a_latency_us
        if latency is not None and (isinstance(latency, bool) or not isinstance(latency, int | float) or
                                    not np.isfinite(latency) or latency < 0):
            raise InputError(f"a2a_latency_us ({latency!r}) must be a number of microseconds >= 0, or null")
        if isinstance(self.tile_rows, bool) or not isinstance(self.tile_rows, int | np.integer) or \
                not 0 <= self.tile_rows <= 4096:
            raise InputError(f"tile_rows ({self.tile_rows!r}) must be a whole number of rows in [0, 4096] (0: no tiles)")
        if self.precision not in ("", *PRECISION_BYTES):
            raise InputError(f"calibration precision {self.precision!r} is unknown; choose one of: "
                             f"{', '.join(PRECISION_BYTES)}")
        for name in ("flops_efficiency", "bandwidth_efficiency"):
            if getattr(self, name) > 1.0:
                raise InputError(f"{name} ({getattr(self, name)}) must be in (0, 1]: a share of the GPU's peak")


def peak_rates(gpu: GpuSpec, calibration: Calibration | None = None, precision: str = "bf16") -> tuple[float, float]:
    """``(FLOP/s, bytes/s)`` the roofline divides by: the GPU's tensor-core peak in ``precision`` (``bf16`` or
    ``fp8``; ``mxfp4``: bf16's, :func:`gemm_precision`) and its memory bandwidth, each times the calibration's
    share."""
    cal = Calibration() if calibration is None else calibration
    return (gpu.peak_tflops(gemm_precision(precision)) * 1e12 * cal.flops_efficiency,
            gpu.memory_bandwidth * 1e9 * cal.bandwidth_efficiency)


def gemm_work(picks: np.ndarray | float, touched: np.ndarray | float, hidden_size: np.ndarray | float,
              ffn_size: np.ndarray | float, *, weight_bytes: float = 2, activation_bytes: float = 2,
              padded: np.ndarray | float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(FLOPs, bytes)`` of a grouped GEMM over ``picks`` picks touching ``touched`` experts of ``H x F``: each pick
    runs ``6 H F`` FLOPs, each expert touched is read once (``3 H F w`` bytes) and each pick's input and output move
    (``2 H a``); arrays broadcast (the calibration fits runs of many shapes). With ``padded`` (rows in whole tiles,
    :func:`padded_rows`) the FLOPs are those rows'."""
    n = np.asarray(picks, dtype=np.float64)
    u = np.asarray(touched, dtype=np.float64)
    H, F = np.asarray(hidden_size, dtype=np.float64), np.asarray(ffn_size, dtype=np.float64)
    rows = n if padded is None else np.asarray(padded, dtype=np.float64)
    return 6.0 * H * F * rows, u * 3.0 * H * F * weight_bytes + 2.0 * n * H * activation_bytes


def padded_rows(picks: np.ndarray, tile_rows: int) -> np.ndarray:
    """``float64 [..., G]``: the rows a grouped GEMM computes for ``picks [..., G, E]`` when it runs each expert's
    rows in tiles of ``tile_rows`` (``tile_rows * ceil(rows / tile_rows)`` each; ``0``: the rows themselves).

    Example: tiles of 128 rows, experts of 3 and 130 rows: 128 + 256 = 384 rows."""
    a = np.asarray(picks, dtype=np.float64)
    if tile_rows <= 0:
        return a.sum(axis=-1)
    return (np.ceil(a / tile_rows) * tile_rows).sum(axis=-1)


def roofline_terms(model: ModelSpec, gpu: GpuSpec, calibration: Calibration | None = None, *,
                   weight_bytes: float = 2, activation_bytes: float = 2,
                   precision: str = "bf16") -> tuple[float, float, float, float]:
    """``(alpha, beta, gamma, launch)`` seconds: the grouped GEMM of ``n`` picks touching ``u`` experts takes
    ``launch + max(alpha n, beta u + gamma n)``, the roofline of :func:`gemm_seconds` as compiled kernels that
    search over picks take it (the ``metro`` router); a calibration's tiles are left out of these terms (a search over
    one GPU's picks prices its FLOPs on the picks themselves)."""
    cal = Calibration() if calibration is None else calibration
    flops_rate, bytes_rate = peak_rates(gpu, cal, precision)
    H, F = model.hidden_size, model.moe_intermediate_size
    pick_flops, pick_bytes = gemm_work(1.0, 0.0, H, F, weight_bytes=weight_bytes, activation_bytes=activation_bytes)
    _, expert_bytes = gemm_work(0.0, 1.0, H, F, weight_bytes=weight_bytes, activation_bytes=activation_bytes)
    return (float(pick_flops) / flops_rate, float(expert_bytes) / bytes_rate, float(pick_bytes) / bytes_rate,
            cal.launch_us * 1e-6)


def gemm_seconds(picks: np.ndarray | float, touched: np.ndarray | float, model: ModelSpec, gpu: GpuSpec,
                 calibration: Calibration | None = None, *, weight_bytes: float = 2, activation_bytes: float = 2,
                 precision: str = "bf16", padded: np.ndarray | float | None = None) -> np.ndarray:
    """Seconds of one GPU's grouped GEMM over ``picks`` picks touching ``touched`` experts (arrays broadcast;
    ``touched`` may be an expectation, as the step model's is): the roofline of the module docstring. Callers with
    each GPU's picks of each expert call :func:`expert_seconds`, which reduces them to these two numbers and, with a
    calibration's tiles, the rows in whole tiles (``padded``, :func:`padded_rows`). Where only the totals are known
    and the calibration has tiles of ``m`` rows, ``padded`` is estimated as ``max(u m, n + u m / 2)``: one tile per
    expert while experts have fewer rows than a tile (decode), else half a tile wasted per expert on average.

    Example (by hand): H100, H = 7168, F = 2048, one pick on one expert: 88 MB of weights at 3.35 TB/s is 26.3 us,
    the 88 MFLOPs take 0.09 us, so the pick costs the weight read.
    """
    cal = Calibration() if calibration is None else calibration
    n = np.asarray(picks, dtype=np.float64)
    if np.any(n < 0) or np.any(np.asarray(touched) < 0):
        raise InputError("picks and experts touched must be >= 0")
    if padded is None and cal.tile_rows:
        u = np.asarray(touched, dtype=np.float64)
        padded = np.maximum(u * cal.tile_rows, n + u * cal.tile_rows / 2)
    flops, traffic = gemm_work(n, touched, model.hidden_size, model.moe_intermediate_size, weight_bytes=weight_bytes,
                               activation_bytes=activation_bytes, padded=padded)
    flops_rate, bytes_rate = peak_rates(gpu, cal, precision)
    return np.where(n > 0, np.maximum(flops / flops_rate, traffic / bytes_rate) + cal.launch_us * 1e-6, 0.0)


def expert_seconds(picks: np.ndarray, model: ModelSpec, gpu: GpuSpec, calibration: Calibration | None = None, *,
                   weight_bytes: float = 2, activation_bytes: float = 2, precision: str = "bf16") -> np.ndarray:
    """``float64 [..., G]``: each GPU's grouped-GEMM seconds in one MoE layer, from ``picks [..., G, E]``, the
    tokens GPU ``g`` serves for expert ``e`` (whole numbers >= 0; leading axes broadcast). A GPU's picks are
    ``n_g = sum_e picks[g, e]``, the experts they touch ``u_g = #{e : picks[g, e] > 0}``, and its time the
    roofline of the module docstring (:func:`gemm_seconds`), its FLOPs on each expert's rows in whole tiles where
    the calibration has tiles (``Calibration.tile_rows``); a GPU with no picks takes 0.

    Example (by hand) -- DeepSeek-V3 (H = 7168, F = 2048) on an H100 at its peaks, two GPUs: GPU 0 serves 3 tokens
    of expert 0 and 1 of expert 1, GPU 1 serves 4 tokens of expert 2. GPU 0 reads two experts' weights (2 x 88.1 MB
    at 3.35 TB/s, 52.6 us) and GPU 1 one (26.3 us), far above their 0.35 GFLOPs (0.36 us) or the activations::

        >>> from moebalance.cost import GPUS, expert_seconds
        >>> from moebalance.models import MODELS
        >>> picks = np.array([[3, 1, 0], [0, 0, 4]])
        >>> (expert_seconds(picks, MODELS["deepseek-v3"], GPUS["h100-80gb"]) * 1e6).round(1)
        array([52.6, 26.3])
    """
    a = np.asarray(picks)
    if a.ndim < 2:
        raise InputError(f"picks must be [..., G, E] (tokens each GPU serves of each expert), got shape {a.shape}")
    if a.dtype.kind not in "iub" and not (a.dtype.kind == "f" and np.all(np.isfinite(a)) and np.all(a == np.round(a))):
        raise InputError(f"picks must be whole numbers of tokens, got dtype {a.dtype}")
    if a.size and a.min() < 0:
        raise InputError(f"picks must be >= 0, got {a.min()}")
    tiles = 0 if calibration is None else calibration.tile_rows
    return gemm_seconds(a.sum(axis=-1, dtype=np.float64), (a > 0).sum(axis=-1), model, gpu, calibration,
                        weight_bytes=weight_bytes, activation_bytes=activation_bytes, precision=precision,
                        padded=padded_rows(a, tiles) if tiles else None)


def rest_seconds(tokens_per_rank: float, model: ModelSpec, gpu: GpuSpec, engine: EngineMemory, gpus_per_node: int, *,
                 kv_tokens_per_rank: float = 0.0, logits_per_rank: float | None = None,
                 calibration: Calibration | None = None, precision: str = "bf16", attended_per_rank: float = 0.0,
                 absorbed: bool = False) -> float:
    """Seconds of everything but the routed experts in one step, on one GPU of a data-parallel rank that processes
    ``tokens_per_rank`` tokens, computes ``logits_per_rank`` next-token logits (default: every token, as in decode;
    a prefill needs one per prompt), reads ``kv_tokens_per_rank`` tokens of KV cache (decode: requests x context, the
    requests being the rank's tokens, one each; a window layer reads at most ``W`` tokens of a request, a linear layer
    its state: :meth:`moebalance.models.ModelSpec.kv_cache_bytes`, split over the GPUs that hold a GQA cache's heads)
    and attends ``attended_per_rank`` (query, key) pairs summed over the decoder layers (per token
    :meth:`moebalance.models.ModelSpec.attended_pairs`: a full layer's causal prompt or decode context, a window
    layer's at most ``W``, a linear layer's none).

    The input embedding is a lookup (its rows, not the table, are read); the LM head is a matrix product over the
    logits; every other non-expert weight multiplies every token and is read once per step, in ``precision`` (its
    bytes ``engine.weight_bytes``; ``mxfp4`` leaves them bf16, as gpt-oss's checkpoint has them).
    Attention multiplies each pair's score and value widths (:meth:`moebalance.models.Attention.widths`; MLA
    ``absorbed`` in decode) by every head, ``2 n_h (score + value)`` FLOPs per pair and layer, split over the rank's
    GPUs by head, in bf16.
    """
    cal = Calibration() if calibration is None else calibration
    logits = tokens_per_rank if logits_per_rank is None else logits_per_rank
    if tokens_per_rank < 0 or kv_tokens_per_rank < 0 or logits < 0 or attended_per_rank < 0:
        raise InputError("tokens, logits, KV tokens and attended pairs per rank must be >= 0")
    if tokens_per_rank == 0:
        return 0.0
    head = model.vocab_size * model.hidden_size / engine.dense_tp  # LM head parameters on this GPU
    table = 0.0 if model.tie_word_embeddings else head  # the input embedding table, only looked up
    params = non_expert_gib_per_gpu(model, engine, gpus_per_node) * GIB / engine.weight_bytes
    flops = 2.0 * (params - head - table) * tokens_per_rank + 2.0 * head * logits
    attention_tp = engine.attention_group(gpus_per_node)
    requests = tokens_per_rank if kv_tokens_per_rank else 0.0  # decode: a token per request
    kv_bytes = model.kv_cache_bytes(kv_tokens_per_rank, requests, engine.kv_bytes, attention_tp,
                                    engine.recurrent_state_bytes)
    traffic = (params - table) * engine.weight_bytes + kv_bytes
    flops_rate, bytes_rate = peak_rates(gpu, cal, precision)
    compute = flops / flops_rate
    if attended_per_rank > 0:
        att = model.architecture()
        score, value = att.widths(absorbed)
        attention = 2.0 * att.num_heads * (score + value) * attended_per_rank / attention_tp
        compute += attention / peak_rates(gpu, cal, "bf16")[0]
    return max(compute, traffic / bytes_rate)


def prefetch_seconds(copies: np.ndarray | float, model: ModelSpec, bandwidth: float, *,
                     weight_bytes: float = 2) -> np.ndarray:
    """Seconds to load ``copies`` expert copies over a link of ``bandwidth`` GB/s: Libra's prefetch of the experts
    a batch's plan adds (``3 H F w`` bytes each, ``w`` bytes per expert weight: :data:`EXPERT_WEIGHT_BYTES`). Libra overlaps it with the layers before; whether it stays hidden
    is a comparison with their compute time.

    Example (by hand): one DeepSeek-V3 expert (88.1 MB in bf16) over NVLink 4 (450 GB/s) takes 0.196 ms.
    """
    c = np.asarray(copies, dtype=np.float64)
    if np.any(c < 0) or not bandwidth > 0:
        raise InputError("expert copies must be >= 0 and the bandwidth positive")
    return c * model.expert_params() * weight_bytes / (bandwidth * 1e9)
