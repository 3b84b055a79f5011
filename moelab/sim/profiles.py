"""Cluster profiles: each paper's testbed as data, with where every number came from.

A profile gives the simulator what it prices plans with: GPUs per node and nodes, the GEMM
throughput compute is charged at, and two link classes (``intra``: per GPU, per direction, inside
a node; ``inter``: the node's NIC(s) together, per direction). ``nics_per_node`` says how that
bandwidth is cut: :func:`moelab.comm.costs.link_capacities` makes ``nics_per_node`` NICs of
``inter_bw_GBps / nics_per_node`` each, with the node's GPUs attached in contiguous blocks (1: one
NIC shared by all GPUs; ``gpus_per_node``: one NIC per GPU, as the link emulator declares; 0, for
single-node profiles, counts as 1), so a GPU alone on the network gets its own NIC's share, not the
node's total, and ring collectives run one channel per NIC. ``links`` keeps finer per-link detail
where a paper gives it (FasterMoE's AE topology); the class bandwidths are then *derived* from it
and the derivation is written in ``sources``. Numbers a paper does not give
are labelled ``[assumption]`` in ``sources`` so a notebook can print them next to its figure.
"""
from __future__ import annotations

import dataclasses
import os
import platform
from dataclasses import dataclass, field
from typing import Optional

from moelab.comm.topology import Topology

GB = 1e9


@dataclass(frozen=True)
class ClusterProfile:
    name: str
    nodes: int
    gpus_per_node: int
    gpu: str
    peak_flops: float  # FLOP/s per GPU at the precision of the paper's runs
    achieved_flops: float  # GEMM FLOP/s compute is charged at (calibrated, or peak x assumed efficiency)
    intra_bw_GBps: float  # per GPU, per direction, inside a node
    intra_latency_us: float  # per collective step inside a node
    inter_bw_GBps: float  # per node (all its NICs together), per direction
    inter_latency_us: float  # per collective step across nodes
    mem_GB: float  # memory per GPU
    nics_per_node: int = 1  # NICs sharing inter_bw_GBps equally; GPUs attach in contiguous blocks
    elem_bytes: int = 2  # bytes per activation element in the paper's runs (fp16 = 2, fp32 = 4)
    links: Optional[dict] = None  # per-link detail, GB/s per direction, where the paper gives it
    fits: dict = field(default_factory=dict)  # measured alpha-beta per collective: {op: (alpha_s, beta_s_per_byte)}
    one_host: bool = False  # every declared node is the same host (loopback): the fits hold across them too
    shared_cores: float = 0  # >0: all ranks run on one host with this many cores, compute shares them
    op_overhead_s: float = 0.0  # fixed seconds per compute op (interpreter / kernel launch), fitted where measured
    call_overhead_s: float = 0.0  # fixed seconds per collective call beyond its alpha-beta line, fitted where measured
    phase_overhead_s: float = 0.0  # >0: a phased call (SAA) pays this per phase instead, measured where used
    emulated_sync_s: Optional[float] = None  # a number: EMULATED links, fixed costs beside link time (OpGraph.transfer)
    busy_call_overhead_s: Optional[float] = None  # a number: call_overhead_s of a call issued while the ranks compute
    busy_emulated_sync_s: Optional[float] = None  # ... and its emulated_sync_s (both measured with compute beside)
    software_on_cores: bool = False  # shared_cores and EMULATED links: a call's fixed costs are CPU work on those cores
    cpu_s_per_byte: float = 0.0  # ... and each byte a rank sends or receives costs it this much CPU (held out)
    # "ring" (gloo, the emulator) | "nccl": per message the faster of ring and a latency-optimal schedule (sim/costs.py)
    allreduce: str = "ring"
    extra: dict = field(default_factory=dict)  # paper constants that are not link/compute numbers
    sources: dict = field(default_factory=dict)  # field -> spec section / paper sentence / [assumption]
    notes: str = ""

    def __hash__(self):  # the dict fields make the generated hash fail; name + shape identify a profile
        return hash((self.name, self.nodes, self.gpus_per_node))

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def topology(self) -> Topology:
        return Topology(self.world_size, self.gpus_per_node)

    def with_nodes(self, nodes: int) -> "ClusterProfile":
        """The same testbed with another node count (Parm B at 2/4/8 nodes, Hecate at 16/32 GPUs)."""
        return dataclasses.replace(self, nodes=int(nodes))

    def with_efficiency(self, efficiency: float, source: str = "") -> "ClusterProfile":
        """The same testbed with compute charged at ``efficiency`` of its peak (a reproduction's assumption sets
        it: the profile's own value is a default); ``source`` says where the value comes from."""
        return dataclasses.replace(self, achieved_flops=_eff(self.peak_flops, efficiency), sources={
            **self.sources, "achieved_flops": source or f"{efficiency:g} of peak"})

    def bandwidth(self, link_class: str) -> float:
        """Bytes/s of one link of the class (``local`` copies are free: inf)."""
        if link_class == "local":
            return float("inf")
        return (self.intra_bw_GBps if link_class == "intra" else self.inter_bw_GBps) * GB

    def latency(self, link_class: str) -> float:
        """Seconds per collective step over the class."""
        if link_class == "local":
            return 0.0
        return (self.intra_latency_us if link_class == "intra" else self.inter_latency_us) * 1e-6

    def describe(self) -> str:
        return (f"{self.name}: {self.nodes} x {self.gpus_per_node} {self.gpu}, "
                f"{self.achieved_flops / 1e12:.1f}/{self.peak_flops / 1e12:.1f} TFLOP/s achieved/peak, "
                f"intra {self.intra_bw_GBps:g} GB/s, inter {self.inter_bw_GBps:g} GB/s per node")


