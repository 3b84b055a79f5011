"""Fine-tuning quality under compression, from real runs (SUBSTITUTE for Table 2, Table 3, Fig. 7 left and right).

Text tasks (``moelab.models.tasks``): the tiny masked-LM MoE pretrained *uncompressed* (the capture model of
:mod:`.tokens`, saved as a checkpoint) is fine-tuned with a classification head on 4 gloo ranks as 2 nodes
with EMULATED links, as Origin (uncompressed) and as LSH-MoE; evaluation uses the exact forward (the
headline) and, for LSH-MoE seed 0, also the compressed one. Tasks: ``topic`` (SST/MNLI-like),
``acceptability`` (CoLA-like: original vs word-shuffled), ``paraphrase`` (MRPC/QQP-like).
Images (Table 3): the patch-token MoE on scikit-learn's ``load_digits`` trained from scratch (no pretrained
vision checkpoint exists here), Top-1 and Top-2, EMULATED samples/s.
Fig. 7: accuracy vs the number of hash functions L on ``topic`` (left), and cross-polytope vs spherical
hashing at the rates 20/15/10% (right), each family's L chosen from the rate sweep on the captured rows
(:func:`.rates.rate_sweep`); every run reports the rate it really reached.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from moelab.config import RunConfig
from moelab.measure.realruns import run_real_many
from moelab.models.tasks import num_classes
from moelab.models.vision import num_patches
from moelab.papers.kit.cache import cached
from moelab.strategies.lsh_moe.options import LSHMoEOptions

from . import rates, tokens
from .common import runs_timeout, scale_spec, tiny_overrides

TEXT_TASKS = ("topic", "acceptability", "paraphrase")
ORIGIN = {"hash_family": "none"}
LSH = {}  # the paper's setting: CP, L=6, r=2, EC


def run_config(scale, task: str, opts: dict, seed: int, iters: int, init_from=None):
    s = scale_spec(scale)
    over = {**tiny_overrides(s, iters=iters, seed=seed), "paper": "lsh_moe", "name": f"ft-{task}",
            "parallel.nproc": s.q_nproc, "parallel.topology.nodes": s.q_nodes, "parallel.strategy": "lsh_moe",
            "parallel.strategy_options": {"error_sample": 0, **opts},
            "train.lr": s.q_lr if task == "digits" else s.ft_lr, "train.task": task,
            "train.eval_every": s.ft_eval_every, "train.eval_batches": 2 * max(2, s.q_eval_batches),
            "train.init_from": init_from,
            "emulation.enabled": True, "emulation.intra_bw_GBps": s.intra_GBps, "emulation.inter_bw_GBps": s.inter_GBps,
            "emulation.intra_latency_us": s.latency_us, "emulation.inter_latency_us": s.latency_us}
    if task == "digits":  # a ViT-like patch model: learned positions, as ViT's (no text plateau to avoid)
        over.update({"train.patch_size": s.v_patch, "train.eval_every": max(1, iters // 4),
                     "model.positions": "learned"})
    return RunConfig().with_overrides(over).validate()


def _rows(runs) -> list:
    """One dict per run: final exact-eval top-1/top-2, measured rho, median step time (after iteration 0),
    the task's number of classes."""
    rows = []
    for run in runs:
        ev = [m for m in run.metrics if m.get("eval_acc") is not None]
        lm = run.layer_metrics
        rho = float(lm.M.sum() / lm.A.sum()) if lm is not None and len(lm) else 1.0
        steps = run.step_times[1:].max(axis=1) if len(run.step_times) > 1 else run.step_times.max(axis=1)
        rows.append(dict(acc=ev[-1]["eval_acc"] if ev else None, top2=ev[-1]["eval_top2_acc"] if ev else None,
                         rho=rho, step_s=float(np.median(steps)), final_loss=run.metrics[-1]["loss"],
                         samples_per_step=run.cfg.train.batch_size * run.cfg.parallel.nproc,
                         classes=num_classes(run.cfg)))
    return rows


_DONE: dict = {}  # run identity (:func:`_identity`) -> its row: a run two tables ask for runs once per process
# (``_DONE.clear()`` forgets them, e.g. after editing the code in a live kernel)


def _identity(cfg) -> str:
    """The config with the strategy's options spelled out (``{}`` and ``{"num_hashes": 6}`` are one run)."""
    import dataclasses
    import json

    d = cfg.to_dict()
    d["parallel"]["strategy_options"] = dataclasses.asdict(LSHMoEOptions.from_dict(d["parallel"]["strategy_options"]))
    d.pop("name", None)
    return json.dumps(d, sort_keys=True, default=str)


