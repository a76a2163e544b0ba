"""The engine's whole launch command for a priced deployment, before its EPLB flags (``advise``'s ``launch.txt``;
docs/design.md, "Advice"): the model, the parallel layout, the all-to-all, the precision and the overlap the price
assumed, each as the engine's own option. What an engine has no option for is said in a ``#`` comment. Every value is
quoted for a POSIX shell (:func:`shlex.quote`) but the ``$NAME`` placeholders a launch on several nodes fills in.

Legend: ``G`` GPUs (the EP size), ``A`` GPUs per data-parallel attention rank (``--attention-tp``, default a node),
``D = G / A`` ranks, ``M`` the model's Hugging Face id where its spec records one (its ``source`` is the
``config.json`` on Hugging Face), else the placeholder ``MODEL_PATH``.

Options, read from the engines' argument parsers (SGLang 0.5.23: ``sglang/srt/arg_groups/fields/``; vLLM 0.33:
``vllm/engine/arg_utils.py``, ``vllm/entrypoints/common/cli_args.py``) and TensorRT-LLM's ``trtllm-serve``
documentation and Wide-EP example (``examples/wide_ep/README.md``):

- SGLang: ``python -m sglang.launch_server --model-path M --tp-size G --ep-size G``; where ``D > 1``
  ``--attn-dp-size D`` (0.5.23's spelling of ``--dp-size D --enable-dp-attention``, which it deprecates) and, for a
  model with dense layers whose MLP is replicated (``--dense-tp 1``), ``--moe-dense-tp-size 1``;
  ``--mem-fraction-static``; DeepEP as ``--moe-a2a-backend deepep --deepep-mode normal|low_latency|auto``;
  ``--enable-two-batch-overlap``; ``--quantization fp8`` (a BF16 checkpoint priced in FP8); ``--kv-cache-dtype
  fp8_e4m3``; ``--max-running-requests`` (over all ranks, as the price's); in prefill ``--chunked-prefill-size`` of
  every rank's chunk (SGLang divides it by the attention data-parallel size); on several nodes ``--nnodes N
  --node-rank $NODE_RANK --dist-init-addr $DIST_INIT_ADDR``.
- vLLM: ``vllm serve M --tensor-parallel-size A --data-parallel-size D --enable-expert-parallel`` (the experts over
  ``A D = G`` GPUs); DeepEP as ``--all2all-backend deepep_high_throughput|deepep_low_latency`` (vLLM has no
  automatic mode: ``auto`` is given as the priced phase's kernel); ``--enable-dbo`` (two-batch overlap);
  ``--quantization fp8``; ``--kv-cache-dtype fp8``; ``--max-num-seqs`` per rank (vLLM applies it per data-parallel
  rank, ``vllm/config/scheduler.py``); in prefill ``--max-num-batched-tokens`` a rank's chunk; on several nodes
  node 0's ``--data-parallel-size-local --data-parallel-address --data-parallel-rpc-port``, the other nodes'
  ``--headless --data-parallel-start-rank`` in a comment (vLLM's data-parallel deployment guide).
- TensorRT-LLM: ``trtllm-serve M --tp_size G --ep_size G --extra_llm_api_options FILE``, FILE (:func:`trtllm_options`)
  holding ``enable_attention_dp`` (TensorRT-LLM's attention is data-parallel on every GPU or tensor-parallel over
  all), ``kv_cache_config.dtype`` and ``moe_config.load_balancer``; ``--max_batch_size`` per rank; in prefill
  ``--max_num_tokens`` a rank's chunk.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from moebalance.core.cluster import Cluster
from moebalance.cost.deployment import A2A_WORDS, Deployment
from moebalance.cost.time import PRECISION_BYTES
from moebalance.models import ModelSpec

__all__ = ["MODEL_PLACEHOLDER", "engine_command", "model_id", "trtllm_options"]

#: The model's place in a command where its spec records no Hugging Face id.
MODEL_PLACEHOLDER = "MODEL_PATH"
_HF_CONFIG = re.compile(r"https://huggingface\.co/([\w.-]+/[\w.-]+)/(?:blob|resolve)/[\w.-]+/config\.json")
#: DeepEP's kernels as SGLang's ``--deepep-mode`` (with its automatic choice by phase) and vLLM's
#: ``--all2all-backend`` name them.
_SGLANG_DEEPEP = {"normal": "normal", "low-latency": "low_latency", "auto": "auto"}
_VLLM_A2A = {"normal": "deepep_high_throughput", "low-latency": "deepep_low_latency"}


def model_id(spec: ModelSpec) -> str | None:
    """The model's Hugging Face id (``deepseek-ai/DeepSeek-V3``) where its ``source`` is its ``config.json`` there."""
    m = _HF_CONFIG.fullmatch(spec.source)
    return m.group(1) if m else None


