"""Strategy ``zero`` (ZeRO-1/2/3 data parallelism of the whole MoE model, FasterMoE §3's baseline) on
real gloo ranks, fp64, Adam: training equals the EP baseline's; memory and bytes follow the stage."""
from __future__ import annotations

import contextlib

import pytest
import torch

from moelab.config import ConfigError, RunConfig
from moelab.runtime.ranks import run_ranks

BASE = {
    "model.d_model": 16, "model.d_ff": 32, "model.n_layers": 2, "model.n_heads": 2, "model.seq_len": 16,
    "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.balance_loss_coef": 0.0,
    "model.moe.z_loss_coef": 0.001, "train.iters": 3, "train.batch_size": 2, "train.dtype": "float64",
    "train.lr": 1e-2, "train.trace": False,
}
TOL = 1e-10


def zero(stage, **opts):
    return {"parallel.strategy": "zero", "parallel.strategy_options": {"stage": stage, **opts}}


def _train(rank, world, overrides):
    from moelab.runtime.train import Trainer

    cfg = RunConfig().with_overrides({**BASE, "parallel.nproc": world, **overrides}).validate()
    tr = Trainer.build(cfg)
    rows = tr.run()
    upd = tr.update
    out = dict(rows=rows, cls=type(tr.model.moe_layers()[0]).__name__, update=type(upd).__name__,
               ops=[(r.tags.get("iter"), r.op, r.tags.get("phase"), dict(r.bytes)) for r in tr.comm.rec.comm])
    if hasattr(upd, "full_params"):
        out.update(S=upd.full_bytes, numel=upd.numel, stage=upd.stage, materialized=upd.materialized)
        if upd.stage == 3:  # the released model refuses to run until gathered
            try:
                tr.model(torch.zeros(1, 4, dtype=torch.long))
                out["refused"] = False
            except RuntimeError:
                out["refused"] = True
    ctx = upd.full_params() if hasattr(upd, "full_params") else contextlib.nullcontext()
    with ctx:
        experts = {}
        for li, layer in enumerate(tr.model.moe_layers()):
            ex = layer.experts
            for s, e in enumerate(ex.experts):
                experts[(li, e)] = torch.cat([p[s].detach().reshape(-1) for p in (ex.w1, ex.b1, ex.w2, ex.b2)]).clone()
        out["dense"] = torch.cat([p.detach().reshape(-1) for p in tr.model.dense_parameters()]).clone()
    out["experts"] = experts
    if hasattr(upd, "full_params"):
        out["materialized_after"] = upd.materialized
    tr.close()  # callers train many configurations in one spawn
    return out


def _train_many(rank, world, runs):
    return [_train(rank, world, o) for o in runs]


# odd d_model, a dense FFN layer (moe_every=2): P = 11245 parameters, so the flat buffer is padded
PAD = {"model.d_model": 15, "model.n_heads": 3, "model.moe_every": 2}
RUNS2 = {"ep": {}, "z0": zero(0), "z1": zero(1), "z2": zero(2), "z3": zero(3),
         "z3_noregather": zero(3, regather_backward=False), "z1_allreduce": zero(1, grad_collective="all_reduce"),
         "ep_pad": PAD, "z1_pad": {**PAD, **zero(1)}, "z3_pad": {**PAD, **zero(3)}}
RUNS4 = {"ep": {"train.batch_size": 1}, **{f"z{s}": {"train.batch_size": 1, "parallel.topology.nodes": 2, **zero(s)}
                                           for s in (0, 1, 2, 3)}}


@pytest.fixture(scope="module")
def runs2():
    res = run_ranks(_train_many, 2, list(RUNS2.values()), timeout=240)
    return {name: [r[i] for r in res] for i, name in enumerate(RUNS2)}


@pytest.fixture(scope="module")
def runs4():
    res = run_ranks(_train_many, 4, list(RUNS4.values()), timeout=300)
    return {name: [r[i] for r in res] for i, name in enumerate(RUNS4)}


def assert_same_training(ep, z):
    """Losses and every parameter (every expert, every dense tensor) equal the EP run's."""
    torch.testing.assert_close(torch.tensor([r["loss"] for r in z[0]["rows"]]),
                               torch.tensor([r["loss"] for r in ep[0]["rows"]]), rtol=TOL, atol=0)
    ep_experts = {k: v for res in ep for k, v in res["experts"].items()}  # EP: each rank its own experts
    for res in z:
        assert set(res["experts"]) == set(ep_experts)  # every rank holds every expert
        for key, v in ep_experts.items():
            torch.testing.assert_close(res["experts"][key], v, rtol=TOL, atol=TOL)
        torch.testing.assert_close(res["dense"], ep[0]["dense"], rtol=TOL, atol=TOL)


