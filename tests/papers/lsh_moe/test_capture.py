"""The LSH-MoE reproduction's captured model: pretrained at a quality run's global batch, captured at one
rank's batch, and its held-out perplexity reported (the reference line of Fig. 6 left)."""
import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def test_capture_trains_at_the_global_batch_and_reports_held_out_perplexity():
    from moelab.papers.lsh_moe import tokens
    from moelab.papers.lsh_moe.common import scale_spec

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

    from moelab.papers.lsh_moe import quality

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
    assert (not lsh.reached and lsh.equal_ppl == pytest.approx(lsh.final_ppl)
            and lsh.final_ppl > s.loc["Origin", "final_ppl"])
    sm_o = quality.smooth([40, 30, 20, 10])
    t_o = quality.first_reach([20, 40, 60, 80], sm_o, lsh.equal_ppl)
    assert lsh.origin_time_to_equal_s == pytest.approx(t_o) and lsh.time_to_equal_s == pytest.approx(40.0)
    assert lsh.time_speedup_to_target == pytest.approx(t_o / 40.0) and lsh.time_speedup_to_target > 1
    assert lsh.iters_speedup_to_target == pytest.approx((t_o / 2) / 40.0) and lsh.iters_speedup_to_target < 1


def test_fine_tuning_runs_a_config_once_however_many_tables_ask(monkeypatch):
    """Table 2's topic runs are Fig. 7's Origin and L = 6: ``finetune._run`` spawns each distinct run once
    (options spelled out: ``{}`` is ``{"num_hashes": 6}``), and every asking row gets that run's values."""
    from moelab.papers.lsh_moe import finetune as ft

    spawned = []

    def fake_runs(cfgs, nproc, timeout):
        spawned.extend(c.parallel.strategy_options.get("num_hashes", 6) for c in cfgs)
        return list(cfgs)

    monkeypatch.setattr(ft, "run_real_many", fake_runs)  # where finetune calls it
    monkeypatch.setattr(ft, "_rows", lambda cfgs: [dict(acc=c.parallel.strategy_options.get("num_hashes", 6) / 10)
                                                   for c in cfgs])
    monkeypatch.setattr(ft, "_DONE", {})
    a = ft._run("smoke", [(dict(v="LSH"), "topic", {}, 0, 6, None),
                          (dict(v="L=6"), "topic", {"num_hashes": 6}, 0, 6, None),
                          (dict(v="L=2"), "topic", {"num_hashes": 2}, 0, 6, None)])
    assert spawned == [6, 2] and list(a.v) == ["LSH", "L=6", "L=2"] and list(a.acc) == [0.6, 0.6, 0.2]
    b = ft._run("smoke", [(dict(v="again"), "topic", {"num_hashes": 2}, 0, 6, None),
                          (dict(v="seed 1"), "topic", {"num_hashes": 2}, 1, 6, None)])
    assert spawned == [6, 2, 2] and list(b.acc) == [0.2, 0.2]  # only the new seed ran