def _run(scale, specs) -> pd.DataFrame:
    """``specs``: (key dict, task, options, seed, iters, init_from) -> one row each, the runs not done yet in
    this process (Table 2's topic runs are Fig. 7's Origin and L = 6) in one spawn. Runs are deterministic
    in their config, so a shared row is the run's own; only its timing was measured once."""
    s = scale_spec(scale)
    cfgs = [run_config(scale, task, opts, seed, iters, init) for _, task, opts, seed, iters, init in specs]
    ids = [_identity(c) for c in cfgs]
    todo = list(dict.fromkeys(i for i in ids if i not in _DONE))
    if todo:
        by_id = dict(zip(ids, cfgs))  # configs of one identity are the same run
        runs = run_real_many([by_id[i] for i in todo], s.q_nproc, timeout=runs_timeout(len(todo)))
        _DONE.update(zip(todo, _rows(runs)))
    return pd.DataFrame([{**key, **_DONE[i]} for (key, *_), i in zip(specs, ids)])


def _label(scale, what: str) -> str:
    s = scale_spec(scale)
    return (f"SUBSTITUTE ({what}): tiny bert-MoE (d={s.d}, {s.layers} layers, {s.experts} experts, top-2, "
            f"ALiBi positions) pretrained uncompressed {s.capture_iters} iterations of {s.q_nproc * s.batch} "
            f"sequences on the stdlib's text, fine-tuned {s.ft_iters} iterations (lr {s.ft_lr}) on "
            f"{s.q_nproc} gloo ranks as {s.q_nodes} nodes (EMULATED links {s.intra_GBps}/{s.inter_GBps} GB/s), "
            f"{s.q_seeds} seed(s); accuracy from the exact forward on held-out windows")


@cached
def table2(scale) -> pd.DataFrame:
    """Per (task, variant, seed): accuracy (exact eval), the compressed-eval accuracy of LSH-MoE seed 0, rho."""
    s = scale_spec(scale)
    ckpt = tokens.pretrained(scale)
    variants = {"Origin": ORIGIN, "LSH-MoE": LSH, **({} if s.ft_low_L is None else rates.lsh_at(s.ft_low_L))}
    specs = [(dict(task=t, variant=v, seed=seed, eval="exact"), t, opts, seed, s.ft_iters, ckpt)
             for t in TEXT_TASKS for seed in range(s.q_seeds) for v, opts in variants.items()]
    specs += [(dict(task=t, variant="LSH-MoE", seed=0, eval="compressed"), t, {**LSH, "eval_mode": "compressed"}, 0,
               s.ft_iters, ckpt) for t in TEXT_TASKS]
    df = _run(scale, specs)
    df.attrs["label"] = _label(scale, "Table 2: GPT-MoE 15B/52B on GLUE")
    return df