def padded_bytes(cfg_over, N):
    """S: every parameter (dense + all experts of every layer), padded to a multiple of N, x 8 bytes.
    Counted from the model's rule in the simulator (independent of the runtime's buffer)."""
    from moelab.strategies.zero.sim_graph import zero_param_count

    cfg = RunConfig().with_overrides({**BASE, "parallel.nproc": N, **cfg_over})
    P = zero_param_count(cfg.model)
    return -(-P // N) * N * 8


# ---- pure: options, registration ---------------------------------------------------------------------
@pytest.mark.parametrize("opts, msg", [({"stage": 4}, "stage must be one of"), ({"stage": "two"}, "stage must be"),
                                       ({"stgae": 1}, "unknown zero option"),
                                       ({"stage": 2, "grad_collective": "all_reduce"}, "stage 1 only"),
                                       ({"stage": 1, "grad_collective": "ring"}, "grad_collective must be"),
                                       ({"stage": 3, "regather_backward": "yes"}, "true or false")])
def test_bad_options_fail_before_training(opts, msg):
    cfg = RunConfig().with_overrides({**BASE, "parallel.nproc": 2, "parallel.strategy": "zero",
                                      "parallel.strategy_options": opts})
    with pytest.raises(ConfigError, match=msg):
        cfg.validate()


def test_zero_rejects_placement_and_dense_dispatcher():
    for over, msg in (({"parallel.placement": {0: [0, 1], 1: [1], 2: [0], 3: [1]}}, "placement unset"),
                      ({"model.moe.dispatcher": "dense", "model.moe.capacity_factor": 1.0}, "dispatcher='sparse'")):
        cfg = RunConfig().with_overrides({**BASE, "parallel.nproc": 2, **zero(3), **over})
        with pytest.raises(ConfigError, match=msg):
            cfg.validate()


def test_registered_and_defaults():
    from moelab.registry import get_update, known_strategies
    from moelab.strategies.zero import ZeroOptions, ZeroUpdate

    assert "zero" in known_strategies()
    assert get_update("zero") is ZeroUpdate
    o = ZeroOptions.from_dict({})
    assert (o.stage, o.regather_backward, o.grad_op) == (3, True, "reduce_scatter")
    assert ZeroOptions.from_dict({"stage": "2"}).stage == 2
    assert [ZeroOptions.from_dict({"stage": s}).grad_op for s in (0, 1, 2, 3)] == \
        ["all_reduce", "reduce_scatter", "reduce_scatter", "reduce_scatter"]


def test_full_replication_keeps_tokens_local():
    from moelab.strategies.zero.layer import full_replication

    for E, N in ((4, 2), (3, 4), (8, 4)):
        pl = full_replication(E, N)
        assert all(pl.local_experts(r) == tuple(range(E)) for r in range(N))
        for src in range(N):
            assert all(pl.blocks(src, e, 5) == [(src, 5)] for e in range(E))  # a holder keeps its own tokens


def test_analytic_bytes_formula():
    from moelab.strategies.zero import ZeroOptions
    from moelab.strategies.zero.update import analytic_bytes

    S, N = 4 * 1200, 4
    unit = (N - 1) * S // N
    assert analytic_bytes(ZeroOptions(stage=0), N, S) == 2 * unit
    assert analytic_bytes(ZeroOptions(stage=1), N, S) == 2 * unit
    assert analytic_bytes(ZeroOptions(stage=1, grad_collective="all_reduce"), N, S) == 3 * unit
    assert analytic_bytes(ZeroOptions(stage=2), N, S) == 2 * unit
    assert analytic_bytes(ZeroOptions(stage=3), N, S) == 3 * unit
    assert analytic_bytes(ZeroOptions(stage=3, regather_backward=False), N, S) == 2 * unit


# ---- the layer alone: local compute, no communication ---------------------------------------------------
def _layer_case(rank, world, global_loads):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.config import MoEConfig
    from moelab.strategies.zero.layer import ZeroMoELayer
    from moelab.strategies.zero.options import ZeroOptions

    cfg = MoEConfig(num_experts=4, top_k=2, capacity_factor=0.75, z_loss_coef=0.001)
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(n, 8, generator=g, dtype=torch.float64) for n in (12, 7, 0, 9)[:world]]
    comm = Communicator(Topology(world, world))
    layer = ZeroMoELayer(8, 16, cfg, layer_id=3, seed=7, comm=comm, dtype=torch.float64,
                         options=ZeroOptions(global_loads=global_loads))
    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    ((y * y).sum() + layer.aux_loss).backward()
    ex = layer.experts
    gw = layer.gate.wg.weight.grad
    return dict(y=y.detach(), gx=x.grad, gw=torch.zeros_like(layer.gate.wg.weight) if gw is None else gw,
                eg=[torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in (ex.w1, ex.b1, ex.w2, ex.b2)],
                counts=layer.last_global_counts,
                recorded=len(comm.rec.comm), record=layer.plan_record(), in_rows=layer.last_plan.in_rows,
                out_rows=layer.last_plan.out_rows, rows_per_slot=layer.last_plan.rows_per_slot)