def _eff(peak: float, eff: float) -> float:
    return peak * eff


_ASSUMED_LAT = "[assumption] typical NCCL per-step latency; fit it where a measurement exists"
_NCCL_ALLREDUCE = ("[assumption] the paper's runs use NCCL, whose tuner picks between its ring and its tree "
                   "(log-depth latency, hierarchical across nodes); priced as the faster of ring and halving-doubling")

HECATE_A = ClusterProfile(
    name="hecate_A", nodes=4, gpus_per_node=8, gpu="V100-SXM2-32GB",
    peak_flops=125e12, achieved_flops=_eff(125e12, 0.5),
    intra_bw_GBps=300.0, intra_latency_us=5.0, inter_bw_GBps=12.5, inter_latency_us=20.0,
    allreduce="nccl", mem_GB=32.0, nics_per_node=1, elem_bytes=2,
    sources={
        "allreduce": _NCCL_ALLREDUCE,
        "nodes": "hecate.md §4: 'Cluster A = 4x AWS p3dn.24xlarge: 8x V100-32GB per node'",
        "peak_flops": "hecate.md §4 calibration plan: dense fp16 peak 125 TFLOPs (V100)",
        "achieved_flops": "[assumption] 50% of peak until calibrated (hecate.md §4 step 1)",
        "intra_bw_GBps": "hecate.md §4: '300 GB/s NVLink' (nominal per-GPU figure, used as given)",
        "inter_bw_GBps": "hecate.md §4: '100 Gbps between nodes' = 12.5 GB/s per-node NIC",
        "intra_latency_us": _ASSUMED_LAT, "inter_latency_us": _ASSUMED_LAT,
        "mem_GB": "hecate.md §4: V100-32GB", "elem_bytes": "hecate.md §2.9: beta_act = 2 (fp16)",
    },
    notes="p3dn.24xlarge. Efficiency and alpha are to be fitted to EP's 5.18x ratio (hecate.md §4).")

HECATE_B = ClusterProfile(
    name="hecate_B", nodes=4, gpus_per_node=8, gpu="A100-SXM4-40GB",
    peak_flops=312e12, achieved_flops=_eff(312e12, 0.5),
    intra_bw_GBps=600.0, intra_latency_us=5.0, inter_bw_GBps=50.0, inter_latency_us=20.0,
    allreduce="nccl", mem_GB=40.0, nics_per_node=4, elem_bytes=2,
    sources={
        "allreduce": _NCCL_ALLREDUCE,
        "nodes": "hecate.md §4: 'Cluster B = 4x p4d.24xlarge: 8x A100-40GB'",
        "peak_flops": "hecate.md §4 calibration plan: dense fp16 peak 312 TFLOPs (A100)",
        "achieved_flops": "[assumption] 50% of peak until calibrated",
        "intra_bw_GBps": "hecate.md §4: '600 GB/s NVSwitch' (nominal, used as given)",
        "inter_bw_GBps": "hecate.md §4: '400 Gbps between nodes' = 50 GB/s per node (4 x 100 Gb/s EFA)",
        "nics_per_node": "p4d.24xlarge has 4 x 100 Gb/s EFA adapters (400 Gb/s total)",
        "intra_latency_us": _ASSUMED_LAT, "inter_latency_us": _ASSUMED_LAT,
        "mem_GB": "hecate.md §4: A100-40GB", "elem_bytes": "hecate.md §2.9: beta_act = 2 (fp16)",
    })

