"""A deployment: what every price of a plan is taken for (docs/design.md, "Cost model").

One frozen :class:`Deployment` holds the model served, the GPU, the calibration of its roofline, how the engine lays
out memory, the requests, and how tokens cross nodes; the command line builds it once (one option group owns the
flags and the builder) and everything that prices reads it: the goodput model, the priced online replay, the phase
steps, ``advise`` and the ``metro`` router. The links are the :class:`~moebalance.core.cluster.Cluster`'s, which
every plan carries.

It also owns the two formulas a layer's price is made of, so that a change of either is one change:

- a GPU's grouped GEMM (:func:`moebalance.cost.time.gemm_seconds`, the roofline, in the deployment's precision);
- a layer: the slowest GPU's grouped GEMM, then the all-to-all (:meth:`Deployment.layer_seconds`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.cost.a2a import KERNELS, LATENCY_US, a2a_estimate, a2a_per_pick, check_kernel_on, kernel_for
from moebalance.cost.hardware import GpuSpec
from moebalance.cost.memory import EngineMemory
from moebalance.cost.time import (
    EXPERT_WEIGHT_BYTES,
    PRECISION_BYTES,
    Calibration,
    gemm_precision,
    gemm_seconds,
    rest_seconds,
    roofline_terms,
)
from moebalance.models import ModelSpec
from moebalance.models.fields import check_fields

__all__ = ["A2A_WORDS", "KERNELS", "OVERLAPS", "PHASES", "PRECISIONS", "Deployment", "Workload"]

#: The precisions a deployment names: the weights' and GEMMs' (``mxfp4``: an MXFP4 checkpoint's experts, the rest and
#: the GEMMs bf16; ``served``: the model's own).
PRECISIONS = ("bf16", "fp8", "mxfp4", "served")
#: How a layer's experts and all-to-all share time: one after the other, or two-batch overlap (SGLang's
#: ``--enable-two-batch-overlap``).
OVERLAPS = ("none", "tbo")
#: The phases a step can be priced in.
PHASES = ("decode", "prefill")
#: Each all-to-all kernel in words (:meth:`Deployment.describe`).
A2A_WORDS = {"per-gpu": "a copy per destination GPU", "normal": "DeepEP normal kernels",
             "low-latency": "DeepEP low-latency kernels", "auto": "DeepEP normal kernels in prefill, low-latency in decode"}


@dataclass(kw_only=True, frozen=True, slots=True)
class Workload:
    """Requests served at saturation: prompt and output tokens each, prefill chunk per data-parallel rank."""

    prompt_tokens: int = 1000
    output_tokens: int = 1000
    #: Prompt tokens a data-parallel rank prefills in one step (CRAFT Section 5.1: chunks of 4096).
    prefill_chunk: int = 4096

    def __post_init__(self) -> None:
        check_fields(self, positive=("prompt_tokens", "output_tokens", "prefill_chunk"), label="")

    @property
    def context_tokens(self) -> int:
        """KV-cache tokens a request holds at its end."""
        return self.prompt_tokens + self.output_tokens


@dataclass(kw_only=True, frozen=True, slots=True)
class Deployment:
    """The model on a GPU under an engine, with its requests (module docstring).

    Example: ``Deployment(model=MODELS["deepseek-v3"], gpu=GPUS["h200"])`` -- published peaks, SGLang's memory
    layout, requests of 1,000 + 1,000 tokens, one all-to-all copy per destination GPU (``a2a="per-gpu"``).
    """

    model: ModelSpec
    gpu: GpuSpec
    calibration: Calibration = field(default_factory=Calibration)
    engine: EngineMemory = field(default_factory=EngineMemory)
    workload: Workload = field(default_factory=Workload)
    #: The all-to-all's kernel (:data:`moebalance.cost.a2a.KERNELS`): ``per-gpu``, DeepEP's ``normal`` or
    #: ``low-latency``, or ``auto`` (normal in prefill, low-latency in decode); DeepEP's on an NVIDIA GPU only
    #: (:func:`moebalance.cost.a2a.kernels_on`).
    a2a: str = "per-gpu"
    #: The weights' and the GEMMs' precision, ``bf16`` or ``fp8``, or ``mxfp4`` (:data:`PRECISIONS`): the routed
    #: experts' weights in MXFP4 as an MXFP4 checkpoint has them, the other weights and the GEMMs bf16
    #: (:func:`moebalance.cost.time.gemm_precision`). ``served``, the default: the model's own
    #: (:attr:`~moebalance.models.ModelSpec.served_precision`), bf16 for an FP8 checkpoint on a GPU without FP8 tensor
    #: cores (weight-only FP8 kernels are not modelled). It sets ``engine.weight_bytes`` and
    #: ``engine.expert_weight_bytes``. Refused in one line (:meth:`_checked_precision`): ``mxfp4`` for a checkpoint
    #: that is not MXFP4, ``fp8`` for one that is.
    precision: str = "served"
    #: ``none`` or ``tbo``, two-batch overlap (:data:`OVERLAPS`; :meth:`layer_seconds`).
    overlap: str = "none"

    def __post_init__(self) -> None:
        for name, kind in (("model", ModelSpec), ("gpu", GpuSpec), ("calibration", Calibration),
                           ("engine", EngineMemory), ("workload", Workload)):
            if not isinstance(getattr(self, name), kind):
                raise InputError(f"Deployment.{name} ({getattr(self, name)!r}) must be a {kind.__name__}")
        check_kernel_on(self.a2a, self.gpu)  # DeepEP's kernels on an AMD GPU: one line
        if self.overlap not in OVERLAPS:
            raise InputError(f"overlap {self.overlap!r} is unknown; choose one of: {', '.join(OVERLAPS)}")
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            raise InputError(f"precision {self.precision!r} is unknown; choose one of: {', '.join(PRECISIONS)}")
        object.__setattr__(self, "precision", self._checked_precision())
        self.gpu.peak_tflops(gemm_precision(self.precision))  # FP8 on a GPU without FP8 tensor cores: one line
        weight_bytes = PRECISION_BYTES[gemm_precision(self.precision)]  # the non-expert weights'
        experts = EXPERT_WEIGHT_BYTES[self.precision]
        expert_bytes = None if experts == weight_bytes else experts  # None: the experts' are weight_bytes too
        if self.engine.weight_bytes not in (weight_bytes, EngineMemory().weight_bytes):
            raise InputError(f"the engine's weights of {self.engine.weight_bytes} bytes disagree with precision "
                             f"{self.precision!r} ({weight_bytes} bytes); give the precision alone, it sets them")
        if self.engine.expert_weight_bytes not in (None, expert_bytes):
            raise InputError(f"the engine's expert weights of {self.engine.expert_weight_bytes:g} bytes disagree with "
                             f"precision {self.precision!r} ({experts:g} bytes); give the precision alone, it sets them")
        if (self.engine.weight_bytes, self.engine.expert_weight_bytes) != (weight_bytes, expert_bytes):
            object.__setattr__(self, "engine", dataclasses.replace(self.engine, weight_bytes=weight_bytes,
                                                                   expert_weight_bytes=expert_bytes))

    def _checked_precision(self) -> str:
        """The precision priced: ``served`` resolved to the model's own (an FP8 checkpoint's in bf16 on a GPU without
        FP8 tensor cores), after refusing what no engine serves from the model's checkpoint: MXFP4 experts of a
        checkpoint that is not MXFP4 (engines read MXFP4 from the checkpoint; SGLang's on-load MXFP4 quantization,
        ``--quantization mxfp4`` or ``quark_mxfp4``, runs on ROCm gfx95 GPUs through AITER only and is not modelled),
        and FP8 weights of an MXFP4 checkpoint (engines serve its MXFP4 as it is)."""
        served, name = self.model.served_precision, self.model.display_name
        if self.precision == "served":
            return "bf16" if served == "fp8" and self.gpu.fp8_tflops is None else served
        if self.precision == "mxfp4" and served != "mxfp4":
            raise InputError(f"--precision mxfp4 prices an MXFP4 checkpoint's experts, but {name}'s checkpoint is "
                             f"{served.upper()} and engines do not quantize to MXFP4 on load; give --precision "
                             "served, bf16 or fp8")
        if self.precision == "fp8" and served == "mxfp4":
            raise InputError(f"--precision fp8 prices FP8 weights, but {name}'s checkpoint is MXFP4, which engines "
                             "serve as it is; give --precision served (mxfp4) or bf16 (a BF16 copy)")
        return self.precision

    def a2a_kernel(self, phase: str | None = None) -> str:
        """The kernel that moves ``phase``'s tokens (:func:`moebalance.cost.a2a.kernel_for`: ``auto`` is ``normal``
        in prefill, ``low-latency`` in decode and for a load's own batches, ``phase`` None)."""
        return kernel_for(self.a2a, phase)

    def a2a_fixed_seconds(self, phase: str | None = None) -> float:
        """Seconds an MoE layer's all-to-all costs besides its bytes, for dispatch and for combine: the calibration's
        measured fixed cost where it has one (``calibrate --measure``), else the kernel's
        (:data:`moebalance.cost.a2a.LATENCY_US`)."""
        measured = self.calibration.a2a_latency_us
        return 2e-6 * (LATENCY_US[self.a2a_kernel(phase)] if measured is None else measured)

    @property
    def activation_bytes(self) -> float:
        """``a``, bytes per activation the grouped GEMM moves: the mean of its input (in the GEMM's precision, bf16
        for ``mxfp4``) and its output (bf16)."""
        return (PRECISION_BYTES[gemm_precision(self.precision)] + PRECISION_BYTES["bf16"]) / 2

    @property
    def dispatch_bytes(self) -> int:
        """One token's dispatch copy: ``H`` values in the GEMM's precision (bf16 for ``mxfp4``); FP8 adds a float32
        scale per 128 values (the per-token, per-128-channel scaling of DeepSeek's FP8 recipe, which DeepEP's FP8
        dispatch sends)."""
        H = self.model.hidden_size
        return H * 2 if gemm_precision(self.precision) == "bf16" else H + 4 * -(-H // 128)

    @property
    def bytes_per_copy(self) -> int:
        """Bytes per token copy and direction the all-to-all is timed with: the mean of the dispatch's
        (:attr:`dispatch_bytes`) and the combine's (bf16, ``2 H``), so that its two phases add up to both."""
        return -(-(self.dispatch_bytes + 2 * self.model.hidden_size) // 2)

    @property
    def bytes_per_expert(self) -> int:
        """One routed expert's weights: ``3 H F w`` bytes, ``w`` the experts' bytes per weight (an MXFP4 expert's
        4.25 / 8 a whole number of bytes, its blocks of 32 weights taking 17), what a copy of it moves."""
        return math.ceil(self.model.expert_params() * self.engine.expert_bytes_per_weight)

    def describe(self) -> str:
        """What the prices assume, in words: ``"published peaks, bf16, no overlap, a copy per destination GPU"``."""
        dispatch = A2A_WORDS[self.a2a]
        overlap = "no overlap" if self.overlap == "none" else "two-batch overlap"
        kv_names = {b: name for name, b in PRECISION_BYTES.items()}
        kv = "" if self.engine.kv_bytes == PRECISION_BYTES["bf16"] else \
            f", {kv_names.get(self.engine.kv_bytes, f'{self.engine.kv_bytes}-byte')} KV cache"
        precision = "mxfp4 experts" if self.precision == "mxfp4" else self.precision
        return f"{self.calibration.source}, {precision}{kv}, {overlap}, {dispatch}"

    def ranks(self, cluster: Cluster, lost: int = 0) -> int:
        """Data-parallel ranks on ``cluster`` with ``lost`` GPUs gone (at least 1)."""
        return max((cluster.num_gpus - lost) // self.engine.attention_group(cluster.gpus_per_node), 1)

    def check_load(self, load: LoadMatrix, *, what: str = "the load", fix: str = "give the load's --model") -> None:
        """Refuse a load (or a plan's load) of another model's shape (:meth:`moebalance.core.load.LoadMatrix.check_model`)."""
        load.check_model(self.model, what=what, fix=fix)

    # ----- the layer's price --------------------------------------------------------------------------------------

    def gemm_seconds(self, picks: np.ndarray | float, touched: np.ndarray | float) -> np.ndarray:
        """A GPU's grouped GEMM over ``picks`` picks touching ``touched`` experts (arrays broadcast)."""
        return gemm_seconds(picks, touched, self.model, self.gpu, self.calibration,
                            weight_bytes=self.engine.expert_bytes_per_weight, activation_bytes=self.activation_bytes,
                            precision=self.precision)

    def layer_seconds(self, expert_gpu: np.ndarray, a2a: np.ndarray | float) -> np.ndarray:
        """``float64 [...]``: an MoE layer from each GPU's grouped GEMM ``expert_gpu [..., G]`` and the all-to-all
        ``a2a [...]``. Without overlap the layer waits for its slowest GPU, then for the all-to-all: ``E + A``. With
        two-batch overlap (``overlap="tbo"``: the step in two micro-batches, one computing while the other's tokens
        move) each resource works on both halves while the other works too, and only half of the lesser one cannot
        hide: ``max(E, A) + min(E, A) / 2`` (the grouped GEMM's weights counted once, though each micro-batch reads
        those it touches)."""
        expert = np.asarray(expert_gpu, dtype=np.float64).max(axis=-1)
        comm = np.asarray(a2a, dtype=np.float64)
        if self.overlap == "tbo":
            return np.maximum(expert, comm) + np.minimum(expert, comm) / 2
        return expert + comm

    def a2a_estimate(self, gpu_load: np.ndarray, cluster: Cluster, phase: str | None = None) -> np.ndarray:
        """All-to-all seconds (bytes and fixed cost) of per-GPU picks ``[..., G]`` of counts, which carry no tokens
        (:func:`moebalance.cost.a2a.a2a_estimate` with ``phase``'s kernel); none where there are no picks."""
        load = np.asarray(gpu_load, dtype=np.float64)
        moved = a2a_estimate(load, cluster, self.bytes_per_copy, kernel=self.a2a_kernel(phase),
                             top_k=self.model.top_k)
        return moved + np.where(load.sum(axis=-1) > 0, self.a2a_fixed_seconds(phase), 0.0)

    def cost_vector(self, cluster: Cluster) -> np.ndarray:
        """``float64 [5]``: ``[alpha, beta, gamma, launch, kappa]`` seconds on ``cluster``, the roofline's terms
        (:func:`moebalance.cost.time.roofline_terms`) and the all-to-all per pick
        (:func:`moebalance.cost.a2a.a2a_per_pick`), as the ``metro`` router's compiled kernel takes them."""
        terms = roofline_terms(self.model, self.gpu, self.calibration,
                               weight_bytes=self.engine.expert_bytes_per_weight,
                               activation_bytes=self.activation_bytes, precision=self.precision)
        return np.array([*terms, a2a_per_pick(cluster, self.bytes_per_copy)])

    # ----- a step -----------------------------------------------------------------------------------------------

    def step_seconds(self, layers: np.ndarray, tokens_per_rank: float, gpus_per_node: int, phase: str) -> float:
        """A forward step: its MoE layers ``layers [L]`` (seconds, :meth:`layer_seconds`) one after another, then
        everything else (:meth:`rest_seconds`) for ``tokens_per_rank`` tokens on each data-parallel rank."""
        return float(np.sum(layers)) + self.rest_seconds(tokens_per_rank, gpus_per_node, phase)

    def rest_seconds(self, tokens_per_rank: float, gpus_per_node: int, phase: str) -> float:
        """Everything but the routed experts in one step of ``tokens_per_rank`` tokens on each data-parallel rank
        (:func:`moebalance.cost.time.rest_seconds`): in ``prefill`` one next-token logit per prompt and no KV cache
        read; in ``decode`` a logit per token and each request's KV cache of ``prompt + output / 2`` tokens."""
        if phase not in PHASES:
            raise InputError(f"phase {phase!r} is unknown; choose one of: {', '.join(PHASES)}")
        w = self.workload
        if phase == "decode":  # each token attends to its request's context, the KV cache it reads
            context = w.prompt_tokens + w.output_tokens / 2
            return rest_seconds(tokens_per_rank, self.model, self.gpu, self.engine, gpus_per_node,
                                kv_tokens_per_rank=tokens_per_rank * context, calibration=self.calibration,
                                precision=self.precision, absorbed=True,
                                attended_per_rank=tokens_per_rank * self.model.attended_pairs(context, prompt=False))
        # a prompt's token i attends to the i tokens up to it: (P + 1) / 2 each on average in a full layer
        return rest_seconds(tokens_per_rank, self.model, self.gpu, self.engine, gpus_per_node,
                            logits_per_rank=tokens_per_rank / w.prompt_tokens, calibration=self.calibration,
                            precision=self.precision,
                            attended_per_rank=tokens_per_rank * self.model.attended_pairs(w.prompt_tokens, prompt=True))
