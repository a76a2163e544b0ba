"""``moebalance advise`` (:mod:`moebalance.app.advise`): every configuration an engine runs, priced in tokens per
second on held-out batches, the recommendation, and the engine files it writes.

Real data: the bundled ESFT law routing (DeepSeek-V2-Lite, token level, 16 batches on 8 ranks) and SGLang's published
DeepSeek-V3 statistics (tests/data/sglang-deepseek-v3, one batch each, attributed in its README).
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import assert_user_error, run_cli, tiny_model_spec

from moebalance.app.advise import (
    DEFAULT_MARGIN,
    Advice,
    Candidate,
    Priced,
    Setup,
    candidates,
    dividing_gpu_counts,
    price,
    recommend,
    redundant_values,
)
from moebalance.app.advise_engines import launch_lines
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix, read_bundled, write_load
from moebalance.core.plan import Placement, read_plan
from moebalance.cost.calibrate import FIT_ERROR_KEY, read_calibration
from moebalance.cost.deployment import Deployment, Workload
from moebalance.cost.hardware import get_gpu
from moebalance.cost.memory import EngineMemory
from moebalance.engines import read_any_load
from moebalance.engines import sglang as sglang_engine
from moebalance.engines import trtllm as trtllm_engine
from moebalance.engines import vllm as vllm_engine
from moebalance.engines.base import EplbChoice, Launch
from moebalance.engines.detect import read_any_plan
from moebalance.models import get_model
from moebalance.online.rearrange import Replanning
from moebalance.online.replay import replay
from moebalance.policies import make_plan
from moebalance.pricing.phase import PhaseModel
from moebalance.pricing.step import StepPricing

STATS = Path(__file__).parent / "data" / "sglang-deepseek-v3"
DECODE, PREFILL = STATS / "decode_in1000out1000.json", STATS / "prefill_in1024.json"
V3 = ["--nodes", 8, "--gpus-per-node", 8, "--gpu", "h100-80gb"]
ESFT = ["--load", "bundled:esft-law", "--model", "deepseek-v2-lite", "--nodes", 1, "--gpus-per-node", 8,
        "--gpu", "h100-80gb"]
CANDIDATE_KEYS = {"label", "tokens_per_s", "kv_cache_gib", "balancedness", "redundant_experts"}
RECOMMENDATION_KEYS = {"label", "engine", "policy", "redundant_experts", "num_groups", "router", "rebalance",
                       "tokens_per_s", "gain_vs_off"}
#: Flags of SGLang 0.5.23 (sglang/srt/arg_groups/fields/: the fields' CLI names) and of vLLM 0.33
#: (vllm/engine/arg_utils.py), and vLLM's EPLBConfig fields (vllm/config/parallel.py), read from their sources.
SGLANG_FLAGS = {"--ep-size", "--ep-num-redundant-experts", "--init-expert-location", "--ep-dispatch-algorithm",
                "--enable-eplb", "--eplb-algorithm", "--eplb-rebalance-num-iterations",
                "--expert-distribution-recorder-buffer-size", "--eplb-rebalance-layers-per-chunk", "--model-path",
                "--tp-size", "--attn-dp-size", "--moe-dense-tp-size", "--nnodes", "--node-rank", "--dist-init-addr",
                "--mem-fraction-static", "--moe-a2a-backend", "--deepep-mode", "--enable-two-batch-overlap",
                "--quantization", "--kv-cache-dtype", "--max-running-requests", "--chunked-prefill-size"}
SGLANG_DISPATCH = {"static", "dynamic", "fake", "lp"}
VLLM_FLAGS = {"--enable-expert-parallel", "--enable-eplb", "--eplb-config", "--tensor-parallel-size",
              "--data-parallel-size", "--data-parallel-size-local", "--data-parallel-address", "--data-parallel-rpc-port",
              "--all2all-backend", "--enable-dbo", "--quantization", "--kv-cache-dtype", "--max-num-seqs",
              "--max-num-batched-tokens"}
#: What ``advise --json`` and advise.json say the prices assumed.
ASSUMPTION_KEYS = {"calibration", "calibration_fit_error", "precision", "kv_cache_dtype", "attention_tp",
                   "data_parallel_ranks", "a2a", "overlap", "phase", "tokens_per_step", "step_note",
                   "requests_per_step", "margin", "held_out", "held_out_note"}
VLLM_EPLB_FIELDS = {"window_size", "step_interval", "num_redundant_experts", "log_balancedness",
                    "log_balancedness_interval", "use_async", "policy", "communicator", "enable_migration_batching"}


def advise(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[dict[str, Any], str]:
    """``advise ... --json``: the document and stderr."""
    rc, out, err = run_cli(["advise", *argv, "--json"], capsys)
    assert rc == 0, err
    return json.loads(out), err


def check_contract(doc: dict[str, Any], margin: float = DEFAULT_MARGIN) -> None:
    """The JSON keys exactly; "off" listed; the recommendation the fastest, or off when nothing beats it by more than
    the margin."""
    assert set(doc) == {"recommendation", "candidates", "engine_files", "priced_with", "margin", "assumptions"}
    assert isinstance(doc["priced_with"], str) and doc["margin"] >= margin
    assert set(doc["assumptions"]) == ASSUMPTION_KEYS and doc["assumptions"]["margin"] == pytest.approx(doc["margin"])
    rec, cands = doc["recommendation"], doc["candidates"]
    assert set(rec) == RECOMMENDATION_KEYS
    assert all(CANDIDATE_KEYS <= set(c) for c in cands)
    labels = [c["label"] for c in cands]
    assert len(set(labels)) == len(labels)
    offs = [c for c in cands if "off" in c["label"]]
    assert len(offs) == 1
    off, best = offs[0], max(cands, key=lambda c: c["tokens_per_s"])
    assert cands[0]["tokens_per_s"] == best["tokens_per_s"]  # ranked, fastest first
    assert rec["label"] in labels
    if best["tokens_per_s"] > off["tokens_per_s"] * (1 + margin):
        assert rec["tokens_per_s"] == best["tokens_per_s"]
        assert rec["gain_vs_off"] == pytest.approx(best["tokens_per_s"] / off["tokens_per_s"] - 1, abs=1e-6)
    else:
        assert rec["label"] == off["label"] and rec["policy"] == "contiguous" and rec["gain_vs_off"] == 0.0
        assert rec["rebalance"] is None and rec["redundant_experts"] == 0


def test_redundant_values_follow_the_engines_rule() -> None:
    # E + r divisible by G, from the smallest r upward in steps of G, up to E / 2, at least two and at most four
    assert redundant_values(64, 8) == [0, 8, 16, 24]
    assert redundant_values(256, 64) == [0, 64, 128]
    assert redundant_values(60, 8) == [4, 12, 20, 28]
    assert redundant_values(8, 16) == [8, 24]
    for E, G in ((64, 8), (256, 64), (60, 8), (8, 16), (160, 48)):
        assert all((E + r) % G == 0 for r in redundant_values(E, G))


def test_esft_on_vllm_prices_periodic_and_plug_in_candidates(capsys: pytest.CaptureFixture[str]) -> None:
    doc, err = advise(capsys, *ESFT, "--engine", "vllm")
    check_contract(doc)
    assert doc["engine_files"] == []
    labels = [c["label"] for c in doc["candidates"]]
    # 8 held-out batches: re-planning every 2 and 4 steps, vLLM's own EPLB and the move-aware plug-in; no CRAFT
    assert any("every 4 on 4 (async)" in x and "plug-in" not in x for x in labels)
    assert any("every 2 on 2 (async), move-aware plug-in" in x for x in labels)
    assert not any("CRAFT" in x or "hierarchical" in x for x in labels)
    assert {c["redundant_experts"] for c in doc["candidates"]} == {0, 8, 16, 24}
    assert {c["router"] for c in doc["candidates"]} == {"random"}
    assert "CRAFT" in err  # said why it is not listed
    # replicas take KV cache: more redundant experts, less cache and fewer tokens per decode step
    static = sorted((c for c in doc["candidates"] if "static plan" in c["label"]), key=lambda c: c["redundant_experts"])
    assert [c["kv_cache_gib"] for c in static] == sorted((c["kv_cache_gib"] for c in static), reverse=True)
    assert static[0]["step_tokens"] > static[-1]["step_tokens"]


def test_sglang_statistics_files_load_back_and_obey_the_engine(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    out = tmp_path / "advice"
    doc, err = advise(capsys, "--load", DECODE, *V3, "--out-dir", out)
    check_contract(doc)
    # what it priced with: the profile shipped for the H100's silicon (the default), precision, overlap, all-to-all
    assert doc["priced_with"] == "profile h800-deepgemm-fp8 (auto for h100-80gb), fp8, no overlap, a copy per " \
                                 "destination GPU"  # DeepSeek-V3 in its served precision, FP8
    assert json.loads((out / "advise.json").read_text())["priced_with"] == doc["priced_with"]
    assert "one batch (statistics)" in err
    rec = doc["recommendation"]
    assert rec["engine"] == "sglang" and rec["policy"] != "contiguous"  # EPLB pays on DeepSeek-V3's decode
    labels = [c["label"] for c in doc["candidates"]]
    for kind in ("EPLB hierarchical", "EPLB global", "CRAFT padded", "LP dispatch", "dynamic dispatch"):
        assert any(kind in x for x in labels), kind
    assert not any("every" in x for x in labels)  # one batch: no periodic re-planning
    files = [Path(f) for f in doc["engine_files"]]
    assert [f.name for f in files] == ["plan.json", "sglang-init-expert-location.json", "launch.txt"]
    assert all(f.parent == out for f in files)  # where they are read from: the out-dir, not the folder written first
    assert json.loads((out / "advise.json").read_text())["recommendation"] == rec
    plan = read_plan(files[0])
    assert plan.policy == rec["policy"]
    load = read_any_load(DECODE)
    cluster = Cluster(num_nodes=8, gpus_per_node=8)
    back = read_any_plan(files[1], cluster, load=load)
    np.testing.assert_array_equal(back.copies, plan.copies)
    phy2log = np.asarray(json.loads(files[1].read_text())["physical_to_logical_map"])
    assert phy2log.shape[0] == 61 and phy2log.shape[1] % 64 == 0
    assert phy2log.shape[1] - 256 == rec["redundant_experts"]
    flags = shlex.split(files[2].read_text().splitlines()[0])  # the whole command, then # comments
    assert flags[:3] == ["python", "-m", "sglang.launch_server"]
    assert {f for f in flags if f.startswith("--")} <= SGLANG_FLAGS
    assert flags[flags.index("--init-expert-location") + 1] == str(files[1])
    assert int(flags[flags.index("--ep-num-redundant-experts") + 1]) == rec["redundant_experts"]
    assert int(flags[flags.index("--ep-size") + 1]) == 64
    assert flags[flags.index("--ep-dispatch-algorithm") + 1] in SGLANG_DISPATCH
    # what the price assumed: DeepSeek-V3's Hugging Face id, tensor parallel over the 64 GPUs with attention data
    # parallel in 8 ranks (a node each, the default), 8 nodes, SGLang's memory share 0.79 (the default), and no DeepEP
    # (the default per-GPU all-to-all, said in a comment)
    given = {f: flags[flags.index(f) + 1] for f in ("--model-path", "--tp-size", "--attn-dp-size", "--nnodes",
                                                    "--node-rank", "--mem-fraction-static")}
    assert given == {"--model-path": "deepseek-ai/DeepSeek-V3", "--tp-size": "64", "--attn-dp-size": "8",
                     "--nnodes": "8", "--node-rank": "$NODE_RANK", "--mem-fraction-static": "0.79"}
    assert "--moe-a2a-backend" not in flags and "--enable-two-batch-overlap" not in flags
    assert any(line.startswith("# priced with a plain all-to-all") for line in files[2].read_text().splitlines())
    page = (out / "report.html").read_text()
    assert f"Run {rec['label']} on sglang" in page and "<script" not in page and "http" not in page.split("<body>")[1]
    # one batch: priced in sample, and every output says so
    assumed = doc["assumptions"]
    assert assumed["held_out"] is False and "has one batch (statistics)" in assumed["held_out_note"]
    assert assumed["tokens_per_step"] == assumed["requests_per_step"] == next(
        c["step_tokens"] for c in doc["candidates"] if c["label"] == rec["label"])  # decode: a token per request
    assert assumed["calibration"] == "profile h800-deepgemm-fp8 (auto for h100-80gb)"
    assert page.index("<h2>Assumptions</h2>") < page.index("<h2>Ranking</h2>")
    assert "in sample: " in page and "has one batch (statistics)" in page


def test_trtllm_yaml_loads_back_with_slots_divisible_by_the_ep_size(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    doc, _ = advise(capsys, "--load", DECODE, *V3, "--engine", "trtllm", "--out-dir", tmp_path)
    check_contract(doc)
    files = {Path(f).name: Path(f) for f in doc["engine_files"]}
    assert set(files) == {"plan.json", "trtllm-load-balancer.yaml", "trtllm-extra-llm-api-options.yaml", "launch.txt"}
    config = yaml.safe_load(files["trtllm-load-balancer.yaml"].read_text())
    assert config["num_slots"] % 64 == 0 and config["num_slots"] - 256 == doc["recommendation"]["redundant_experts"]
    assert config["layer_updates_per_iter"] == 0  # a static plan
    # the MoE layers in the model's numbering, and DeepSeek-V3's one MTP layer (61) in the engine's default order:
    # TensorRT-LLM looks its key up when the MTP layer registers and stops with a KeyError without it
    assert sorted(config["initial_global_assignments"]) == [*range(3, 61), 61]
    assert config["initial_global_assignments"][61] == [p % 256 for p in range(config["num_slots"])]
    back = read_any_plan(files["trtllm-load-balancer.yaml"], Cluster(num_nodes=8, gpus_per_node=8),
                         load=read_any_load(DECODE))
    np.testing.assert_array_equal(back.copies, read_plan(files["plan.json"]).copies)
    # the whole command: trtllm-serve with the EP size and the options YAML, which names the load balancer's file and
    # runs attention data parallel (8 ranks priced, a node each)
    command = shlex.split(files["launch.txt"].read_text().splitlines()[0])
    assert command == ["trtllm-serve", "deepseek-ai/DeepSeek-V3", "--tp_size", "64", "--ep_size", "64",
                       "--extra_llm_api_options", str(files["trtllm-extra-llm-api-options.yaml"])]
    options = yaml.safe_load(files["trtllm-extra-llm-api-options.yaml"].read_text())
    assert options == {"enable_attention_dp": True,
                       "moe_config": {"load_balancer": str(files["trtllm-load-balancer.yaml"])}}
    doc, _ = advise(capsys, "--load", DECODE, *V3, "--engine", "trtllm", "--out-dir", tmp_path / "no-mtp",
                    "--mtp-layers", 0)
    config = yaml.safe_load((tmp_path / "no-mtp" / "trtllm-load-balancer.yaml").read_text())
    assert sorted(config["initial_global_assignments"]) == list(range(3, 61))


def _shell_words(line: str) -> list[str]:
    """The arguments a POSIX shell passes the command of ``line`` (run as a function that prints them), with the
    multi-node placeholders set: NODE_RANK 3, DIST_INIT_ADDR node0:5000, HEAD_IP node0, DP_RPC_PORT 13345."""
    name = next(w for w in shlex.split(line) if "=" not in w)
    env = {**os.environ, "NODE_RANK": "3", "DIST_INIT_ADDR": "node0:5000", "HEAD_IP": "node0", "DP_RPC_PORT": "13345"}
    done = subprocess.run(["sh", "-c", f'{name}() {{ printf "%s\\n" "$@"; }}\n{line}'], env=env, capture_output=True,
                          text=True, check=True)
    return done.stdout.splitlines()


def test_the_launch_command_is_whole_and_runs_in_a_shell(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """launch.txt's first line is the engine's whole command for what was priced (DeepEP in SGLang's automatic mode,
    two-batch overlap, an FP8 KV cache, 2,048 running requests over 8 nodes of 8), and a shell reads the placement
    file's path as one word, its space and quote kept."""
    out = tmp_path / "bob's advice"
    argv = ["--load", DECODE, *V3, "--a2a", "auto", "--overlap", "tbo", "--kv-cache-dtype", "fp8",
            "--max-running-requests", 2048]
    doc, _ = advise(capsys, *argv, "--out-dir", out)
    check_contract(doc)
    assert doc["recommendation"]["policy"] != "contiguous"
    words = _shell_words((out / "launch.txt").read_text().splitlines()[0])
    assert words[:2] == ["-m", "sglang.launch_server"] and {w for w in words if w.startswith("--")} <= SGLANG_FLAGS

    def given(flag: str) -> str:
        return words[words.index(flag) + 1]

    assert given("--init-expert-location") == str(out / "sglang-init-expert-location.json")
    assert (given("--node-rank"), given("--dist-init-addr")) == ("3", "node0:5000")
    assert (given("--moe-a2a-backend"), given("--deepep-mode")) == ("deepep", "auto")
    assert "--enable-two-batch-overlap" in words
    assert (given("--kv-cache-dtype"), given("--max-running-requests")) == ("fp8_e4m3", "2048")  # over all ranks
    assumed = doc["assumptions"]
    assert (assumed["a2a"], assumed["overlap"], assumed["kv_cache_dtype"]) == ("auto", "tbo", "fp8")
    # vLLM: 8 data-parallel ranks of tensor parallel 8, one a node; DeepEP's low-latency kernels (auto's in decode:
    # vLLM picks none by phase); dual-batch overlap; 2,048 requests as 256 per rank (vLLM's max_num_seqs is per rank)
    rc, text, err = run_cli(["advise", *argv, "--engine", "vllm"], capsys)
    assert rc == 0, err
    words = _shell_words(next(line for line in text.splitlines() if "vllm serve " in line))
    assert words[0] == "serve" and words[1] == "deepseek-ai/DeepSeek-V3"
    assert {w for w in words if w.startswith("--")} <= VLLM_FLAGS
    assert [given(f) for f in ("--tensor-parallel-size", "--data-parallel-size", "--data-parallel-size-local",
                               "--data-parallel-address", "--data-parallel-rpc-port", "--all2all-backend",
                               "--kv-cache-dtype", "--max-num-seqs")] == \
        ["8", "8", "1", "node0", "13345", "deepep_low_latency", "fp8", "256"]
    assert "--enable-dbo" in words and "--enable-expert-parallel" in words
    assert set(json.loads(given("--eplb-config"))) <= VLLM_EPLB_FIELDS
    assert "on node i > 0 the same with --headless --data-parallel-start-rank i" in text


