"""Lina's inference at paper scale, SIMULATED: one device per expert on profile ``lina``, from the REAL routing
traces of the served model (:func:`moelab.papers.lina.runs.inference_suite`), each batch tiled to the fitted
batch size (Figs. 16-18, Table 5's times). Training at paper scale is :mod:`.paper_scale`."""
from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.comm.topology import Topology
from moelab.papers.kit.cache import cached
from moelab.papers.kit.compare import paper_value
from moelab.papers.lina import runs
from moelab.strategies.lina.options import LinaServeOptions
from moelab.strategies.lina.popularity import PathTable
from moelab.strategies.lina.sim_infer import InferShape, simulate_serving

from .common import scale_spec
from .paper_scale import assumed, calibrated_profile


def paper_overheads() -> dict:
    """The inference model's constants (:data:`moelab.strategies.lina.sim_infer.DEFAULT_OVERHEADS`'s names, in
    seconds and GB/s) from ``experiments/lina/assumptions.yaml``: the paper's measured scheduler costs
    (``o_check``, ``o_plan``, ms) and the guessed swap bandwidth and per-expert launch cost."""
    return {"o_check_s": assumed("o_check") / 1e3, "o_plan_s": assumed("o_plan") / 1e3,
            "h2d_GBps": assumed("h2d_GBps"), "expert_launch_s": assumed("expert_launch_us") / 1e6}


@cached
def fitted_infer_tokens(scale: str, seed: int = 0) -> dict:
    """Tokens per inference batch FITTED (a fit, not a result) so that the baseline's all-to-all time per MoE
    layer equals Table 1's inference measurement (16 GPUs, 12 layers: ``infer_a2a_16gpu_12L`` ms in paper.yaml,
    / 12), the spec's calibration target for the simulator. The all-to-all time is about linear in the tokens:
    one proportional step from the assumption's value, rounded to whole REAL batches, then priced again."""
    target = paper_value("lina", "infer_a2a_16gpu_12L") / 1e3 / 12

    def per_layer(tokens):
        df = inference(scale, seed, tokens, ("baseline",))
        return float(df.a2a_s.mean()) / df.attrs["moe_layers"], df.attrs["batch_tokens"]

    start = assumed("infer_tokens_per_batch")
    got, _ = per_layer(start)
    tokens = start * target / got
    a2a, used = per_layer(tokens)
    return {"tokens": used, "a2a_per_layer_s": a2a, "target_s": target, "start_tokens": start}


