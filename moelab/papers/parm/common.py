"""Parm reproduction, shared pieces: the scale spec (sizes in ``experiments/parm/scales.yaml``)."""
from __future__ import annotations

from dataclasses import dataclass

from moelab.config import EmulationConfig

SCHEDULES = ("baseline", "s1", "s2", "s2_aas")


@dataclass(frozen=True)
class ScaleSpec:
    """Sizes of every Parm experiment at one scale (smoke: CI on 2 cores; default: a laptop; full: the
    largest this machine class does). Paper-scale parts are SIMULATED at every scale."""

    name: str
    # one MoE layer on real ranks (Figs. 1 REAL, 3, 4, 5; Table IV and Fig. 7 EMULATED analogs)
    S: int  # tokens per MP group (B*L)
    M: int
    h: int  # expert hidden size per ESP shard
    f: float
    iters: int  # timed calls per schedule (after warmup), round-robin
    warmup: int
    f7_S: tuple  # Fig. 7 analog at P=8 (4,4): the configurations swept
    f7_M: tuple
    f7_f: tuple
    fit_exps: tuple  # Fig. 6: log2 sizes of the alpha-beta sweep
    fit_reps: int
    # emulated links (per rank, as moelab.config.EmulationConfig)
    intra_GBps: float
    inter_GBps: float
    intra_lat_us: float
    inter_lat_us: float
    # Table V REAL: tiny MoE-BERT / MoE-GPT at P=8, N_MP=N_ESP=4, E=2
    tv_d: int
    tv_layers: int
    tv_heads: int
    tv_seq: int
    tv_batch: int
    tv_iters: int
    # SIMULATED Table III grid: every ``grid_stride``-th configuration (1 = the whole grid)
    grid_stride: int


def scale_spec(scale) -> ScaleSpec:
    from moelab.papers.kit.scales import load_scale  # here: the kit loads plotly, this module does not

    return load_scale("parm", ScaleSpec, scale)


def emulation(s: ScaleSpec):
    return EmulationConfig(enabled=True, intra_bw_GBps=s.intra_GBps, inter_bw_GBps=s.inter_GBps,
                           intra_latency_us=s.intra_lat_us, inter_latency_us=s.inter_lat_us)


def links_label(s: ScaleSpec) -> str:
    return (f"EMULATED links: intra {s.intra_GBps:g} GB/s, inter {s.inter_GBps:g} GB/s per rank, latency "
            f"{s.intra_lat_us:g}/{s.inter_lat_us:g} us")


def paper(key: str) -> float:
    """Parm's own number ``key`` from ``experiments/parm/paper.yaml`` (a note quoting the paper reads it here)."""
    from moelab.papers.kit.compare import paper_value  # here: the kit loads plotly, this module does not

    return paper_value("parm", key)
