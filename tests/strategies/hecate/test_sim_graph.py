"""Hecate's simulator graph (``moelab/strategies/hecate/sim_graph.py``): which calls run beside compute."""
from __future__ import annotations

import dataclasses

import pytest

from moelab.config import RunConfig
from moelab.sim import get_profile
from moelab.sim.graphs import config_for_profile, iteration_graph, synthetic_loads
from moelab.strategies.hecate.policy import homogeneous_owners


@pytest.mark.parametrize("busy", [None, 5e-3])
def test_sparse_collectives_beside_attention_and_backward_pay_the_busy_costs(busy):
    """spAG is issued before attention and moves beside it, spRS beside the backward below its layer: where
    the profile has a busy host's fixed costs they pay them; the token all-to-alls, which the ranks wait for,
    pay the idle ones. Without busy costs every call pays the idle ones."""
    prof = get_profile("fastermoe_johnny")  # 2 nodes x 8: hardware pricing, the fixed cost joins the duration
    cfg = config_for_profile(RunConfig(), prof, **{"model.n_layers": 2, "model.moe.num_experts": 16,
                                                   "parallel.strategy": "hecate", "model.seq_len": 32})
    N = cfg.parallel.nproc
    owners = homogeneous_owners(2, 16, N)
    holders = [tuple((int(o),) + (tuple(d for d in range(N) if d != o) if e == 0 else ()) for e, o in enumerate(row))
               for row in owners]  # expert 0 of each layer on every device
    prof = dataclasses.replace(prof, call_overhead_s=1e-3, busy_call_overhead_s=busy)
    g = iteration_graph(cfg, prof, synthetic_loads(cfg, seed=3, skew=1.5), holders=holders, owners=owners)
    comm = {o.name: o for o in g.ops if o.kind == "comm"}
    sparse = [o for n, o in comm.items() if ".spag" in n or ".sprs" in n]
    tokens = [o for n, o in comm.items()
              if n.split(".", 1)[1] in ("dispatch", "combine", "dispatch.bwd", "combine.bwd")]
    assert len(sparse) == 4 and len(tokens) == 8  # spAG and spRS of both layers; 4 token exchanges a layer
    tok_alpha = tokens[0].duration - 1e-3
    for o in sparse:
        # the same links' latency as a token all-to-all across both nodes, plus the call's fixed cost
        assert o.duration == pytest.approx(tok_alpha + (busy if busy else 1e-3))
    assert all(o.duration == pytest.approx(tok_alpha + 1e-3) for o in tokens)


def test_calibration_policy_time_is_compute_before_dispatch():
    """A real run's measured calibration CPU time (``policy_s``) is compute on every rank between the gate and
    the dispatch all-to-all: the iteration grows by exactly it, once per MoE layer that has it."""
    from moelab.sim.engine import simulate

    prof = get_profile("fastermoe_johnny")
    cfg = config_for_profile(RunConfig(), prof, **{"model.n_layers": 2, "model.moe.num_experts": 16,
                                                   "parallel.strategy": "hecate", "model.seq_len": 32})
    owners = homogeneous_owners(2, 16, cfg.parallel.nproc)
    loads = synthetic_loads(cfg, seed=3, skew=1.5)
    base = simulate(iteration_graph(cfg, prof, loads, owners=owners)).makespan
    g = iteration_graph(cfg, prof, loads, owners=owners, policy_s=[0.02, 0.0])
    pol = [o for o in g.ops if ".calibrate_policy." in o.name]
    assert len(pol) == cfg.parallel.nproc and {o.ranks for o in pol} == {(r,) for r in range(cfg.parallel.nproc)}
    assert simulate(g).makespan == pytest.approx(base + 0.02 + g.op_overhead_s, rel=1e-9)  # plus the per-op overhead


def test_replay_times_the_calibration_only_when_asked():
    """``time_policy`` adds this host's calibration seconds per layer (``policy_s``, what a REAL run records) and
    changes no plan; without it the replay is host-independent (no timing key). The graph prices those seconds as
    they are: one op per rank and timed layer lasting exactly ``policy_s[j]``, and the iteration longer than the
    untimed plan's by exactly their sum (they sit on every rank's path before dispatch)."""
    import numpy as np

    from moelab.papers.hecate.replay import graph_kwargs, hecate_plans
    from moelab.sim.engine import simulate
    from moelab.sim.placement_cost import PlacementCost

    trace = np.random.default_rng(1).integers(0, 50, size=(4, 2, 4, 8)) * np.array([8, 1, 1, 1, 1, 1, 1, 1])
    prof = get_profile("hecate_A")
    cost = PlacementCost.from_profile(prof, d_model=64, d_ff=128, ranks_per_node=2)
    kw = dict(t=2, m=2, ranks_per_node=2, cost=cost, calibration_rule="best")
    plain, timed = hecate_plans(trace, **kw), hecate_plans(trace, **kw, time_policy=True)
    assert all("policy_s" not in p for p in plain)
    assert [{k: v for k, v in p.items() if k != "policy_s"} for p in timed] == plain
    assert any(s != "off" for p in plain for s in p["calibration"]) and sum(sum(p["policy_s"]) for p in timed) > 0
    cfg = RunConfig().with_overrides({"model.d_model": 64, "model.d_ff": 128, "model.n_layers": 2, "model.seq_len": 32,
                                      "model.moe.num_experts": 8, "parallel.nproc": 4, "parallel.topology.nodes": 2,
                                      "parallel.strategy": "hecate"})
    for it, (p, q) in enumerate(zip(plain, timed)):
        assert len(q["policy_s"]) == 2
        g = iteration_graph(cfg, prof, trace[it], **graph_kwargs(q))
        ops = {o.name: o.duration for o in g.ops if ".calibrate_policy." in o.name}
        assert ops == {f"L{j}.calibrate_policy.{r}": s for j, s in enumerate(q["policy_s"]) if s > 0 for r in range(4)}
        timed_ops = sum(s > 0 for s in q["policy_s"])
        grown = simulate(g).makespan - simulate(iteration_graph(cfg, prof, trace[it], **graph_kwargs(p))).makespan
        assert grown == pytest.approx(sum(q["policy_s"]) + timed_ops * g.op_overhead_s, rel=1e-6, abs=1e-12)
