"""The cost model: parameter counts, memory per GPU, the roofline time model, plan cost and goodput, the CLI.

Hand-computed cases carry their arithmetic in comments; the time model is checked for monotonicity in tokens and in
experts touched (hypothesis); CRAFT's four published KV-cache reductions are checked within 5 points.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_user_error, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix, read_bundled
from moebalance.core.plan import Placement, write_plan
from moebalance.cost.a2a import a2a_estimate
from moebalance.cost.deployment import Deployment, Workload
from moebalance.cost.hardware import GPUS, GpuSpec, get_gpu
from moebalance.cost.memory import EngineMemory, memory_per_gpu, non_expert_gib_per_gpu
from moebalance.cost.time import Calibration, expert_seconds, gemm_seconds, rest_seconds
from moebalance.models import MODELS, Attention, ModelSpec, get_model
from moebalance.policies import make_plan
from moebalance.pricing.goodput import price_plan

MIB = 1 << 20

# A tiny model: 2 MoE layers of 4 experts (top-2), H = 4, F = 8, GQA with 2 heads, 1 KV head of size 2, vocab 10.
TINY = ModelSpec(name="tiny", display_name="Tiny", num_layers=2, num_dense_layers=0, num_experts=4, top_k=2,
                 hidden_size=4, moe_intermediate_size=8, num_shared_experts=0, num_groups=1, source="test",
                 attention=Attention(kind="gqa", num_heads=2, num_kv_heads=1, head_dim=2), vocab_size=10,
                 dense_intermediate_size=8)
# 1 MiB of memory, 1 TFLOP/s, 1 GB/s.
SMALL_GPU = GpuSpec(name="small", display_name="Small", bf16_tflops=1.0, memory_gib=1 / 1024, memory_bandwidth=1.0,
                    source="test")


def test_tiny_parameter_counts_by_hand() -> None:
    assert TINY.expert_params() == 96  # 3 * H * F = 3 * 4 * 8
    assert TINY.attention_params() == 48  # q 4*2*2 + k,v 2*4*1*2 + o 2*2*4
    assert TINY.non_expert_params() == {"attention": 96, "dense_mlp": 0, "shared_experts": 0, "router": 32,
                                        "embeddings": 80}  # router L*H*E = 2*4*4; embeddings + head 2*10*4
    assert TINY.routed_params() == 768 and TINY.total() == 976
    assert TINY.kv_bytes_per_request(1) == 16  # a token: 2 layers x (k + v) x 1 head x 2 numbers x 2 bytes


@pytest.mark.parametrize("name", sorted(MODELS))
def test_architectures_match_published_totals(name: str) -> None:
    arch = get_model(name)
    assert arch.total() == pytest.approx(arch.total_params, rel=0.015)
    assert arch.num_layers * arch.num_experts * arch.expert_params() == arch.routed_params()


def test_gb200_mi300x_and_mi355x_peaks_from_their_datasheets() -> None:
    # NVIDIA GB200 NVL72 specifications, the GB200 Grace Blackwell Superchip column (2 GPUs): FP16/BF16 10 PFLOPS and
    # FP8 20 PFLOPS with sparsity (dense: half), up to 372 GB HBM3e, 16 TB/s
    gb = get_gpu("gb200")
    assert (gb.bf16_tflops, gb.fp8_tflops, gb.memory_gib, gb.memory_bandwidth) == (2500.0, 5000.0, 186.0, 8000.0)
    # AMD Instinct MI300X datasheet: BF16 1,307.4 TFLOPS and FP8 2,614.9 dense, 192 GB HBM3, 5.3 TB/s
    mi300x = get_gpu("mi300x")
    assert (mi300x.bf16_tflops, mi300x.fp8_tflops, mi300x.memory_gib, mi300x.memory_bandwidth) == \
        (1307.4, 2614.9, 192.0, 5300.0)
    # AMD Instinct MI355X datasheet: BF16 2.5 PFLOPS and FP8 5 PFLOPS dense, 288 GB HBM3E, 8 TB/s
    mi355x = get_gpu("mi355x")
    assert (mi355x.bf16_tflops, mi355x.fp8_tflops, mi355x.memory_gib, mi355x.memory_bandwidth) == \
        (2500.0, 5000.0, 288.0, 8000.0)
    # their scale-up links, per direction: NVLink 5 1.8 TB/s both ways; 7 Infinity Fabric links of 128 (MI300X) and
    # 153.6 GB/s (MI355X), both ways
    from moebalance.core.cluster import LINK_PRESETS

    assert LINK_PRESETS["nvlink5"] == 1800 / 2
    assert LINK_PRESETS["xgmi-mi300x"] == 7 * 128 / 2
    assert LINK_PRESETS["xgmi-mi355x"] == pytest.approx(7 * 153.6 / 2)
    # the GB200's and the MI355X's peaks and bandwidth coincide: a calibration of one is not the other's
    from moebalance.cost.calibrate import same_silicon

    assert not same_silicon("gb200", "mi355x") and not same_silicon("gb200", "b200")
    assert same_silicon("h800", "h100-80gb")


AMD = ("mi300x", "mi355x")


def test_deepeps_kernels_are_refused_on_an_amd_gpu() -> None:
    """DeepEP runs on NVIDIA GPUs only (its README's requirements): a deployment on an MI300X or MI355X prices the
    plain all-to-all alone, and naming DeepEP's kernels there, or moving a DeepEP deployment onto one (a ``metro``
    router's ``gpu=``), is one line naming the GPU and the fix."""
    import dataclasses

    from moebalance.cost.a2a import DEEPEP_KERNELS, KERNELS, kernels_on

    v3 = get_model("deepseek-v3")
    assert {n for n, g in GPUS.items() if g.vendor == "amd"} == set(AMD)
    for name in AMD:
        gpu = get_gpu(name)
        assert kernels_on(gpu) == ("per-gpu",)
        assert Deployment(model=v3, gpu=gpu).a2a == "per-gpu"
        for kernel in DEEPEP_KERNELS:
            with pytest.raises(InputError, match=rf"^--a2a {kernel} prices DeepEP's kernels, which run on NVIDIA GPUs "
                                                 rf"only, not on --gpu {name} \(AMD Instinct MI3\d\dX\), where "
                                                 r"engines run MORI EP, which moebalance has not measured; give --a2a "
                                                 r"per-gpu$"):
                Deployment(model=v3, gpu=gpu, a2a=kernel)
    on_h100 = Deployment(model=v3, gpu=GPUS["h100-80gb"], a2a="auto")
    with pytest.raises(InputError, match="not on --gpu mi300x"):
        dataclasses.replace(on_h100, gpu=GPUS["mi300x"])
    # NVIDIA GPUs keep every kernel, the default first
    for name, gpu in GPUS.items():
        if name not in AMD:
            assert gpu.vendor == "nvidia" and kernels_on(gpu) == KERNELS, name
            assert all(Deployment(model=v3, gpu=gpu, a2a=k).a2a == k for k in KERNELS)
    with pytest.raises(InputError, match=r"GpuSpec\.vendor \('intel'\) must be 'nvidia' or 'amd'"):
        dataclasses.replace(SMALL_GPU, vendor="intel")


def test_the_cli_refuses_deepep_on_an_amd_gpu_and_defaults_to_a_copy_per_gpu(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--a2a normal|low-latency|auto`` with ``--gpu mi300x|mi355x`` exits 2 with one line naming the GPU and
    ``--a2a per-gpu``; without ``--a2a`` the AMD deployment prices a copy per destination GPU; an NVIDIA GPU still
    prices DeepEP's kernels."""
    import argparse

    from moebalance.app import deployment

    base = ["compare", "--load", "bundled:olmoe-1b-7b-tokens", "--policies", "contiguous", "--nodes", 2,
            "--gpus-per-node", 4, "--slots-per-gpu", 8, "--attention-tp", 1, "--calibration", "peaks"]
    for gpu, kernel in (("mi300x", "normal"), ("mi355x", "low-latency"), ("mi300x", "auto")):
        assert_user_error([*base, "--gpu", gpu, "--a2a", kernel], capsys, f"--a2a {kernel} prices DeepEP's kernels",
                          f"not on --gpu {gpu}", "give --a2a per-gpu")
    rc, _, err = run_cli([*base, "--gpu", "mi300x", "--a2a", "per-gpu", "--json"], capsys)
    assert rc == 0, err
    rc, _, err = run_cli([*base, "--gpu", "rtx4090", "--a2a", "auto", "--json"], capsys)
    assert rc == 0, err
    args = argparse.Namespace(gpu="mi355x", model="deepseek-v3", calibration="peaks", calibration_any_gpu=None)
    assert deployment.build(args).a2a == "per-gpu"  # the automatic choice on AMD is never DeepEP's
    assert deployment.build(argparse.Namespace(**{**vars(args), "gpu": "h200", "a2a": "auto"})).a2a == "auto"


def test_a_2026_model_is_priced_on_a_2026_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """MiniMax-M2's FP8 checkpoint on 8 MI355X over their Infinity Fabric: served in FP8, which the MI355X has,
    62 layers x 256 experts over 8 GPUs; an unknown GPU is one line naming it."""
    rc, out, err = run_cli(["cost", "--model", "minimax-m2", "--gpu", "mi355x", "--nodes", 1, "--gpus-per-node", 8,
                            "--intra-link", "xgmi-mi355x", "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert (doc["precision"], doc["gpu"], doc["experts_per_gpu"]) == ("fp8", "mi355x", 62 * 256 // 8), doc
    assert_user_error(["cost", "--model", "minimax-m2", "--gpu", "gb300", "--nodes", 1, "--gpus-per-node", 8], capsys,
                      "gb300")


def test_mla_kv_bytes_by_hand() -> None:
    # DeepSeek-V3: 61 decoder layers x (kv_lora_rank 512 + rope 64) x 2 bytes a token
    assert get_model("deepseek-v3").kv_bytes_per_request(1) == 61 * 576 * 2 == 70272
    assert get_model("deepseek-v3").kv_bytes_per_request(4096) == 4096 * 70272
    # Qwen3-235B (GQA): 94 layers x 2 x 4 KV heads x 128 x 2 bytes a token
    assert get_model("qwen3-235b-a22b").kv_bytes_per_request(1) == 94 * 2 * 4 * 128 * 2


def test_mtp_module_matches_its_published_size() -> None:
    # DeepSeek-V3's README_WEIGHTS.md: 1 MTP module of 11.5B parameters besides the shared embeddings and head.
    # By hand: 256 + 1 experts x 3 x 7168 x 2048, MLA attention 187,105,280, router 7168 x 256, eh_proj 2 x 7168^2
    v3 = get_model("deepseek-v3")
    assert v3.mtp_params() == 257 * 44_040_192 + 187_105_280 + 7168 * 256 + 2 * 7168 * 7168
    assert v3.mtp_params() == pytest.approx(11.5e9, rel=0.015)
    assert v3.total() == pytest.approx(671e9, rel=0.015)  # the main model's total leaves the module out
    assert get_model("qwen3-30b-a3b").mtp_params() == 0


def test_the_cost_model_reads_the_one_model_description() -> None:
    import importlib.util

    from moebalance.core.load import read_load

    # one description: no second model class for the cost model
    assert importlib.util.find_spec("moebalance.cost.architecture") is None
    assert all(isinstance(m, ModelSpec) for m in MODELS.values())
    # the spec a synthetic trace names is the one the cost model weighs
    spec = read_load("bundled:deepseek-v3-8x8").model
    assert spec is not None and spec.kv_bytes_per_request(1) == 70272


def test_a_routing_shape_alone_is_refused_by_the_cost_model() -> None:
    shape = ModelSpec(name="shape", display_name="Shape", num_layers=2, num_dense_layers=0, num_experts=4, top_k=2,
                      hidden_size=4, moe_intermediate_size=8, num_shared_experts=0, num_groups=1, source="test")
    assert shape.expert_params() == 96 and not shape.has_architecture  # the routing shape is enough for this
    for call in (shape.total, lambda: shape.kv_bytes_per_request(1), lambda: shape.kv_shards(2),
                 lambda: memory_per_gpu(shape, SMALL_GPU, num_gpus=2, gpus_per_node=2)):
        with pytest.raises(InputError) as info:
            call()
        assert str(info.value) == ("model 'shape' gives only its routing shape; the cost model needs its attention "
                                   "and vocab_size too: use a preset model or give them")


@pytest.mark.parametrize(("build", "needle"), [
    (lambda: Calibration(launch_us=True), "launch_us (True) must be a finite number >= 0"),
    (lambda: Calibration(flops_efficiency="0.5"), "flops_efficiency ('0.5') must be a finite number > 0"),
    (lambda: Calibration(bandwidth_efficiency=1.5), "bandwidth_efficiency (1.5) must be in (0, 1]"),
    (lambda: Calibration(source=""), "source ('') must be a non-empty string"),
    (lambda: GpuSpec(name="g", display_name="G", bf16_tflops=float("inf"), memory_gib=1.0, memory_bandwidth=1.0,
                     source="test"), "GpuSpec.bf16_tflops (inf) must be a finite number > 0"),
    (lambda: GpuSpec(name="", display_name="G", bf16_tflops=1.0, memory_gib=1.0, memory_bandwidth=1.0,
                     source="test"), "GpuSpec.name ('') must be a non-empty string"),
    (lambda: EngineMemory(memory_fraction=True), "memory_fraction (True) must be a finite number > 0"),
    (lambda: EngineMemory(reserve_gib=float("nan")), "reserve_gib (nan) must be a finite number >= 0"),
    (lambda: Workload(prefill_chunk=0), "prefill_chunk (0) must be a positive integer"),
])
def test_cost_settings_are_checked_in_one_line(build: object, needle: str) -> None:
    with pytest.raises(InputError) as info:
        build()  # type: ignore[operator]
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_memory_of_a_tiny_deployment_by_hand() -> None:
    engine = EngineMemory(memory_fraction=0.5, reserve_gib=0.0, attention_tp=1, dense_tp=1)
    report = memory_per_gpu(TINY, SMALL_GPU, num_gpus=2, gpus_per_node=2, replicas_per_gpu=1, engine=engine,
                            context_tokens=4096)
    # budget 0.5 MiB = 524,288 B; non-expert weights 208 params x 2 B = 416 B on every GPU (nothing split);
    # without replicas each GPU hosts L * ceil(E / G) = 4 experts = 4 x 96 x 2 = 768 B; one replica 192 B
    assert report.experts_per_gpu_no_replicas == 4 and report.experts_per_gpu == 5
    kv_without = 524288 - 416 - 768
    assert report.replica_gb_per_gpu * (1 << 30) == pytest.approx(192)
    assert report.kv_cache_gb_per_gpu * (1 << 30) == pytest.approx(kv_without - 192)
    assert report.kv_cache_reduction == pytest.approx(192 / kv_without)
    assert report.weights_gb_per_gpu * (1 << 30) == pytest.approx(416 + 5 * 192)
    # a request of 4096 tokens holds 4096 x 16 B = 65,536 B: 7 fit in 522,912 B, on each of 2 ranks
    assert report.max_concurrency == 14


def test_memory_from_a_plans_fullest_gpu_and_refusals() -> None:
    engine = EngineMemory(memory_fraction=0.5, reserve_gib=0.0, attention_tp=1)
    even = memory_per_gpu(TINY, SMALL_GPU, num_gpus=2, gpus_per_node=2, experts_per_gpu=np.array([4, 6]),
                          engine=engine)
    assert even.experts_per_gpu == 6 and even.replica_gb_per_gpu * (1 << 30) == pytest.approx(2 * 192)
    with pytest.raises(InputError, match="does not fit"):
        memory_per_gpu(TINY, SMALL_GPU, num_gpus=2, gpus_per_node=2, engine=EngineMemory(memory_fraction=0.0001))
    with pytest.raises(InputError, match="memory_fraction"):
        EngineMemory(memory_fraction=1.5)
    with pytest.raises(InputError, match="not whole nodes of 2"):
        memory_per_gpu(TINY, SMALL_GPU, num_gpus=3, gpus_per_node=2)


def test_craft_kv_cache_reductions_within_five_points() -> None:
    """CRAFT Section 5.3 (A100-80GB, 8 GPUs a node, bf16): EPLB takes 19% of the KV cache on DeepSeek-R1 over 8
    nodes, 75% and 24% on Kimi-K2 over 6 and 12 nodes; CRAFT R = 8 takes 6% on Kimi-K2 over 6 nodes."""
    a100 = get_gpu("a100-80gb")
    for model, nodes, replicas, published in (("deepseek-r1", 8, 58, 0.19), ("kimi-k2", 6, 60, 0.75),
                                              ("kimi-k2", 12, 60, 0.24), ("kimi-k2", 6, 8, 0.06)):
        got = memory_per_gpu(get_model(model), a100, num_gpus=8 * nodes, gpus_per_node=8,
                             replicas_per_gpu=replicas).kv_cache_reduction
        assert abs(got - published) <= 0.05, (model, nodes, replicas, got)


def test_expert_time_by_hand() -> None:
    arch, h100 = get_model("deepseek-v3"), get_gpu("h100-80gb")
    # one pick, one expert: 3 x 7168 x 2048 x 2 B of weights + 2 x 7168 x 2 B in and out, at 3.35 TB/s
    one = float(gemm_seconds(1, 1, arch, h100))
    assert one == pytest.approx((3 * 7168 * 2048 * 2 + 2 * 7168 * 2) / 3.35e12)
    # 4096 picks of one expert: 6 x 7168 x 2048 x 4096 FLOPs at 989 TFLOP/s (compute bound)
    many = float(gemm_seconds(4096, 1, arch, h100))
    assert many == pytest.approx(6 * 7168 * 2048 * 4096 / 989e12)
    assert float(gemm_seconds(0, 0, arch, h100)) == 0.0
    slow = float(gemm_seconds(1, 1, arch, h100, Calibration(bandwidth_efficiency=0.5, launch_us=10.0)))
    assert slow == pytest.approx(2 * one + 10e-6)


@settings(max_examples=60, deadline=None)
@given(st.floats(0, 1e5), st.floats(0, 1e5), st.floats(0, 300), st.floats(0, 300), st.sampled_from(sorted(GPUS)))
def test_expert_time_is_monotone_in_tokens_and_experts(n1: float, n2: float, u1: float, u2: float, gpu: str) -> None:
    arch = get_model("kimi-k2")
    lo_n, hi_n, lo_u, hi_u = min(n1, n2), max(n1, n2), min(u1, u2), max(u1, u2)
    t = lambda n, u: float(gemm_seconds(n, u, arch, get_gpu(gpu)))  # noqa: E731
    assert t(lo_n, lo_u) <= t(hi_n, lo_u) + 1e-15
    assert t(lo_n, lo_u) <= t(lo_n, hi_u) + 1e-15


@settings(max_examples=40, deadline=None)
@given(st.floats(1, 1e5), st.floats(1, 1e5), st.floats(0, 1e7))
def test_rest_of_step_is_monotone_in_tokens(a: float, b: float, kv: float) -> None:
    arch, gpu, engine = get_model("deepseek-v3"), get_gpu("h100-80gb"), EngineMemory()
    lo, hi = min(a, b), max(a, b)
    assert rest_seconds(lo, arch, gpu, engine, 8, kv_tokens_per_rank=kv) <= \
        rest_seconds(hi, arch, gpu, engine, 8, kv_tokens_per_rank=kv) + 1e-15


def test_a2a_estimate_by_hand() -> None:
    cluster = Cluster(num_nodes=1, gpus_per_node=2, intra_node_bandwidth=2.0)
    # picks [3, 1], tokens on either GPU with probability 1/2: GPU 0 receives 3/2 from GPU 1 and sends 1/2 to it
    # (GPU 1: receives 1/2, sends 3/2): the busiest link moves 1.5 copies of 1000 B at 2 GB/s, twice (combine)
    assert a2a_estimate(np.array([3.0, 1.0]), cluster, 1000) == pytest.approx(2 * 1000 * 1.5 / 2.0 / 1e9)
    two = Cluster(num_nodes=2, gpus_per_node=1, intra_node_bandwidth=100.0, inter_node_bandwidth=1.0)
    # two nodes of one GPU: every remote copy crosses the network; GPU 0 receives 3/2, GPU 1 sends 3/2
    assert a2a_estimate(np.array([3.0, 1.0]), two, 1000) == pytest.approx(2 * 1000 * 1.5 / 1.0 / 1e9)


def test_a2a_estimate_merges_a_tokens_picks_by_hand() -> None:
    """Top-2, 2 tokens: on one node of 2 GPUs with picks [2, 2] a token reaches each GPU with probability
    1 - (1/2)^2 = 3/4, so each GPU receives 2 x 3/4 x 1/2 = 0.75 copies from the other where one message per pick
    (low-latency) is 1. On 2 nodes x 2 GPUs with picks [1, 1, 1, 1] a token reaches a node with probability 3/4:
    DeepEP's normal kernels send each GPU's token to the other node 3/4 times, and each GPU receives 2 x 3/4 / 4."""
    one = Cluster(num_nodes=1, gpus_per_node=2, intra_node_bandwidth=1.0)
    assert a2a_estimate(np.array([2.0, 2.0]), one, 1000, top_k=2) == pytest.approx(2 * 1000 * 0.75 / 1e9)
    assert a2a_estimate(np.array([2.0, 2.0]), one, 1000, top_k=2, kernel="low-latency") == \
        pytest.approx(2 * 1000 * 1.0 / 1e9)
    assert a2a_estimate(np.array([2.0, 2.0]), one, 1000, top_k=2, kernel="normal") == \
        pytest.approx(2 * 1000 * 0.75 / 1e9)  # one node: nothing to forward
    two = Cluster(num_nodes=2, gpus_per_node=2, intra_node_bandwidth=100.0, inter_node_bandwidth=1.0)
    assert a2a_estimate(np.ones(4), two, 1000, top_k=2, kernel="normal") == pytest.approx(2 * 1000 * 0.375 / 1e9)
    # a copy per GPU: each GPU reached by 2 x (1 - (3/4)^2) = 0.875 tokens, half of them from the other node
    assert a2a_estimate(np.ones(4), two, 1000, top_k=2) == pytest.approx(2 * 1000 * 0.4375 / 1e9)
    with pytest.raises(InputError, match="not auto"):
        a2a_estimate(np.ones(4), two, 1000, kernel="auto")


@pytest.mark.parametrize("kernel", ["per-gpu", "normal", "low-latency"])
def test_a2a_estimate_matches_sampled_tokens(kernel: str) -> None:
    """The closed form for counts against tokens drawn as it assumes (each token's picks independent of where it
    lives, drawn from skewed expert shares) and counted token by token by the replay's own traffic: within 5%."""
    from moebalance.core.trace import RoutingTrace
    from moebalance.routing.copies import traffic

    rng = np.random.default_rng(7)
    cluster = Cluster(num_nodes=2, gpus_per_node=4, intra_node_bandwidth=150.0, inter_node_bandwidth=50.0)
    G, E, K, T = 8, 256, 8, 20_000
    plan = Placement([[list(range(g * 32, (g + 1) * 32)) for g in range(G)]], E, cluster)
    share = rng.dirichlet(np.full(E, 2.0))
    keys = np.log(share)[None, :] + rng.gumbel(size=(T, E))  # Gumbel top-K: K distinct experts by share
    topk = np.argpartition(-keys, K, axis=1)[:, :K][:, None, :]
    trace = RoutingTrace(topk, rng.integers(0, G, T), np.zeros(T, dtype=np.int64), num_experts=E)
    counted = traffic(plan, trace, topk // 32, bytes_per_copy=7000, kernel=kernel).a2a_seconds[0, 0]
    picks = np.bincount((topk // 32).ravel(), minlength=G).astype(np.float64)
    assert a2a_estimate(picks, cluster, 7000, top_k=K, kernel=kernel) == pytest.approx(counted, rel=0.05)


def _tiny_plan_and_load() -> tuple[Placement, LoadMatrix]:
    arch = get_model("olmoe-1b-7b")
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 400, (6, arch.num_layers, arch.num_experts))
    load = LoadMatrix(counts, preset="olmoe-1b-7b")
    plan, _ = make_plan("eplb", load, Cluster(num_nodes=2, gpus_per_node=2), Budget(slots_per_gpu=17))
    return plan, load


def test_price_plan_layer_time_is_the_straggler_plus_all_to_all() -> None:
    plan, load = _tiny_plan_and_load()
    arch, gpu = get_model("olmoe-1b-7b"), get_gpu("rtx4090")
    cost = price_plan(plan, load, Deployment(model=arch, gpu=gpu, engine=EngineMemory(attention_tp=1, reserve_gib=0.0)))
    from moebalance.routing.simulate import gpu_loads

    loads = gpu_loads(plan, load.counts)  # uniform router
    touched = np.einsum("ble,leg->blg", (load.counts > 0).astype(float), (plan.copies > 0).astype(float))
    expect = gemm_seconds(loads, touched, arch, gpu).max(axis=2) + a2a_estimate(loads, plan.cluster, 2048 * 2, top_k=arch.top_k)
    assert cost.modelled_layer_ms == pytest.approx(1e3 * expect.mean())
    assert cost.modelled_goodput > 0 and cost.decode_step_ms > 0 and cost.prefill_step_ms > cost.decode_step_ms / 100
    assert set(cost.as_dict()) >= {"weights_gb_per_gpu", "replica_gb_per_gpu", "kv_cache_gb_per_gpu",
                                   "kv_cache_reduction", "max_concurrency", "modelled_layer_ms", "modelled_goodput"}


def test_goodput_falls_when_the_kv_cache_is_taken() -> None:
    """The same plan with a larger engine reserve holds fewer requests, so its goodput is lower."""
    plan, load = _tiny_plan_and_load()
    arch, gpu = get_model("olmoe-1b-7b"), get_gpu("rtx4090")
    roomy = price_plan(plan, load, Deployment(model=arch, gpu=gpu, engine=EngineMemory(attention_tp=1, reserve_gib=0.0)))
    tight = price_plan(plan, load, Deployment(model=arch, gpu=gpu, engine=EngineMemory(attention_tp=1, reserve_gib=10.0)))
    assert tight.memory.max_concurrency < roomy.memory.max_concurrency
    assert tight.modelled_goodput < roomy.modelled_goodput
    with pytest.raises(InputError, match="prompt_tokens"):
        Workload(prompt_tokens=0)


def test_cost_cli(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, text, err = run_cli(["cost", "--model", "kimi-k2", "--gpu", "a100-80gb", "--nodes", 6, "--gpus-per-node", 8,
                             "--replicas-per-gpu", 60, "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(text)
    assert {"weights_gb_per_gpu", "replica_gb_per_gpu", "kv_cache_gb_per_gpu", "kv_cache_reduction",
            "max_concurrency"} <= set(doc)
    assert doc["experts_per_gpu"] == 60 * 8 + 60 and abs(doc["kv_cache_reduction"] - 0.75) <= 0.05
    plan, load = _tiny_plan_and_load()
    write_plan(tmp_path / "p.json", plan)
    np.save(tmp_path / "c.npy", load.counts)
    rc, text, err = run_cli(["cost", "--model", "olmoe-1b-7b", "--gpu", "rtx4090", "--plan", tmp_path / "p.json",
                             "--load", tmp_path / "c.npy", "--intra-link", "pcie4", "--inter-link", "eth25",
                             "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(text)
    assert doc["modelled_layer_ms"] > 0 and doc["modelled_goodput"] > 0 and doc["model"] == "olmoe-1b-7b"
    rc, text, _ = run_cli(["cost", "--model", "olmoe-1b-7b", "--gpu", "rtx4090", "--nodes", 1, "--gpus-per-node", 4],
                          capsys)
    assert rc == 0 and "kv_cache_gb_per_gpu" in text


def test_cost_cli_errors(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(["cost", "--model", "kimi-k2", "--gpu", "a100-80gb"], capsys, "--nodes")
    assert_user_error(["cost", "--model", "kimi-k2", "--gpu", "a100-80gb", "--nodes", 1, "--gpus-per-node", 8],
                      capsys, "does not fit")
    assert_user_error(["cost", "--model", "kimi-k2", "--gpu", "a100-80gb", "--plan", "x.json"], capsys, "--load")
    assert_user_error(["cost", "--model", "nope", "--gpu", "a100-80gb"], capsys, "nope")
    (tmp_path / "cal.json").write_text(json.dumps({"format": "moebalance.calibration", "flops_efficiency": 2.0}))
    assert_user_error(["cost", "--model", "kimi-k2", "--gpu", "a100-80gb", "--nodes", 6, "--gpus-per-node", 8,
                       "--calibration", tmp_path / "cal.json"], capsys, "flops_efficiency")
    assert math.isfinite(get_gpu("b200").bf16_tflops)


def test_compare_with_a_gpu_shows_kv_cache_and_goodput(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "--load", "bundled:olmoe-1b-7b-tokens", "--policies", "contiguous,eplb", "--nodes", 2,
            "--gpus-per-node", 4, "--slots-per-gpu", 10, "--gpu", "rtx4090", "--attention-tp", 1, "--json"]
    rc, text, err = run_cli(argv, capsys)
    assert rc == 0, err
    rows = json.loads(text)["rows"]
    cost = {r["policy"]: r["cost"] for r in rows}
    # 64 experts on 8 GPUs: contiguous hosts 8 per layer, eplb's 10 slots add 2 x 16 layers of replicas
    assert cost["contiguous"]["experts_per_gpu"] == 128 and cost["eplb"]["experts_per_gpu"] == 160
    assert cost["eplb"]["kv_cache_gb_per_gpu"] < cost["contiguous"]["kv_cache_gb_per_gpu"]
    assert all(c["modelled_goodput"] > 0 and c["modelled_layer_ms"] > 0 for c in cost.values())
    rc, text, _ = run_cli(argv[:-1], capsys)
    assert rc == 0 and "goodput" in text and "KV cache" in text
    assert_user_error(["compare", "--load", "bundled:olmoe-1b-7b-tokens", "--policies", "eplb", "--nodes", 2,
                       "--gpus-per-node", 4, "--slots-per-gpu", 10, "--gpu", "rtx4090", "--model", "kimi-k2"],
                      capsys, "give the load's --model")


def test_calibration_fit_recovers_known_constants(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Times made by the roofline with 50% of the FLOP/s, 80% of the bandwidth and 20 us per call are fitted back."""
    from moebalance.cost.calibrate import fit, read_measurements

    arch, gpu = get_model("deepseek-v3"), get_gpu("h100-80gb")
    truth = Calibration(flops_efficiency=0.5, bandwidth_efficiency=0.8, launch_us=20.0)
    lines = ["experts,tokens_per_expert,hidden_size,ffn_size,seconds"]
    for experts in (1, 8, 32):
        for tokens in (1, 4, 16, 64, 256, 1024, 2048):
            t = float(gemm_seconds(experts * tokens, experts, arch, gpu, truth))
            lines.append(f"{experts},{tokens},7168,2048,{t!r}")
    (tmp_path / "m.csv").write_text("\n".join(lines) + "\n")
    got, error, (by_flops, by_memory) = fit(read_measurements(tmp_path / "m.csv"), gpu)
    assert error < 0.02 and by_flops > 0 and by_memory > 0
    assert got.flops_efficiency == pytest.approx(0.5, rel=0.05)
    assert got.bandwidth_efficiency == pytest.approx(0.8, rel=0.05)
    assert got.launch_us == pytest.approx(20.0, abs=5.0)
    rc, _, err = run_cli(["calibrate", "--measurements", tmp_path / "m.csv", "--gpu", "h100-80gb", "--out",
                          tmp_path / "cal.json"], capsys)
    assert rc == 0, err
    assert json.loads((tmp_path / "cal.json").read_text())["mean_abs_log_error"] == pytest.approx(error, abs=1e-6)
    rc, text, err = run_cli(["cost", "--model", "kimi-k2", "--gpu", "h100-80gb", "--nodes", 6, "--gpus-per-node", 8,
                             "--calibration", tmp_path / "cal.json", "--json"], capsys)
    assert rc == 0 and json.loads(text)["calibration"] == "fitted to m.csv on h100-80gb"
    (tmp_path / "bad.csv").write_text("experts,tokens_per_expert,hidden_size,seconds\n1,1,7168,0.1\n")
    assert_user_error(["calibrate", "--measurements", tmp_path / "bad.csv", "--gpu", "h100-80gb", "--out",
                       tmp_path / "c2.json"], capsys, "lacks column 'ffn_size'")
    (tmp_path / "neg.csv").write_text("experts,tokens_per_expert,hidden_size,ffn_size,seconds\n1,1,7168,2048,-1\n")
    assert_user_error(["calibrate", "--measurements", tmp_path / "neg.csv", "--gpu", "h100-80gb", "--out",
                       tmp_path / "c3.json"], capsys, "line 2: seconds is -1.0")
    assert not (tmp_path / "c2.json").exists() and not (tmp_path / "c3.json").exists()


def test_auto_by_goodput_picks_the_best_modelled_r(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--load", "bundled:deepseek-v3-8x8", "--policy", "craft", "--nodes", 8, "--gpus-per-node", 8,
            "--replicas-per-gpu", "auto", "--gpu", "a100-80gb", "--inter-link", "efa-p4d", "--batches", ":50"]
    picked = {}
    for reserve in (0.0, 20.0):  # a roomy KV cache (25 GiB per GPU), and one that replicas eat into (9 GiB)
        out = tmp_path / f"auto{reserve}.json"
        rc, _, err = run_cli([*base, "--auto-by", "goodput", "--reserve-gib", reserve, "--out", out], capsys)
        assert rc == 0, err
        params = json.loads(out.read_text())["params"]
        curve = {int(k): v for k, v in params["goodput_by_replicas_per_gpu"].items()}
        assert sorted(curve) == [0, 1, 2, 4, 8, 16, 32, 58]  # placement only, powers of two, then L = 58
        assert params["auto_by"] == "goodput" and params["replicas_per_gpu"] == "auto"
        assert curve[params["chosen_replicas_per_gpu"]] == max(curve.values())
        picked[reserve] = params["chosen_replicas_per_gpu"]
    assert picked[20.0] < picked[0.0]  # the less KV cache there is, the fewer replicas pay (measured: 4 and 32)
    assert_user_error([*base, "--auto-by", "goodput", "--out", tmp_path / "x.json", "--policy", "eplb"], capsys,
                      "--auto-by goodput chooses craft's R")
    assert_user_error(["plan", "--load", "bundled:olmoe-1b-7b-tokens", "--policy", "craft", "--nodes", 2,
                       "--gpus-per-node", 4, "--replicas-per-gpu", "auto", "--auto-by", "goodput", "--out",
                       tmp_path / "y.json"], capsys, "needs --gpu")


def test_sweep_with_a_gpu_models_goodput(capsys: pytest.CaptureFixture[str]) -> None:
    rc, text, err = run_cli(["sweep", "--load", "bundled:olmoe-1b-7b-tokens", "--policies", "craft", "--nodes", 2,
                             "--gpus-per-node", 4, "--replicas-per-gpu", "0,4,16", "--gpu", "rtx4090",
                             "--attention-tp", 1, "--json"], capsys)
    assert rc == 0, err
    points = json.loads(text)["points"]
    kv = [p["kv_cache_gb_per_gpu"] for p in points]
    assert [p["replicas_per_gpu"] for p in points] == [0, 4, 16]
    assert kv[0] > kv[1] > kv[2] and all(p["modelled_goodput"] > 0 for p in points)


def test_prefetch_time_by_hand_and_in_online(capsys: pytest.CaptureFixture[str]) -> None:
    from moebalance.cost.time import prefetch_seconds

    # one DeepSeek-V3 expert: 3 x 7168 x 2048 x 2 B = 88,080,384 B over 450 GB/s
    assert float(prefetch_seconds(1, get_model("deepseek-v3"), 450.0)) == pytest.approx(88_080_384 / 450e9)
    rc, text, err = run_cli(["online", "--load", "bundled:olmoe-1b-7b-tokens", "--policy", "libra", "--nodes", 1,
                             "--gpus-per-node", 8, "--slots-per-gpu", 10, "--warmup", "0:8", "--batches", "8:12",
                             "--set", "predictor=oracle", "--model", "olmoe-1b-7b", "--intra-link", "pcie4", "--json"],
                            capsys)
    assert rc == 0, err
    doc = json.loads(text)
    expert_bytes = 3 * 2048 * 1024 * 2  # OLMoE: H = 2048, F = 1024, bf16
    assert doc["modelled_prefetch"]["gb_per_batch"] == pytest.approx(doc["experts_moved"] * expert_bytes / 2**30,
                                                                     rel=1e-5)
    per = doc["experts_moved"] / (16 * 8) * expert_bytes / 32e9 * 1e3  # 16 layers x 8 GPUs, PCIe 4.0 at 32 GB/s
    assert doc["modelled_prefetch"]["mean_ms_per_gpu_and_layer"] == pytest.approx(per, rel=1e-4)


def test_compare_auto_by_goodput(capsys: pytest.CaptureFixture[str]) -> None:
    rc, text, err = run_cli(["compare", "--load", "bundled:deepseek-v3-8x8", "--policies", "craft", "--nodes", 8,
                             "--gpus-per-node", 8, "--replicas-per-gpu", "auto", "--auto-by", "goodput", "--gpu",
                             "a100-80gb", "--inter-link", "efa-p4d", "--json"], capsys)
    assert rc == 0, err
    row = json.loads(text)["rows"][0]
    assert row["plan_seconds"] > 0 and row["cost"]["modelled_goodput"] > 0
    assert row["extra_replicas"] % 64 == 0 and row["extra_replicas"] > 0  # R * G replicas for the chosen R


def test_no_room_for_a_request_and_bad_attention_split() -> None:
    plan, load = _tiny_plan_and_load()
    arch, gpu = get_model("olmoe-1b-7b"), get_gpu("rtx4090")
    huge = price_plan(plan, load, Deployment(model=arch, gpu=gpu, engine=EngineMemory(attention_tp=1),
                                             workload=Workload(prompt_tokens=10**8, output_tokens=1)))
    assert huge.memory.max_concurrency == 0 and huge.modelled_goodput == 0.0
    json.dumps(huge.as_dict(), allow_nan=False)  # a finite decode step even then
    with pytest.raises(InputError, match="--attention-tp 3 must divide"):
        memory_per_gpu(arch, gpu, num_gpus=4, gpus_per_node=2, engine=EngineMemory(attention_tp=3))



def test_calibration_of_one_regime_keeps_the_other_efficiency_at_its_largest(tmp_path) -> None:
    """Decode-sized runs only (bound by memory): the FLOP/s efficiency is not determined, so it stays at 1."""
    from moebalance.cost.calibrate import fit, read_measurements

    arch, gpu = get_model("deepseek-v3"), get_gpu("h100-80gb")
    truth = Calibration(flops_efficiency=0.6, bandwidth_efficiency=0.8)
    lines = ["experts,tokens_per_expert,hidden_size,ffn_size,seconds"]
    lines += [f"{u},{n},7168,2048,{float(gemm_seconds(u * n, u, arch, gpu, truth))!r}" for u in (1, 8) for n in (1, 4)]
    (tmp_path / "m.csv").write_text("\n".join(lines) + "\n")
    got, error, (by_flops, by_memory) = fit(read_measurements(tmp_path / "m.csv"), gpu)
    assert (by_flops, by_memory) == (0, 4) and got.flops_efficiency == 1.0
    assert got.bandwidth_efficiency == pytest.approx(0.8, rel=0.05) and error < 0.02


def test_goodput_of_a_tiny_deployment_by_hand() -> None:
    """One GPU (1 TFLOP/s, 1 GB/s, 1 MiB), the tiny model, contiguous plan, one batch: every step term by hand."""
    cluster = Cluster(num_nodes=1, gpus_per_node=1)
    plan = Placement([[[0, 1, 2, 3]], [[0, 1, 2, 3]]], 4, cluster)
    load = LoadMatrix(np.array([[[2, 2, 0, 0], [1, 1, 1, 1]]]))
    engine = EngineMemory(memory_fraction=0.5, reserve_gib=0.0, attention_tp=1)
    work = Workload(prompt_tokens=4, output_tokens=2, prefill_chunk=8)
    cost = price_plan(plan, load, Deployment(model=TINY, gpu=SMALL_GPU, engine=engine, workload=work))
    # memory: 524,288 B - 416 B of non-expert weights - 8 experts x 192 B = 522,336 B; a request holds 6 tokens x 16 B
    assert cost.memory.max_concurrency == 522336 // 96 == 5441
    # at the load's own size: layer 0 has 4 picks on 2 touched experts, layer 1 4 picks on 4 (memory bound:
    # 192 B per expert touched + 2 x 4 x 2 B per pick in and out, at 1 GB/s); one GPU: no all-to-all
    assert cost.modelled_layer_ms == pytest.approx(((2 * 192 + 4 * 16) + (4 * 192 + 4 * 16)) / 2 / 1e9 * 1e3)
    assert cost.modelled_a2a_ms == 0.0

    def experts(n: float, used: float) -> float:  # the roofline, memory bound here
        return max(192 * n / 1e12, (192 * used + 16 * n) / 1e9)

    C = 5441
    # decode: C tokens, 2 picks each; layer 0 shares (1/2, 1/2), layer 1 (1/4 x 4); every copy touched
    moe = experts(2 * C, 2 * (1 - math.exp(-C))) + experts(2 * C, 4 * (1 - math.exp(-C / 2)))
    # the rest: non-expert weights but the input embedding (208 - 40 params, 2 B each) + KV of C x (4 + 1) tokens
    rest = (168 * 2 + C * 5 * 16) / 1e9
    decode = moe + rest
    # prefill: 8 tokens, 16 picks per layer, two prompts' logits; no KV read
    prefill = experts(16, 2 * (1 - math.exp(-8))) + experts(16, 4 * (1 - math.exp(-4))) + 168 * 2 / 1e9
    assert cost.decode_step_ms == pytest.approx(decode * 1e3)
    assert cost.prefill_step_ms == pytest.approx(prefill * 1e3)
    assert cost.modelled_goodput == pytest.approx(C * 2 / (2 * decode + C * 4 / 8 * prefill))


def test_gqa_kv_is_split_over_its_heads_only() -> None:
    qwen = get_model("qwen3-30b-a3b")  # 4 KV heads
    assert (qwen.kv_shards(1), qwen.kv_shards(2), qwen.kv_shards(8)) == (1, 2, 4)
    assert get_model("deepseek-v3").kv_shards(8) == 1  # MLA: the latent vector is whole on every GPU
    h100 = get_gpu("h100-80gb")
    one = memory_per_gpu(qwen, h100, num_gpus=8, gpus_per_node=8, engine=EngineMemory(attention_tp=1))
    eight = memory_per_gpu(qwen, h100, num_gpus=8, gpus_per_node=8, engine=EngineMemory(attention_tp=8))
    # tp 8: one rank whose 8 pools hold 4 shards of each request (heads copied beyond 4), against 8 ranks of 1;
    # the pools differ only by the attention weights, which tp 8 splits
    per_request = qwen.kv_bytes_per_request(4096) / (1 << 30)  # the default context of 4096 tokens
    assert eight.max_concurrency == math.floor(eight.kv_cache_gb_per_gpu * 4 / per_request)
    assert one.max_concurrency == 8 * math.floor(one.kv_cache_gb_per_gpu / per_request)


def test_window_layers_raise_gpt_oss_concurrency_over_the_all_full_count() -> None:
    """gpt-oss-120b on a node of 8 H100s (one data-parallel rank, its 8 KV heads one per GPU), 4096-token requests:
    its 18 sliding-window layers keep 128 tokens each, so a request takes (18 x 4096 + 18 x 128) x 2048 = 155,713,536
    bytes, not the 36 x 4096 x 2048 = 301,989,888 of every layer full: 1.94x the requests."""
    gpt, h100 = get_model("gpt-oss-120b"), get_gpu("h100-80gb")
    report = memory_per_gpu(gpt, h100, num_gpus=8, gpus_per_node=8, context_tokens=4096)
    kv_bytes = report.kv_cache_gb_per_gpu * (1 << 30)  # the pool of each GPU, 1/8 of every request in it
    assert report.max_concurrency == math.floor(kv_bytes / (155_713_536 / 8)) > 0
    all_full = math.floor(kv_bytes / (301_989_888 / 8))
    assert report.max_concurrency > all_full and report.max_concurrency / all_full == pytest.approx(1.94, abs=0.01)


def test_a_decode_step_reads_a_window_layers_window_and_a_linear_layers_state() -> None:
    """A decode token of a 100,000-token request reads, on one of 8 GPUs: gpt-oss-120b (8 KV heads, one a GPU) 18 full
    layers' 100,000 tokens and 18 window layers' 128, 2048 bytes each; Qwen3-Next (2 KV heads over 2 GPUs) 12 full
    layers' tokens and 36 linear layers' states of 2,146,304 bytes (over 8 GPUs); both bound by memory bandwidth."""
    h100, engine = get_gpu("h100-80gb"), EngineMemory()
    for name, kv in (("gpt-oss-120b", (18 * 100_000 + 18 * 128) * 2048 / 8),
                     ("qwen3-next-80b-a3b", 12 * 100_000 * 2048 / 2 + 36 * 2_146_304 / 8)):
        spec = get_model(name)
        without = rest_seconds(1.0, spec, h100, engine, 8)
        with_kv = rest_seconds(1.0, spec, h100, engine, 8, kv_tokens_per_rank=100_000)
        assert with_kv - without == pytest.approx(kv / 3.35e12, rel=1e-9), name


def test_step_model_skips_idle_batches_and_an_unknown_kernel_is_one_line() -> None:
    plan, load = _tiny_plan_and_load()
    arch, gpu = get_model("olmoe-1b-7b"), get_gpu("rtx4090")
    engine = EngineMemory(attention_tp=1, reserve_gib=0.0)
    busy = price_plan(plan, load, Deployment(model=arch, gpu=gpu, engine=engine))
    counts = np.zeros((2 * load.num_batches, *load.counts.shape[1:]), dtype=np.int64)
    counts[1::2] = load.counts  # every other batch idle: the same busy batches, the step model must not see zeros
    idle = price_plan(plan, LoadMatrix(counts), Deployment(model=arch, gpu=gpu, engine=engine))
    assert idle.decode_step_ms == pytest.approx(busy.decode_step_ms)
    assert idle.modelled_goodput == pytest.approx(busy.modelled_goodput)
    with pytest.raises(InputError, match="all-to-all kernel 'node' is unknown; choose one of: per-gpu, normal"):
        Deployment(model=arch, gpu=gpu, engine=engine, a2a="node")
    with pytest.raises(InputError, match="--dense-tp 9"):
        memory_per_gpu(arch, gpu, num_gpus=4, gpus_per_node=2, engine=EngineMemory(dense_tp=9))


# ----- the contract: expert_seconds(picks [..., G, E], model, gpu, calibration=...) -> [..., G] --------------------

def test_expert_seconds_contract_worked_example() -> None:
    """The docstring's example by hand: DeepSeek-V3 on an H100 at its peaks; GPU 0 serves 3 + 1 picks of two experts,
    GPU 1 four picks of one. Reading an expert's 3 H F x 2 bytes at 3.35 TB/s dominates the FLOPs."""
    v3, h100 = MODELS["deepseek-v3"], GPUS["h100-80gb"]
    H, F = v3.hidden_size, v3.moe_intermediate_size
    read = 3 * H * F * 2 / 3.35e12  # one expert's weights: 26.3 us
    act = 2 * H * 2 / 3.35e12  # one pick's input and output
    got = expert_seconds(np.array([[3, 1, 0], [0, 0, 4]]), v3, h100)
    assert got.shape == (2,)
    np.testing.assert_allclose(got, [2 * read + 4 * act, read + 4 * act], rtol=1e-12)
    assert np.round(got * 1e6, 1).tolist() == [52.6, 26.3]


@given(picks=st.lists(st.lists(st.lists(st.integers(0, 5000), min_size=3, max_size=3), min_size=2, max_size=2),
                      min_size=1, max_size=3),
       launch=st.sampled_from([0.0, 7.5]))
@settings(max_examples=50, deadline=None)
def test_expert_seconds_is_the_roofline_of_each_gpus_picks(picks: list[list[list[int]]], launch: float) -> None:
    """Leading axes broadcast; each GPU's time is the roofline of its picks and the experts they touch, an idle GPU
    takes nothing, and more picks of an expert it already reads never make it faster."""
    arr = np.array(picks)  # [B, G, E]
    cal = Calibration(flops_efficiency=0.5, bandwidth_efficiency=0.7, launch_us=launch)
    arch = MODELS["mixtral-8x7b"]
    got = expert_seconds(arr, arch, GPUS["a100-80gb"], cal)
    assert got.shape == arr.shape[:-1]
    H, F = arch.hidden_size, arch.moe_intermediate_size
    for idx in np.ndindex(*arr.shape[:-1]):
        n, u = int(arr[idx].sum()), int((arr[idx] > 0).sum())
        want = 0.0 if n == 0 else launch * 1e-6 + max(6 * H * F * n / (312e12 * 0.5),
                                                       (3 * H * F * 2 * u + 2 * n * H * 2) / (2039e9 * 0.7))
        assert got[idx] == pytest.approx(want, rel=1e-12)
    more = arr + (arr > 0)  # one more pick of every expert already read
    assert np.all(expert_seconds(more, arch, GPUS["a100-80gb"], cal) >= got)


def test_expert_seconds_refuses_what_is_not_a_picks_matrix() -> None:
    v3, h100 = MODELS["deepseek-v3"], GPUS["h100-80gb"]
    with pytest.raises(InputError, match=r"picks must be \[\.\.\., G, E\]"):
        expert_seconds(np.array([1, 2]), v3, h100)
    with pytest.raises(InputError, match="whole numbers of tokens"):
        expert_seconds(np.array([[0.5, 1.0]]), v3, h100)
    with pytest.raises(InputError, match=">= 0"):
        expert_seconds(np.array([[-1, 1]]), v3, h100)
    assert expert_seconds(np.array([[2.0, 0.0]]), v3, h100)[0] > 0  # whole numbers in a float array are picks


def test_every_price_of_a_layer_is_the_deployments() -> None:
    """The goodput model's layer time, the phase time and a served step are one formula: on the same plan, load and
    router they agree to the last bit (the layer priced once, by pricing.layer)."""
    from moebalance.pricing.layer import price_layers
    from moebalance.pricing.phase import phase_time
    from moebalance.routing import get_router

    arch, gpu = get_model("olmoe-1b-7b"), GPUS["h100-80gb"]
    load = read_bundled("olmoe-1b-7b-tokens").select_batches(0, 3)
    cluster = Cluster(num_nodes=2, gpus_per_node=4)
    plan = make_plan("eplb", load, cluster, Budget(slots_per_gpu=9))[0]
    d = Deployment(model=arch, gpu=gpu, engine=EngineMemory(attention_tp=1))
    priced = price_layers(plan, load, get_router("uniform"), d, np.random.default_rng(0))
    active = priced.active
    cost = price_plan(plan, load, d)
    phase = phase_time(plan, load, "uniform", d, phase="prefill", step_tokens=256)
    assert cost.modelled_layer_ms == pytest.approx(float(priced.seconds[active].mean() * 1e3), rel=1e-15)
    assert phase.moe_layer_ms == cost.modelled_layer_ms
    np.testing.assert_array_equal(priced.seconds, priced.expert.max(axis=2) + priced.a2a)


def test_expert_seconds_docstring_example_runs() -> None:
    import doctest

    import moebalance.cost.time as module

    result = doctest.testmod(module, extraglobs={"np": np})
    assert result.attempted >= 2 and result.failed == 0


def test_a_load_with_load_in_a_dense_layer_is_no_models_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One fit rule everywhere: DeepSeek-V3's 61 decoder rows fit only with no load in the 3 dense ones, on the command
    line and in the library's price."""
    counts = np.ones((2, 61, 256), dtype=np.int64)
    np.save(tmp_path / "dense.npy", counts)
    assert_user_error(["compare", "--load", tmp_path / "dense.npy", "--model", "deepseek-v3", "--gpu", "h100-80gb",
                       "--policies", "eplb", "--nodes", 8, "--gpus-per-node", 8, "--slots-per-gpu", 5], capsys,
                      "load in layer 0, which is dense in DeepSeek-V3 (layers 0..2)")
    v3 = Deployment(model=get_model("deepseek-v3"), gpu=GPUS["h100-80gb"])
    cluster = Cluster(num_nodes=8, gpus_per_node=8)
    fine = counts.copy()
    fine[:, :3] = 0
    plan = make_plan("eplb", LoadMatrix(fine, preset="deepseek-v3"), cluster, Budget(slots_per_gpu=5))[0]
    assert price_plan(plan, LoadMatrix(fine), v3).modelled_goodput > 0
    with pytest.raises(InputError, match=r"the plan's load does not fit model 'deepseek-v3': it has load in layer 0.*"
                                         r"give the model the plan was made for"):
        price_plan(plan, LoadMatrix(counts), v3)


# ----- precision: the weights' and GEMMs' bytes and peak -------------------------------------------------------------

def test_fp8_halves_the_weights_and_doubles_the_flops_peak() -> None:
    """By hand: an FP8 DeepSeek-V3 expert is 3 H F bytes, read at the same bandwidth (half the decode time); a
    FLOP-bound GEMM runs at the FP8 peak (1,979 against 989 TFLOP/s on an H100); a dispatch copy is H bytes plus a
    float32 scale per 128 values, the combine stays bf16."""
    v3, h100 = get_model("deepseek-v3"), GPUS["h100-80gb"]
    bf16 = Deployment(model=v3, gpu=h100, precision="bf16")
    fp8 = Deployment(model=v3, gpu=h100, precision="fp8")
    H, F = v3.hidden_size, v3.moe_intermediate_size
    assert (bf16.engine.weight_bytes, fp8.engine.weight_bytes) == (2, 1)
    assert fp8.bytes_per_expert == 3 * H * F and bf16.bytes_per_expert == 2 * fp8.bytes_per_expert
    assert fp8.dispatch_bytes == H + 4 * 56 and bf16.dispatch_bytes == 2 * H
    assert fp8.bytes_per_copy == (H + 4 * 56 + 2 * H) // 2 and bf16.bytes_per_copy == 2 * H
    decode = float(fp8.gemm_seconds(1.0, 1.0))  # one pick of one expert: the weight read (and 1.5 H bytes moved)
    assert decode == pytest.approx((3 * H * F + 2 * H * 1.5) / 3.35e12, rel=1e-12)
    prefill = 4096.0  # picks of one expert: bound by FLOPs
    assert float(fp8.gemm_seconds(prefill, 1.0)) == pytest.approx(6 * H * F * prefill / 1979e12, rel=1e-12)
    assert float(bf16.gemm_seconds(prefill, 1.0)) == pytest.approx(6 * H * F * prefill / 989e12, rel=1e-12)
    # served: the checkpoint's own precision
    assert Deployment(model=v3, gpu=h100, precision="served").precision == "fp8"
    assert Deployment(model=get_model("qwen3-30b-a3b"), gpu=h100, precision="served").precision == "bf16"
    # quantization_config quant_method fp8 in config.json: DeepSeek-V3/R1, Kimi-K2, MiniMax-M2
    assert {m.name for m in MODELS.values() if m.served_precision == "fp8"} == \
        {"deepseek-v3", "deepseek-r1", "kimi-k2", "minimax-m2"}


def test_fp8_leaves_more_kv_cache_and_is_refused_where_the_gpu_has_none(
        capsys: pytest.CaptureFixture[str]) -> None:
    base = ["cost", "--model", "deepseek-v3", "--nodes", 8, "--gpus-per-node", 8, "--json"]
    rc, out, err = run_cli([*base, "--gpu", "h100-80gb", "--precision", "bf16"], capsys)
    assert rc == 0, err
    bf16 = json.loads(out)
    rc, out, err = run_cli([*base, "--gpu", "h100-80gb"], capsys)  # the default: served, FP8 for DeepSeek-V3
    assert rc == 0, err
    fp8 = json.loads(out)
    assert (bf16["precision"], fp8["precision"]) == ("bf16", "fp8")
    rc, out, err = run_cli([*base, "--gpu", "a100-80gb"], capsys)  # served on a GPU without FP8: bf16
    assert rc == 0, err
    assert json.loads(out)["precision"] == "bf16"
    assert fp8["weights_gb_per_gpu"] == pytest.approx(bf16["weights_gb_per_gpu"] / 2, rel=1e-3)
    assert fp8["kv_cache_gb_per_gpu"] > bf16["kv_cache_gb_per_gpu"] and fp8["max_concurrency"] > bf16["max_concurrency"]
    assert_user_error([*base, "--gpu", "a100-80gb", "--precision", "fp8"], capsys,
                      "A100-SXM4-80GB has no FP8 tensor cores", "give --precision bf16")
    assert_user_error(["compare", "--load", "bundled:deepseek-v3-8x8", "--policies", "eplb", "--nodes", 8,
                       "--gpus-per-node", 8, "--slots-per-gpu", 5, "--precision", "fp8"], capsys,
                      "--precision is used with --gpu")


def test_gpt_oss_mxfp4_experts_take_4_25_bits_in_memory_and_in_the_decode_weight_read() -> None:
    """gpt-oss-120b served (MXFP4 experts) on a node of 8 H100s, by hand from its config: an expert is 3 x 2880 x 2880 =
    24,883,200 weights; at 4.25 bits (4-bit values, an 8-bit scale per block of 32) that is 24,883,200 x 17 / 32 =
    13,219,200 bytes. Each GPU hosts 36 layers x 128 / 8 = 576 experts: 576 x 13,219,200 = 7,614,259,200 bytes =
    7.0913 GiB, against 576 x 24,883,200 x 2 bytes = 26.6953 GiB in bf16 (16 / 4.25 = 3.76x); the non-expert weights
    stay bf16 in both. One decode pick on one expert reads its 13,219,200 bytes and moves 2 x 2880 x 2 bytes of bf16
    activations at 3.35 TB/s: 3.9495 us; a FLOP-bound prefill runs at the bf16 peak (989 TFLOP/s), not FP8's."""
    gpt, h100 = get_model("gpt-oss-120b"), GPUS["h100-80gb"]
    mxfp4, bf16 = Deployment(model=gpt, gpu=h100), Deployment(model=gpt, gpu=h100, precision="bf16")
    assert (mxfp4.precision, bf16.precision) == ("mxfp4", "bf16")
    assert (mxfp4.engine.weight_bytes, mxfp4.engine.expert_weight_bytes) == (2, 4.25 / 8)
    assert mxfp4.bytes_per_expert == 13_219_200 and bf16.bytes_per_expert == 2 * 24_883_200  # what a copy moves
    node = {"num_gpus": 8, "gpus_per_node": 8}
    fixed = non_expert_gib_per_gpu(gpt, EngineMemory(), 8)  # attention, router, embeddings: bf16 (2 bytes)
    assert non_expert_gib_per_gpu(gpt, mxfp4.engine, 8) == fixed
    small = memory_per_gpu(gpt, h100, engine=mxfp4.engine, **node)
    big = memory_per_gpu(gpt, h100, engine=bf16.engine, **node)
    assert small.experts_per_gpu == big.experts_per_gpu == 576
    assert small.weights_gb_per_gpu - fixed == pytest.approx(7_614_259_200 / 2**30, rel=1e-12)  # 7.0913 GiB
    assert big.weights_gb_per_gpu - fixed == pytest.approx(576 * 24_883_200 * 2 / 2**30, rel=1e-12)
    assert small.kv_cache_gb_per_gpu > big.kv_cache_gb_per_gpu and small.max_concurrency > big.max_concurrency
    # decode: the weight read at 4.25 bits, bf16 activations (a = 2: dispatch and GEMM input stay bf16)
    assert (mxfp4.activation_bytes, mxfp4.dispatch_bytes) == (2.0, 2 * 2880)
    assert float(mxfp4.gemm_seconds(1.0, 1.0)) == pytest.approx((13_219_200 + 2 * 2880 * 2) / 3.35e12, rel=1e-12)
    assert float(mxfp4.gemm_seconds(1.0, 1.0)) * 1e6 == pytest.approx(3.9495, abs=1e-4)
    assert mxfp4.cost_vector(Cluster(num_nodes=1, gpus_per_node=8))[1] == pytest.approx(13_219_200 / 3.35e12)
    # prefill: 4096 picks of one expert, bound by FLOPs at the bf16 peak, on an H100 and on a B200 (FP8 4,500)
    for gpu, peak in ((h100, 989e12), (GPUS["b200"], 2250e12)):
        d = Deployment(model=gpt, gpu=gpu)
        assert float(d.gemm_seconds(4096.0, 1.0)) == pytest.approx(6 * 2880 * 2880 * 4096 / peak, rel=1e-12)
    # everything but the experts is priced as in bf16: the same weights, the same peak
    assert mxfp4.rest_seconds(64, 8, "decode") == bf16.rest_seconds(64, 8, "decode")
    assert mxfp4.rest_seconds(4096, 8, "prefill") == bf16.rest_seconds(4096, 8, "prefill")
    # served on a GPU without FP8 tensor cores is MXFP4 still (weight-only: bf16 tensor cores)
    assert Deployment(model=get_model("gpt-oss-20b"), gpu=GPUS["a100-80gb"]).precision == "mxfp4"
    assert mxfp4.describe() == "published peaks, mxfp4 experts, no overlap, a copy per destination GPU"


def test_mxfp4_is_served_for_gpt_oss_and_refused_where_no_engine_serves_it(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["cost", "--nodes", 1, "--gpus-per-node", 8, "--gpu", "h100-80gb", "--json"]
    rc, out, err = run_cli([*base, "--model", "gpt-oss-120b"], capsys)  # served: its MXFP4 checkpoint
    assert rc == 0, err
    served = json.loads(out)
    rc, out, err = run_cli([*base, "--model", "gpt-oss-120b", "--precision", "mxfp4"], capsys)
    assert rc == 0, err
    assert json.loads(out) == served and served["precision"] == "mxfp4"
    rc, out, err = run_cli([*base, "--model", "gpt-oss-120b", "--precision", "bf16"], capsys)
    assert rc == 0, err
    bf16 = json.loads(out)
    # 576 experts per GPU at 13,219,200 bytes against 49,766,400 (the test above)
    assert bf16["weights_gb_per_gpu"] - served["weights_gb_per_gpu"] == \
        pytest.approx(576 * (49_766_400 - 13_219_200) / 2**30, abs=1e-3)
    assert served["max_concurrency"] > bf16["max_concurrency"]
    assert_user_error([*base, "--model", "qwen3-30b-a3b", "--precision", "mxfp4"], capsys,
                      "--precision mxfp4 prices an MXFP4 checkpoint's experts, but Qwen3-30B-A3B's checkpoint is BF16",
                      "engines do not quantize to MXFP4 on load; give --precision served, bf16 or fp8")
    assert_user_error([*base, "--model", "deepseek-v3", "--precision", "mxfp4"], capsys,
                      "DeepSeek-V3's checkpoint is FP8")
    assert_user_error([*base, "--model", "gpt-oss-20b", "--precision", "fp8"], capsys,
                      "--precision fp8 prices FP8 weights, but gpt-oss-20b's checkpoint is MXFP4",
                      "give --precision served (mxfp4) or bf16 (a BF16 copy)")
    with pytest.raises(InputError, match=r"engine's expert weights of 0\.5 bytes disagree with precision 'bf16'"):
        Deployment(model=get_model("gpt-oss-120b"), gpu=GPUS["h100-80gb"], precision="bf16",
                   engine=EngineMemory(expert_weight_bytes=0.5))
    with pytest.raises(InputError, match="expert_weight_bytes"):
        EngineMemory(expert_weight_bytes=0.0)


def test_the_request_cap_is_sglangs_split_over_ranks_and_fp8_kv_halves_a_requests_bytes() -> None:
    """By hand: 8 x 8 H100 with a data-parallel rank per node (8 ranks). The KV cache holds ``k`` requests per rank;
    ``--max-running-requests 100`` gives each rank 100 // 8 = 12 (SGLang's division), so 96 in all; an FP8 KV cache
    holds twice the tokens of the same bytes."""
    v3, h100 = get_model("deepseek-v3"), GPUS["h100-80gb"]
    free = memory_per_gpu(v3, h100, num_gpus=64, gpus_per_node=8, engine=EngineMemory(), context_tokens=2000)
    capped = memory_per_gpu(v3, h100, num_gpus=64, gpus_per_node=8, engine=EngineMemory(max_running_requests=100),
                            context_tokens=2000)
    assert free.max_concurrency > 96 and capped.max_concurrency == 96
    assert capped.kv_cache_gb_per_gpu == free.kv_cache_gb_per_gpu  # the cap leaves the pool as it is
    loose = memory_per_gpu(v3, h100, num_gpus=64, gpus_per_node=8, context_tokens=2000,
                           engine=EngineMemory(max_running_requests=10**9))
    assert loose.max_concurrency == free.max_concurrency
    fp8_kv = memory_per_gpu(v3, h100, num_gpus=64, gpus_per_node=8, engine=EngineMemory(kv_bytes=1),
                            context_tokens=2000)
    assert fp8_kv.max_concurrency // 8 == 2 * (free.max_concurrency // 8) or \
        fp8_kv.max_concurrency // 8 == 2 * (free.max_concurrency // 8) + 1  # floor of twice the per-rank count
    for bad in (0, -3, True, 2.5):
        with pytest.raises(InputError, match="max_running_requests"):
            EngineMemory(max_running_requests=bad)  # type: ignore[arg-type]


def test_cap_and_kv_dtype_flags_reach_the_deployment(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["cost", "--model", "deepseek-v3", "--gpu", "h100-80gb", "--nodes", 8, "--gpus-per-node", 8, "--json"]
    rc, out, err = run_cli([*base, "--max-running-requests", 1000], capsys)
    assert rc == 0, err
    assert json.loads(out)["max_concurrency"] == 1000  # 125 on each of 8 ranks, under the 1,528 the cache holds
    rc, out, err = run_cli([*base, "--kv-cache-dtype", "fp8"], capsys)
    assert rc == 0, err
    rc, out2, err = run_cli(base, capsys)
    assert json.loads(out)["max_concurrency"] > json.loads(out2)["max_concurrency"]
    assert_user_error([*base, "--max-running-requests", 0], capsys, "--max-running-requests", "0 must be >= 1")


def test_attended_pairs_follow_each_layers_attention() -> None:
    """A token's (query, key) pairs over the decoder layers, by hand: every layer full (DeepSeek-V3, 61 layers),
    gpt-oss-120b's 18 full and 18 sliding-window layers of 128, Qwen3-Next's 12 full and 36 linear (none)."""
    v3, oss, nxt = get_model("deepseek-v3"), get_model("gpt-oss-120b"), get_model("qwen3-next-80b-a3b")
    assert v3.attended_pairs(4096, prompt=True) == 61 * 4097 / 2 and v3.attended_pairs(3000, prompt=False) == 61 * 3000
    # a prompt of 4,096: token i attends min(i, 128) in a window layer: 128 x 129 / 2 for the first 128, then 128 each
    window = (128 * 129 / 2 + (4096 - 128) * 128) / 4096
    assert oss.attended_pairs(4096, prompt=True) == pytest.approx(18 * 4097 / 2 + 18 * window, rel=1e-12)
    assert oss.attended_pairs(100, prompt=True) == pytest.approx(36 * 101 / 2, rel=1e-12)  # shorter than the window
    assert oss.attended_pairs(3000, prompt=False) == 18 * 3000 + 18 * 128
    assert nxt.attended_pairs(4096, prompt=True) == 12 * 4097 / 2 and nxt.attended_pairs(0, prompt=True) == 0
    with pytest.raises(InputError, match="context"):
        oss.attended_pairs(-1, prompt=False)
    # a long prefill of gpt-oss costs less with its window layers than were every layer full
    h100 = GPUS["h100-80gb"]
    d = Deployment(model=oss, gpu=h100, workload=Workload(prompt_tokens=32768))
    full = Deployment(model=dataclasses.replace(oss, layer_kinds=(), attention_window=0), gpu=h100,
                      workload=Workload(prompt_tokens=32768))
    assert d.rest_seconds(32768, 8, "prefill") < 0.8 * full.rest_seconds(32768, 8, "prefill")


def test_attention_flops_by_hand() -> None:
    """Each (query, key) pair a layer attends costs 2 n_h (score + value) FLOPs, split over the rank's GPUs by
    head: GQA's head_dim twice; MLA's 192 + 128 as prefill runs it, its 576 + 512 latent widths absorbed in decode.
    Checked on a rank whose FLOPs bind (no KV cache read, tiny weights against the pairs, summed over the layers)."""
    from moebalance.cost.time import rest_seconds

    qwen, v3, h100 = get_model("qwen3-30b-a3b"), get_model("deepseek-v3"), GPUS["h100-80gb"]
    assert qwen.architecture().widths(False) == (128, 128) == qwen.architecture().widths(True)
    assert v3.architecture().widths(False) == (192, 128) and v3.architecture().widths(True) == (576, 512)
    engine = EngineMemory(attention_tp=1)
    pairs = 1e12  # far more than the weights' FLOPs
    for spec, absorbed in ((qwen, False), (v3, False), (v3, True)):
        att = spec.architecture()
        score, value = att.widths(absorbed)
        without = rest_seconds(1.0, spec, h100, engine, 8)
        with_pairs = rest_seconds(1.0, spec, h100, engine, 8, attended_per_rank=pairs, absorbed=absorbed)
        want = 2 * att.num_heads * (score + value) * pairs / 989e12
        assert with_pairs == pytest.approx(want, rel=2e-2)  # the weights' FLOPs for one token are far below
        assert with_pairs > without
    # split by head over a rank of 8 GPUs
    split = rest_seconds(1.0, v3, h100, EngineMemory(attention_tp=8), 8, attended_per_rank=pairs, absorbed=True)
    whole = rest_seconds(1.0, v3, h100, engine, 8, attended_per_rank=pairs, absorbed=True)
    assert split == pytest.approx(whole / 8, rel=2e-2)
    # a prefill step's pairs: a prompt of P tokens attends P (P + 1) / 2 pairs a layer, so longer prompts cost more
    d_short = Deployment(model=v3, gpu=h100, workload=Workload(prompt_tokens=1000))
    d_long = Deployment(model=v3, gpu=h100, workload=Workload(prompt_tokens=4000))
    assert d_long.rest_seconds(16384, 8, "prefill") > d_short.rest_seconds(16384, 8, "prefill")


def test_two_batch_overlap_hides_the_lesser_half() -> None:
    """By hand: a layer of 3 ms of experts (slowest GPU) and 2 ms of all-to-all costs 5 ms one after the other and
    3 + 2 / 2 = 4 ms with two-batch overlap; equal parts, 1.5x one of them; the price of a plan follows."""
    v3, h100 = get_model("deepseek-v3"), GPUS["h100-80gb"]
    none = Deployment(model=v3, gpu=h100)
    tbo = Deployment(model=v3, gpu=h100, overlap="tbo")
    expert = np.array([[1e-3, 3e-3], [2e-3, 2e-3]])  # [2 layers, 2 GPUs]
    a2a = np.array([2e-3, 2e-3])
    np.testing.assert_allclose(none.layer_seconds(expert, a2a), [5e-3, 4e-3])
    np.testing.assert_allclose(tbo.layer_seconds(expert, a2a), [4e-3, 3e-3])
    with pytest.raises(InputError, match="overlap 'dbo' is unknown; choose one of: none, tbo"):
        Deployment(model=v3, gpu=h100, overlap="dbo")
    load = read_bundled("deepseek-v3-8x8").select_batches(0, 2)
    plan = make_plan("eplb", load, Cluster(num_nodes=8, gpus_per_node=8), Budget(slots_per_gpu=5))[0]
    slow, fast = price_plan(plan, load, none), price_plan(plan, load, tbo)
    assert fast.modelled_layer_ms < slow.modelled_layer_ms and fast.modelled_goodput > slow.modelled_goodput
    assert fast.modelled_a2a_ms == slow.modelled_a2a_ms  # the all-to-all itself is the same, it hides


def test_a_deployment_says_what_its_prices_assume() -> None:
    v3, h100 = get_model("deepseek-v3"), GPUS["h100-80gb"]
    assert Deployment(model=v3, gpu=h100).describe() == "published peaks, fp8, no overlap, a copy per destination GPU"
    assert Deployment(model=v3, gpu=GPUS["a100-80gb"]).describe().startswith("published peaks, bf16,")  # no FP8 cores
    d = Deployment(model=v3, gpu=h100, precision="served", overlap="tbo", a2a="normal",
                   engine=EngineMemory(kv_bytes=1), calibration=Calibration(launch_us=5.0, source="h100 fit"))
    assert d.describe() == "h100 fit, fp8, fp8 KV cache, two-batch overlap, DeepEP normal kernels"


def test_rest_of_a_step_by_hand_in_both_phases() -> None:
    """Pinned by hand: DeepSeek-V3 in FP8 on an H100, one GPU per data-parallel rank. Prefill of 16,384 tokens of
    4,096-token prompts: 16,384 x 4,097 / 2 causal pairs x 81,920 FLOPs x 61 layers at 989 TFLOP/s (bf16) beside the
    weights' 2 FLOPs per parameter and token at 1,979; decode of 162 tokens at a context of 2,000 reads the KV cache."""
    v3, h100 = get_model("deepseek-v3"), GPUS["h100-80gb"]
    engine = EngineMemory(attention_tp=1)
    d = Deployment(model=v3, gpu=h100, engine=engine, precision="fp8", workload=Workload(prompt_tokens=4096))
    pairs = 16384 * 4097 / 2
    attention = pairs * 2 * 128 * (192 + 128) * 61 / 989e12
    no_attention = rest_seconds(16384, v3, h100, d.engine, 8, logits_per_rank=16384 / 4096, precision="fp8")
    assert d.rest_seconds(16384, 8, "prefill") == pytest.approx(no_attention + attention, rel=1e-9)
    decode = Deployment(model=v3, gpu=h100, engine=engine, precision="fp8",
                        workload=Workload(prompt_tokens=1000, output_tokens=2000))
    kv = 162 * v3.kv_bytes_per_request(2000, 2)
    weights_read = rest_seconds(1, v3, h100, decode.engine, 8, logits_per_rank=0.0, precision="fp8")  # bytes-bound
    assert decode.rest_seconds(162, 8, "decode") == pytest.approx(weights_read + kv / 3.35e12, rel=1e-3)


def test_precision_and_cap_mistakes_are_one_line() -> None:
    v3, h100 = get_model("deepseek-v3"), GPUS["h100-80gb"]
    with pytest.raises(InputError, match=r"engine's weights of 1 bytes disagree with precision 'bf16'"):
        Deployment(model=v3, gpu=h100, engine=EngineMemory(weight_bytes=1), precision="bf16")
    assert Deployment(model=v3, gpu=h100, engine=EngineMemory(weight_bytes=1), precision="fp8").engine.weight_bytes == 1
    with pytest.raises(InputError, match="precision \\['x'\\] is unknown"):
        Deployment(model=v3, gpu=h100, precision=["x"])  # type: ignore[arg-type]
    with pytest.raises(InputError, match="--max-running-requests 7 leaves no request to each of the 8 data-parallel"):
        memory_per_gpu(v3, h100, num_gpus=64, gpus_per_node=8, engine=EngineMemory(max_running_requests=7))


def test_flags_nothing_reads_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    memory = ["cost", "--model", "deepseek-v3", "--gpu", "h100-80gb", "--nodes", 8, "--gpus-per-node", 8]
    for flag, value in (("--overlap", "tbo"), ("--a2a", "normal"), ("--prefill-chunk", 512)):
        assert_user_error([*memory, flag, value], capsys, f"{flag} is used by cost with --plan and --load")
    sglang = str(Path(__file__).parent / "data" / "sglang-deepseek-v3" / "prefill_in1024.json")
    for flag, value in (("--output-tokens", 10), ("--kv-cache-dtype", "fp8"), ("--max-running-requests", 64)):
        assert_user_error(["advise", "--load", sglang, "--nodes", 4, "--gpus-per-node", 8, "--gpu", "h100-80gb",
                           "--phase", "prefill", flag, value], capsys,
                          f"{flag} is used by decode steps, not by --phase prefill")


# ----- tiles, profiles, FP8 calibration -----------------------------------------------------------------------------

def test_tiles_count_each_experts_rows_in_whole_tiles_by_hand() -> None:
    """Tiles of 128 rows: experts of 3 and 130 rows compute 128 + 256 = 384 rows. A compute-bound GPU (prefill
    sizes) pays for its padded rows: 1 expert of 129 rows costs as much FLOP time as 256 rows would, and 128 rows
    no more than one."""
    from moebalance.cost.time import padded_rows

    assert padded_rows(np.array([[3, 130, 0]]), 128).tolist() == [384.0]
    assert padded_rows(np.array([[3, 130, 0]]), 0).tolist() == [133.0]
    v3, h100 = get_model("deepseek-v3"), GPUS["h100-80gb"]
    tiled = Calibration(tile_rows=128)
    flop = 6 * 7168 * 2048 / 989e12  # seconds per row at the peak
    # 4,096 rows: FLOP-bound; 4,097 rows: one more tile of 128 rows
    one, more = expert_seconds(np.array([[4096], [4097]]), v3, h100, tiled)
    assert one == pytest.approx(4096 * flop) and more == pytest.approx(4224 * flop)
    plain = expert_seconds(np.array([[4097]]), v3, h100)
    assert plain[0] == pytest.approx(4097 * flop)
    with pytest.raises(InputError, match="tile_rows"):
        Calibration(tile_rows=-1)


def test_fit_finds_the_tile_where_runs_cross_its_boundaries(tmp_path: Path) -> None:
    """Times made by a tiled roofline (128 rows) at rows around the tile boundaries: the fit recovers the tile and
    the efficiencies; the same model without tiles fits worse."""
    from moebalance.cost.calibrate import fit, read_measurements

    arch, gpu = get_model("deepseek-v3"), get_gpu("h100-80gb")
    truth = Calibration(flops_efficiency=0.5, bandwidth_efficiency=0.8, launch_us=20.0, tile_rows=128)
    lines = ["experts,tokens_per_expert,hidden_size,ffn_size,seconds"]
    for experts in (1, 8, 32):
        for tokens in (1, 16, 127, 128, 129, 255, 256, 257, 383, 385, 1024, 1025, 4096):
            t = float(expert_seconds(np.full((1, experts), tokens), arch, gpu, truth)[0])
            lines.append(f"{experts},{tokens},7168,2048,{t!r}")
    (tmp_path / "m.csv").write_text("\n".join(lines) + "\n")
    got, error, _ = fit(read_measurements(tmp_path / "m.csv"), gpu)
    assert got.tile_rows == 128 and error < 0.02
    assert got.flops_efficiency == pytest.approx(0.5, rel=0.05)


def test_fp8_calibration_takes_shares_of_the_fp8_peak(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """FP8 runs at 60% of the H100's FP8 peak (1,979 TFLOP/s, above its bf16 peak of 989): a bf16 fit cannot reach
    it (it stops at 100% of bf16), an FP8 fit finds 0.6 and records its precision."""
    from moebalance.cost.calibrate import fit, read_measurements

    arch, gpu = get_model("deepseek-v3"), get_gpu("h100-80gb")
    truth = Calibration(flops_efficiency=0.6, bandwidth_efficiency=0.7)
    lines = ["experts,tokens_per_expert,hidden_size,ffn_size,seconds"]
    for experts in (1, 8):
        for tokens in (1, 16, 256, 1024, 4096, 8192):
            t = float(expert_seconds(np.full((1, experts), tokens), arch, gpu, truth, weight_bytes=1,
                                     activation_bytes=1.5, precision="fp8")[0])
            lines.append(f"{experts},{tokens},7168,2048,{t!r}")
    (tmp_path / "m.csv").write_text("\n".join(lines) + "\n")
    got, error, _ = fit(read_measurements(tmp_path / "m.csv"), gpu, precision="fp8")
    assert got.precision == "fp8" and got.flops_efficiency == pytest.approx(0.6, rel=0.05) and error < 0.02
    as_bf16, bf16_error, _ = fit(read_measurements(tmp_path / "m.csv"), gpu)
    assert as_bf16.flops_efficiency == 1.0 and bf16_error > error
    rc, printed, err = run_cli(["calibrate", "--measurements", tmp_path / "m.csv", "--gpu", "h100-80gb",
                                "--precision", "fp8", "--out", tmp_path / "cal.json"], capsys)
    assert rc == 0, err
    assert "of H100-SXM5-80GB's FP8 peak" in printed
    assert json.loads((tmp_path / "cal.json").read_text())["precision"] == "fp8"


def test_shipped_profiles_read_by_name() -> None:
    """Every shipped profile reads back by name with its fit error; an unknown name lists them; a path still reads."""
    from moebalance.cost.calibrate import PROFILES, profile_names, read_calibration

    names = profile_names()
    assert {"h200-torch-bf16", "h800-deepgemm-fp8"} <= set(names)
    for name in names:
        cal, error = read_calibration(name)
        assert cal.source == f"profile {name}" and error is not None and 0 <= error < 0.2
        assert cal.precision in ("bf16", "fp8")
    assert read_calibration(str(PROFILES / "h800-deepgemm-fp8.json"))[0].precision == "fp8"
    with pytest.raises(InputError, match=r"no calibration file or shipped profile 'h100-magic'.*h200-torch-bf16"):
        read_calibration("h100-magic")


def test_calibration_auto_is_the_profile_for_the_gpus_silicon() -> None:
    """``--calibration auto`` (the default): the profile fitted on the GPU (H200), or on one of the same silicon (the
    H800's for the H100: equal bf16 and FP8 peaks and memory bandwidth), else the peaks, named; ``peaks`` asks for
    the peaks."""
    from moebalance.cost.calibrate import read_calibration, resolve_calibration

    h200, h200_error = resolve_calibration(None, "h200")
    assert h200.source == "profile h200-torch-bf16 (auto for h200)" and h200_error is not None
    assert h200.launch_us == read_calibration("h200-torch-bf16")[0].launch_us
    h100, _ = resolve_calibration("auto", "h100-80gb")
    assert h100.source == "profile h800-deepgemm-fp8 (auto for h100-80gb)" and h100.gpu == "h800"
    a100, a100_error = resolve_calibration(None, "a100-80gb")
    assert a100.source == "published peaks (no profile for a100-80gb)" and a100_error is None
    assert a100.flops_efficiency == 1.0 and a100.launch_us == 0.0
    assert resolve_calibration("peaks", "h200") == (Calibration(), None)


def _calibrate_h100(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, prefix: str = "") -> dict:
    """``calibrate`` on times the roofline makes on the H100 with 50% of its FLOP/s, 80% of its bandwidth and 20 us
    per call, written to ``name``.csv (after ``prefix``); the calibration's JSON."""
    arch, gpu = get_model("deepseek-v3"), get_gpu("h100-80gb")
    truth = Calibration(flops_efficiency=0.5, bandwidth_efficiency=0.8, launch_us=20.0)
    lines = ["experts,tokens_per_expert,hidden_size,ffn_size,seconds"]
    lines += [f"{u},{n},7168,2048,{float(gemm_seconds(u * n, u, arch, gpu, truth))!r}"
              for u in (1, 8) for n in (1, 16, 256, 2048)]
    (tmp_path / f"{name}.csv").write_text(prefix + "\n".join(lines) + "\n", encoding="utf-8")
    rc, _, err = run_cli(["calibrate", "--measurements", tmp_path / f"{name}.csv", "--gpu", "h100-80gb", "--out",
                          tmp_path / f"{name}.json"], capsys)
    assert rc == 0, err
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_calibrate_reads_a_csv_with_a_byte_order_mark(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """A CSV saved with a UTF-8 BOM (as spreadsheet programs write it) was refused: "lacks column 'experts'"."""
    with_bom = _calibrate_h100(tmp_path, capsys, "bom", prefix="\ufeff")
    assert (tmp_path / "bom.csv").read_bytes()[:3] == b"\xef\xbb\xbf"
    plain = _calibrate_h100(tmp_path, capsys, "plain")
    assert with_bom["source"] == "fitted to bom.csv on h100-80gb" and with_bom["gpu"] == "h100-80gb"
    assert {**with_bom, "source": ""} == {**plain, "source": ""}
    assert with_bom["flops_efficiency"] == pytest.approx(0.5, rel=0.05)
    assert with_bom["bandwidth_efficiency"] == pytest.approx(0.8, rel=0.05)


def test_a_calibration_prices_only_the_gpu_it_was_fitted_on(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """A calibration fitted on the H100 priced an H200 without a word. It prices its GPU and one of the same silicon
    (the H800); another is refused naming both GPUs, unless --calibration-any-gpu, and then the output says so. A file
    that records no GPU (older ones) prices any."""
    assert _calibrate_h100(tmp_path, capsys, "m")["gpu"] == "h100-80gb"
    cal = tmp_path / "m.json"
    base = ["cost", "--model", "olmoe-1b-7b", "--nodes", 1, "--gpus-per-node", 8, "--calibration", cal]
    for gpu in ("h100-80gb", "h800"):
        rc, text, err = run_cli([*base, "--gpu", gpu, "--json"], capsys)
        assert rc == 0, err
        assert json.loads(text)["calibration"] == "fitted to m.csv on h100-80gb"
    assert_user_error([*base, "--gpu", "h200"], capsys, "fitted on GPU h100-80gb", "--gpu h200",
                      "--calibration-any-gpu")
    rc, text, err = run_cli([*base, "--gpu", "h200", "--calibration-any-gpu", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(text)["calibration"] == \
        "fitted to m.csv on h100-80gb (from another GPU: fitted on h100-80gb, priced for h200)"
    rc, text, err = run_cli([*base, "--gpu", "h200", "--calibration-any-gpu"], capsys)
    assert rc == 0 and "from another GPU" in text, err
    # the deployment a table names (compare's title)
    rc, text, err = run_cli(["compare", "--load", "bundled:olmoe-1b-7b-tokens", "--policies", "contiguous",
                             "--nodes", 2, "--gpus-per-node", 4, "--slots-per-gpu", 8, "--gpu", "h200",
                             "--attention-tp", 1, "--calibration", cal, "--calibration-any-gpu"], capsys)
    assert rc == 0 and "fitted on h100-80gb, priced for h200" in " ".join(text.split()), err
    # a shipped profile is bound to its GPU too; the flag needs a --calibration, and a deployment
    assert_user_error(["cost", "--model", "olmoe-1b-7b", "--nodes", 1, "--gpus-per-node", 8, "--gpu", "h100-80gb",
                       "--calibration", "h200-torch-bf16"], capsys, "h200", "h100-80gb")
    assert_user_error(["cost", "--model", "olmoe-1b-7b", "--nodes", 1, "--gpus-per-node", 8, "--gpu", "h200",
                       "--calibration-any-gpu"], capsys, "--calibration-any-gpu", "--calibration FILE")
    assert_user_error(["compare", "--load", "bundled:olmoe-1b-7b-tokens", "--policies", "contiguous", "--nodes", 2,
                       "--gpus-per-node", 4, "--slots-per-gpu", 8, "--calibration-any-gpu"], capsys,
                      "--calibration-any-gpu", "--gpu")
    # older files record no GPU: the one committed with the GPU check results still prices any GPU
    old = Path(__file__).parents[1] / "docs/results/gpu/calibration.json"
    assert "gpu" not in json.loads(old.read_text())
    rc, text, err = run_cli([*base[:-1], old, "--gpu", "a100-80gb", "--json"], capsys)
    assert rc == 0 and json.loads(text)["calibration"] == "fitted to gemm_grouped_mm.csv on h200", err


def test_a_gpu_prices_its_own_nodes_link_by_default() -> None:
    """``--gpu`` without ``--intra-link`` takes the link of the node the GPU is sold in (its spec's ``intra_link``):
    NVLink 5's 900 GB/s each way for a B200 or GB200, AMD's xGMI for the MI300X (448) and MI355X (537.6), the H800's
    NVLink (160, DeepEP's figure), PCIe 4.0 for the RTX 4090 (32), NVLink 3 for the A100 (300), NVLink 4 for the
    H100 and H200 (450); a given ``--intra-link`` wins."""
    import argparse
    import dataclasses

    from moebalance.app.options import links

    want = {"b200": 900.0, "gb200": 900.0, "mi300x": 448.0, "mi355x": 537.6, "h800": 160.0, "rtx4090": 32.0,
            "a100-80gb": 300.0, "h100-80gb": 450.0, "h200": 450.0}
    for gpu, gbs in want.items():
        args = argparse.Namespace(gpu=gpu, calibration="peaks", calibration_any_gpu=None, intra_link=None,
                                  inter_link=None)
        assert links(args)["intra_node_bandwidth"] == gbs, gpu
    args = argparse.Namespace(gpu="b200", calibration="peaks", calibration_any_gpu=None, intra_link=64.0,
                              inter_link=None)
    assert links(args)["intra_node_bandwidth"] == 64.0
    with pytest.raises(InputError, match="intra_link 'nvlink9' is not a link preset"):
        dataclasses.replace(get_gpu("b200"), intra_link="nvlink9")
