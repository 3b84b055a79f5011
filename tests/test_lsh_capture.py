"""The LSH-MoE reproduction's captured model: pretrained at a quality run's global batch, captured at one
rank's batch, and its held-out perplexity reported (the reference line of Fig. 6 left)."""
import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def test_capture_trains_at_the_global_batch_and_reports_held_out_perplexity():
    from moelab.strategies.lsh_moe.experiments import tokens
    from moelab.strategies.lsh_moe.experiments.common import scale_spec

    s = scale_spec("smoke")
    torch.set_num_threads(1)
    trained, untrained = tokens.capture("smoke"), tokens.capture("smoke", trained=False)
    assert trained["iters"] == s.capture_iters
    meta = json.loads(next(Path(trained["ckpt"]).glob("meta.json")).read_text())
    assert meta["config"]["train"]["batch_size"] == s.q_nproc * s.batch  # a quality run's global batch
    rows = s.batch * s.seq  # each captured batch plays one source rank of a quality run
    assert all(x.shape[0] == rows for layer in trained["x"] for x in layer)
    assert len(trained["x"][0]) == s.capture_batches
    assert math.isfinite(trained["eval_ppl"]) and trained["eval_ppl"] < untrained["eval_ppl"]


def test_time_to_equal_perplexity_is_read_where_both_curves_reach_it():
    """Fig. 6's metric on hand-made curves: LSH steps twice as fast but ends above Origin's final perplexity,
    so the target is LSH's own final level; the times come from linear interpolation between evaluations."""
    import pandas as pd

    from moelab.strategies.lsh_moe.experiments import quality

    assert quality.first_reach([0, 10, 20], [9.0, 5.0, 1.0], 3.0) == pytest.approx(15.0)
    assert quality.first_reach([0, 10], [9.0, 5.0], 4.0) is None
    rows = []
    for v, step, ppl in (("Origin", 2.0, [40, 30, 20, 10]), ("LSH-MoE", 1.0, [40, 32, 24, 16])):
        for it in range(40):
            rows.append(dict(variant=v, seed=0, iter=it, loss=0.0, step_s=step, time_s=step * (it + 1), rho=1.0,
                             eval_ppl=ppl[it // 10] if it % 10 == 9 else None))
    df = pd.DataFrame(rows)
    s = quality.summary(df).set_index("variant")
    lsh = s.loc["LSH-MoE"]
    assert not lsh.reached and lsh.equal_ppl == pytest.approx(lsh.final_ppl) and lsh.final_ppl > s.loc["Origin", "final_ppl"]
    sm_o = quality.smooth([40, 30, 20, 10])
    t_o = quality.first_reach([20, 40, 60, 80], sm_o, lsh.equal_ppl)
    assert lsh.origin_time_to_equal_s == pytest.approx(t_o) and lsh.time_to_equal_s == pytest.approx(40.0)
    assert lsh.time_speedup_to_target == pytest.approx(t_o / 40.0) and lsh.time_speedup_to_target > 1
    assert lsh.iters_speedup_to_target == pytest.approx((t_o / 2) / 40.0) and lsh.iters_speedup_to_target < 1
