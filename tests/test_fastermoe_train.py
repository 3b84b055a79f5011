"""Strategy ``fastermoe`` through the Trainer (fp64, Adam, real gloo ranks): parameters equal the EP
baseline's after several steps (spec §5.4, 'after K optimizer steps ... identical')."""
from __future__ import annotations

import pytest
import torch

from moelab.config import ConfigError, RunConfig
from moelab.testing import run_ranks

BASE = {
    "model.d_model": 16, "model.d_ff": 32, "model.n_layers": 2, "model.n_heads": 2, "model.seq_len": 16,
    "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.balance_loss_coef": 0.0,
    "model.moe.z_loss_coef": 0.001, "train.iters": 3, "train.batch_size": 2, "train.dtype": "float64",
    "train.lr": 1e-2, "train.trace": False,
}


def _train(rank, world, overrides):
    from moelab.runtime.train import Trainer

    cfg = RunConfig().with_overrides({**BASE, "parallel.nproc": world, **overrides}).validate()
    tr = Trainer.build(cfg)
    losses = [row["loss"] for row in tr.run()]
    experts = {}
    for li, layer in enumerate(tr.model.moe_layers()):
        ex = layer.experts
        for s, e in enumerate(ex.experts):
            experts[(li, e)] = torch.cat([p[s].detach().reshape(-1) for p in (ex.w1, ex.b1, ex.w2, ex.b2)])
    dense = torch.cat([p.detach().reshape(-1) for p in tr.model.dense_parameters()])
    shadows = [list(getattr(layer, "shadow_log", [])) for layer in tr.model.moe_layers()]
    ops = {}
    for r in tr.comm.rec.comm:
        ops[r.op] = ops.get(r.op, 0) + 1
    return dict(losses=losses, experts=experts, dense=dense, shadows=shadows, ops=ops, cls=type(tr.model.moe_layers()[0]).__name__)


def assert_same_training(a, b, tol=1e-10):
    torch.testing.assert_close(torch.tensor(b[0]["losses"]), torch.tensor(a[0]["losses"]), rtol=tol, atol=0)
    for ra, rb in zip(a, b):
        assert set(ra["experts"]) == set(rb["experts"])
        for key in ra["experts"]:
            torch.testing.assert_close(rb["experts"][key], ra["experts"][key], rtol=tol, atol=tol)
        torch.testing.assert_close(rb["dense"], ra["dense"], rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def ep():
    """The EP baseline, trained once for the whole module."""
    return run_ranks(_train, 2, {}, timeout=120)


def test_shadowing_trains_like_ep(ep):
    forced = run_ranks(_train, 2, {"parallel.strategy": "fastermoe",
                                   "parallel.strategy_options": {"shadow": True, "shadow_force": [0, 3]}}, timeout=120)
    assert forced[0]["cls"] == "FasterMoELayer"
    assert forced[0]["shadows"][0] == [(0, 3)] * 3
    # 2 layers x 3 iterations x 2 shadowed experts: one broadcast and one reduce each
    assert forced[0]["ops"]["broadcast"] == forced[0]["ops"]["reduce"] == 12
    assert_same_training(ep, forced)


def test_smart_schedule_with_shadowing_trains_like_ep(ep):
    smart = run_ranks(_train, 2, {"parallel.strategy": "fastermoe", "parallel.strategy_options": {
        "smart": True, "group_size": 1, "shadow_force": [1]}}, timeout=120)
    assert smart[0]["ops"].get("all_to_all", 0) == 0 and smart[0]["ops"]["p2p"] > 0
    assert_same_training(ep, smart)


def test_policy_driven_shadowing_trains_like_ep(ep):
    opts = {"shadow": True, "shadow_gpu_flops": 1e5, "shadow_net_bw": 1e12}  # compute-bound: shadow hot experts
    pol = run_ranks(_train, 2, {"parallel.strategy": "fastermoe", "parallel.strategy_options": opts}, timeout=120)
    assert pol[0]["shadows"] == pol[1]["shadows"]
    assert any(s for layer in pol[0]["shadows"] for s in layer)  # the policy really shadowed something
    assert_same_training(ep, pol)


@pytest.mark.parametrize("opts, msg", [({"shadwo": True}, "unknown fastermoe option"),
                                       ({"smart": True, "group_size": 3}, "N % group_size"),
                                       ({"shadow_force": [9]}, "outside")])
def test_bad_options_fail_before_training(opts, msg):
    """Bad options fail in RunConfig.validate(), i.e. before any process starts."""
    cfg = RunConfig().with_overrides({**BASE, "parallel.nproc": 4, "parallel.strategy": "fastermoe",
                                      "parallel.strategy_options": opts})
    with pytest.raises(ConfigError, match=msg):
        cfg.validate()