def engine_command(engine: str, d: Deployment, cluster: Cluster, phase: str) -> tuple[list[str], list[str]]:
    """The engine module's command for ``d`` before its EPLB flags: ``(words, comments)``."""
    module = {"sglang": sglang_engine, "trtllm": trtllm_engine, "vllm": vllm_engine}[engine]
    return module.command(Launch(d, cluster, phase, None, None))


def test_engine_commands_carry_what_was_priced() -> None:
    one_node = Cluster(num_nodes=1, gpus_per_node=8)
    # Qwen3's BF16 checkpoint priced in FP8: SGLang and vLLM quantize it online; TensorRT-LLM needs an FP8 checkpoint
    qwen = Deployment(model=get_model("qwen3-30b-a3b"), gpu=get_gpu("h100-80gb"), precision="fp8")
    for engine in ("sglang", "vllm"):
        words, _ = engine_command(engine, qwen, one_node, "decode")
        assert "Qwen/Qwen3-30B-A3B" in words and words[words.index("--quantization") + 1] == "fp8"
    words, comments = engine_command("trtllm", qwen, one_node, "decode")
    assert "--quantization" not in words and any("FP8-quantized checkpoint" in c for c in comments)
    # DeepSeek-V3's FP8 checkpoint on A100s (no FP8 tensor cores) is priced in BF16: no option converts it
    v3 = Deployment(model=get_model("deepseek-v3"), gpu=get_gpu("a100-80gb"))
    assert v3.precision == "bf16"
    for engine in ("sglang", "vllm", "trtllm"):
        words, comments = engine_command(engine, v3, Cluster(num_nodes=4, gpus_per_node=8), "decode")
        assert "deepseek-ai/DeepSeek-V3" in words and "--quantization" not in words
        assert any("checkpoint is FP8: serve a BF16 copy" in c for c in comments)
    # a model spec that records no Hugging Face id: a placeholder, and a comment that says what goes there
    words, comments = engine_command("vllm", Deployment(model=tiny_model_spec(), gpu=get_gpu("h100-80gb")), one_node,
                                     "decode")
    assert words[2] == "MODEL_PATH" and comments[0].startswith("# MODEL_PATH: Tiny's weights")
    # attention data parallel on every GPU of 2 nodes of 4, prefill chunks of 1,024: SGLang takes every rank's chunk
    # (it divides it by the attention DP size), vLLM and TensorRT-LLM a rank's
    two = Cluster(num_nodes=2, gpus_per_node=4)
    dp = Deployment(model=get_model("deepseek-v2-lite"), gpu=get_gpu("h100-80gb"), engine=EngineMemory(attention_tp=1),
                    workload=Workload(prefill_chunk=1024))
    sglang = engine_command("sglang", dp, two, "prefill")[0]
    assert (sglang[sglang.index("--attn-dp-size") + 1], sglang[sglang.index("--chunked-prefill-size") + 1]) == \
        ("8", "8192")
    vllm = engine_command("vllm", dp, two, "prefill")[0]
    assert [vllm[vllm.index(f) + 1] for f in ("--tensor-parallel-size", "--data-parallel-size",
                                              "--data-parallel-size-local", "--max-num-batched-tokens")] == \
        ["1", "8", "4", "1024"]
    trtllm = engine_command("trtllm", dp, two, "prefill")[0]
    assert trtllm[trtllm.index("--max_num_tokens") + 1] == "1024"
    assert trtllm_engine.api_options(Launch(dp, two, "prefill", None, None)) == {"enable_attention_dp": True}
    # attention tensor parallel over all 8 GPUs: one rank, data-parallel attention nowhere; vLLM's one rank spans
    # both nodes, which its per-node flags cannot say
    tp = Deployment(model=get_model("deepseek-v2-lite"), gpu=get_gpu("h100-80gb"), engine=EngineMemory(attention_tp=8))
    assert "--attn-dp-size" not in engine_command("sglang", tp, two, "decode")[0]
    with_plan = Launch(tp, two, "decode", EplbChoice(redundant_experts=8, router="uniform"), Path("out"))
    assert trtllm_engine.api_options(with_plan) == {"moe_config": {"load_balancer": "out/trtllm-load-balancer.yaml"}}
    words, comments = engine_command("vllm", tp, two, "decode")
    assert "--data-parallel-size-local" not in words and any("do not split evenly over 2 nodes" in c for c in comments)