def _common(d: Deployment, engine: str) -> tuple[str, list[str]]:
    """The model word and the comments every engine shares: the model placeholder, weights of another precision than
    the checkpoint's, and an all-to-all no engine option selects."""
    spec, comments = d.model, []
    name = model_id(spec)
    if name is None:
        comments.append(f"# {MODEL_PLACEHOLDER}: {spec.display_name}'s weights (a folder or a Hugging Face id); its "
                        "model spec records no Hugging Face id")
    if d.precision == "bf16" and spec.served_precision == "fp8":
        comments.append(f"# priced with BF16 weights, but {spec.display_name}'s checkpoint is FP8: serve a BF16 copy "
                        "of it in the model's place")
    if d.precision == "fp8" and spec.served_precision != "fp8" and engine == "trtllm":
        comments.append(f"# priced with FP8 weights: give TensorRT-LLM an FP8-quantized checkpoint of "
                        f"{spec.display_name} in the model's place")
    if d.a2a == "per-gpu":
        comments.append("# priced with a plain all-to-all (a copy per destination GPU, no fixed cost: a bandwidth "
                        "lower bound), which no engine option selects; --a2a normal, low-latency or auto prices "
                        "DeepEP's kernels")
    return shlex.quote(name or MODEL_PLACEHOLDER), comments


