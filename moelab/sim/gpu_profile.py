"""A ``local_gpu`` cluster profile fitted from ``benchmarks/gpu_layer.py``'s rows, and how well it predicts them.

One MoE layer's forward+backward on one device is priced as

    t = kernels x launch overhead + 12 S d f / achieved GEMM FLOP/s + 2 x permute bytes / HBM bandwidth

(``S`` expert rows, two GEMMs of ``2 S d f`` forward and twice that backward; permute + unpermute move
their rows forward and again backward). The three constants are fitted by least squares over the
benchmark's sweep (shapes x token counts) and kept as data with their kind and source; the profile's
``extra`` also keeps each shape's measured GEMM efficiency and the HBM bandwidth the permute rows reached.
:func:`fit_gpu` returns the fit with R² of its own predictions over the sweep, which the benchmark prints.
"""
from __future__ import annotations

import numpy as np

from moelab.sim.graphs import DTYPE_BYTES
from moelab.sim.profiles import PROFILES, ClusterProfile

LAYER_KERNELS = 13  # launches of one layer fwd+bwd: permute, 2 GEMMs, activation, unpermute; 8 backward


def permute_bytes(tokens: int, rows: int, d: int, elem_bytes: int) -> int:
    """HBM bytes of one permute + unpermute: each direction reads and writes the tokens and the expert rows."""
    return 2 * (tokens + rows) * d * elem_bytes


def layer_terms(row: dict) -> tuple:
    """(kernels, FLOPs, HBM bytes) of one benchmark row's layer forward+backward."""
    S = row["T"] * row["k"]
    moved = permute_bytes(row["T"], S, row["d"], DTYPE_BYTES[row["dtype"].removeprefix("torch.")])
    return LAYER_KERNELS, 12.0 * S * row["d"] * row["f"], 2.0 * moved


def fit_gpu(rows: list) -> dict:
    """Least-squares (launch overhead, 1/FLOP rate, 1/HBM bandwidth) over the rows' layer times (best
    implementation per row), with R² of the predictions; negative terms fall back to the rate alone."""
    terms = np.array([layer_terms(r) for r in rows], float)
    t = np.array([min(v for k, v in r.items() if k.startswith("layer_")) for r in rows], float)
    coef, *_ = np.linalg.lstsq(terms, t, rcond=None)
    if (coef < 0).any():
        coef = np.array([0.0, float(terms[:, 1] @ t / (terms[:, 1] @ terms[:, 1])), 0.0])
    pred = terms @ coef
    ss = float(((t - t.mean()) ** 2).sum())
    gemm_eff = {f"{r['shape']}@{r['T']}": 2.0 * r["T"] * r["k"] * r["d"] * r["f"]
                / min(v for k, v in r.items() if k.startswith("gemm_")) / (r["peak_tflops"] * 1e12) for r in rows}
    return {"launch_s": float(coef[0]),  # per kernel: the kernels column is LAYER_KERNELS on every row
            "flops_per_s": 1.0 / coef[1] if coef[1] > 0 else float("inf"),
            "hbm_bytes_per_s": 1.0 / coef[2] if coef[2] > 0 else float("inf"),
            "r2": 1.0 - float(((t - pred) ** 2).sum()) / ss if ss > 0 else 1.0, "n": len(rows),
            "predicted_s": pred.tolist(), "measured_s": t.tolist(), "gemm_efficiency": gemm_eff,
            "device": rows[0]["device"], "peak_flops": rows[0]["peak_tflops"] * 1e12, "kind": "fitted",
            "source": "benchmarks/gpu_layer.py sweep on this device (layer forward+backward times)"}


def local_gpu_profile(fit: dict, name: str = "local_gpu") -> ClusterProfile:
    """One GPU as a profile: achieved FLOP/s and per-kernel overhead from :func:`fit_gpu` (no links)."""
    return ClusterProfile(
        name=name, nodes=1, gpus_per_node=1, gpu=fit["device"], peak_flops=fit["peak_flops"],
        achieved_flops=fit["flops_per_s"], intra_bw_GBps=float("inf"), intra_latency_us=0.0,
        inter_bw_GBps=float("inf"), inter_latency_us=0.0, mem_GB=0.0, nics_per_node=0, elem_bytes=2,
        op_overhead_s=fit["launch_s"],
        extra={"hbm_GBps": fit["hbm_bytes_per_s"] / 1e9, "gemm_efficiency": fit["gemm_efficiency"], "r2": fit["r2"]},
        sources={"*": f"fitted: {fit['source']}", "peak_flops": "data sheet (benchmarks/gpu_layer.py DEVICES)"},
        notes="single device: links are not modelled here (take them from a cluster profile)")


def predict_layer_s(profile: ClusterProfile, row: dict) -> float:
    """The profile's price of one benchmark row's layer forward+backward."""
    kernels, flops, moved = layer_terms(row)
    return kernels * profile.op_overhead_s + flops / profile.achieved_flops + moved / (profile.extra["hbm_GBps"] * 1e9)


def assumed_vs_measured(fit: dict) -> list:
    """Each registered profile whose achieved FLOP/s is an assumption or a default efficiency, beside the
    efficiency this device measured (achieved / data-sheet peak, same kind of number): rows of
    (profile, its GPU, assumed efficiency, measured efficiency, measured on)."""
    measured = fit["flops_per_s"] / fit["peak_flops"]
    rows = []
    for name, p in sorted(PROFILES.items()):
        src = p.sources.get("achieved_flops", "")
        if "assumption" in src or "default" in src:
            rows.append(dict(profile=name, gpu=p.gpu, assumed=p.achieved_flops / p.peak_flops, measured=measured,
                             measured_on=fit["device"], source=src))
    return rows