# johnny: uniform intra-node all-to-all of b bytes per pair. Each GPU ships 7b over its own
# 11 GB/s PCIe link (0.636 b/GB/s), but 4 GPUs x 4 cross-socket peers push 16b through the 22.5 GB/s
# QPI (0.711 b/GB/s), which binds: per-GPU effective = 7 / 0.711 = 9.84 GB/s.
JOHNNY = ClusterProfile(
    name="fastermoe_johnny", nodes=2, gpus_per_node=8, gpu="V100-PCIe",
    peak_flops=14e12, achieved_flops=11.5e12,
    intra_bw_GBps=7 * 22.5 / 16, intra_latency_us=10.0, inter_bw_GBps=6.25, inter_latency_us=20.0,
    allreduce="nccl", mem_GB=16.0, nics_per_node=1, elem_bytes=4,
    links={"gpu-socket (PCIe)": 11.0, "socket1-nic (QPI)": 22.5, "socket0-nic": float("inf"),
           "nic-switch": 6.25},
    extra={"P_code": 11.5e12},
    sources={
        "allreduce": _NCCL_ALLREDUCE,
        "nodes": "fastermoe.md §2.2 johnny: 2 nodes under a root switch, 4 GPUs per socket x 2 sockets",
        "peak_flops": "V100-PCIe fp32 vendor peak 14 TFLOP/s",
        "achieved_flops": "fastermoe.md §2.2: code uses P = 11.5e12 FLOP/s for V100-PCIe fp32",
        "intra_bw_GBps": "derived from fastermoe.md §2.2 links: uniform a2a is QPI-bound, 7*22.5/16 GB/s per GPU",
        "inter_bw_GBps": "fastermoe.md §2.2: NIC<->switch 50 Gb/s (6.25 GB/s); §4: EDR cut to 50 Gb/s",
        "links": "fastermoe.md §2.2 johnny preset (AE toposim create_pcie_gpu_cluster)",
        "intra_latency_us": _ASSUMED_LAT, "inter_latency_us": _ASSUMED_LAT,
        "mem_GB": "[assumption] V100-PCIe memory not stated (16 GB variant)",
        "elem_bytes": "fastermoe.md §2.0: s = 4 (fp32 everywhere)",
    })

# trevor: 4 V100-SXM2 on an NVLink ring; uniform intra-node a2a is bound by the slowest pair
# (0,2)/(1,3) at 88 Gb/s = 11 GB/s, so the per-GPU class bandwidth is 3 x 11 = 33 GB/s.
_TREVOR_LINKS = {"gpu0-gpu1": 317 / 8, "gpu2-gpu3": 317 / 8, "gpu0-gpu3": 171 / 8, "gpu1-gpu2": 171 / 8,
                 "gpu0-gpu2": 88 / 8, "gpu1-gpu3": 88 / 8, "gpu0-nic": 55 / 8, "gpu1-nic": 55 / 8,
                 "gpu2-nic": 62 / 8, "gpu3-nic": 62 / 8, "nic-switch": 62 / 8}
TREVOR = ClusterProfile(
    name="fastermoe_trevor", nodes=16, gpus_per_node=4, gpu="V100-SXM2",
    peak_flops=15.7e12, achieved_flops=0.9 * 15.7e12,
    intra_bw_GBps=3 * 88 / 8, intra_latency_us=5.0, inter_bw_GBps=62 / 8, inter_latency_us=20.0,
    allreduce="nccl", mem_GB=16.0, nics_per_node=1, elem_bytes=4, links=_TREVOR_LINKS,
    sources={
        "allreduce": _NCCL_ALLREDUCE,
        "nodes": "fastermoe.md §2.2/§4 trevor: 16 nodes x 4 V100-SXM2 = 64 GPUs",
        "peak_flops": "V100-SXM2 fp32 vendor peak 15.7 TFLOP/s",
        "achieved_flops": "fastermoe.md §2.2 [R]: 0.9 x 15.7 TFLOP/s",
        "intra_bw_GBps": "derived from fastermoe.md §2.2 links: slowest pair 88 Gb/s binds uniform a2a, 3 x 11 GB/s",
        "inter_bw_GBps": "fastermoe.md §2.2: NIC<->switch 62 Gb/s (AE code); the paper text (§4) says 100 Gb/s EDR",
        "links": "fastermoe.md §2.2 trevor preset (AE toposim create_nvlink_cluster), Gb/s / 8",
        "intra_latency_us": _ASSUMED_LAT, "inter_latency_us": _ASSUMED_LAT,
        "mem_GB": "[assumption] V100-SXM2 memory not stated (16 GB variant)",
        "elem_bytes": "fastermoe.md §2.0: s = 4 (fp32 everywhere)",
    })

