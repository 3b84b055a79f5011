"""Strategy ``fastermoe`` through the Trainer (fp64, Adam, real gloo ranks): parameters equal the EP
baseline's after several steps (spec §5.4, 'after K optimizer steps ... identical')."""
from __future__ import annotations

import pytest
import torch

from moelab.config import ConfigError, RunConfig
from moelab.runtime.ranks import run_ranks
from moelab.testing import TINY_TRAIN, train_snapshot


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
    return run_ranks(train_snapshot, 2, {}, timeout=120)


def test_shadowing_trains_like_ep(ep):
    forced = run_ranks(train_snapshot, 2, {"parallel.strategy": "fastermoe",
                                   "parallel.strategy_options": {"shadow": True, "shadow_force": [0, 3]}}, timeout=120)
    assert forced[0]["cls"] == "FasterMoELayer"
    assert forced[0]["shadows"][0] == [(0, 3)] * 3
    # 2 layers x 3 iterations x 2 shadowed experts: one broadcast and one reduce each
    assert forced[0]["ops"]["broadcast"] == forced[0]["ops"]["reduce"] == 12
    assert_same_training(ep, forced)


def test_smart_schedule_with_shadowing_trains_like_ep(ep):
    smart = run_ranks(train_snapshot, 2, {"parallel.strategy": "fastermoe", "parallel.strategy_options": {
        "smart": True, "group_size": 1, "shadow_force": [1]}}, timeout=120)
    assert smart[0]["ops"].get("all_to_all", 0) == 0 and smart[0]["ops"]["p2p"] > 0
    assert_same_training(ep, smart)


def test_policy_driven_shadowing_trains_like_ep(ep):
    opts = {"shadow": True, "shadow_gpu_flops": 1e5, "shadow_net_bw": 1e12}  # compute-bound: shadow hot experts
    pol = run_ranks(train_snapshot, 2, {"parallel.strategy": "fastermoe", "parallel.strategy_options": opts},
                    timeout=120)
    assert pol[0]["shadows"] == pol[1]["shadows"]
    assert any(s for layer in pol[0]["shadows"] for s in layer)  # the policy really shadowed something
    assert_same_training(ep, pol)


@pytest.mark.parametrize("opts, msg", [({"shadwo": True}, "unknown fastermoe option"),
                                       ({"smart": True, "group_size": 3}, "N % group_size"),
                                       ({"shadow_force": [9]}, "outside")])
def test_bad_options_fail_before_training(opts, msg):
    """Bad options fail in RunConfig.validate(), i.e. before any process starts."""
    cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": 4, "parallel.strategy": "fastermoe",
                                      "parallel.strategy_options": opts})
    with pytest.raises(ConfigError, match=msg):
        cfg.validate()
