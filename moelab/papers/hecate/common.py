"""Hecate reproduction, shared pieces: the scale spec (sizes in ``experiments/hecate/scales.yaml``),
the constants the paper-scale parts guess or fit (``experiments/hecate/assumptions.yaml``), and the
Table 1 models (``moelab.models.params``: one place for the paper models and their parameter rule; the paper's
own counts are paper numbers, in ``experiments/hecate/paper.yaml``)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd

from moelab.models.params import count_params, paper_model
from moelab.papers.kit.assumptions import Assumptions, load_assumptions
from moelab.papers.kit.compare import paper_value
from moelab.papers.kit.registry import Quantity
from moelab.papers.kit.scales import load_scale

P = "hecate"  # the paper id products register under
X = "x"  # the unit of a ratio
SCALES = ("smoke", "default", "full")
PAPER_MODELS = ("GPT-MoE-S", "GPT-MoE-L", "BERT-MoE", "BERT-MoE-Deep")  # Table 1, in the paper's order
BASELINES = ("FasterMoE", "SmartMoE", "FlexMoE")  # the paper's state-of-the-art systems (§5 Baselines); EP is the base
# The abstract's "up to ...x over state-of-the-art MoE training systems" and the introduction's "with
# re-materialization, up to ...x" (paper.yaml speedup_up_to, rm_speedup_up_to): per row the speedup over the baseline
# beaten most (the slowest of BASELINES present); the largest over the rows is the paper's best case
UP_TO = Quantity("end-to-end speedup of Hecate over a state-of-the-art MoE system (best case)", "x")
RM_UP_TO = Quantity("end-to-end speedup of Hecate-RM over a state-of-the-art MoE system (best case)", "x")
# Table 1's "params" column: the keys of experiments/hecate/paper.yaml holding the paper's counts
TABLE1_PARAMS_KEYS = {"GPT-MoE-S": "gpt_moe_s_params", "GPT-MoE-L": "gpt_moe_l_params", "BERT-MoE": "bert_moe_params",
                      "BERT-MoE-Deep": "bert_moe_deep_params"}


@dataclass(frozen=True)
class ScaleSpec:
    """Sizes of every Hecate experiment at one scale (smoke: CI on 2 cores; default: a laptop;
    full: the largest this machine class does). Paper-scale parts are SIMULATED at every scale."""

    name: str
    # REAL load trace (Fig. 3; the loads every paper-scale replay upsamples): a tiny GPT-MoE on gloo ranks
    trace_nproc: int
    trace_layers: int
    trace_d: int
    trace_experts: int
    trace_seq: int
    trace_batch: int
    trace_iters: int
    # REAL runs of the strategies (Figs. 1, 4-6, 8, 9, 11-13, 15a): nodes x ranks_per_node gloo ranks on this
    # machine's loopback, no link emulation (experiments/hecate/scales.yaml says why)
    nodes: int
    ranks_per_node: int
    d: int
    layers: int
    experts: int
    seq: int
    batch: int
    iters: int
    # SIMULATED paper scale (Figs. 9-15, M1-M3)
    paper_layers: Optional[int]  # MoE layers simulated per model (None: all, as the paper)
    paper_iters: int  # trace iterations priced per configuration
    interval_iters: int  # Fig. 15b: iterations of the re-sharding-interval replay (paper-like: >= 2000)

    @property
    def nproc(self) -> int:
        return self.nodes * self.ranks_per_node


def scale_spec(scale) -> ScaleSpec:
    """The :class:`ScaleSpec` of ``scale`` (a name in ``experiments/hecate/scales.yaml``, or a spec)."""
    return load_scale("hecate", ScaleSpec, scale)


@functools.lru_cache(maxsize=1)
def _base_assumptions() -> Assumptions:
    return load_assumptions("hecate", root=Path(__file__).resolve().parent)


def assumptions(overrides: tuple = ()) -> Assumptions:
    """Hecate's guessed / fitted / paper constants as data; ``overrides``: ``((name, value), ...)``."""
    A = _base_assumptions()
    return A.with_values(dict(overrides)) if overrides else A


def table1() -> pd.DataFrame:
    """Table 1 as moelab counts it: the paper's parameter rule (expert FFNs 2·d·2d without biases plus
    4·d² attention per layer; embeddings, norms, gates excluded) evaluated by
    :func:`moelab.models.params.count_params` on moelab's own configs of the four models, beside the
    closed form L·(4E+4)·d² and the paper's column (labelled, read from ``experiments/hecate/paper.yaml``)."""
    rows = []
    for name in PAPER_MODELS:
        m = paper_model(name)
        E, d, L = m.moe.num_experts, m.d_model, m.n_layers
        c = count_params(m, convention="hecate")
        rows.append(dict(model=name, d_model=d, seq_len=m.seq_len, layers=L, experts=E, heads=m.n_heads,
                         vocab=m.vocab_size, params=c["total"], params_B=c["total"] / 1e9,
                         closed_form_B=L * (4 * E + 4) * d * d / 1e9,
                         paper_params_B=paper_value(P, TABLE1_PARAMS_KEYS[name]) / 1e9,
                         expert_MB_fp16=2 * 2 * d * m.d_ff / 1e6))
    t = pd.DataFrame(rows)
    t["matches_paper"] = t.params_B.round(2) == t.paper_params_B
    t.attrs["label"] = ("REAL: moelab's parameter counting of its Table 1 configs (no training); "
                        "paper_params_B is the paper's column (reference); heads/vocab are spec §4 [choice]; "
                        "training at this size is SUBSTITUTE: tiny models of the same shape on gloo ranks, and the "
                        "simulator at the paper's size, stand in for it (no GPU cluster)")
    return t