# Parm's testbeds: the intra-node link is derived from the paper's one quoted fit (Fig. 6, AG_MP; seconds and
# seconds per output element, taken at n = 4 ranks: parm.md §2.10(a, b)), kept here once, in ``extra``
# (moelab.strategies.parm.perf_model.paper_fits reads it there). Compute: the spec's default efficiency, a default
# only: Parm's reproduction sets it from experiments/parm/assumptions.yaml (compute_efficiency, with_efficiency).
PARM_EFFICIENCY = 0.5  # parm.md §2.10(c): "eff default 0.5" (no GPU to calibrate it)
_PARM_A_AG_MP = {"alpha_s": 6.64e-4, "beta_s_per_elem": 5.38e-10}
_PARM_B_AG_MP = {"alpha_s": 1.09e-4, "beta_s_per_elem": 7.14e-10}
_PARM_EFF_SOURCE = (f"parm.md §2.10(c): eff default {PARM_EFFICIENCY:g} (Parm's reproduction sets it from "
                    "experiments/parm/assumptions.yaml compute_efficiency)")


def _ag_mp_bw_GBps(fit: dict, elem_bytes: int = 4, n: int = 4) -> float:
    """parm.md §2.10(b): W_in = ((n-1)/n) * b / beta, the ring AllGather's slope at n ranks."""
    return (n - 1) / n * elem_bytes / fit["beta_s_per_elem"] / GB


def _ag_mp_latency_us(fit: dict, n: int = 4) -> float:
    """parm.md §2.10(b): alpha_in = alpha / (n-1)."""
    return fit["alpha_s"] / (n - 1) * 1e6


PARM_A = ClusterProfile(
    name="parm_A", nodes=1, gpus_per_node=8, gpu="RTX4090-24GB",
    peak_flops=82.6e12, achieved_flops=_eff(82.6e12, PARM_EFFICIENCY),
    intra_bw_GBps=_ag_mp_bw_GBps(_PARM_A_AG_MP), intra_latency_us=_ag_mp_latency_us(_PARM_A_AG_MP),
    inter_bw_GBps=_ag_mp_bw_GBps(_PARM_A_AG_MP), inter_latency_us=_ag_mp_latency_us(_PARM_A_AG_MP),
    allreduce="nccl", mem_GB=24.0, nics_per_node=0, elem_bytes=4,
    extra={"AG_MP_fit": _PARM_A_AG_MP},
    sources={
        "allreduce": _NCCL_ALLREDUCE,
        "nodes": "parm.md §4 Table II: one server with 8x RTX 4090 on PCIe 4.0 x16, no network",
        "peak_flops": "parm.md §2.10(c): RTX4090 fp32 82.6 TFLOPS",
        "achieved_flops": _PARM_EFF_SOURCE,
        "intra_bw_GBps": "parm.md §2.10(b): W_in = 0.75*4/beta from the Fig. 6 AG_MP fit (about 5.6 GB/s)",
        "intra_latency_us": "parm.md §2.10(b): alpha_in = alpha/3 from the Fig. 6 AG_MP fit",
        "inter_bw_GBps": "single node: no inter-node link (set equal to intra so nothing divides by 0)",
        "inter_latency_us": "single node: no inter-node link",
        "mem_GB": "parm.md §4 Table II: 24 GB", "elem_bytes": "parm.md §6 P19: assume fp32",
        "extra": "parm.md §2.10(a): Fig. 6 AG_MP fit, x = output elements",
    })

