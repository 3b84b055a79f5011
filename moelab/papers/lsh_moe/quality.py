"""Model quality under compression, from real training (Fig. 6 left, SUBSTITUTE): a RoBERTa-like masked-LM
MoE on the stdlib's text, trained on gloo ranks declared as 2 nodes with EMULATED links, three variants
(Origin = the uncompressed layer, LSH-MoE = CP L=6 r=2 with residual compensation, LSH-MoE without it)
plus the L calibrated on the substitute to reach rho <= 0.25 when L=6 does not, over several seeds.

Evaluation runs the exact (uncompressed) forward, the headline; one extra run of LSH-MoE (seed 0) is
evaluated with the compressed forward. Every run logs its measured rho per iteration
(Σ M / Σ A over ranks and MoE layers, from the layers'
own metrics), its held-out perplexity every ``q_eval_every`` iterations and its step times (EMULATED
links: the all-to-all bytes each variant really sends, priced by the door's emulation). Time to the
Origin's final perplexity is read off these curves; a run that never reaches it says so.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.config import RunConfig
from moelab.measure.realruns import run_real_many
from moelab.papers.kit.cache import cached

from . import rates, tokens
from .common import runs_timeout, scale_spec, tiny_overrides

VARIANTS = {"Origin": {"hash_family": "none"}, "LSH-MoE": {}, "LSH-MoE w/o EC": {"error_compensation": False}}
COMPRESSED_EVAL = "LSH-MoE, compressed eval"  # every other variant is evaluated with the exact forward (the headline)


def variants(scale) -> dict:
    """Fig. 6's variants, plus ``LSH-MoE (L=n)`` at the calibrated L when L=6 is above rho 0.25."""
    return {**VARIANTS, **rates.low_rate_variant(scale)}


PANELS = {"lm": "Fig. 6 left: RoBERTa-MoE masked LM on BooksCorpus+Wikipedia",
          "span": "Fig. 6 right: T5-MoE span-masked LM on an industry dataset"}


def run_config(scale, opts: dict, seed: int, task: str = "lm"):
    s = scale_spec(scale)
    return RunConfig().with_overrides({
        **tiny_overrides(s, iters=s.q_iters, seed=seed), "paper": "lsh_moe", "name": f"quality-{task}",
        "train.task": task,
        "parallel.nproc": s.q_nproc, "parallel.topology.nodes": s.q_nodes, "parallel.strategy": "lsh_moe",
        "parallel.strategy_options": {"error_sample": 0, **opts}, "train.lr": s.q_lr,
        "train.eval_every": s.q_eval_every,
        "train.eval_batches": s.q_eval_batches, "emulation.enabled": True, "emulation.intra_bw_GBps": s.intra_GBps,
        "emulation.inter_bw_GBps": s.inter_GBps, "emulation.intra_latency_us": s.latency_us,
        "emulation.inter_latency_us": s.latency_us}).validate()


@cached
def convergence(scale, task: str = "lm") -> pd.DataFrame:
    """One row per (variant, seed, iteration): loss, eval_ppl (NaN between evaluations), step_s (slowest
    rank), time_s (cumulative), rho (measured; 1 for Origin). ``task``: ``lm`` (masked LM, Fig. 6 left) or
    ``span`` (T5-like span corruption on the same encoder, Fig. 6 right)."""
    s = scale_spec(scale)
    vs = variants(scale)
    keys = [(v, seed) for seed in range(s.q_seeds) for v in vs]
    vs[COMPRESSED_EVAL] = {**vs["LSH-MoE"], "eval_mode": "compressed"}  # the same training, evaluated compressed
    keys.append((COMPRESSED_EVAL, 0))
    runs = run_real_many([run_config(scale, vs[v], seed, task) for v, seed in keys], s.q_nproc,
                         timeout=runs_timeout(len(keys)))
    rows = []
    for (v, seed), run in zip(keys, runs):
        lm = run.layer_metrics
        rho = (lm.groupby("iter").M.sum() / lm.groupby("iter").A.sum()) if lm is not None and len(lm) else None
        t = 0.0
        for it, m in enumerate(run.metrics):
            step = float(np.max(run.step_times[it]))
            t += step
            rows.append(dict(variant=v, seed=seed, iter=it, loss=m["loss"], eval_ppl=m.get("eval_ppl"), step_s=step,
                             time_s=t, rho=float(rho.loc[it]) if rho is not None else 1.0))
    df = pd.DataFrame(rows)
    df["eval_ppl"] = pd.to_numeric(df.eval_ppl, errors="coerce")
    if task == "lm":  # how far these runs are from a longer-trained model of the same shape
        cap = tokens.capture(scale)
        df.attrs["reference_ppl"], df.attrs["reference_iters"] = cap["eval_ppl"], cap["iters"]
    df.attrs["label"] = (f"SUBSTITUTE ({PANELS[task]}): tiny bert-MoE "
                         f"{'masked LM' if task == 'lm' else 'span corruption (encoder-only)'} "
                         f"(d={s.d}, {s.layers} layers, {s.experts} experts, top-2, ALiBi positions) "
                         f"on the stdlib's text; REAL training on {s.q_nproc} gloo ranks as {s.q_nodes} nodes, "
                         f"EMULATED links {s.intra_GBps}/{s.inter_GBps} GB/s "
                         f"intra/inter, {s.q_seeds} seed(s), {s.q_iters} iterations")
    return df