def table2_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per task: mean accuracy of each variant over seeds (exact eval), the compressed-eval accuracy, the
    delta LSH − Origin and its absolute value, LSH's measured rho, the low-rate setting's accuracy and
    rho (when one was added), the chance level (1 / classes)."""
    ex = df[df["eval"] == "exact"]
    rows = []
    for t, sub in ex.groupby("task", sort=False):
        o, l = sub[sub.variant == "Origin"], sub[sub.variant == "LSH-MoE"]
        comp = df[(df.task == t) & (df["eval"] == "compressed")]
        chance = 1 / int(sub.classes.iloc[0])
        low = sub[sub.variant.str.startswith(rates.AT_L)]  # the low-rate setting, when one was added
        rows.append(dict(task=t, origin_acc=o.acc.mean(), origin_std=o.acc.std(ddof=0), lsh_acc=l.acc.mean(),
                         lsh_std=l.acc.std(ddof=0),
                         lsh_acc_compressed_eval=float(comp.acc.mean()) if len(comp) else None,
                         acc_delta=l.acc.mean() - o.acc.mean(), abs_acc_delta=abs(l.acc.mean() - o.acc.mean()),
                         lsh_rho=l.rho.mean(), low_rate_variant=low.variant.iloc[0] if len(low) else None,
                         low_rate_acc=low.acc.mean() if len(low) else None,
                         low_rate_rho=low.rho.mean() if len(low) else None, chance=chance, seeds=len(o)))
    out = pd.DataFrame(rows)
    out.attrs["label"] = df.attrs.get("label", "")
    return out


def bounded_L(rows_per_group: float, r: int = 2, target: float = 0.25) -> int:
    """The largest L whose bucket bound keeps every group at rho <= ``target`` whatever the data:
    ``(2r)^L <= target · rows per group`` (at least 1)."""
    L = 1
    while (2 * r) ** (L + 1) <= target * rows_per_group:
        L += 1
    return L


@cached
def table3(scale) -> pd.DataFrame:
    """Digits: Origin, LSH-MoE (L=6) and LSH-MoE at the L whose bucket bound guarantees rho <= 0.25 (the
    digits rows are not the text model's, so the capture cannot calibrate them), per seed: Top-1, Top-2,
    rho, EMULATED samples/s."""
    s = scale_spec(scale)
    rows_per_group = s.batch * num_patches(s.v_patch) * 2 / s.experts
    Lb = bounded_L(rows_per_group)
    variants = [("Origin", ORIGIN), ("LSH-MoE", LSH), *rates.lsh_at(Lb).items()]
    specs = [(dict(variant=v, seed=seed), "digits", opts, seed, s.v_iters, None)
             for seed in range(s.q_seeds) for v, opts in variants]
    df = _run(scale, specs)
    df["samples_per_s"] = df.samples_per_step / df.step_s
    df.attrs["label"] = ("SUBSTITUTE (Table 3: Swin-MoE on ImageNet-1K): patch-token MoE "
                         f"({s.v_patch}x{s.v_patch} patches, d={s.d}, {s.experts} experts) "
                         f"on scikit-learn's load_digits trained from scratch {s.v_iters} "
                         f"iterations on {s.q_nproc} gloo ranks as {s.q_nodes} nodes; samples/s EMULATED "
                         f"({s.intra_GBps}/{s.inter_GBps} GB/s), {s.q_seeds} seed(s)")
    return df


def table3_summary(df: pd.DataFrame) -> pd.DataFrame:
    g = df.groupby("variant", sort=False).agg(top1=("acc", "mean"), top2=("top2", "mean"), rho=("rho", "mean"),
                                              samples_per_s=("samples_per_s", "mean")).reset_index()
    o = g[g.variant == "Origin"].iloc[0]
    g["top1_delta"] = (g.top1 - o.top1) * 100
    g["throughput_speedup"] = g.samples_per_s / o.samples_per_s
    g.attrs["label"] = df.attrs.get("label", "")
    return g


def _L_for_rate(scale, family: str, target: float) -> tuple:
    """(L, rate on the captured rows) of ``family`` closest to ``target`` (CP at r=2)."""
    sw = rates.rate_sweep(scale)
    sub = sw[(sw.source == "trained") & (sw.family == family)]
    if family == "cross_polytope":
        sub = sub[sub.r == 2]
    best = sub.iloc[(sub.rho - target).abs().argsort().iloc[0]]
    return int(best.L), float(best.rho)


@cached
def fig7(scale) -> pd.DataFrame:
    """``topic`` fine-tuning: accuracy vs L (CP, r=2) with Origin (left), and CP vs spherical at target rates
    20/15/10% (right; each family's L from the rate sweep). Rows: panel, variant, family, L, target, seed, acc, rho."""
    s = scale_spec(scale)
    ckpt = tokens.pretrained(scale)
    specs = []
    for seed in range(s.f7_seeds):
        specs.append((dict(panel="left", variant="Origin", family="none", L=0, target=None, seed=seed), "topic", ORIGIN,
                      seed, s.ft_iters, ckpt))
        for L in (2, 4, 6, 8, 10):
            specs.append((dict(panel="left", variant=f"CP L={L}", family="cross_polytope", L=L, target=None, seed=seed),
                          "topic", {"num_hashes": L}, seed, s.ft_iters, ckpt))
        for target in (0.2, 0.15, 0.1):
            for fam in ("cross_polytope", "spherical"):
                L, _ = _L_for_rate(scale, fam, target)
                specs.append((dict(panel="right", variant=f"{fam} @ {target:.0%}", family=fam, L=L,
                                   target=target, seed=seed),
                              "topic", {"hash_family": fam, "num_hashes": L}, seed, s.ft_iters, ckpt))
    df = _run(scale, specs)
    df.attrs["label"] = _label(scale, "Fig. 7: GPT-MoE 15B on MNLI/SST-2").replace(f"{s.q_seeds} seed(s)",
                                                                                   f"{s.f7_seeds} seed(s)")
    return df


def fig7_right_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per target rate: each family's L, achieved rho and accuracy (mean over seeds), and whether CP >= SP."""
    r = df[df.panel == "right"].groupby(["target", "family"]).agg(L=("L", "first"), rho=("rho", "mean"),
                                                                  acc=("acc", "mean")).reset_index()
    rows = []
    for t, sub in r.groupby("target"):
        cp, sp = sub[sub.family == "cross_polytope"].iloc[0], sub[sub.family == "spherical"].iloc[0]
        rows.append(dict(target=t, cp_L=cp.L, cp_rho=cp.rho, cp_acc=cp.acc, sp_L=sp.L, sp_rho=sp.rho, sp_acc=sp.acc,
                         cp_at_least_sp=int(cp.acc >= sp.acc)))
    out = pd.DataFrame(rows)
    out.attrs["label"] = df.attrs.get("label", "")
    return out