PARM_B = ClusterProfile(
    name="parm_B", nodes=8, gpus_per_node=4, gpu="RTX2080Ti-11GB",
    peak_flops=13.4e12, achieved_flops=_eff(13.4e12, PARM_EFFICIENCY),
    intra_bw_GBps=_ag_mp_bw_GBps(_PARM_B_AG_MP), intra_latency_us=_ag_mp_latency_us(_PARM_B_AG_MP),
    inter_bw_GBps=12.5 * 0.9, inter_latency_us=20.0,
    allreduce="nccl", mem_GB=11.0, nics_per_node=1, elem_bytes=4,
    extra={"AG_MP_fit": _PARM_B_AG_MP},
    sources={
        "allreduce": _NCCL_ALLREDUCE,
        "nodes": "parm.md §4 Table II: 8 nodes x 4 RTX 2080Ti on PCIe 3.0 x16 (used at 2, 4, 8 nodes: with_nodes)",
        "peak_flops": "parm.md §2.10(c): 2080Ti fp32 13.4 TFLOPS",
        "achieved_flops": _PARM_EFF_SOURCE,
        "intra_bw_GBps": "parm.md §2.10(b): W_in = 0.75*4/beta from the Fig. 6 AG_MP fit (about 4.2 GB/s)",
        "intra_latency_us": "parm.md §2.10(b): alpha_in = alpha/3",
        "inter_bw_GBps": "parm.md §2.10(b): W_nic = 12.5 GB/s x 0.9 (one 100 Gb/s ConnectX-5 per node)",
        "inter_latency_us": "parm.md §2.10(b): alpha_out = 2e-5 s [assumption there]",
        "mem_GB": "parm.md §4 Table II: 11 GB", "elem_bytes": "parm.md §6 P19: assume fp32",
        "extra": "parm.md §2.10(a): Fig. 6 AG_MP fit, x = output elements",
    })

LINA = ClusterProfile(
    name="lina", nodes=4, gpus_per_node=4, gpu="A100-40GB",
    peak_flops=312e12, achieved_flops=_eff(312e12, 0.5),
    intra_bw_GBps=300.0, intra_latency_us=5.0, inter_bw_GBps=12.5, inter_latency_us=20.0,
    allreduce="nccl", mem_GB=40.0, nics_per_node=1, elem_bytes=2,
    sources={
        "allreduce": _NCCL_ALLREDUCE,
        "nodes": "lina.md §4: 'Testbed: 4 nodes x 4 A100-40GB, 100 Gb/s InfiniBand per node'",
        "peak_flops": "A100 dense fp16 vendor peak 312 TFLOP/s",
        "achieved_flops": ("[assumption] 50% of peak, uncalibrated; Lina's reproduction fits it to Table 1 "
                           "(papers/lina/paper_scale.calibration)"),
        "intra_bw_GBps": ("[assumption] lina.md §2.4: intra-node link not stated; NVLink3 300 GB/s per "
                          "direction, uncalibrated; Lina's reproduction fits it to Table 1 (paper_scale.calibration)"),
        "inter_bw_GBps": "lina.md §2.4: BW_nic = 12.5 GB/s (100 Gb/s)",
        "intra_latency_us": _ASSUMED_LAT, "inter_latency_us": _ASSUMED_LAT,
        "mem_GB": "lina.md §4: A100-40GB", "elem_bytes": "lina.md §2.4: b = 2 (fp16)",
    })

LSH_V100 = ClusterProfile(
    name="lsh_v100", nodes=2, gpus_per_node=8, gpu="V100-32GB",
    peak_flops=125e12, achieved_flops=_eff(125e12, 0.4),
    intra_bw_GBps=150.0, intra_latency_us=5.0, inter_bw_GBps=12.5, inter_latency_us=20.0,
    allreduce="nccl", mem_GB=32.0, nics_per_node=1, elem_bytes=2,
    sources={
        "allreduce": _NCCL_ALLREDUCE,
        "nodes": "lsh-moe.md §4: 'V100 cluster: 2 servers x 8 V100-32GB, NVLink 2.0, one RDMA NIC with 100 Gb/s'",
        "peak_flops": "lsh-moe.md §4 Fig. 3: V100 125 TFLOP/s fp16",
        "achieved_flops": "lsh-moe.md §2.9 worked example: 40% MFU [assumption until calibrated]",
        "intra_bw_GBps": "lsh-moe.md §4 Fig. 3: NVLink 150 GB/s per direction per GPU",
        "inter_bw_GBps": "lsh-moe.md §4: 100 Gb/s per server = 12.5 GB/s",
        "intra_latency_us": _ASSUMED_LAT, "inter_latency_us": _ASSUMED_LAT,
        "mem_GB": "lsh-moe.md §4: V100-32GB", "elem_bytes": "lsh-moe.md §2.9: fp16 elements",
    })

