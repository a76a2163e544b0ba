"""Published peak numbers of the GPUs the cost model knows, each with its source.

``bf16_tflops`` is the dense BF16 tensor-core peak (no structured sparsity), ``memory_gib`` the datasheet's memory
capacity (taken as GiB; the driver reports a little less), ``memory_bandwidth`` the peak device-memory bandwidth in
GB/s. These are peaks: a calibration measured on a real GPU (``moebalance calibrate``) scales them. Where a vendor
publishes a system's totals (HGX B200, GB200 NVL72) or only peaks with structured sparsity, the entry divides them
(per GPU; dense is half the sparse peak) and says so.

A GPU's links are not part of its spec: the scale-up link inside a node is a preset of
:data:`moebalance.core.cluster.LINK_PRESETS` (``--intra-link``: ``nvlink5`` for the B200 and GB200, ``xgmi-mi300x``,
``xgmi-mi355x``) and the scale-up domain is ``--gpus-per-node`` (8 on an HGX or AMD Instinct platform, 72 in a
GB200 NVL72 rack), as each entry's comment says.

Each GPU records its ``vendor``: DeepEP's all-to-all kernels (``--a2a normal|low-latency|auto``) run on NVIDIA GPUs
only (https://github.com/deepseek-ai/DeepEP, README, "Requirements": SM90 GPUs or architectures with SM90 PTX ISA
support, CUDA 12.3 or later, NVLink with CUDA peer access between the node's GPUs, RDMA across nodes), so on an AMD
GPU, which serves under ROCm with other kernels, a deployment prices ``--a2a per-gpu`` alone
(:func:`moebalance.cost.a2a.kernels_on`). Which NVIDIA architectures a DeepEP release supports is not checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from moebalance.core.cluster import LINK_PRESETS
from moebalance.core.errors import InputError
from moebalance.models.fields import check_fields

__all__ = ["GPUS", "VENDORS", "GpuSpec", "get_gpu"]

#: The vendors a GPU is made by (:attr:`GpuSpec.vendor`), each with its name in words.
VENDORS = {"nvidia": "NVIDIA", "amd": "AMD"}


@dataclass(kw_only=True, frozen=True, slots=True)
class GpuSpec:
    """One GPU model's peaks. Example: ``GPUS["h100-80gb"].bf16_tflops == 989.0``."""

    name: str
    display_name: str
    #: Dense BF16 tensor-core peak, TFLOP/s.
    bf16_tflops: float
    #: Device memory, GiB.
    memory_gib: float
    #: Peak device-memory bandwidth, GB/s.
    memory_bandwidth: float
    #: Where the numbers come from.
    source: str
    #: Dense FP8 tensor-core peak, TFLOP/s; ``None``: the GPU has no FP8 tensor cores.
    fp8_tflops: float | None = None
    #: The :data:`moebalance.core.cluster.LINK_PRESETS` name of its link inside the node it is sold in: the intra-node
    #: bandwidth a command prices with ``--gpu`` unless given ``--intra-link`` (or a calibration's measured link).
    intra_link: str = "nvlink4"
    #: Who makes it, a key of :data:`VENDORS`: ``nvidia`` (CUDA; DeepEP's kernels run on it) or ``amd`` (ROCm; they
    #: do not: module docstring).
    vendor: str = "nvidia"
    #: Its compute architecture as engines' checks name it (CUDA ``sm80``, ROCm ``gfx942``); empty: not recorded.
    arch: str = ""

    def __post_init__(self) -> None:
        check_fields(self, text=("name", "display_name", "source"),
                     positive_reals=("bf16_tflops", "memory_gib", "memory_bandwidth"), choices={"vendor": tuple(VENDORS)})
        if self.intra_link not in LINK_PRESETS:
            raise InputError(f"GPU {self.name}: intra_link {self.intra_link!r} is not a link preset; choose one of: "
                             f"{', '.join(LINK_PRESETS)}")
        if self.fp8_tflops is not None:
            check_fields(self, positive_reals=("fp8_tflops",))

    def peak_tflops(self, precision: str) -> float:
        """The dense tensor-core peak of ``precision`` (``bf16`` or ``fp8``), TFLOP/s; FP8 on a GPU without FP8
        tensor cores is a one-line :class:`InputError`."""
        if precision == "bf16":
            return self.bf16_tflops
        if precision != "fp8":
            raise InputError(f"precision {precision!r} is unknown; choose bf16 or fp8")
        if self.fp8_tflops is None:
            raise InputError(f"{self.display_name} has no FP8 tensor cores; give --precision bf16")
        return self.fp8_tflops


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    # A100 SXM 80GB: BF16 tensor 312 TFLOPS dense (624 with sparsity), HBM2e 80 GB, 2,039 GB/s; no FP8.
    GpuSpec(name="a100-80gb", intra_link="nvlink3", display_name="A100-SXM4-80GB", bf16_tflops=312.0, memory_gib=80.0,
            memory_bandwidth=2039.0, source="NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB column)", arch="sm80"),
    # H100 SXM 80GB: BF16 tensor 1,979 TFLOPS with sparsity -> 989 dense, FP8 3,958 -> 1,979 dense, HBM3 80 GB,
    # 3.35 TB/s.
    GpuSpec(name="h100-80gb", arch="sm90", display_name="H100-SXM5-80GB", bf16_tflops=989.0, memory_gib=80.0,
            memory_bandwidth=3350.0, fp8_tflops=1979.0,
            source="NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column)"),
    # H800 SXM 80GB (the H100's export variant: the same tensor cores and HBM3, a narrower NVLink): BF16 989 dense,
    # FP8 1,979 dense, 80 GB, 3.35 TB/s. Its NVLink is the link preset nvlink-h800.
    GpuSpec(name="h800", intra_link="nvlink-h800", display_name="H800-SXM5-80GB", bf16_tflops=989.0, memory_gib=80.0,
            memory_bandwidth=3350.0, fp8_tflops=1979.0,
            source="NVIDIA H800 Tensor Core GPU datasheet (H800 SXM column)", arch="sm90"),
    # H200 SXM: BF16 tensor 1,979 TFLOPS with sparsity -> 989 dense, FP8 3,958 -> 1,979 dense, HBM3e 141 GB,
    # 4.8 TB/s.
    GpuSpec(name="h200", arch="sm90", display_name="H200-SXM-141GB", bf16_tflops=989.0, memory_gib=141.0,
            memory_bandwidth=4800.0, fp8_tflops=1979.0,
            source="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column)"),
    # B200 (HGX B200, 8 GPUs): BF16 tensor 36 PFLOPS with sparsity in all -> 2.25 PFLOPS dense per GPU, FP8 72
    # PFLOPS with sparsity -> 4.5 dense per GPU, 1.4 TB HBM3e in all -> 180 GB per GPU, 64 TB/s in all -> 8 TB/s.
    # NVLink 14.4 TB/s in all -> 1.8 TB/s per GPU, both directions: the link preset nvlink5.
    GpuSpec(name="b200", intra_link="nvlink5", display_name="B200-180GB", bf16_tflops=2250.0, memory_gib=180.0,
            memory_bandwidth=8000.0, fp8_tflops=4500.0,
            source="NVIDIA HGX B200 specifications (8-GPU totals divided by 8)", arch="sm100"),
    # GB200 (one of the two Blackwell GPUs of a GB200 Grace Blackwell Superchip): the superchip's FP16/BF16 tensor 10
    # PFLOPS with sparsity -> 2.5 PFLOPS dense per GPU, FP8 20 PFLOPS with sparsity -> 5 dense per GPU, up to 372 GB
    # HBM3e -> 186 GB per GPU, 16 TB/s -> 8 TB/s per GPU. NVLink 3.6 TB/s per superchip -> 1.8 TB/s per GPU, both
    # directions: the link preset nvlink5; a GB200 NVL72 rack is one NVLink domain of 72 GPUs (--gpus-per-node 72).
    GpuSpec(name="gb200", intra_link="nvlink5", display_name="GB200 (per GPU)", bf16_tflops=2500.0, memory_gib=186.0,
            memory_bandwidth=8000.0, fp8_tflops=5000.0,
            source="NVIDIA GB200 NVL72 specifications (GB200 Grace Blackwell Superchip column, divided by its 2 GPUs)",
            arch="sm100"),
    # AMD Instinct MI300X: peak BF16 1,307.4 TFLOPS dense (2,614.9 with sparsity), FP8 2,614.9 dense (5,229.8 with
    # sparsity), 192 GB HBM3, 5.3 TB/s. 7 AMD Infinity Fabric links of 128 GB/s peak each (both directions): 448
    # GB/s per direction in all, the link preset xgmi-mi300x; an 8-GPU platform, each GPU linked to the 7 others.
    GpuSpec(name="mi300x", intra_link="xgmi-mi300x", display_name="Instinct MI300X", bf16_tflops=1307.4, memory_gib=192.0,
            memory_bandwidth=5300.0, fp8_tflops=2614.9, source="AMD Instinct MI300X accelerator datasheet",
            vendor="amd", arch="gfx942"),
    # AMD Instinct MI355X: peak BF16 2.5 PFLOPS dense (5 with sparsity), FP8 5 PFLOPS dense (10.1 with sparsity),
    # 288 GB HBM3E, 8 TB/s. 7 AMD Infinity Fabric links of 153.6 GB/s peak each (both directions): 537.6 GB/s per
    # direction in all, the link preset xgmi-mi355x; an 8-GPU platform, each GPU linked to the 7 others.
    GpuSpec(name="mi355x", intra_link="xgmi-mi355x", display_name="Instinct MI355X", bf16_tflops=2500.0, memory_gib=288.0,
            memory_bandwidth=8000.0, fp8_tflops=5000.0, source="AMD Instinct MI355X GPU datasheet", vendor="amd",
            arch="gfx950"),
    # GeForce RTX 4090: BF16 tensor with FP32 accumulate 165.2 TFLOPS dense (330.4 with sparsity), FP8 with FP32
    # accumulate 330.3 dense (660.6 with sparsity), 24 GB GDDR6X, 1,008 GB/s.
    GpuSpec(name="rtx4090", intra_link="pcie4", display_name="GeForce RTX 4090", bf16_tflops=165.2, memory_gib=24.0,
            memory_bandwidth=1008.0, fp8_tflops=330.3,
            source="NVIDIA Ada Lovelace GPU architecture whitepaper, Appendix A (RTX 4090)", arch="sm89"),
)}


def get_gpu(name: str) -> GpuSpec:
    """The GPU called ``name`` (a key of :data:`GPUS`); an unknown name raises :class:`InputError`."""
    spec = GPUS.get(name)
    if spec is None:
        raise InputError(f"unknown GPU {name!r}; known GPUs: {', '.join(sorted(GPUS))}")
    return spec