def smooth(y, sigma: float = 0.5) -> np.ndarray:
    """The paper's Gaussian smoothing (sigma in points) of a perplexity curve."""
    y = np.asarray(y, dtype=float)
    if sigma <= 0 or len(y) < 2:
        return y
    x = np.arange(len(y))
    w = np.exp(-0.5 * ((x[:, None] - x[None, :]) / sigma) ** 2)
    return (w @ y) / w.sum(1)


def first_reach(x, ppl, level: float):
    """Where a (smoothed) perplexity curve first reaches ``level``: ``x`` linearly interpolated between the
    two evaluations around the crossing (the first point if it starts there); None if it never does."""
    x, ppl = np.asarray(x, dtype=float), np.asarray(ppl, dtype=float)
    hit = np.nonzero(ppl <= level * (1 + 1e-9))[0]
    if not len(hit):
        return None
    i = int(hit[0])
    if i == 0 or ppl[i - 1] == ppl[i]:
        return float(x[i])
    f = (ppl[i - 1] - level) / (ppl[i - 1] - ppl[i])
    return float(x[i - 1] + min(max(f, 0.0), 1.0) * (x[i] - x[i - 1]))


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per variant (mean over seeds): final eval perplexity, measured rho, mean step time; whether it reached
    Origin's final (smoothed) perplexity, and after how many iterations and seconds; and the paper's metric,
    time (and iterations) to *equal* perplexity against Origin: to the level both this variant and Origin
    reach (the higher of the two final smoothed perplexities), interpolated between evaluations
    (``iters_to_equal`` / ``origin_iters_to_equal``: the iterations each needs to that level, which
    :func:`moelab.papers.lsh_moe.speed.simulated_time` prices at paper scale)."""
    ev = df.dropna(subset=["eval_ppl"])
    curves = ev.groupby(["variant", "iter"]).agg(ppl=("eval_ppl", "mean"), time_s=("time_s", "mean")).reset_index()
    origin = curves[curves.variant == "Origin"]
    o_sm = smooth(origin.ppl.to_numpy())
    target = float(o_sm[-1])
    rows = []
    for v, c in curves.groupby("variant", sort=False):
        sm = smooth(c.ppl.to_numpy())
        hit = np.nonzero(sm <= target * (1 + 1e-9))[0]
        sub = df[(df.variant == v) & (df.iter > 0)]  # iteration 0 pays the warm-up
        common = max(target, float(sm[-1]))
        t_v, t_o = first_reach(c.time_s, sm, common), first_reach(origin.time_s, o_sm, common)
        i_v, i_o = first_reach(c.iter + 1, sm, common), first_reach(origin.iter + 1, o_sm, common)
        rows.append(dict(variant=v, final_ppl=float(sm[-1]), rho=float(sub.rho.mean()), step_s=float(sub.step_s.mean()),
                         reached=bool(len(hit)), iters_to_target=int(c.iter.iloc[hit[0]]) + 1 if len(hit) else None,
                         time_to_target_s=float(c.time_s.iloc[hit[0]]) if len(hit) else None,
                         equal_ppl=common, time_to_equal_s=t_v, origin_time_to_equal_s=t_o,
                         iters_to_equal=i_v, origin_iters_to_equal=i_o,
                         time_speedup_to_target=t_o / t_v if t_v and t_o else None,
                         iters_speedup_to_target=i_o / i_v if i_v and i_o else None))
    out = pd.DataFrame(rows)
    out["ppl_gap_noec_equal_time"] = float("nan")
    if {"LSH-MoE", "LSH-MoE w/o EC"} <= set(curves.variant):  # the paper's "+0.3 ppl without EC at equal time"
        a, b = (curves[curves.variant == v] for v in ("LSH-MoE", "LSH-MoE w/o EC"))
        t = min(a.time_s.max(), b.time_s.max())
        at = lambda c: float(np.interp(t, c.time_s, smooth(c.ppl.to_numpy())))  # noqa: E731
        out.loc[out.variant == "LSH-MoE w/o EC", "ppl_gap_noec_equal_time"] = at(b) - at(a)
    o = out[out.variant == "Origin"].iloc[0]
    out["ppl_vs_origin"] = out.final_ppl - o.final_ppl
    out["step_speedup"] = o.step_s / out.step_s
    out.attrs["target_ppl"] = target
    out.attrs["reference_ppl"], out.attrs["reference_iters"] = (df.attrs.get("reference_ppl"),
                                                                df.attrs.get("reference_iters"))
    out.attrs["label"] = df.attrs.get("label", "")
    return out