@pytest.mark.parametrize("world", [2, 4])
def test_layer_matches_reference_without_communication(world):
    from moelab.config import MoEConfig
    from moelab.moe.reference import ReferenceMoE

    res = run_ranks(_layer_case, world, True, timeout=120)
    cfg = MoEConfig(num_experts=4, top_k=2, capacity_factor=0.75, z_loss_coef=0.001)
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(n, 8, generator=g, dtype=torch.float64).requires_grad_() for n in (12, 7, 0, 9)[:world]]
    ref = ReferenceMoE(8, 16, cfg, layer_id=3, seed=7)
    outs, aux, routes = ref(xs)
    (sum((y * y).sum() for y in outs) + aux).backward()
    counts = torch.stack([torch.bincount(r.idx[r.idx >= 0], minlength=4) for r in routes])
    for rank, r in enumerate(res):
        assert r["recorded"] == 0  # tokens never leave their rank; the count gather is unrecorded
        torch.testing.assert_close(r["y"], outs[rank].detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["gx"], xs[rank].grad, rtol=1e-12, atol=1e-12)
        assert torch.equal(r["counts"], counts)
        # the core's stages planned the call: every row stays on its rank, the record says so
        local = sum(r["rows_per_slot"])
        assert local == int(counts[rank].sum())
        assert r["in_rows"] == r["out_rows"] == [local if j == rank else 0 for j in range(world)]
        assert r["record"]["counts"] == counts.tolist() and r["record"]["call"] == 0
        assert all(h[0] == h2 for h, h2 in zip(r["record"]["placement"]["holders"].values(),
                                               [0, 0, 1, 1] if world == 2 else [0, 1, 2, 3]))
        assert all(len(h) == world for h in r["record"]["placement"]["holders"].values())
    # summed over ranks (what ZeRO's reduce-scatter does), the local grads are the reference's
    torch.testing.assert_close(sum(r["gw"] for r in res), ref.gate.wg.weight.grad, rtol=1e-10, atol=1e-12)
    for e in range(4):
        for i, p in enumerate(ref.expert(e)):
            torch.testing.assert_close(sum(r["eg"][i][e] for r in res), p.grad, rtol=1e-10, atol=1e-12)


def test_layer_local_counts_without_global_loads():
    res = run_ranks(_layer_case, 2, False, timeout=120)
    for rank, r in enumerate(res):
        assert r["recorded"] == 0
        assert r["counts"][1 - rank].sum() == 0 and r["counts"][rank].sum() > 0


# ---- training: equivalence, memory, bytes ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["z0", "z1", "z2", "z3", "z3_noregather", "z1_allreduce"])
def test_zero_trains_like_ep_2_ranks(runs2, name):
    z = runs2[name]
    assert z[0]["cls"] == "ZeroMoELayer" and z[0]["update"] == "ZeroUpdate"
    assert_same_training(runs2["ep"], z)


@pytest.mark.parametrize("name", ["z1", "z2", "z3"])
def test_zero_trains_like_ep_4_ranks(runs4, name):
    assert_same_training(runs4["ep"], runs4[name])