def engine_command(engine: str, d: Deployment, cluster: Cluster, phase: str) -> tuple[list[str], list[str]]:
    """``(words, comments)``: the command that serves ``d`` on ``cluster`` with ``engine`` (module docstring), each
    word ready for a POSIX shell, and the ``#`` lines that say what no option of the engine carries."""
    model, comments = _common(d, engine)
    G, N, gpn = cluster.num_gpus, cluster.num_nodes, cluster.gpus_per_node
    A = d.engine.attention_group(gpn)
    D = max(G // A, 1)
    fp8_weights = d.precision == "fp8" and d.model.served_precision != "fp8"
    fp8_kv = d.engine.kv_bytes == PRECISION_BYTES["fp8"]
    cap, chunk = d.engine.max_running_requests, d.workload.prefill_chunk
    if engine == "sglang":
        words = ["python", "-m", "sglang.launch_server", "--model-path", model, "--tp-size", str(G), "--ep-size", str(G)]
        if D > 1:
            words += ["--attn-dp-size", str(D)]
            if d.engine.dense_tp == 1 and d.model.num_dense_layers > 0:
                words += ["--moe-dense-tp-size", "1"]
        if N > 1:
            words += ["--nnodes", str(N), "--node-rank", "$NODE_RANK", "--dist-init-addr", "$DIST_INIT_ADDR"]
            comments.append(f"# on each of the {N} nodes: NODE_RANK its rank (0 to {N - 1}), DIST_INIT_ADDR node 0's "
                            "HOST:PORT")
        words += ["--mem-fraction-static", f"{d.engine.memory_fraction:g}"]
        if d.a2a != "per-gpu":
            words += ["--moe-a2a-backend", "deepep", "--deepep-mode", _SGLANG_DEEPEP[d.a2a]]
        words += ["--enable-two-batch-overlap"] if d.overlap == "tbo" else []
        if d.overlap == "tbo" and d.a2a == "per-gpu" and D == 1:  # sglang/srt/arg_groups/validation_hook.py
            comments.append("# SGLang refuses two-batch overlap without DeepEP unless attention is data parallel: "
                            "give --a2a or an --attention-tp below the GPUs")
        words += ["--quantization", "fp8"] if fp8_weights else []
        words += ["--kv-cache-dtype", "fp8_e4m3"] if fp8_kv else []
        words += [] if cap is None else ["--max-running-requests", str(cap)]
        words += ["--chunked-prefill-size", str(chunk * D)] if phase == "prefill" else []
        return words, comments
    if engine == "vllm":
        words = ["vllm", "serve", model, "--tensor-parallel-size", str(A), "--data-parallel-size", str(D)]
        if N > 1 and D % N == 0:
            local = D // N
            words += ["--data-parallel-size-local", str(local), "--data-parallel-address", "$HEAD_IP",
                      "--data-parallel-rpc-port", "$DP_RPC_PORT"]
            start = "i" if local == 1 else f"i * {local}"
            comments.append(f"# on node 0 of {N} (HEAD_IP its address, DP_RPC_PORT a free port); on node i > 0 the "
                            f"same with --headless --data-parallel-start-rank {start}")
        elif N > 1:
            comments.append(f"# {D} data-parallel ranks of {A} GPUs do not split evenly over {N} nodes of {gpn}: "
                            "place the ranks by hand (vLLM's --data-parallel-size-local)")
        words.append("--enable-expert-parallel")
        if d.a2a != "per-gpu":
            kernel = d.a2a_kernel(phase)
            words += ["--all2all-backend", _VLLM_A2A[kernel]]
            if d.a2a == "auto":
                comments.append(f"# vLLM picks no DeepEP kernel by phase: the {phase} steps' ({kernel}) is given")
        words += ["--enable-dbo"] if d.overlap == "tbo" else []
        words += ["--quantization", "fp8"] if fp8_weights else []
        words += ["--kv-cache-dtype", "fp8"] if fp8_kv else []
        words += [] if cap is None else ["--max-num-seqs", str(max(cap // D, 1))]
        words += ["--max-num-batched-tokens", str(chunk)] if phase == "prefill" else []
        return words, comments
    words = ["trtllm-serve", model, "--tp_size", str(G), "--ep_size", str(G)]
    ranks = G if A < G else 1  # TensorRT-LLM's attention: data-parallel on every GPU, or tensor-parallel over all
    if 1 < A < G:
        comments.append(f"# priced with attention tensor-parallel over {A} GPUs in {D} data-parallel ranks, which "
                        "TensorRT-LLM does not run (its attention is data-parallel on every GPU or tensor-parallel "
                        "over all): enable_attention_dp is given; --attention-tp 1 prices its layout")
    words += [] if cap is None else ["--max_batch_size", str(max(cap // ranks, 1))]
    words += ["--max_num_tokens", str(chunk)] if phase == "prefill" else []
    if d.a2a != "per-gpu":
        comments.append(f"# priced with {A2A_WORDS[d.a2a]}; TensorRT-LLM chooses its all-to-all kernels itself")
    if d.overlap == "tbo":
        comments.append("# priced with two-batch overlap, which moebalance names no TensorRT-LLM option for")
    if N > 1:
        comments.append(f"# on {N} nodes: launch it on all of them in one MPI world (mpirun or srun)")
    return words, comments


def trtllm_options(d: Deployment, cluster: Cluster, load_balancer: str | None) -> dict[str, Any]:
    """TensorRT-LLM's ``--extra_llm_api_options`` YAML: data-parallel attention where the price had more than one
    rank, an FP8 KV cache where it had one, and ``moe_config.load_balancer`` naming the load-balancer file."""
    doc: dict[str, Any] = {}
    if d.engine.attention_group(cluster.gpus_per_node) < cluster.num_gpus:
        doc["enable_attention_dp"] = True
    if d.engine.kv_bytes == PRECISION_BYTES["fp8"]:
        doc["kv_cache_config"] = {"dtype": "fp8"}
    if load_balancer is not None:
        doc["moe_config"] = {"load_balancer": load_balancer}
    return doc
