"""LSH-MoE in training: a launched run (torchrun, 2 gloo ranks) writes every rank's per-layer metrics
(the trainer's ``layer.last_metrics`` hook) and its plans, and the two agree on the compression rate; a
run with the CP hash compresses (M < A somewhere) and trains to finite losses."""
from __future__ import annotations

import pandas as pd

from moelab.runtime.launch import launch
from moelab.testing import TINY_TRAIN


def test_launched_run_records_per_layer_metrics_that_agree_with_the_plans(tmp_path):
    over = {**{k: v for k, v in TINY_TRAIN.items() if k != "train.dtype"}, "parallel.strategy": "lsh_moe",
            "parallel.strategy_options": {"num_hashes": 1, "cp_dim": 1}, "train.iters": 3}
    run = launch({}, 2, overrides=over, out_root=tmp_path, progress=False, timeout=180)
    lm = run.layer_metrics
    n_moe = run.plans.layer.nunique()
    assert len(lm) == 2 * 3 * n_moe and set(lm["rank"]) == {0, 1}
    assert (lm.M <= lm.A).all() and (lm.M < lm.A).any()
    assert run.metrics.loss.notna().all()
    per = lm.groupby(["iter", "layer"])[["M", "A"]].sum()
    for p in run.plans.itertuples():
        m, a = per.loc[(p.iter, p.layer)]
        assert p.lsh["rho"] == m / a  # the layer's own count of rows and the all-gathered counts agree
        assert sum(map(sum, p.lsh["centroids"])) == m
    assert isinstance(lm, pd.DataFrame) and {"rho", "rho_remote", "hash_s", "err_ec", "err_noec"} <= set(lm.columns)
