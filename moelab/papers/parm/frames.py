"""Frames of Parm's small-scale items, built from the real-rank suite (:mod:`.real`) or the pure layout:
Fig. 2 (layout), Fig. 3 (op timelines), Fig. 4 (byte matrices), Fig. 5 (SAA phases), the EMULATED
Table IV / Fig. 1 / Fig. 7 analogs. Every frame carries ``attrs["label"]``."""
from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.strategies.parm.layout import ParmLayout

from . import real
from .common import SCHEDULES, links_label, scale_spec

GROUP_NAMES = {"mp": "MP", "esp": "ESP", "ep_strided": "EP", "ep_esp": "EP&ESP", "ep_esp_saa": "EP&ESP (SAA)",
               "dense_dp": "dense DP", "world": "world"}


def layout_frame(P: int = 4, n_mp: int = 2, n_esp: int = 2, rpn: int = 2) -> pd.DataFrame:
    """Fig. 2: each rank's node, coordinates, groups and expert shard, from :class:`ParmLayout` itself."""
    lay = ParmLayout(P, n_mp, n_esp, P // n_esp, rpn).check()
    g = lay.groups()
    rows = []
    for r in range(P):
        c = lay.coords(r)
        inst = {name: next(i for i in insts if r in i) for name, insts in g.items()}
        rows.append(dict(rank=r, node=r // rpn, **c, experts=lay.experts_of(r), shard=f"{c['esp'] + 1}/{n_esp}",
                         **{f"{GROUP_NAMES[k]} group": v for k, v in inst.items() if k != "ep_esp_saa"}))
    df = pd.DataFrame(rows)
    df.attrs["label"] = f"REAL: the layout moelab builds (P={P}, N_MP={n_mp}, N_ESP={n_esp}, {P // rpn} nodes x {rpn})"
    return df


def timeline(world: int, scale, cell: tuple, seed: int = 0) -> pd.DataFrame:
    """Fig. 3: every rank's ops of one traced forward + backward per schedule (comm calls and compute
    spans), times relative to the call's start."""
    suite = real.layer_suite(world, scale, seed)
    rows = []
    for rank, traces in enumerate(suite["rank_traces"]):
        for m in SCHEDULES:
            t = traces[(cell, m)]
            base = t["t0"]
            for r in t["recs"]:
                rows.append(dict(schedule=m, rank=rank, kind="comm",
                                 op=f"{r['op']} {GROUP_NAMES.get(r['group'], r['group'])}",
                                 phase=r["phase"], start_ms=(r["t0"] - base) * 1e3, end_ms=(r["t1"] - base) * 1e3))
            for sp in t["spans"]:
                if sp["cat"] == "compute":
                    rows.append(dict(schedule=m, rank=rank, kind="compute", op=sp["name"], phase="fwd",
                                     start_ms=(sp["t0"] - base) * 1e3, end_ms=(sp["t1"] - base) * 1e3))
                elif sp["cat"] == "comm_phase":
                    rows.append(dict(schedule=m, rank=rank, kind="saa phase", op=sp["name"], phase="",
                                     start_ms=(sp["t0"] - base) * 1e3, end_ms=(sp["t1"] - base) * 1e3))
    df = pd.DataFrame(rows)
    df.attrs["label"] = (f"REAL: {world} gloo ranks (loopback), one MoE layer fwd+bwd per schedule, cell (N_MP, N_ESP)="
                         f"{cell}; compute spans are the forward's (backward compute is the gaps)")
    return df


def byte_matrices(world: int, scale, cell: tuple, schedules=("baseline", "s1"), seed: int = 0) -> pd.DataFrame:
    """Fig. 4: bytes each rank sent each rank, per schedule, call (op, group) and pass, from the door's records."""
    suite = real.layer_suite(world, scale, seed)
    rows = []
    for src, traces in enumerate(suite["rank_traces"]):
        for m in schedules:
            for i, r in enumerate(traces[(cell, m)]["recs"]):
                for dst, b in r["sent"].items():
                    rows.append(dict(schedule=m, call=i, op=f"{r['op']} {GROUP_NAMES.get(r['group'], r['group'])}",
                                     phase=r["phase"], src=src, dst=int(dst), bytes=int(b)))
    df = pd.DataFrame(rows)
    df.attrs["label"] = f"REAL: the door's records on {world} gloo ranks, cell (N_MP, N_ESP)={cell}"
    return df


def saa_phase_table(P: int = 4, n_mp: int = 2) -> pd.DataFrame:
    """Fig. 5's content: per phase and rank, which chunk the all-to-all half receives (red) and which
    chunk the gather half forwards to the MP peers (blue) — the schedule :func:`moelab.comm.saa.saa` runs."""
    rows = []
    for i in range(P + 1):
        for r in range(P):
            a2a = f"D{(r - i) % P}->{r}" if 0 < i < P else ("own chunk (local copy)" if i == 0 else "")
            fwd = f"chunk from {(r - i + 1) % P} -> MP peers" if i >= 1 and n_mp > 1 else ""
            rows.append(dict(phase=i, rank=r, a2a_receives=a2a, gather_forwards=fwd))
    df = pd.DataFrame(rows)
    df.attrs["label"] = f"REAL: the phase schedule of moelab.comm.saa (P={P}, N_MP={n_mp})"
    return df


def saa_trace(scale, seed: int = 0) -> pd.DataFrame:
    """Fig. 5 measured: the SAA phase spans of S2's forward and backward on 4 ranks, cell (2, 2)."""
    df = timeline(4, scale, (2, 2), seed)
    df = df[(df.schedule == "s2") & ((df.kind == "saa phase") | df.op.str.startswith("saa"))].reset_index(drop=True)
    df.attrs["label"] = "REAL: SAA of S2 on 4 gloo ranks (loopback), N_MP=2, N_ESP=2"
    return df


def table4_emulated(scale, seed: int = 0) -> pd.DataFrame:
    """Table IV analog: per cell, median layer time per schedule, speedups over the baseline, ``auto``'s pick."""
    s = scale_spec(scale)
    rows = []
    for world in (4, 8):
        suite = real.layer_suite(world, scale, seed)
        for cell, t in suite["times"].items():
            if 1 in cell:
                continue
            a = suite["auto"][cell]
            best = "s1" if t["s1"] <= t["s2"] else "s2"
            rows.append(dict(P=world, n_mp=cell[0], n_esp=cell[1], **{f"{m}_ms": t[m] * 1e3 for m in SCHEDULES},
                             s1_speedup=t["baseline"] / t["s1"], s2_speedup=t["baseline"] / t["s2"],
                             aas_speedup=t["baseline"] / t["s2_aas"],
                             parm_speedup=t["baseline"] / t[a["schedule"]], oracle_speedup=t["baseline"] / t[best],
                             auto=a["schedule"], auto_right=a["schedule"] == best,
                             tD1_ms=a["tD1_s"] * 1e3, tD2_ms=a["tD2_s"] * 1e3))
    df = pd.DataFrame(rows)
    df.attrs["label"] = (f"EMULATED: gloo ranks, {links_label(s)}; one MoE layer fwd+bwd, S={s.S}, M={s.M}, "
                         f"h={s.h}, f={s.f}, k=1, einsum; median of {s.iters}, slowest rank")
    return df


def fig1_real_share(scale, seed: int = 0) -> pd.DataFrame:
    """Fig. 1 analog: the baseline's communication share of the layer time on 8 ranks (from the traced
    calls: the union of comm intervals on the slowest rank / the call's span)."""
    suite = real.layer_suite(8, scale, seed)
    rows = []
    for cell in real.CELLS[8]:
        shares = []
        for traces in suite["rank_traces"]:
            t = traces[(cell, "baseline")]
            iv = sorted((r["t0"], r["t1"]) for r in t["recs"])
            busy, end = 0.0, -np.inf
            for a, b in iv:
                if b > end:
                    busy += b - max(a, end)
                    end = b
            shares.append(busy / max(t["t1"] - t["t0"], 1e-12))
        rows.append(dict(n_mp=cell[0], n_esp=cell[1], comm_share=float(np.median(shares))))
    df = pd.DataFrame(rows).sort_values("comm_share").reset_index(drop=True)
    df.attrs["label"] = "REAL: 8 gloo ranks (loopback, 2 cores): baseline comm time / layer time, median over ranks"
    return df


def fig7_emulated(scale, seed: int = 0) -> pd.DataFrame:
    s = scale_spec(scale)
    df = pd.DataFrame(real.layer_suite(8, scale, seed)["f7"])
    df["parm_speedup"] = df.baseline_s / np.where(df.pick == "s1", df.s1_s, df.s2_s)
    df["oracle_speedup"] = df.baseline_s / np.minimum(df.s1_s, df.s2_s)
    df.attrs["label"] = f"EMULATED: 8 gloo ranks, N_MP=N_ESP=4, {links_label(s)}; Parm = Alg. 1 on live fits"
    return df
