"""SmartMoE (moelab.placement.rebalance, strategy smartmoe): the LPT permutation and the cost decision as pure
functions, and on gloo ranks 5 Adam steps with a re-placement at step 3 equal to the single-process run
(params + Adam state moved by the one migration routine); no collective when nothing moves; bad options."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.config import ConfigError, RunConfig
from moelab.placement.rebalance import decide, device_loads, lpt_owners, moves, smartmoe_round
from moelab.runtime.ranks import run_ranks
from moelab.testing import TINY_TRAIN


def test_lpt_fills_every_device_and_follows_the_greedy_rule():
    rng = np.random.default_rng(0)
    for _ in range(50):
        N = int(rng.integers(1, 5))
        k = int(rng.integers(1, 4))
        F = rng.integers(0, 100, size=N * k).tolist()
        own = lpt_owners(F, N, k)
        assert np.bincount(own, minlength=N).tolist() == [k] * N
        load, free = [0] * N, [k] * N  # replay: each expert (load order) lands on a least-loaded open device
        for e in sorted(range(N * k), key=lambda e: (-F[e], e)):
            best = min(load[d] for d in range(N) if free[d])
            assert load[own[e]] == best
            load[own[e]] += F[e]
            free[own[e]] -= 1
        assert device_loads(own, F, N) == load
    with pytest.raises(ValueError):
        lpt_owners([1, 2, 3], 2, 1)


def test_decision_applies_only_when_the_gain_pays_for_the_move():
    from moelab.sim.placement_cost import PlacementCost
    from moelab.sim.profiles import get_profile

    cost = PlacementCost.from_profile(get_profile("hecate_A"), 768, 1536, ranks_per_node=2)
    old = [0, 0, 1, 1, 2, 2, 3, 3]
    C = np.array([[5000, 5000, 1, 1, 1, 1, 1, 1]] * 4)  # both hot experts on device 0
    new = lpt_owners(C.sum(0).tolist(), 4, 2)
    ok, gain, mig = decide(old, new, C, 25, cost)
    assert ok and gain > mig and moves(old, new)
    ok, gain, mig = decide(old, new, C // 1000 + 1, 1, cost)  # a few tokens, one iteration: not worth it
    assert not ok and gain < mig
    assert decide(old, old, C, 25, cost) == (False, 0.0, 0.0)
    assert decide(old, new, C, 25, cost, "never")[0] is False and decide(old, new, C // 1000 + 1, 1, cost, "always")[0]
    rnd = smartmoe_round([old], C[None], 25, cost, 4)
    assert rnd[0][1] == "applied" and rnd[0][0] == new


BASE = {**TINY_TRAIN, "train.iters": 5, "model.moe.num_experts": 8}


def _train(rank, world, runs):
    from moelab.runtime.train import Trainer

    torch.set_num_threads(1)
    out = {}
    for name, over in runs.items():
        cfg = RunConfig().with_overrides({**BASE, "parallel.nproc": world, **over}).validate()
        tr = Trainer.build(cfg)
        losses = [r["loss"] for r in tr.run()]
        experts = {}
        for li, layer in enumerate(tr.model.moe_layers()):
            ex = layer.experts
            for s, e in enumerate(ex.experts):
                experts[(li, e)] = (torch.cat([p[s].detach().reshape(-1) for p in ex.stacked() if p is not None]),
                                    tr.update.optimizer.state[ex.w1]["exp_avg"][s].clone())
        out[name] = dict(losses=losses, experts=experts, plans=tr.plans,
                         migrate=sum(1 for r in tr.comm.rec.comm if r.tags.get("phase") == "migrate"))
    return out


def test_five_adam_steps_with_a_replacement_equal_the_single_process_run():
    ref = run_ranks(_train, 1, {"ref": {"train.batch_size": 4 * BASE["train.batch_size"]}}, timeout=120)[0]["ref"]
    runs = {"always": {"parallel.strategy": "smartmoe",
                       "parallel.strategy_options": {"interval": 3, "decision": "always"}},
            "never": {"parallel.strategy": "smartmoe",
                      "parallel.strategy_options": {"interval": 3, "decision": "never"}}}
    got = run_ranks(_train, 4, runs, timeout=120)
    for name in runs:
        torch.testing.assert_close(torch.tensor(got[0][name]["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-10, atol=0)
        held = {k: v for r in got for k, v in r[name]["experts"].items()}
        assert set(held) == set(ref["experts"])
        for k, (p, m) in ref["experts"].items():
            torch.testing.assert_close(held[k][0], p, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(held[k][1], m, rtol=1e-10, atol=1e-12)
    moved = [r for it in got[0]["always"]["plans"] for r in [it] if r["smartmoe"]["moved"]]
    assert moved and {r["iter"] for r in moved} == {3}  # the round ran at the interval and moved experts
    assert all(r["never"]["migrate"] == 0 for r in got) and all(r["always"]["migrate"] == 1 for r in got)


def test_bad_options_fail_before_launch():
    def cfg(opts, **over):
        return RunConfig().with_overrides({"parallel.nproc": 2, "model.moe.num_experts": 4,
                                           "parallel.strategy": "smartmoe",
                                           "parallel.strategy_options": opts, **over})

    for opts, over, msg in [({"interval": 0}, {}, "interval must be >= 1"), ({"decision": "maybe"}, {}, "decision"),
                            ({"cost_profile": "nope"}, {}, "cost_profile"),
                            ({}, {"model.moe.num_experts": 2}, "E/N = 1"),
                            ({}, {"model.moe.dispatcher": "dense"}, "dispatcher"),
                            ({}, {"parallel.placement": {0: [0], 1: [0], 2: [1], 3: [1]}}, "placement")]:
        with pytest.raises(ConfigError, match=msg):
            cfg(opts, **over).validate()


def test_replay_is_deterministic_and_replaces_at_the_interval():
    from moelab.sim.placement_cost import PlacementCost
    from moelab.sim.profiles import get_profile
    from moelab.strategies.smartmoe.sim_graph import smartmoe_replay

    cost = PlacementCost.from_profile(get_profile("hecate_A"), 768, 1536, ranks_per_node=2)
    rng = np.random.default_rng(1)
    trace = rng.multinomial(4000, [0.5, 0.3] + [0.2 / 6] * 6, size=(12, 2, 4))
    a, note = smartmoe_replay(trace, K=5, window=5, cost=cost, N=4, decision="always")
    b, _ = smartmoe_replay(trace, K=5, window=5, cost=cost, N=4, decision="always")
    assert a == b and "applied" in note
    assert {i for i, p in enumerate(a) if p["moved"]} <= {5, 10} and a[5]["moved"]
