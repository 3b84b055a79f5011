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