@pytest.mark.parametrize("name", ["z1_pad", "z3_pad"])
def test_zero_with_padding_and_dense_ffn_layers(runs2, name):
    z = runs2[name]
    assert z[0]["numel"] == 11245 and z[0]["S"] == 11246 * 8  # padded by one element to a multiple of 2
    assert_same_training(runs2["ep_pad"], z)
    k = 3 if name == "z3_pad" else 2
    for res in z:
        for row in res["rows"]:
            assert row["bytes_intra"] == k * (11246 // 2) * 8


def test_single_rank_is_plain_adam():
    ep, z = run_ranks(_train_many, 1, [{}, zero(3)], timeout=120)[0]
    assert_same_training([ep], [z])
    assert all(row["bytes_intra"] == row["bytes_inter"] == 0 for row in z["rows"])


def _bytes_check(runs, N, over):
    S = padded_bytes(over, N)
    unit = (N - 1) * (S // N)
    want = {"z0": 2, "z1": 2, "z2": 2, "z3": 3, "z3_noregather": 2, "z1_allreduce": 3}
    measured = {}
    for name, k in want.items():
        if name not in runs:
            continue
        for res in runs[name]:
            assert res["S"] == S
            for row in res["rows"]:
                assert row["bytes_intra"] + row["bytes_inter"] == k * unit, (name, row)
            measured[name] = res["rows"][0]["bytes_intra"] + res["rows"][0]["bytes_inter"]
    return S, measured


def test_bytes_per_iteration_match_the_analytic_count_2_ranks(runs2):
    S, measured = _bytes_check(runs2, 2, {})
    # the collectives, in order, per iteration (pairwise rule: own block counts as local)
    ops = [(op, ph) for it, op, ph, _ in runs2["z3"][0]["ops"] if it == 0]
    assert ops == [("all_gather", "param_gather"), ("all_gather", "param_gather_bwd"), ("reduce_scatter", "grad_sync")]
    assert [(op, ph) for it, op, ph, _ in runs2["z2"][0]["ops"] if it == 0] == \
        [("reduce_scatter", "grad_sync"), ("all_gather", "param_gather")]
    assert [op for it, op, _, _ in runs2["z0"][0]["ops"] if it == 0] == ["all_reduce"]
    for it, op, _, b in runs2["z3"][1]["ops"]:
        assert b == {"local": S // 2, "intra": S // 2, "inter": 0}
    print(f"\nS = {S} B; per-rank network bytes per iteration (2 ranks): {measured}")


def test_bytes_per_iteration_match_the_analytic_count_4_ranks_two_nodes(runs4):
    S, measured = _bytes_check(runs4, 4, {"train.batch_size": 1})
    for res in runs4["z3"]:
        row = res["rows"][0]
        assert row["bytes_local"] == 3 * (S // 4)
        assert row["bytes_inter"] == 3 * 2 * (S // 4) and row["bytes_intra"] == 3 * (S // 4)  # 2 peers off-node
    print(f"\nS = {S} B; per-rank network bytes per iteration (4 ranks): {measured}")


@pytest.mark.parametrize("world", [2, 4])
def test_memory_reflects_the_sharding(runs2, runs4, world):
    runs = runs2 if world == 2 else runs4
    S = runs["z0"][0]["S"]
    for name in ("z0", "z1", "z2", "z3"):
        for res in runs[name]:
            st = res["stage"]
            for row in res["rows"]:
                opt = row["mem_optim_bytes"]
                assert opt == (2 * S if st == 0 else 2 * S // world) + 4  # exp_avg, exp_avg_sq, step
                assert row["mem_grads_bytes"] == (S if st <= 1 else S // world)
                assert row["mem_params_bytes"] == (S if st <= 2 else S // world)
    z0 = runs["z0"][0]["rows"][-1]
    for name in ("z1", "z2", "z3"):
        ratio = runs[name][0]["rows"][-1]["mem_optim_bytes"] / z0["mem_optim_bytes"]
        assert abs(ratio - 1 / world) < 1e-3
    assert abs(runs["z3"][0]["rows"][-1]["mem_params_bytes"] / z0["mem_params_bytes"] - 1 / world) < 1e-9


def test_stage3_releases_and_guards_parameters(runs2):
    for name in ("z3", "z3_noregather"):
        for res in runs2[name]:
            assert res["materialized"] is False and res["refused"] is True
            assert res["materialized_after"] is False  # full_params() released them again


def test_stage3_regather_bytes_differ_only_by_one_all_gather(runs2):
    a = sum(r["bytes_intra"] for r in runs2["z3"][0]["rows"])
    b = sum(r["bytes_intra"] for r in runs2["z3_noregather"][0]["rows"])
    S = runs2["z3"][0]["S"]
    assert a - b == 3 * (S // 2)  # one S/2 block to the one peer per iteration, 3 iterations


# ---- the simulator ----------------------------------------------------------------------------------------
def test_sim_graph_registered_and_param_count_matches_the_runtime(runs2):
    from moelab.sim.graphs import get_graph
    from moelab.strategies.zero.sim_graph import zero_iteration_graph, zero_param_count

    assert get_graph("zero") is zero_iteration_graph
    cfg = RunConfig().with_overrides({**BASE, "parallel.nproc": 2})
    assert zero_param_count(cfg.model) == runs2["z1"][0]["numel"]
    assert zero_param_count(cfg.with_overrides(PAD).model) == runs2["z1_pad"][0]["numel"]


def test_sim_graph_at_paper_scale_orders_the_stages():
    """FasterMoE's setting (johnny, 16 experts): stage 3 moves 1.5x the bytes of stages 1-2 and is slower."""
    from moelab.comm.topology import Topology
    from moelab.sim import get_profile, simulate, synthetic_loads
    from moelab.sim.graphs import config_for_profile, graph_bytes
    from moelab.strategies.zero.sim_graph import zero_iteration_graph

    prof = get_profile("johnny")
    base = RunConfig().with_overrides({"model.d_model": 1024, "model.d_ff": 2048, "model.n_layers": 2,
                                       "model.n_heads": 16, "model.seq_len": 512, "model.moe.num_experts": 16,
                                       "model.moe.top_k": 2, "train.batch_size": 2})
    t, b = {}, {}
    for st in (1, 2, 3):
        c = config_for_profile(base.with_overrides(zero(st)), prof)
        g = zero_iteration_graph(c, prof, synthetic_loads(c, seed=1))
        t[st] = simulate(g).makespan
        topo = Topology.from_config(c.parallel.nproc, c.parallel.topology.nodes, c.parallel.topology.ranks_per_node)
        gb = graph_bytes(g, topo, categories={"allgather", "reduce_scatter", "allreduce"})  # the flat buffer's
        b[st] = gb[0]["intra"] + gb[0]["inter"]
        N = c.parallel.nproc
        assert b[st] == (3 if st == 3 else 2) * (N - 1) * (g.meta["flat_bytes"] // N)
    assert b[1] == b[2] and b[3] * 2 == b[1] * 3
    assert t[3] > t[2]
    pk = simulate(zero_iteration_graph(config_for_profile(base.with_overrides(zero(3)), prof), prof,
                                       synthetic_loads(config_for_profile(base, prof), seed=1))).peak_memory()
    assert (pk["optimizer"] > 0).all()


@pytest.mark.timeout(240)
def test_simulated_bytes_equal_measured_bytes_2_ranks():
    import warnings

    from moelab.measure.validate import BytesMismatchWarning, compare, machine_profile, run_real_many, simulate_real

    cal = {"nproc": 2, "gemm_flops": 1e9, "collectives": {op: {"alpha": 1e-4, "beta": 1e-9} for op in
                                                          ("all_to_all", "all_reduce", "all_gather", "reduce_scatter")}}
    names = {"z1": zero(1), "z2": zero(2), "z3": zero(3), "z3_noregather": zero(3, regather_backward=False),
             "z1_allreduce": zero(1, grad_collective="all_reduce"), "z3_pad": {**PAD, **zero(3)},
             "z2_2x1": {**zero(2), "parallel.topology.nodes": 2}}
    cfgs = [RunConfig().with_overrides({**BASE, "parallel.nproc": 2, **o}) for o in names.values()]
    reals = run_real_many(cfgs, 2, timeout=200)
    for name, real in zip(names, reals):
        b = real.bytes()
        assert (b["bytes_intra"] + b["bytes_inter"]).sum() > 0
        with warnings.catch_warnings():
            warnings.simplefilter("error", BytesMismatchWarning)
            sim = simulate_real(real.cfg, real.loads, machine_profile(real.cfg, cal, compute="gemm"))
            c = compare(real, sim, warmup=0, names=[name])
        assert c.metrics["bytes_exact"], (name, c.mismatches)
        ops = set(c.bytes[c.bytes.real > 0].op)
        assert ops == ({"all_gather", "all_reduce"} if name == "z1_allreduce" else {"all_gather", "reduce_scatter"})