LSH_A100 = ClusterProfile(
    name="lsh_a100", nodes=4, gpus_per_node=8, gpu="A100-40GB",
    peak_flops=312e12, achieved_flops=_eff(312e12, 0.4),
    intra_bw_GBps=300.0, intra_latency_us=5.0, inter_bw_GBps=25.0, inter_latency_us=20.0,
    allreduce="nccl", mem_GB=40.0, nics_per_node=2, elem_bytes=2,
    sources={
        "allreduce": _NCCL_ALLREDUCE,
        "nodes": ("lsh-moe.md §4: 'A100 cluster: 4 servers x 8 A100-40GB, NVLink 3.0, two RDMA NICs "
                  "with 200 Gb/s total'"),
        "peak_flops": "lsh-moe.md §4 Fig. 3: A100 312 TFLOP/s fp16",
        "achieved_flops": "lsh-moe.md §2.9 worked example: 40% MFU [assumption until calibrated]",
        "intra_bw_GBps": "lsh-moe.md §4 Fig. 3: NVLink 300 GB/s per direction per GPU",
        "inter_bw_GBps": "lsh-moe.md §4: 200 Gb/s per server = 25 GB/s (2 NICs)",
        "intra_latency_us": _ASSUMED_LAT, "inter_latency_us": _ASSUMED_LAT,
        "mem_GB": "lsh-moe.md §4: A100-40GB", "elem_bytes": "lsh-moe.md §2.9: fp16 elements",
    })

PROFILES: dict = {p.name: p for p in (HECATE_A, HECATE_B, JOHNNY, TREVOR, PARM_A, PARM_B, LINA,
                                      LSH_V100, LSH_A100)}
ALIASES = {"A": "hecate_A", "B": "hecate_B", "johnny": "fastermoe_johnny", "trevor": "fastermoe_trevor",
           "testbed_A": "parm_A", "testbed_B": "parm_B"}


def register_profile(profile: ClusterProfile) -> ClusterProfile:
    PROFILES[profile.name] = profile
    return profile


def get_profile(name: str) -> ClusterProfile:
    """A registered profile by name or alias (``trevor``, ``hecate_A``, ...)."""
    key = ALIASES.get(name, name)
    try:
        return PROFILES[key]
    except KeyError:
        raise KeyError(f"unknown cluster profile {name!r}; known: {sorted(PROFILES)} "
                       f"(aliases {sorted(ALIASES)})") from None


def local_profile_from_calibration(fit: dict, name: str = "local") -> ClusterProfile:
    """A profile of this machine from :func:`moelab.measure.calibrate.calibrate_local`'s result.

    One node of ``nproc`` ranks; the class bandwidth and latency come from the all-to-all fit, and
    every fitted collective keeps its own (alpha, beta) in ``fits`` so the cost model prices it with
    its own line (x = bytes a rank sends to other ranks, by the shared byte rule).
    """
    n = int(fit["nproc"])
    colls = fit.get("collectives", {})
    a2a = colls.get("all_to_all") or next(iter(colls.values()))
    bw = 1.0 / a2a["beta"] / GB if a2a["beta"] > 0 else float("inf")
    lat = max(a2a["alpha"], 0.0) * 1e6
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB / n
    except (ValueError, OSError, AttributeError):
        mem = 0.0
    flops = float(fit["gemm_flops"])
    comp = fit.get("compute")  # a fitted compute line: the ranks share the host's cores (an engine CPU pool)
    return ClusterProfile(
        name=name, nodes=1, gpus_per_node=n, gpu=fit.get("device") or platform.processor() or "cpu",
        peak_flops=float(fit.get("peak_flops", flops)), achieved_flops=float(comp["flops_per_s"]) if comp else flops,
        shared_cores=int(fit.get("cores", 0)) if comp else 0,
        op_overhead_s=float(comp["op_overhead_s"]) if comp else 0.0,
        intra_bw_GBps=bw, intra_latency_us=lat, inter_bw_GBps=bw, inter_latency_us=lat,
        mem_GB=mem, nics_per_node=0, elem_bytes=int(fit.get("elem_bytes", 4)),
        fits={op: (max(v["alpha"], 0.0), max(v["beta"], 0.0)) for op, v in colls.items()},
        sources={"*": f"measured on this machine ({n} gloo ranks): calibrate_local",
                 "fits": "least-squares alpha-beta per collective, x = non-local bytes sent per rank",
                 **({"achieved_flops": f"fitted: {comp['source']}", "op_overhead_s": f"fitted: {comp['source']}",
                     "shared_cores": "os.sched_getaffinity: cores the ranks share"} if comp else {})},
        one_host=True, notes="loopback: one link class; EMULATED topologies reuse these numbers for both classes")
