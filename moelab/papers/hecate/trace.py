"""Hecate reproduction, the REAL load trace (Fig. 3) and its upsampling for paper-scale replays.

A tiny GPT-MoE (spec §4 Fig. 3: 4 ranks, L = 4, E = 16, top-2, the byte-level corpus of the Python
installation) trains with plain EP on gloo ranks; the dispatcher's count exchange gives, per
iteration and MoE layer, the ``[N, E]`` matrix of tokens each source rank routed to each expert. That
trace is Fig. 3 (share of tokens per iteration x expert: imbalance and drift) and the load input of
every SIMULATED figure (Figs. 9-15), upsampled to the paper's 16/32 sources by multinomial splits of
the global loads (spec §4 calibration plan, step 3; iid data shards)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.config import RunConfig
from moelab.measure.realruns import run_real
from moelab.papers.kit.cache import cached

from .common import ScaleSpec, scale_spec


def trace_config(sp: ScaleSpec, experts=None):
    """The tiny GPT-MoE that records the trace (``experts``: the paper replays record one per expert
    count they need, 32 and 64, rather than inventing sub-experts; Fig. 3 uses the spec's 16)."""
    return RunConfig().with_overrides({
        "paper": "hecate", "name": "trace",
        "model.arch": "gpt", "model.d_model": sp.trace_d, "model.d_ff": 2 * sp.trace_d,
        "model.n_layers": sp.trace_layers, "model.n_heads": 4, "model.seq_len": sp.trace_seq,
        "model.moe.num_experts": experts or sp.trace_experts, "model.moe.top_k": 2, "model.moe.gate": "topk",
        "model.moe.balance_loss_coef": 0.0,  # spec §6.8: aux loss off while recording imbalance traces
        "parallel.nproc": sp.trace_nproc, "train.iters": sp.trace_iters, "train.batch_size": sp.trace_batch,
        "train.lr": 1e-3, "train.trace": False}).validate()


@cached
def real_trace(scale="smoke", experts=None) -> np.ndarray:
    """``[iters, layers, N, E]`` tokens per (iteration, MoE layer, source rank, expert), REAL (EP, gloo)."""
    sp = scale_spec(scale)
    run = run_real(trace_config(sp, experts), timeout=max(300.0, 2.0 * sp.trace_iters))
    return np.asarray(run.loads, dtype=np.int64)


def trace_label(sp: ScaleSpec, experts=None) -> str:
    return (f"REAL: {sp.trace_nproc} ranks gloo, tiny GPT-MoE (L={sp.trace_layers}, d={sp.trace_d}, "
            f"E={experts or sp.trace_experts}, top-2, no aux loss), {sp.trace_iters} iterations, byte-level corpus")


def fig3_heatmap(scale="smoke") -> pd.DataFrame:
    """Fig. 3 as a long frame: layer, iter, expert, tokens, share (of the layer's assignments)."""
    sp = scale_spec(scale)
    C = real_trace(sp.name).sum(axis=2)  # [iters, layers, E] global loads
    it, layer, e = np.meshgrid(np.arange(C.shape[0]), np.arange(C.shape[1]), np.arange(C.shape[2]), indexing="ij")
    share = C / np.maximum(C.sum(axis=2, keepdims=True), 1)
    df = pd.DataFrame(dict(iter=it.ravel(), layer=layer.ravel(), expert=e.ravel(), tokens=C.ravel(),
                           share=share.ravel()))
    df.attrs["label"] = trace_label(sp)
    return df


def imbalance_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Per layer: mean max/mean expert load ratio over iterations, and the drift of the hottest expert
    (how many distinct experts were the hottest one)."""
    g = frame.groupby(["layer", "iter"])
    ratio = (g.tokens.max() / g.tokens.mean()).groupby("layer").mean()
    hottest = frame.loc[g.tokens.idxmax()].groupby("layer").expert.nunique()
    out = pd.DataFrame({"max_over_mean": ratio, "distinct_hottest": hottest}).reset_index()
    out.attrs["label"] = frame.attrs.get("label", "")
    return out


def upsample(trace: np.ndarray, sources: int, tokens: int, k: int = 2, seed: int = 0, skew: float = 1.0) -> np.ndarray:
    """``[iters, layers, sources, E]``: per (iteration, layer) each of ``sources`` ranks draws its
    ``k * tokens`` assignments multinomially from the measured global load shares (iid data shards,
    spec §4 step 3; the per-token "k distinct experts" cap is not enforced: at paper token counts no
    expert comes near ``tokens`` per source); deterministic in ``seed``.

    ``skew``: the shares raised to this power and renormalized (1: the measured shares as they are; > 1 a
    SUBSTITUTE trace, sharper than the measured one with the same ranking and drift: :func:`skew_for`)."""
    trace = np.asarray(trace, dtype=np.int64)
    iters, layers, _, E = trace.shape
    rng = np.random.default_rng(seed)
    G = trace.sum(axis=2).astype(np.float64)
    out = np.empty((iters, layers, sources, E), dtype=np.int64)
    for i in range(iters):
        for l in range(layers):
            p = G[i, l] / G[i, l].sum() if G[i, l].sum() else np.full(E, 1.0 / E)
            if skew != 1.0:
                p = p ** float(skew)
                p = p / p.sum()
            out[i, l] = rng.multinomial(k * tokens, p, size=sources)
    return out
