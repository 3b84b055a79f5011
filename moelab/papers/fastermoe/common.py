"""FasterMoE reproduction, shared pieces: the scale spec (sizes in ``experiments/fastermoe/scales.yaml``),
the AE's trace iterations and weights, the paper-scale layer models and constants (``assumptions.yaml``),
the paper clusters' profiles and shadow-policy constants, and the MoE-layer time of a simulated iteration."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from moelab.papers.kit.assumptions import Assumptions, load_assumptions
from moelab.papers.kit.scales import load_scale
from moelab.sim import get_profile
from moelab.strategies.fastermoe import perf_model as pm

SCALES = ("smoke", "default", "full")
TRACE_ITERS = (500, 5500, 80500)  # AE trace iterations (Figs. 10, 12, 13)
TRACE_WEIGHTS = (500, 5000, 75000)  # AE time weights of those iterations


# ==== scales ===========================================================================================
@dataclass(frozen=True)
class ScaleSpec:
    """Sizes of every experiment at one scale (smoke: CI on 2 cores in <= 3 min for the whole notebook;
    default: a laptop in <= 15 min; full: closest to the paper this machine class can do)."""

    name: str
    # REAL layer benchmark (Figs. 5a, 6, 8, 11a, 12a, 13a): 2 emulated nodes x nproc/2 ranks, 16 experts
    nproc: int
    d: int  # h of the CPU layer (h_ff = 2h)
    tokens: int  # tokens per rank per iteration (x top-2 assignments)
    suite_iters: int  # trace iterations every variant runs (the first `warmup` untimed)
    shadow_iters: int  # further iterations only FastMoE and shadowing run (Fig. 11a)
    warmup: int
    intra_GBps: float  # emulated per-rank intra-node link
    inter_GBps: float  # emulated per-rank inter-node link (NIC)
    latency_us: float
    # Fig. 9 (a): predictor sweep
    sweep_nprocs: tuple
    sweep_h: tuple
    sweep_tokens: int
    sweep_iters: int
    sweep_plain: bool  # also without emulation (loopback gloo)
    # Fig. 14 / Table 3: REAL tiny MoE-GPT
    conv_nproc: int
    conv_steps: int
    conv_d: int
    conv_layers: int
    conv_seq: int
    conv_batch: int
    conv_time_samples: int  # iterations priced at paper scale (interpolated in between)
    # SIMULATED paper scale
    paper_layers: Optional[int]  # layers simulated per model (None: all, as the paper)
    trace_iters: tuple  # T2 iterations averaged (with TRACE_WEIGHTS)
    fig11_iters: int  # iterations of the Fig. 11 replay (paper: 62)
    fig4_iters: int  # T2 iterations drawn in Fig. 4
    e2e_iters: int = 8  # Fig. 10 (a): training steps per system of the REAL end-to-end comparison
    suite_trace: str = "hot"  # what the layer suite replays (suite.TRACE_KINDS)


def scale_spec(scale) -> ScaleSpec:
    """The :class:`ScaleSpec` of ``scale`` (a name in ``experiments/fastermoe/scales.yaml``, or a ScaleSpec
    passed through)."""
    return load_scale("fastermoe", ScaleSpec, scale)


# ==== assumptions (experiments/fastermoe/assumptions.yaml) ================================================
@functools.lru_cache(maxsize=1)
def _base_assumptions() -> Assumptions:
    return load_assumptions("fastermoe", root=Path(__file__).resolve().parent)


def assumptions(overrides: tuple = ()) -> Assumptions:
    """FasterMoE's constants as data; ``overrides``: ``((name, value), ...)`` (hashable, so cached
    experiments can take it) replaces some values, e.g. for :func:`fig10_sensitivity`."""
    A = _base_assumptions()
    return A.with_values(dict(overrides)) if overrides else A


def assumes(fig_id: str, overrides: tuple = ()) -> tuple:
    """``(names, text)``: the guessed/fitted constants ``fig_id`` depends on and a short "assumes: ..."
    for its label (values as used, overridden ones marked VARIED)."""
    A = assumptions(overrides)
    names = A.names_for(fig_id)
    varied = dict(overrides)
    parts = [f"{n}={A.value(n):g}" + (" (VARIED)" if n in varied else "") for n in names]
    parts += [f"{n}={v:g} (VARIED)" for n, v in varied.items() if n not in names]
    text = "assumes: " + (", ".join(parts) if parts else "no guessed constant (paper values only)")
    return names, text + " [experiments/fastermoe/assumptions.yaml]"


def mark_assumptions(df: pd.DataFrame, fig_id: str, overrides: tuple = ()) -> pd.DataFrame:
    """Put ``attrs["assumptions"]`` (names) on ``df`` and append "assumes: ..." to its label."""
    names, text = assumes(fig_id, overrides)
    df.attrs["assumptions"] = names
    df.attrs["label"] = (df.attrs.get("label", "") + "; " + text).lstrip("; ")
    return df


ZERO_OVERLAP = assumptions().value("zero_overlap")  # the base value; experiments read it per call


# ==== paper models (Table 2 as far as it can be reconstructed) ===========================================
@dataclass(frozen=True)
class PaperLayerModel:
    name: str
    cluster: str  # johnny | trevor
    layers: int
    experts: int
    tokens: int  # tokens per worker per iteration (x k = 2 assignments)
    h: int
    h_ff: int
    source: str


MODEL_FIELDS = ("layers", "experts", "tokens", "h", "h_ff")
MODEL_CLUSTERS = {"GPT-S": "johnny", "GPT-L": "johnny", "BERT-Deep": "johnny", "BERT-Deep-L": "johnny",
                  "BERT-Wide": "trevor"}  # spec §4 Table 2


def paper_layer_models(overrides: tuple = ()) -> dict:
    """Table 2's layer models with their sizes read from the assumptions file (``model.<name>.<field>``)."""
    A = assumptions(overrides)
    out = {}
    for name, cl in MODEL_CLUSTERS.items():
        ent = {f: A[f"model.{name}.{f}"] for f in MODEL_FIELDS}
        kinds = {}
        for f, a in ent.items():
            kinds.setdefault(a.kind, []).append(f)
        src = "; ".join(f"{k}: {', '.join(v)}" for k, v in kinds.items())
        out[name] = PaperLayerModel(name, cl, *(int(ent[f].value) for f in MODEL_FIELDS), source=src)
    return out