def test_gpt_oss_is_priced_with_its_mxfp4_experts_and_its_commands_need_no_quantization_flag(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """gpt-oss's checkpoint carries quant_method mxfp4, which every engine reads itself: its served (MXFP4) price needs
    no --quantization and no comment; its bf16 price needs a BF16 copy of the checkpoint, as an FP8 one's does."""
    one_node, gpt, h100 = Cluster(num_nodes=1, gpus_per_node=8), get_model("gpt-oss-120b"), get_gpu("h100-80gb")
    served, bf16 = Deployment(model=gpt, gpu=h100), Deployment(model=gpt, gpu=h100, precision="bf16")
    for engine in ("sglang", "vllm", "trtllm"):
        words, comments = engine_command(engine, served, one_node, "decode")
        assert "openai/gpt-oss-120b" in words and "--quantization" not in words
        assert not any("checkpoint" in c for c in comments), comments
        words, comments = engine_command(engine, bf16, one_node, "decode")
        assert "--quantization" not in words
        assert any("priced with BF16 weights, but gpt-oss-120b's checkpoint is MXFP4: serve a BF16 copy" in c
                   for c in comments), comments
    # advise on a gpt-oss load: mxfp4 in its JSON and in its title's assumptions
    path = tmp_path / "gpt-oss.npz"
    write_load(path, LoadMatrix(np.full((4, 36, 128), 600, dtype=np.int64), preset="gpt-oss-120b"))
    rc, text, err = run_cli(["advise", "--load", path, "--nodes", 1, "--gpus-per-node", 8, "--gpu", "h100-80gb",
                             "--engine", "sglang", "--precision", "served", "--calibration", "peaks"], capsys)
    assert rc == 0, err
    assert "precision mxfp4 experts (4.25 bits a weight), bf16 other weights and GEMMs, bf16 KV cache" in \
        text.splitlines()[0]
    doc, _ = advise(capsys, "--load", path, "--nodes", 1, "--gpus-per-node", 8, "--gpu", "h100-80gb", "--engine",
                    "sglang", "--calibration", "peaks")
    assert doc["assumptions"]["precision"] == "mxfp4" and "mxfp4 experts" in doc["priced_with"]


def test_the_assumptions_follow_the_command_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """advise.json, the table's title and the report's Assumptions panel say what the command line priced with."""
    path = tmp_path / "uniform.npz"
    write_load(path, LoadMatrix(np.full((4, 26, 64), 600, dtype=np.int64), preset="deepseek-v2-lite"))
    out = tmp_path / "advice"
    rc, text, err = run_cli(["advise", "--load", path, "--nodes", 1, "--gpus-per-node", 8, "--gpu", "h100-80gb",
                             "--engine", "sglang", "--precision", "bf16", "--calibration", "peaks", "--a2a",
                             "low-latency", "--overlap", "tbo", "--attention-tp", 4, "--margin", 0.1, "--phase",
                             "prefill", "--prompt-tokens", 2048, "--out-dir", out], capsys)
    assert rc == 0, err
    # 8 GPUs in data-parallel ranks of 4: 2 ranks, each prefilling a chunk of 4,096 (the default) per step: 8,192
    # tokens, 4 prompts of 2,048; 4 batches, 2 planned on and 2 priced: held out
    assert json.loads((out / "advise.json").read_text())["assumptions"] == {
        "calibration": "published peaks", "calibration_fit_error": None, "precision": "bf16", "kv_cache_dtype": "bf16",
        "attention_tp": 4, "data_parallel_ranks": 2, "a2a": "low-latency", "overlap": "tbo", "phase": "prefill",
        "tokens_per_step": 8192, "step_note": None, "requests_per_step": 4.0, "margin": 0.1, "held_out": True,
        "held_out_note": None}
    rows = {"calibration": "published peaks; no fit error recorded",
            "precision": "bf16 weights and GEMMs, bf16 KV cache",
            "attention": "tensor-parallel over 4 GPUs in each of 2 data-parallel ranks",
            "all-to-all": "low-latency: DeepEP low-latency kernels", "overlap": "two-batch overlap (tbo)",
            "tokens per step": "8,192", "margin": "10.0% over EPLB off", "priced batches": "held out (not planned on)"}
    title = text.splitlines()[0]
    assert all(f"{what} {value}" in title for what, value in rows.items()), title
    page = (out / "report.html").read_text()
    panel = page.split("<h2>Assumptions</h2>", 1)[1].split("</table>", 1)[0]
    shown = dict(re.findall(r'<tr><th scope="row">(.*?)</th><td>(.*?)</td></tr>', html.unescape(panel)))
    assert rows.items() <= shown.items() and shown["requests per step"].startswith("4.00")
    assert page.index("<h2>Assumptions</h2>") < page.index("<h2>Ranking</h2>")


def _hot(first: int, batches: int = 4) -> LoadMatrix:
    """DeepSeek-V2-Lite's shape with experts ``first .. first + 7`` ten times as hot as the others."""
    counts = np.full((batches, 26, 64), 100, dtype=np.int64)
    counts[:, :, first:first + 8] = 1000
    return LoadMatrix(counts, preset="deepseek-v2-lite")


def test_price_load_plans_on_one_workload_and_prices_on_another(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    """A plan made for one workload's hot experts gains less on a workload whose hot experts are others than that
    workload's own plan does, and the assumptions say which workload was planned on and which priced."""
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    write_load(a, _hot(0))
    write_load(b, _hot(32))
    argv = ["--load", a, "--nodes", 1, "--gpus-per-node", 8, "--gpu", "h100-80gb", "--engine", "sglang", "--phase",
            "prefill"]

    def gains(doc: dict[str, Any]) -> dict[str, float]:
        off = next(c["tokens_per_s"] for c in doc["candidates"] if c["label"].startswith("off "))
        return {c["label"]: c["tokens_per_s"] / off - 1 for c in doc["candidates"] if c["policy"] == "eplb"}

    other, _ = advise(capsys, *argv, "--price-load", b)
    own, _ = advise(capsys, *[b if x == a else x for x in argv], "--price-load", b)
    assert other["assumptions"]["held_out"] and other["assumptions"]["held_out_note"] == f"planned on {a}, priced on {b}"
    assert not own["assumptions"]["held_out"] and "is both a --load and a --price-load" in \
        own["assumptions"]["held_out_note"]
    # EPLB without replicas spreads the experts it was told are hot: planned on b's routing it spreads b's hot experts
    # and gains; planned on a's, it leaves b's where contiguous blocks put them together (on GPU 4) far more often
    label = "EPLB global, 0 redundant, static plan, static dispatch"
    assert gains(own)[label] > gains(other)[label] + 0.05 > 0.05


def test_trtllm_is_not_advised_on_an_amd_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["advise", "--load", "bundled:esft-law", "--nodes", 1, "--gpus-per-node", 8, "--gpu", "mi300x"]
    assert_user_error([*argv, "--engine", "trtllm"], capsys,
                      "trtllm runs on NVIDIA GPUs only, not on --gpu mi300x (AMD Instinct MI300X); give --engine "
                      "vllm|sglang")
    rc, _, err = run_cli([*argv, "--engine", "sglang", "--json"], capsys)
    assert rc == 0, err


def test_each_engine_prices_the_linear_attention_state_it_keeps(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    """Qwen3-Next's Gated DeltaNet state: SGLang keeps its recurrent numbers in float32, vLLM in bf16, so the same KV
    cache holds more of vLLM's requests, and EPLB off's decode step is larger on vLLM."""
    from moebalance.engines.registry import ENGINES

    assert {n: e.rule.recurrent_state_bytes for n, e in ENGINES.items()} == {"vllm": 2, "sglang": 4, "trtllm": 4}
    path = tmp_path / "qwen3-next.npz"
    write_load(path, LoadMatrix(np.full((2, 48, 512), 100, dtype=np.int64), preset="qwen3-next-80b-a3b"))
    steps = {}
    for engine in ("sglang", "vllm"):
        doc, _ = advise(capsys, "--load", path, "--nodes", 1, "--gpus-per-node", 8, "--gpu", "h100-80gb",
                        "--engine", engine)
        off = next(c for c in doc["candidates"] if c["label"].startswith("off "))
        steps[engine] = (off["step_tokens"], off["kv_cache_gib"])
    assert steps["vllm"][1] == steps["sglang"][1] and steps["vllm"][0] > 1.1 * steps["sglang"][0]


def test_sglang_serves_mxfp4_on_amd_gfx95_only(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """gpt-oss's MXFP4 experts: SGLang 0.5.23 refuses MXFP4 on an AMD GPU but a gfx95 one, so advise refuses it on
    the MI300X (gfx942) and prices it on the MI355X (gfx950) and with vLLM."""
    path = tmp_path / "gpt-oss.npz"
    write_load(path, LoadMatrix(np.full((2, 36, 128), 100, dtype=np.int64), preset="gpt-oss-120b"))
    argv = ["advise", "--load", path, "--nodes", 1, "--gpus-per-node", 8, "--phase", "prefill"]
    assert_user_error([*argv, "--gpu", "mi300x", "--engine", "sglang"], capsys,
                      "SGLang serves MXFP4 experts on AMD's gfx95 GPUs only (the MI355X), not on --gpu mi300x "
                      "(gfx942); give --engine vllm")
    for gpu, engine in (("mi355x", "sglang"), ("mi300x", "vllm")):
        rc, _, err = run_cli([*argv, "--gpu", gpu, "--engine", engine, "--json"], capsys)
        assert rc == 0, err
    rc, _, err = run_cli([*argv, "--gpu", "mi300x", "--engine", "sglang", "--precision", "bf16", "--json"], capsys)
    assert rc == 0, err


def test_price_load_refuses_what_does_not_fit(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a, other = tmp_path / "a.npz", tmp_path / "other.npz"
    write_load(a, _hot(0))
    write_load(other, LoadMatrix(np.full((2, 16, 64), 100, dtype=np.int64)))
    argv = ["advise", "--load", a, "--nodes", 1, "--gpus-per-node", 8, "--gpu", "h100-80gb", "--engine", "sglang"]
    assert_user_error([*argv, "--price-load", a, "--train-frac", 0.5], capsys,
                      "with --price-load every --load is planned on whole")
    assert_user_error([*argv, "--price-load", other], capsys, f"--price-load {other} is [layers, experts] = [16, 64]")


def test_mtp_layers_are_for_trtllm_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(["advise", "--load", DECODE, *V3, "--engine", "sglang", "--mtp-layers", 1], capsys,
                      "--mtp-layers is for --engine trtllm")


def test_several_loads_add_worst_of_plans_and_memory_limits_the_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    # a memory share that leaves about 2 GiB of KV cache with 64 redundant experts and none with 128
    doc, err = advise(capsys, "--load", DECODE, "--load", PREFILL, *V3, "--memory-fraction", 0.56, "--precision",
                      "bf16")
    check_contract(doc)
    labels = [c["label"] for c in doc["candidates"]]
    assert any("worst of 2 workloads, 64 redundant" in x for x in labels)
    assert {c["redundant_experts"] for c in doc["candidates"]} == {0, 64}
    assert "128 redundant experts (6 per GPU and layer) leave no KV cache for a request: not listed" in err


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_perfectly_uniform_load_recommends_off(engine: str, capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    path = tmp_path / "uniform.npz"
    write_load(path, LoadMatrix(np.full((4, 26, 64), 600, dtype=np.int64), preset="deepseek-v2-lite"))
    doc, _ = advise(capsys, "--load", path, "--nodes", 1, "--gpus-per-node", 8, "--gpu", "h100-80gb", "--engine", engine)
    check_contract(doc)
    assert doc["recommendation"]["policy"] == "contiguous"
    assert "off" in doc["recommendation"]["label"]


def test_dividing_gpu_counts_are_the_nearest_divisors() -> None:
    assert dividing_gpu_counts(64, 21) == [16, 32]
    assert dividing_gpu_counts(256, 48) == [32, 64]
    assert dividing_gpu_counts(160, 48) == [40, 80]
    assert dividing_gpu_counts(64, 1000) == [64]  # more GPUs than experts: the experts' count alone
    assert dividing_gpu_counts(8, 12) == [8]


@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
def test_gpus_that_do_not_divide_the_experts_never_get_eplb_off(engine: str, capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    # 64 experts over 3 x 7 = 21 GPUs: SGLang and TensorRT-LLM need experts plus redundant ones divisible by 21, so
    # EPLB off (which a uniform load would keep, as on 8 GPUs above) is the reference only, and r = 20 + 21 k is run
    path = tmp_path / "uniform.npz"
    write_load(path, LoadMatrix(np.full((4, 16, 64), 600, dtype=np.int64), preset="olmoe-1b-7b"))
    argv = ["--load", path, "--nodes", 3, "--gpus-per-node", 7, "--gpu", "h100-80gb", "--engine", engine]
    doc, err = advise(capsys, *argv)
    rec = doc["recommendation"]
    assert rec["policy"] != "contiguous" and rec["redundant_experts"] in (20, 41)
    off = [c for c in doc["candidates"] if c["policy"] == "contiguous"]
    assert [c["label"] for c in off] == [f"off (contiguous, no EPLB; reference only, {engine} cannot run it)"]
    assert f"{engine} cannot run EPLB off here: 64 experts do not divide over 21 GPUs (16 or 32 GPUs would divide " \
           "them)" in err
    rc, out, _ = run_cli(["advise", *argv], capsys)
    assert rc == 0 and "EPLB off cannot run here, as 64 experts do not divide over 21 GPUs" in out
    if engine == "sglang":
        command = shlex.split(next(line for line in out.splitlines() if line.startswith("python -m sglang")))
        assert command[command.index("--ep-size") + 1] == "21"
        assert command[command.index("--ep-num-redundant-experts") + 1] == str(rec["redundant_experts"])
        assert command[command.index("--attn-dp-size") + 1] == "3"  # 21 GPUs, attention over a node of 7
    # vLLM's expert map gives 1 of the 21 GPUs a fourth expert: EPLB off runs there and stays the baseline
    doc, err = advise(capsys, *argv[:-1], "vllm")
    assert doc["recommendation"]["policy"] == "contiguous" and "cannot run EPLB off" not in err


def test_more_gpus_than_experts_is_noted(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "mixtral.npz"
    write_load(path, LoadMatrix(np.full((4, 32, 8), 600, dtype=np.int64), preset="mixtral-8x7b"))
    _, err = advise(capsys, "--load", path, "--nodes", 3, "--gpus-per-node", 4, "--gpu", "h100-80gb", "--engine",
                    "vllm")
    assert "note: 12 GPUs for 8 experts: more GPUs than experts, so EPLB off leaves 4 GPUs without experts" in err


def _setup(phase: str = "decode", router_ms: float = 0.0) -> Setup:
    load = read_bundled("esft-law")
    spec, gpu = get_model("deepseek-v2-lite"), get_gpu("h100-80gb")
    train, test = load.split(0.5)
    deployment = Deployment(model=spec, gpu=gpu)
    pricing = StepPricing(deployment=deployment, phase=phase, router_ms=router_ms)
    return Setup(cluster=Cluster(num_nodes=1, gpus_per_node=8), phase=PhaseModel(phase, deployment), pricing=pricing,
                 train=train, test=test, workload_batches=(8,))


@pytest.mark.parametrize("router", ["random", "rebalance"])
def test_a_given_plan_is_priced_as_the_replay_prices_its_policy(router: str) -> None:
    # a plan no registered policy makes (CRAFT padded) is replayed as given: the same as its policy's own replay
    setup = _setup(router_ms=0.3)
    steps = setup.steps(700)
    budget = Budget(slots_per_gpu=9)
    plan = make_plan("eplb", setup.train, setup.cluster, budget)[0]
    kw: dict = {"warmup": (0, 8), "batches": (8, 16), "router": router, "pricing": setup.pricing}
    given = replay(steps, setup.cluster, budget, plan, **kw)
    ref = replay(steps, setup.cluster, budget, "eplb", {}, **kw)
    assert given.balancedness == ref.balancedness and given.time == ref.time and given.policy == "eplb"
    assert given.time is not None and (given.time["exposed_router_ms"] > 0) == (router == "rebalance")
    with pytest.raises(InputError, match="a given plan serves unchanged"):
        replay(steps, setup.cluster, budget, plan, replanning=Replanning(every=2), **kw)


def test_prefill_steps_are_a_chunk_per_rank_whatever_the_replicas() -> None:
    setup = _setup("prefill")
    listed, _ = candidates(setup, "trtllm", periods=[(4, 4)])
    priced = [price(setup, c) for c in listed if c.redundant_experts in (0, 24) and c.rebalance is None]
    assert {p.step_tokens for p in priced} == {4096}  # one data-parallel rank of 8 GPUs, --prefill-chunk 4096
    assert len({p.kv_cache_gib for p in priced}) > 1


def _priced(label: str, tps: float, policy: str = "eplb", **extra: Any) -> Priced:
    c = Candidate(label, policy, {}, 9, 8, "uniform", **extra)
    plan = Placement([[[0, 1], [2, 3]]], 4, Cluster(num_nodes=1, gpus_per_node=2))
    return Priced(c, tps, 10.0, 5.0, 0.9, 100, {"exposed_balancing_ms": 0.0}, plan)


def test_leave_eplb_off_unless_the_gain_clears_the_margin() -> None:
    off = _priced("off", 100.0, "contiguous")
    near, clear = _priced("near", 104.9), _priced("clear", 105.1)
    assert recommend([off, near], "vllm", 0.05).recommended is off
    advice = recommend([near, off, clear], "vllm", 0.05)
    assert advice.recommended is clear and advice.ranked[0] is clear
    assert advice.recommendation()["gain_vs_off"] == pytest.approx(0.051)
    assert recommend([off, clear], "vllm", 0.10).recommended is off
    slower = _priced("slower", 90.0)
    assert recommend([slower, off], "vllm", 0.0).recommended is off


def test_eplb_off_the_engine_cannot_run_is_never_recommended() -> None:
    why = "64 experts do not divide over 21 GPUs (16 or 32 GPUs would divide them)"
    off = _priced("off", 100.0, "contiguous", reference_only=why)
    slower = _priced("slower", 90.0)
    advice = recommend([off, slower], "sglang", 0.05)
    assert advice.recommended is slower and not advice.leave_off  # whatever the margin: off cannot run
    with pytest.raises(InputError, match=r"sglang can run none of the configurations: 64 experts .*\(16 or 32 GPUs"):
        recommend([off], "sglang", 0.05)


def test_a_calibration_fit_error_widens_the_margin(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:

    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"format": "moebalance.calibration", "flops_efficiency": 0.6,
                                "bandwidth_efficiency": 0.8, "launch_us": 5.0, "source": "test",
                                FIT_ERROR_KEY: 0.4}))

    calibration, error = read_calibration(path)
    assert calibration.bandwidth_efficiency == 0.8 and error == 0.4
    # the recorded error (exp(0.4) - 1 = 49%) outweighs the default 5%: EPLB's modelled gain no longer clears it
    doc, _ = advise(capsys, "--load", DECODE, *V3, "--calibration", path)
    check_contract(doc, margin=math.expm1(0.4))
    assert doc["margin"] == pytest.approx(math.expm1(0.4)) and doc["priced_with"].startswith("test, fp8")
    off = next(c for c in doc["candidates"] if "off" in c["label"])
    assert doc["candidates"][0]["tokens_per_s"] > 1.2 * off["tokens_per_s"]
    assert doc["recommendation"]["label"] == off["label"]
    path.write_text(json.dumps({"format": "moebalance.calibration", FIT_ERROR_KEY: -1}))
    assert_user_error(["advise", "--load", DECODE, *V3, "--calibration", path], capsys, FIT_ERROR_KEY, "-1")


def test_periodic_flags_name_only_what_the_engines_accept() -> None:
    setup = _setup()
    plan = make_plan("eplb", setup.train, setup.cluster, Budget(slots_per_gpu=9))[0]
    off = Priced(Candidate("off", "contiguous", {}, 8, 0, "random"), 100.0, 10, 5, 0.7, 900, {}, plan)

    def lines(engine: str, **extra: Any) -> list[str]:
        c = Candidate("x", "eplb", {"num_groups": 1}, 9, 8, extra.pop("router", "uniform"), 1, "global", **extra)
        rec = Priced(c, 120.0, 9, 6, 0.9, 890, {}, plan)
        return launch_lines(Advice(engine, (rec, off), off, rec, 0.05), setup, Path("out"))

    vllm = lines("vllm", router="random", rebalance=(4, 2), rearrange="async", migration="aligned", plugin="move-aware")
    flags = shlex.split(vllm[0])
    assert {f for f in flags if f.startswith("--")} <= VLLM_FLAGS
    config = json.loads(flags[flags.index("--eplb-config") + 1])
    assert config == {"window_size": 2, "step_interval": 4, "num_redundant_experts": 8, "use_async": True}
    # the plug-in's variant in the command's environment; one node of 8: one data-parallel rank, tensor parallel 8
    assert set(config) <= VLLM_EPLB_FIELDS and flags[:3] == ["MOEBALANCE_VLLM_EPLB=move-aware", "vllm", "serve"]
    assert flags[3] == "deepseek-ai/DeepSeek-V2-Lite" and flags[4:8] == ["--tensor-parallel-size", "8",
                                                                         "--data-parallel-size", "1"]
    static = json.loads(shlex.split(lines("vllm", router="random")[0])[-1])
    assert static["step_interval"] == 4 * static["window_size"]  # vLLM's first plan after step_interval / 4
    sglang = shlex.split(lines("sglang", router="minmax", rebalance=(8, 8))[0])
    assert {f for f in sglang if f.startswith("--")} <= SGLANG_FLAGS
    assert sglang[sglang.index("--ep-dispatch-algorithm") + 1] == "lp"
    assert sglang[sglang.index("--eplb-rebalance-num-iterations") + 1] == "8"
    assert sglang[sglang.index("--eplb-algorithm") + 1] == "deepseek"
    trtllm = lines("trtllm", rebalance=(4, 4), layers_per_step=7)
    assert shlex.split(trtllm[0])[-2:] == ["--extra_llm_api_options", "out/trtllm-extra-llm-api-options.yaml"]
    assert trtllm[1:4] == ["# out/trtllm-extra-llm-api-options.yaml holds:", "#   moe_config:",
                           "#     load_balancer: out/trtllm-load-balancer.yaml"]


def test_user_mistakes_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert_user_error(["advise", *ESFT, "--engine", "tgi"], capsys, "--engine", "tgi")
    assert_user_error(["advise", *ESFT, "--engine", "vllm", "--phase", "both"], capsys, "--phase", "both")
    assert_user_error(["advise", *ESFT], capsys, "names no one engine", "--engine")
    assert_user_error(["advise", "--load", "bundled:esft-law", "--model", "deepseek-v3", "--nodes", 1,
                       "--gpus-per-node", 8, "--gpu", "h100-80gb", "--engine", "vllm"], capsys, "deepseek-v3")
    assert_user_error(["advise", "--load", DECODE, *V3, "--memory-fraction", 0.4, "--precision", "bf16"], capsys,
                      "does not fit")
    assert_user_error(["advise", "--load", DECODE, *V3, "--memory-fraction", 0.478, "--precision", "bf16"], capsys,
                      "no configuration fits")
    assert_user_error(["advise", "--load", DECODE, "--load", "bundled:esft-law", *V3], capsys, "names no one engine")
    assert_user_error(["advise", "--load", DECODE, "--load", "bundled:esft-law", *V3, "--engine", "sglang"], capsys,
                      "give workloads of one model")
    afile = tmp_path / "f"
    afile.write_text("x")
    assert_user_error(["advise", "--load", DECODE, *V3, "--out-dir", afile], capsys, "is a file")
    assert sorted(tmp_path.iterdir()) == [afile]


def test_a_candidate_priced_by_hand(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A worked example of the cost model behind ``advise``: EPLB off, priced here from the published formulas
    (docs/design.md, "Cost model"; moebalance.cost.time, .a2a, .deployment) with every size typed in, not computed
    by moebalance. The simplest options are pinned: the published peaks (``--calibration peaks``), bf16, no overlap,
    a copy per destination GPU (``--a2a per-gpu``, no fixed cost), prefill steps.

    Mixtral-8x7B (its config.json): H = 4096, F = 14336, 8 experts, top-2, 32 layers (all MoE), 32 query heads and
    8 KV heads of 128, vocabulary 32000, embeddings not tied. One node of 2 H100 SXM (989 TFLOP/s dense BF16,
    3350 GB/s), NVLink given as 400 GB/s per GPU and direction, attention split over both GPUs (one data-parallel
    rank). The load: 2 batches (one plans, one is priced), every layer routing 100 picks to expert 0 and 100 to
    expert 4. A prefill step of 64 tokens (``--prefill-chunk 64``, one rank) makes 128 picks per layer; an expert
    takes a token once, so each of the two experts gets exactly 64 of them, whatever the draw.
    """
    counts = np.zeros((2, 32, 8), dtype=np.int64)
    counts[:, :, 0] = counts[:, :, 4] = 100
    write_load(tmp_path / "two.npz", LoadMatrix(counts, preset="mixtral-8x7b"))
    doc, _ = advise(capsys, "--load", tmp_path / "two.npz", "--engine", "vllm", "--nodes", 1, "--gpus-per-node", 2,
                    "--gpu", "h100-80gb", "--calibration", "peaks", "--precision", "bf16", "--overlap", "none",
                    "--a2a", "per-gpu", "--intra-link", 400, "--attention-tp", 2, "--phase", "prefill",
                    "--prefill-chunk", 64, "--prompt-tokens", 64)
    off = next(c for c in doc["candidates"] if c["label"].startswith("off"))
    H, F, FLOPS, BW, NVLINK = 4096, 14336, 989e12, 3350e9, 400e9
    # EPLB off lays experts 0-3 on GPU 0 and 4-7 on GPU 1: each GPU serves n = 64 picks of u = 1 expert.
    # Grouped GEMM: 6 H F FLOPs a pick; bytes: the expert's weights once (3 H F x 2 bytes) and each pick's input and
    # output (2 H x 2 bytes). 22.5 GFLOP take 22.8 us; 353.4 MB take 105.5 us: bound by the weights.
    flops = 6 * H * F * 64
    traffic = 1 * 3 * H * F * 2 + 2 * 64 * H * 2
    expert = max(flops / FLOPS, traffic / BW)
    assert expert == pytest.approx(105.48e-6, rel=1e-4)
    # All-to-all (counts carry no tokens): each GPU holds 64 / 2 = 32 tokens; a token makes its 2 picks with the
    # GPUs' shares 1/2 each, so it reaches the other GPU with probability 1 - (1/2)^2 = 3/4: 24 copies each way over
    # NVLink, of (dispatch 2H bytes + combine 2H bytes) / 2 = 2H bytes, dispatch and combine: 0.98 us.
    a2a = 2 * (2 * H) * 24 / NVLINK
    # The rest of the step on the rank's 64 tokens (one prompt of 64): non-expert weights on a GPU -- attention
    # (32 layers x (q 4096 x 4096 + k, v 2 x 4096 x 1024 + o 4096 x 4096), split over 2 GPUs), the routers
    # (32 x 4096 x 8), the embedding table and the LM head (32000 x 4096 each).
    attention = 32 * (H * 32 * 128 + 2 * H * 8 * 128 + 32 * 128 * H) / 2
    router, table = 32 * H * 8, 32000 * H
    head = table
    # FLOPs: 2 per weight and token for all but the table (looked up) and the head (one logit per prompt), plus the
    # attention's 2 x 32 heads x (128 + 128) per causal pair (64 x 65 / 2 of them) and layer, over the 2 GPUs
    rest_flops = 2 * (attention + router) * 64 + 2 * head * 1 + 2 * 32 * 256 * (64 * 65 / 2) * 32 / 2
    rest_bytes = (attention + router + head) * 2  # every weight but the table read once, in bf16
    rest = max(rest_flops / FLOPS, rest_bytes / BW)
    assert rest == pytest.approx(479.53e-6, rel=1e-4)  # bound by reading 1.6 GB of weights
    step = 32 * (expert + a2a) + rest  # no overlap: each layer is its slowest GPU, then the all-to-all
    assert off["step_tokens"] == 64
    assert off["step_ms_mean"] == pytest.approx(step * 1e3, rel=1e-6)
    assert off["tokens_per_s"] == pytest.approx(64 / step, rel=1e-6)  # 16,467 tokens/s


def test_the_report_chart_shows_distinct_steps_with_their_tokens(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    """On ESFT's routing on vLLM most candidates price within a fraction of a percent of each other: the step-time
    chart keeps one of each group (same tokens per step, within 0.5%), names each bar's tokens per step, keeps EPLB off,
    and the ranking explains "every K on W"."""
    doc, _ = advise(capsys, *ESFT, "--engine", "vllm", "--out-dir", tmp_path / "a")
    page = (tmp_path / "a" / "report.html").read_text()
    chart = page.split("Mean step time", 1)[1].split("</svg>", 1)[0]
    bars = re.findall(r"<title>([^<]*tokens/step)</title>", chart)
    steps = {c["label"]: c for c in doc["candidates"]}
    assert any(b.startswith("off (contiguous, no EPLB): ") for b in bars)
    assert len(bars) < len(steps) and len(bars) == len(set(bars))
    for bar in bars:
        label, tokens = bar.rsplit(": ", 1)
        assert tokens == f"{steps[label]['step_tokens']:,} tokens/step"
    assert "&quot;every K on W&quot;: re-planned every K steps from the load of the last W steps" in page
