"""The expert-parallel cluster: nodes, GPUs per node, and the links between GPUs.

``G = num_nodes * gpus_per_node`` GPUs; GPU ``g`` is on node ``g // gpus_per_node``. Bandwidths are per GPU
and per direction, in GB/s, and are used to turn all-to-all traffic into time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.core.errors import InputError
from moebalance.core.limits import check_alloc

__all__ = ["LINK_PRESETS", "Cluster"]

#: Per-GPU, per-direction link bandwidths in GB/s.
LINK_PRESETS: dict[str, float] = {
    # NVLink 4 (H100 SXM): 900 GB/s bidirectional per GPU -> 450 GB/s each way.
    # NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/
    "nvlink4": 450.0,
    # NVLink on the H800 (its export variant of NVLink 4): about 160 GB/s achievable per direction, as DeepEP's README
    # states for the H800s its kernel tables were measured on (https://github.com/deepseek-ai/DeepEP).
    "nvlink-h800": 160.0,
    # NVLink 5 (B200, GB200): 1.8 TB/s bidirectional per GPU -> 900 GB/s each way (NVIDIA GB200 NVL72 specifications:
    # 130 TB/s over 72 GPUs; HGX B200: 14.4 TB/s over 8).
    "nvlink5": 900.0,
    # AMD Infinity Fabric (xGMI) of the MI300X: 7 links of 128 GB/s peak, both directions -> 7 x 64 = 448 GB/s each
    # way in all, 64 GB/s of it to each of the 7 other GPUs of the 8-GPU platform (AMD Instinct MI300X datasheet).
    "xgmi-mi300x": 448.0,
    # AMD Infinity Fabric of the MI355X: 7 links of 153.6 GB/s peak, both directions -> 537.6 GB/s each way in all
    # (AMD Instinct MI355X datasheet).
    "xgmi-mi355x": 537.6,
    # NVLink 3 (A100 SXM): 600 GB/s bidirectional -> 300 GB/s each way.
    # NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/
    "nvlink3": 300.0,
    # PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b -> about 63 GB/s per direction, rounded to 64
    # (PCI-SIG PCI Express Base Specification 5.0: 32 GT/s per lane, 128b/130b encoding).
    "pcie5": 64.0,
    # PCIe 4.0 x16: 16 GT/s x 16 lanes -> about 32 GB/s per direction (PCI Express Base Spec. 4.0). GRACE-MoE
    # Section 5.1 quotes 63 GB/s per direction for its RTX 4090 servers' PCIe 4.0 x16, which is the
    # PCIe 5.0 figure (or both directions); we keep the specification's number.
    "pcie4": 32.0,
    # InfiniBand NDR, one 400 Gb/s NIC per GPU: 50 GB/s per direction (NVIDIA ConnectX-7).
    "ib-ndr400": 50.0,
    # AWS EFA on p4de.24xlarge: 400 Gb/s per instance over 8 GPUs -> 6.25 GB/s per GPU
    # (the cluster of CRAFT Section 3.1; https://aws.amazon.com/ec2/instance-types/p4/).
    "efa-p4d": 6.25,
    # RoCE / Ethernet, one 200 Gb/s NIC per GPU: 200 / 8 = 25 GB/s per direction
    # (200GbE, IEEE 802.3bs; e.g. NVIDIA ConnectX-6 Dx adapters).
    "eth200": 25.0,
    # 25 Gb Ethernet, one NIC per server (GRACE-MoE Section 5.1's cluster): 25 / 8 = 3.125 GB/s per
    # direction, to be divided among the GPUs of a node that share it (the time model has per-GPU links).
    "eth25": 3.125,
}


@dataclass(kw_only=True, frozen=True, slots=True)
class Cluster:
    """A cluster of ``num_nodes`` nodes with ``gpus_per_node`` GPUs each.

    Example: ``Cluster(num_nodes=2, gpus_per_node=4)`` has GPUs 0-3 on node 0 and 4-7 on node 1.
    """

    num_nodes: int
    gpus_per_node: int
    #: GB/s per GPU and direction between GPUs of one node (default NVLink 4).
    intra_node_bandwidth: float = LINK_PRESETS["nvlink4"]
    #: GB/s per GPU and direction between nodes (default one 400 Gb/s NIC per GPU).
    inter_node_bandwidth: float = LINK_PRESETS["ib-ndr400"]

    def __post_init__(self) -> None:
        for name in ("num_nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise InputError(f"{name} ({value!r}) must be a positive integer")
            object.__setattr__(self, name, int(value))
        # scoring and the traffic models build [G, G] link matrices (link_kind, bandwidth_matrix)
        check_alloc((self.num_gpus, self.num_gpus), 8, f"the link matrix [G, G] of {self.num_nodes:,} nodes x "
                    f"{self.gpus_per_node:,} GPUs", "use fewer nodes or GPUs per node")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            value = getattr(self, name)
            if not np.isfinite(value) or value <= 0:
                raise InputError(f"{name} ({value!r}) must be a positive number of GB/s")

    @property
    def num_gpus(self) -> int:
        """``G``, the number of GPUs (expert-parallel ranks)."""
        return self.num_nodes * self.gpus_per_node

    def node_of(self) -> np.ndarray:
        """``int64 [G]``: the node of each GPU. For 2 nodes x 2 GPUs: ``[0, 0, 1, 1]``."""
        return np.arange(self.num_gpus, dtype=np.int64) // self.gpus_per_node

    def link_kind(self) -> np.ndarray:
        """``int8 [G, G]``: 0 for the same GPU, 1 for two GPUs of one node, 2 across nodes."""
        node = self.node_of()
        kind = np.where(node[:, None] == node[None, :], 1, 2).astype(np.int8)
        np.fill_diagonal(kind, 0)
        return kind

    def bandwidth_matrix(self) -> np.ndarray:
        """``float64 [G, G]`` GB/s from GPU ``g1`` to ``g2``; ``inf`` on the diagonal (local copies)."""
        kind = self.link_kind()
        bw = np.where(kind == 1, self.intra_node_bandwidth, self.inter_node_bandwidth).astype(np.float64)
        np.fill_diagonal(bw, np.inf)
        return bw

    def to_dict(self) -> dict[str, int]:
        """The plan-file form (docs/design.md, "Data formats"): ``{"num_nodes": N, "gpus_per_node": M}``."""
        return {"num_nodes": self.num_nodes, "gpus_per_node": self.gpus_per_node}