PAPER_LAYER_MODELS = paper_layer_models()


def table2_models() -> pd.DataFrame:
    """Table 2 (model specs) as moelab uses them, with each value's kind: the paper's (spec §4, from
    the AE scripts) or a moelab assumption where the paper gives none (spec §4, §6.17)."""
    A = assumptions()
    rows = []
    for m in PAPER_LAYER_MODELS.values():
        r = dict(model=m.name, cluster=m.cluster, gpus=16 if m.cluster == "johnny" else 64, moe_layers=m.layers,
                 experts=m.experts, tokens_per_worker=m.tokens, top_k=2, h=m.h, h_ff=m.h_ff)
        kinds = {f: A[f"model.{m.name}.{f}"].kind for f in MODEL_FIELDS}
        r.update({f"{f}_kind": k for f, k in kinds.items()})
        r["assumed"] = ", ".join(f for f, k in kinds.items() if k != "paper")
        r["source"] = m.source
        rows.append(r)
    df = pd.DataFrame(rows)
    df.attrs["label"] = ("PAPER values (spec §4 Table 2, from the AE scripts) and moelab ASSUMPTIONS where the "
                         "paper gives none: see the *_kind columns and 'assumed'")
    return mark_assumptions(df, "table2")


def cluster_preset(name: str) -> pm.Cluster:
    """The perf model's directed-link tree of a paper cluster (``johnny`` 16 GPUs, ``trevor`` 64), with
    its P from the assumptions file."""
    return pm.cluster(name, P=policy_constants(name)["P"])


def sim_profile(name: str, overrides: tuple = ()):
    """The simulator profile of a paper cluster with the assumptions file's values applied (P as
    ``achieved_flops``; trevor's NIC bandwidth)."""
    prof = get_profile({"johnny": "fastermoe_johnny", "trevor": "fastermoe_trevor"}.get(name, name))
    A = assumptions(overrides)
    src = "experiments/fastermoe/assumptions.yaml: "
    if prof.name == "fastermoe_johnny":
        return dataclasses.replace(prof, achieved_flops=A.value("johnny_P"),
                                   sources={**prof.sources, "achieved_flops": src + "johnny_P"})
    if prof.name == "fastermoe_trevor":
        return dataclasses.replace(prof, achieved_flops=A.value("trevor_P"),
                                   inter_bw_GBps=A.value("trevor_nic_Gbps") / 8,
                                   sources={**prof.sources, "achieved_flops": src + "trevor_P",
                                            "inter_bw_GBps": src + "trevor_nic_Gbps / 8"})
    return prof


def policy_constants(cluster: str, overrides: tuple = ()) -> dict:
    """Shadow-policy constants of a paper cluster from the assumptions file: P, W_net (bytes/s), c and the
    smart schedule's group size (johnny: FastMoE's defaults and the AE's Gs = 2, spec §2.7; trevor: its
    assumed P, its NIC as W_net, the code default Gs = 4)."""
    A = assumptions(overrides)
    cl = "johnny" if cluster == "johnny" else "trevor"
    return dict(P=A.value(f"{cl}_P"), W_net=A.value(f"{cl}_policy_W_net_Gbps") * pm.GBPS,
                c=int(A.value("shadow_comm_factor")), group_size=int(A.value(f"{cl}_group_size")))


def moe_layer_times(res, layer_ids: Sequence[int]) -> np.ndarray:
    """Seconds of each MoE layer in one simulated iteration (:meth:`moelab.sim.engine.SimResult.moe_layer_times`:
    the MoE-layer-only time the AE's layer benchmarks measure, spec §6.15)."""
    return res.moe_layer_times(layer_ids)