@cached
def inference(scale: str, seed: int = 0, tokens_per_batch=None, variants=None, free_scheduling: bool = False,
              rounding: str = "floor", replan_test: str = "sets", first_layers: str = "static",
              path_len=None) -> pd.DataFrame:
    """Fig. 16 at one device per expert: every variant's batch times from the REAL model's routing
    traces (its first half fits the path table, the second half is served), priced at paper scale: the
    served half cut into the REAL serving path's batches (B sequences), each tiled to the assumed paper
    batch (``tokens_per_batch``; default: :func:`fitted_infer_tokens`'s) so Lina's fixed scheduling costs
    meet a paper-size batch; ``variants``: default all; ``free_scheduling``: a what-if with the paper's
    scheduler costs (``o_plan``, ``o_check``) set to zero, to separate them from the placement's quality;
    ``rounding``: the scheduled variants' ``serve.strategy_options.replica_rounding``
    (:func:`moelab.strategies.lina.placement.allocate`); ``replan_test``: Lina's ``serve.strategy_options.replan_test``
    (phase 2 by the top sets, or by load); ``first_layers``: its ``serve.strategy_options.first_layers`` (the layers
    before path_len static, or planned from the actual counts); ``path_len``:
    the estimator's path (default: the scale's middle one, Table 5's 3 at the default scale)."""
    s = scale_spec(scale)
    t = np.asarray(runs.inference_suite(scale, seed)["traces"], dtype=np.int64)
    E = s.i_experts
    Lp = s.path_lens[min(1, len(s.path_lens) - 1)] if path_len is None else path_len
    half = len(t) // 2
    table = PathTable.fit(t[:half], E, Lp)
    test = t[half:]
    real = min(s.serve_batch * s.i_seq, len(test))  # the tokens of one batch of the REAL serving path
    n_batches = max(1, len(test) // real)
    fit = tokens_per_batch is None
    k = max(1, round((fitted_infer_tokens(scale, seed)["tokens"] if fit else tokens_per_batch) / real))
    src = np.arange(len(test)) % E
    batches = [np.tile(np.arange(b * real, (b + 1) * real), k) for b in range(n_batches)]
    sv = LinaServeOptions(path_len=Lp, replica_rounding=rounding, replan_test=replan_test, first_layers=first_layers)
    over = paper_overheads() | ({"o_plan_s": 0.0, "o_check_s": 0.0} if free_scheduling else {})
    rows = simulate_serving(test, src, batches, variants or runs.VARIANTS, sv, table, calibrated_profile(),
                            Topology(E, min(4, E)), InferShape(d_model=assumed("d_model"), d_ff=assumed("d_ff"),
                                                                seq_len=assumed("seq_len")), overheads=over)
    out = pd.DataFrame(rows)
    out.attrs.update(batch_tokens=k * real, moe_layers=int(t.shape[1]), label=(
        f"SIMULATED: profile lina (calibrated to Table 1's training row), {E} devices (one per expert), "
        "priced from the REAL routing traces of the model "
        f"trained here: {n_batches} batches of {real} served tokens, each tiled x{k} to {k * real} tokens per batch "
        + ("(FITTED: the baseline's all-to-all time per MoE layer = Table 1's inference all-to-all at 16 GPUs "
           "/ its 12 layers)" if fit else "(given)")
        + "; a tiled batch keeps its expert mix, where a real batch that size would be smoother"))
    return out


def inference_layers(scale: str, seed: int = 0) -> pd.DataFrame:
    """Figs. 17, 18 (SIMULATED, as Fig. 16): per variant and MoE layer, the p95 over batches of the layer's time
    and of its all-to-alls' time, and the baseline's p95 over each variant's."""
    raw = inference(scale, seed)
    rows = []
    for v, g in raw.groupby("variant", sort=False):
        span, a2a = np.array(g.layer_s.tolist()), np.array(g.layer_a2a_s.tolist())
        for layer in range(span.shape[1]):
            rows.append({"variant": v, "layer": layer, "p95_layer_s": float(np.percentile(span[:, layer], 95)),
                         "p95_a2a_s": float(np.percentile(a2a[:, layer], 95))})
    df = pd.DataFrame(rows)
    base = df[df.variant == "baseline"].set_index("layer")
    df["p95_layer_speedup"] = df.layer.map(base.p95_layer_s) / df.p95_layer_s
    df["a2a_reduction"] = df.layer.map(base.p95_a2a_s) / df.p95_a2a_s
    df.attrs["label"] = raw.attrs["label"]
    return df


def path_length_times(scale: str, seed: int = 0) -> pd.DataFrame:
    """Table 5's times (SIMULATED, as Fig. 16): per path length of the scale, Lina's median and p95 batch time
    over Ideal's on the same batches."""
    rows = []
    for n in scale_spec(scale).path_lens:
        df = inference(scale, seed, variants=("ideal", "lina"), path_len=int(n))
        g = df.groupby("variant").batch_s
        med, p95 = g.median(), g.quantile(0.95)
        rows.append({"path_len": int(n), "median_over_ideal": med["lina"] / med["ideal"],
                     "p95_over_ideal": p95["lina"] / p95["ideal"],
                     "replans": int(df[df.variant == "lina"].replans.sum())})
    out = pd.DataFrame(rows)
    out.attrs["label"] = df.attrs["label"]
    return out
