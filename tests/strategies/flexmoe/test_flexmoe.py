"""FlexMoE (spec ``papers/hecate.md`` §3): the pure scheduler's invariants, the on-demand replica groups
of the comm door, migrate_holders moving params + Adam state with replicas, and fp64 training on 2 and
4 gloo ranks equal to the single-process run with replicas bitwise equal to each other."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.config import ConfigError, RunConfig
from moelab.moe.experts import expert_param_shapes
from moelab.runtime.memory import storage_bytes
from moelab.runtime.ranks import run_ranks
from moelab.strategies.flexmoe.policy import (
    balance_ratio,
    canonical,
    device_loads,
    load_gain,
    schedule,
    slot_budget,
    slots_used,
    time_gain,
    undo_steps,
)
from moelab.testing import TINY_TRAIN

EP2 = ((0,), (0,), (1,), (1,))  # 4 experts on 2 devices


# ---- the pure scheduler -----------------------------------------------------------------------------
def test_balance_ratio_splits_an_expert_evenly_over_its_replicas():
    assert balance_ratio(EP2, [30, 10, 0, 0], 2) == pytest.approx(2.0)
    assert balance_ratio(((0, 1), (0,), (1,), (1,)), [30, 10, 0, 0], 2) == pytest.approx(25 / 20)
    assert balance_ratio(EP2, [0, 0, 0, 0], 2) == 1.0
    assert device_loads(((0, 1), (1,)), [10, 4], 2).tolist() == [5.0, 9.0]


def test_expand_goes_to_the_least_loaded_free_slot():
    holders = ((0,), (1,), (2,), (3,))
    new, steps = schedule(holders, [40, 10, 1, 5], 4, 1, max_steps=1)
    assert steps == [("expand", 0, 0, 2)] and new[0] == (0, 2)


def test_shrink_frees_a_slot_when_every_slot_is_full():
    holders = ((0, 1), (0,), (1,), (1,))  # r=1: device 0 holds 2 of 3 slots, device 1 holds 3 of 3
    new, steps = schedule(holders, [2, 10, 60, 6], 2, 1, max_steps=1)
    # expert 2 is hottest and only device 0 lacks it; device 0 has a free slot: plain expand
    assert steps == [("expand", 2, 1, 0)]
    hot = ((0,), (0, 1), (1,), (1, 0))  # device 1 full, expert 2 (hot) only on 1, expert 1 cold with 2 copies
    new, steps = schedule(hot, [5, 2, 80, 5], 2, 1, max_steps=1)
    assert steps == [("shrink", 1, 0, -1), ("expand", 2, 1, 0)]
    assert new == ((0,), (1,), (0, 1), (0, 1)) and slots_used(new, 2).max() <= slot_budget(4, 2, 1)


def test_migrate_moves_a_replica_off_the_busiest_device():
    new, steps = schedule(EP2, [100, 90, 10, 10], 2, 1, max_steps=4)
    assert steps == [("migrate", 1, 0, 1)] and new == ((0,), (1,), (1,), (1,))


def test_cost_gates_steps_and_K_amortises_them():
    F = [40, 10, 1, 5]
    h = ((0,), (1,), (2,), (3,))
    gain = load_gain(F, 4)(h, schedule(h, F, 4, 1, max_steps=1)[0])  # busiest 40 -> 21 tokens
    assert gain == pytest.approx(19.0)
    assert schedule(h, F, 4, 1, max_steps=1, migration_cost=25.0, K=1)[1] == []
    assert schedule(h, F, 4, 1, max_steps=1, migration_cost=25.0, K=2)[1] == [("expand", 0, 0, 2)]
    assert schedule(h, F, 4, 0, max_steps=4) == (canonical(h), [])  # r=0 from EP: every slot full


def test_time_gain_from_the_hecate_cost_model():
    from moelab.sim.placement_cost import PlacementCost
    from moelab.sim.profiles import get_profile

    cost = PlacementCost.from_profile(get_profile("hecate_A"), 1024, 2048, ranks_per_node=4)
    counts = np.array([[4000, 100, 100, 100]] * 4)
    h = ((0,), (1,), (2,), (3,))
    new, steps = schedule(h, counts.sum(0), 4, 1, max_steps=3, gain_fn=time_gain(cost, counts),
                          migration_cost=cost.migration_bytes(1) / cost.nic_Bps, K=100)
    assert steps and all(s[0] == "expand" and s[1] == 0 for s in steps) and len(new[0]) == 4
    assert schedule(h, counts.sum(0), 4, 1, gain_fn=time_gain(cost, counts), migration_cost=1.0, K=1)[1] == []


@pytest.mark.parametrize("seed", range(4))
def test_scheduler_invariants_on_random_loads(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        N = int(rng.choice([2, 4]))
        E, r, max_steps = N * int(rng.integers(1, 3)), int(rng.integers(0, 3)), int(rng.integers(1, 5))
        F = rng.zipf(1.5, E).clip(0, 500) * rng.integers(0, 2, E)
        h = canonical((e // (E // N),) for e in range(E))
        for _round in range(3):  # rounds start from replicated placements too
            new, steps = schedule(h, F, N, r, max_steps=max_steps)
            assert (new, steps) == schedule(h, F, N, r, max_steps=max_steps)  # deterministic
            assert all(len(x) >= 1 and len(set(x)) == len(x) for x in new)
            assert slots_used(new, N).max() <= slot_budget(E, N, r)
            assert sum(1 for s in steps if s[0] != "shrink") <= max_steps
            assert undo_steps(new, steps) == h
            cur, ratio = [set(x) for x in h], balance_ratio(h, F, N)
            for kind, e, src, dst in steps:  # replay: the ratio never grows after an accepted step
                if kind in ("expand", "migrate"):
                    cur[e].add(dst)
                if kind in ("shrink", "migrate"):
                    cur[e].discard(src)
                if kind != "shrink":
                    now = balance_ratio(canonical(cur), F, N)
                    assert now <= ratio + 1e-12
                    ratio = now
            assert canonical(cur) == new
            h = new


def test_scheduler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="r must be >= 0"):
        schedule(EP2, [1, 1, 1, 1], 2, -1)
    with pytest.raises(ValueError, match="max_steps"):
        schedule(EP2, [1, 1, 1, 1], 2, 1, max_steps=0)
    with pytest.raises(ValueError, match="K"):
        schedule(EP2, [1, 1, 1, 1], 2, 1, K=0)
    with pytest.raises(ValueError, match="budget"):
        schedule(((0, 1), (0,), (0,), (1,)), [1, 1, 1, 1], 2, 0)


# ---- options --------------------------------------------------------------------------------------
def _cfg(world=2, **over):
    return RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": world, "parallel.strategy": "flexmoe",
                                       **over}).validate()


@pytest.mark.parametrize("opts,msg", [({"r": -1}, "r \\(reserved"), ({"threshold": 1.0}, "threshold"),
                                      ({"interval": 0}, "interval"), ({"max_steps": 0}, "max_steps"),
                                      ({"window": 0}, "window"), ({"cost_profile": "nope"}, "cost_profile"),
                                      ({"migration_cost_s": -1}, "migration_cost_s"), ({"k": 3}, "unknown")])
def test_option_errors_name_the_option(opts, msg):
    with pytest.raises(ConfigError, match=msg):
        _cfg(**{"parallel.strategy_options": opts})


def test_run_errors():
    with pytest.raises(ConfigError, match="placement unset"):
        _cfg(**{"parallel.placement": {0: [0], 1: [0], 2: [1], 3: [1]}})
    with pytest.raises(ConfigError, match="dispatcher='sparse'"):
        _cfg(**{"model.moe.dispatcher": "dense", "model.moe.capacity_factor": 2.0})
    with pytest.raises(ConfigError, match="divisible"):
        _cfg(world=3)
    assert _cfg(**{"parallel.strategy_options": {"r": 0, "threshold": 1.5}}).parallel.strategy == "flexmoe"


# ---- replica groups and migrate_holders on 4 gloo ranks -------------------------------------------------
D, FF, E = 4, 8, 4


def _snapshot(layers, opt):
    out = {}
    for li, layer in enumerate(layers):
        ps = [p for p in layer.experts.stacked() if p is not None]
        for s, e in enumerate(layer.experts.experts):
            out[(li, e)] = [torch.cat([(p if k is None else opt.state[p][k])[s].detach().reshape(-1)
                                       for p in ps]).clone()
                            for k in (None, "exp_avg", "exp_avg_sq")]
    return out


def _comm_and_migrate(rank, world):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.config import MoEConfig
    from moelab.moe.layer import MoELayer
    from moelab.moe.migrate import migrate_holders

    comm = Communicator(Topology(world, world))
    made = []
    new_group = comm._new_group
    comm._new_group = lambda ranks: made.append(tuple(ranks)) or new_group(ranks)
    # on-demand groups: created once per rank set, every rank calling in the same order
    names = [comm.replica_group(rs) for rs in ([1, 0], [3, 1, 2], [0, 1], [0, 1, 2, 3], [2, 1, 3])]
    n0 = len(comm.rec.comm)
    sums = {}
    for name in dict.fromkeys(names):
        ranks = [int(x) for x in name.split(":")[1].split(",")]
        if rank in ranks:
            x = torch.full((5,), float(rank + 1), dtype=torch.float64)
            sums[name] = float(comm.all_reduce_(x, group=name)[0])
    recs = [(r.op, r.group, dict(r.sent_to)) for r in comm.rec.comm[n0:]]
    member_of = sorted({n for n in names if n in comm._groups})

    cfg = MoEConfig(num_experts=E, top_k=2)
    layers = [MoELayer(D, FF, cfg, layer_id=i, seed=3, comm=comm, dtype=torch.float64) for i in range(2)]
    params = [p for lay in layers for p in lay.parameters()]
    opt = torch.optim.Adam(params, lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):  # real Adam state first
        sum(lay(torch.randn(6, D, generator=g, dtype=torch.float64)).square().sum() for lay in layers).backward()
        for p in params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        opt.step()
        opt.zero_grad(set_to_none=True)
    start = _snapshot(layers, opt)
    plans = [  # expand e0 to 2 and e3 to 0; then drops, an expand and owner swaps; then a drop only
        [((0, 2), (1,), (2,), (0, 3)), ((0,), (1,), (2,), (3,))],
        [((2,), (1, 3), (2,), (0,)), ((1,), (0,), (2,), (3,))],
        [((2,), (1,), (2,), (0,)), ((1,), (0,), (2,), (3,))],
    ]
    steps = []
    for new in plans:
        m0 = len(comm.rec.comm)
        moves = migrate_holders(comm, layers, new, opt)
        recs_m = comm.rec.comm[m0:]
        steps.append(dict(moves=moves, ops=[r.op for r in recs_m], held=[lay.experts.experts for lay in layers],
                          snap=_snapshot(layers, opt),
                          sent=sum(v for r in recs_m for q, v in r.sent_to.items() if q != rank)))
    live = [p for lay in layers for p in lay.parameters()]
    sum(lay(torch.randn(6, D, generator=g, dtype=torch.float64)).square().sum() for lay in layers).backward()
    for p in live:
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
    opt.step()
    in_opt = {id(p) for grp in opt.param_groups for p in grp["params"]}
    return dict(names=names, made=made, sums=sums, recs=recs, member_of=member_of, start=start, steps=steps,
                stepped=all(id(p) in in_opt and p in opt.state for p in live) and len(in_opt) == len(live))


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_comm_and_migrate, 4, timeout=120)


def test_replica_groups_are_created_once_and_go_through_the_door(four_ranks):
    from moelab.comm.bytes import peer_bytes

    for rank, res in enumerate(four_ranks):
        assert res["names"] == ["replica:0,1", "replica:1,2,3", "replica:0,1", "replica:0,1,2,3", "replica:1,2,3"]
        assert res["made"] == [(0, 1), (1, 2, 3), (0, 1, 2, 3)]  # one process group per distinct set, every rank
        assert res["member_of"] == sorted({n for n in res["names"] if str(rank) in n.split(":")[1].split(",")})
        for name, got in res["sums"].items():
            ranks = [int(x) for x in name.split(":")[1].split(",")]
            assert got == sum(r + 1 for r in ranks)
        for op, group, sent in res["recs"]:
            ranks = [int(x) for x in group.split(":")[1].split(",")]
            assert op == "all_reduce" and sent == peer_bytes("all_reduce", ranks, rank, 5 * 8)


def test_replica_group_single_process_and_bad_ranks():
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology

    comm = Communicator(Topology(1, 1))
    name = comm.replica_group([0])
    x = torch.ones(3)
    assert comm.all_reduce_(x, group=name) is x and comm.replica_group((0,)) == name
    with pytest.raises(ValueError, match="replica_group ranks"):
        comm.replica_group([0, 1])


def test_migrate_holders_copies_params_and_adam_state_from_the_first_old_holder(four_ranks):
    start = {k: v for r in four_ranks for k, v in r["start"].items()}
    numel = 2 * D * FF + FF + D
    expect_moves = [[(0, 0, 0, 2), (0, 3, 3, 0)], [(0, 1, 1, 3), (1, 0, 0, 1), (1, 1, 1, 0)], []]
    for i, want in enumerate(expect_moves):
        for rank, res in enumerate(four_ranks):
            st = res["steps"][i]
            assert st["moves"] == want
            assert st["ops"] == (["all_to_all"] if want else [])  # one collective for all layers; none for drops
            assert st["sent"] == sum(1 for m in want if m[2] == rank) * 3 * numel * 8
            for key, parts in st["snap"].items():  # every copy bitwise the original, params and moments
                assert all(torch.equal(a, b) for a, b in zip(parts, start[key])), (i, rank, key)
        held = [{(li, e) for li, lay in enumerate(r["steps"][i]["held"]) for e in lay} for r in four_ranks]
        assert sum(len(h) for h in held) == [10, 9, 8][i]  # copies created and dropped
    assert four_ranks[2]["steps"][2]["held"] == [(0, 2), (2,)] and all(r["stepped"] for r in four_ranks)


# ---- fp64 training: FlexMoE on 2 and 4 ranks == the single-process run ----------------------------------
FLEX = {"r": 1, "interval": 1, "threshold": 1.01, "max_steps": 2, "window": 2, "migration_cost_s": 0.0}
ITERS = 5


def _train(rank, world, overrides):
    from moelab.runtime.train import Trainer

    torch.set_num_threads(1)
    cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": world, "train.iters": ITERS,
                                      "train.batch_size": 4 // world, **overrides}).validate()
    tr = Trainer.build(cfg)
    made = []
    new_group = tr.comm._new_group
    tr.comm._new_group = lambda ranks: made.append(tuple(ranks)) or new_group(ranks)
    losses = [row["loss"] for row in tr.run()]
    opt = getattr(tr.update, "optimizer")
    experts = _snapshot(tr.model.moe_layers(), opt)
    dense = torch.cat([p.detach().reshape(-1) for p in tr.model.dense_parameters()])
    ops = [(r.op, r.group, r.tags.get("phase")) for r in tr.comm.rec.comm]
    u, layers = tr.update, tr.model.moe_layers()
    memory = dict(params=u.param_bytes(), dense=storage_bytes(tr.model.dense_parameters()),
                  held=[len(lay.experts.experts) for lay in layers], item=layers[0].experts.w1.element_size(),
                  expert_numel=sum(int(torch.Size(s).numel()) for s in expert_param_shapes(layers[0].experts) if s),
                  reserved=({k: [t.numel() for t in v] for k, v in u.reserved().items()}
                            if hasattr(u, "reserved") else {}))
    return dict(losses=losses, experts=experts, dense=dense, plans=tr.plans, made=made, ops=ops, memory=memory,
                rounds=list(getattr(tr.update, "rounds", [])))


@pytest.fixture(scope="module")
def single():
    return run_ranks(_train, 1, {"parallel.strategy": "ep"}, timeout=120)[0]


@pytest.mark.parametrize("world", [2, 4])
def test_training_with_replicas_equals_the_single_process_run(single, world):
    res = run_ranks(_train, world, {"parallel.strategy": "flexmoe", "parallel.strategy_options": FLEX}, timeout=150)
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(single["losses"]), rtol=1e-10, atol=0)
    copies = {}
    for r in res:
        torch.testing.assert_close(r["dense"], single["dense"], rtol=1e-10, atol=1e-12)
        for key, parts in r["experts"].items():
            torch.testing.assert_close(parts[0], single["experts"][key][0], rtol=1e-9, atol=1e-11)
            copies.setdefault(key, []).append(parts)
    replicated = [k for k, v in copies.items() if len(v) > 1]
    assert replicated, "no expert was replicated: the test would not test replicas"
    for key in replicated:  # every copy of an expert: the same params and Adam moments, bitwise
        for other in copies[key][1:]:
            assert all(torch.equal(a, b) for a, b in zip(copies[key][0], other)), key
    plans = res[0]["plans"]
    assert all(p["flexmoe"] == q["flexmoe"] for r in res[1:] for p, q in zip(plans, r["plans"]))
    expands = [s for p in plans for s in p["flexmoe"]["steps"] if s[0] == "expand"]
    assert expands and all(not p["flexmoe"]["steps"] for p in plans if p["iter"] == 0)
    sets = {tuple(h) for p in plans for h in p["flexmoe"]["holders"] if len(h) > 1}
    by_iter = [[p["flexmoe"]["holders"] for p in plans if p["iter"] == it] for it in range(ITERS)]
    migrations = sum(1 for a, b in zip(by_iter, by_iter[1:])  # iterations where some rank got a new copy
                     if any(set(hb) - set(ha) for la, lb in zip(a, b) for ha, hb in zip(la, lb)))
    for r in res:  # one process group per distinct replica set over the whole run, none per iteration
        assert sorted(r["made"]) == sorted(sets)
        syncs = [g for op, g, ph in r["ops"] if ph == "replica_sync"]
        assert syncs and all(op == "all_reduce" for op, g, ph in r["ops"] if ph == "replica_sync")
        assert all(g.startswith("replica:") for g in syncs)
        assert [op for op, g, ph in r["ops"] if ph == "migrate"] == ["all_to_all"] * migrations
        _assert_slot_budget_held(r["memory"], world, FLEX["r"])


def _assert_slot_budget_held(m, world, r):
    """Every rank holds the whole budget E/N + r per layer: filled slots as experts, the rest as reserve."""
    budget, pe = 4 // world + r, m["expert_numel"]
    free = [budget - h for h in m["held"]]
    assert min(free) >= 0 and m["reserved"] == {"params": [f * pe for f in free], "grads": [f * pe for f in free],
                                                "optim": [2 * f * pe for f in free]}
    assert m["params"] - m["dense"] == len(free) * budget * pe * m["item"]


def test_without_reserve_only_filled_slots_use_memory_and_training_is_unchanged(single):
    on = run_ranks(_train, 2, {"parallel.strategy": "flexmoe", "parallel.strategy_options": FLEX}, timeout=150)
    off = run_ranks(_train, 2, {"parallel.strategy": "flexmoe",
                                "parallel.strategy_options": {**FLEX, "reserve": False}},
                    timeout=150)
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"] and all(torch.equal(x, y) for k in a["experts"]
                                                  for x, y in zip(a["experts"][k], b["experts"][k]))
        m = b["memory"]
        assert m["reserved"] == {} and m["params"] - m["dense"] == sum(m["held"]) * m["expert_numel"] * m["item"]
        assert sum(m["held"]) < len(m["held"]) * (2 + FLEX["r"]), "every slot filled: reserve would not differ"
        _assert_slot_budget_held(a["memory"], 2, FLEX["r"])


def test_simulated_migration_and_replica_bytes():
    """The graph prices a round's copies from the recorded holders and steps, and one ring all-reduce
    per replicated expert within its set."""
    from moelab.sim.graphs import expert_param_count, graph_bytes, topology_of
    from moelab.sim.profiles import get_profile
    from moelab.strategies.flexmoe.sim_graph import flexmoe_iteration_graph, migration_matrix

    cfg = _cfg(world=4)
    holders = [((0, 2), (1,), (2,), (3,)), ((0,), (1,), (2,), (3,))]
    steps = [[("expand", 0, 0, 2)], []]
    numel = expert_param_count(cfg.model)
    mig = migration_matrix(holders, steps, 4, 3 * numel * 8)
    assert mig[0, 2] == 3 * numel * 8 and mig.sum() == mig[0, 2]
    loads = np.full((2, 4, 4), 8, dtype=np.int64)
    prof = get_profile("hecate_A")
    g = flexmoe_iteration_graph(cfg, prof, loads, holders=holders, steps=steps)
    g0 = flexmoe_iteration_graph(cfg, prof, loads, holders=holders)
    cats = {o.category for o in g.ops}
    assert "migrate" in cats and "replica_sync" in cats and "migrate" not in {o.category for o in g0.ops}
    b = graph_bytes(g, topology_of(cfg), categories={"migrate"})
    assert sum(b[0].values()) == 3 * numel * 8
    rs = graph_bytes(g, topology_of(cfg), categories={"replica_sync"})
    assert rs[0]["intra"] == rs[2]["intra"] == numel * 8 and sum(rs[1].values()) == 0  # ring of 2: g bytes each
