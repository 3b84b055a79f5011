"""Strategy ``fsdp_expert`` (FSDP of each MoE layer's experts, spec ``papers/hecate.md`` §3, §5.1, §5.5)
on real gloo ranks, fp64: the layer equals the single-process reference, the reduce-scattered shard
gradients are the reference's expert gradients, bytes are ``(N-1)/N S`` per collective, the gathered
storage is freed between forward and backward with ``reshard_after_forward``, and 3 Adam steps equal
EP. One spawn per world size (module fixtures)."""
from __future__ import annotations

import pytest
import torch

from moelab.config import ConfigError, MoEConfig, RunConfig
from moelab.runtime.ranks import run_ranks
from moelab.testing import TINY_TRAIN, rank_inputs

D, F = 5, 7  # expert numel 2*5*7 + 7 + 5 = 82; E = 3: 246 elements, padded to 248 on 4 ranks
MOE = dict(num_experts=3, top_k=2, balance_loss_coef=0.01, z_loss_coef=0.001)
TOKENS = {2: [9, 0], 4: [5, 0, 11, 3]}  # a rank with no token at all
TOL = dict(rtol=1e-10, atol=1e-12)
FSDP = {"parallel.strategy": "fsdp_expert"}
RESHARD = {**FSDP, "parallel.strategy_options": {"reshard_after_forward": True}}
TRAIN = {"ep": {}, "fsdp": FSDP, "reshard": RESHARD}


# ---- the rank functions ------------------------------------------------------------------------------------
def _layer_case(rank, world, reshard):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.strategies.fsdp_expert.layer import FsdpExpertMoELayer
    from moelab.strategies.fsdp_expert.options import FsdpExpertOptions

    xs, gys = rank_inputs(TOKENS[world], D, seed=3)
    comm = Communicator(Topology(world, world))
    layer = FsdpExpertMoELayer(D, F, MoEConfig(**MOE), layer_id=2, seed=5, comm=comm, dtype=torch.float64,
                               options=FsdpExpertOptions(reshard_after_forward=reshard))
    st = layer.full.untyped_storage()
    before = st.nbytes()
    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    after_fwd = st.nbytes()
    seen = {}
    y1 = y * 1  # its gradient hook runs before y's (the layer's re-gather hook): the backward's start
    y1.register_hook(lambda g: seen.update(bwd_start=st.nbytes()))
    ((y1 * gys[rank]).sum() + layer.aux_loss).backward()
    ex = layer.experts
    return dict(y=y.detach(), gx=x.grad, shard_grad=layer.shard.grad.clone(), padded=layer.padded,
                numel=layer.numel, S=layer.full_bytes, before=before, after_fwd=after_fwd,
                bwd_start=seen["bwd_start"], after_bwd=st.nbytes(), resident=layer.resident,
                local=[p.grad.clone() for p in (ex.w1, ex.b1, ex.w2, ex.b2)],
                records=[(r.op, r.tags.get("phase"), dict(r.bytes)) for r in comm.rec.comm])


def _train(rank, world, overrides):
    from moelab.runtime.train import Trainer

    cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": world, **overrides}).validate()
    tr = Trainer.build(cfg)
    rows = tr.run()
    upd = tr.update
    out = dict(rows=rows, cls=type(tr.model.moe_layers()[0]).__name__, update=type(upd).__name__,
               records=[(r.tags.get("iter"), r.tags.get("layer"), r.op, r.tags.get("phase"), dict(r.bytes))
                        for r in tr.comm.rec.comm],
               resident=[getattr(layer, "resident", True) for layer in tr.model.moe_layers()],
               dense_numel=sum(p.numel() for p in tr.model.dense_parameters()),
               dense_tensors=len(tr.model.dense_parameters()))
    if hasattr(upd, "shards"):
        out.update(shard_numel=[s.numel() for s in upd.shards], S=[layer.full_bytes for layer in tr.model.moe_layers()],
                   analytic=upd.expert_bytes_per_iteration())
    experts = {}
    with upd.resident_params() as model:
        for li, layer in enumerate(model.moe_layers()):
            ex = layer.experts
            for s, e in enumerate(ex.experts):
                experts[(li, e)] = torch.cat([p[s].detach().reshape(-1) for p in (ex.w1, ex.b1, ex.w2, ex.b2)]).clone()
        out["dense"] = torch.cat([p.detach().reshape(-1) for p in model.dense_parameters()]).clone()
    out["experts"] = experts
    out["released_after"] = [not getattr(layer, "resident", False) for layer in tr.model.moe_layers()]
    return out


def _all(rank, world):
    over = {"train.batch_size": 1} if world == 4 else {}
    return dict(layer=[_layer_case(rank, world, r) for r in (False, True)],
                train={k: _train(rank, world, {**o, **over}) for k, o in TRAIN.items()})


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    world = request.param
    return world, run_ranks(_all, world, timeout=240)


# ---- pure: options, registration -----------------------------------------------------------------------------
@pytest.mark.parametrize("over, msg", [
    ({"parallel.strategy_options": {"reshard": True}}, "unknown fsdp_expert option"),
    ({"parallel.strategy_options": {"reshard_after_forward": "yes"}}, "reshard_after_forward must be true or false"),
    ({"parallel.strategy_options": {"global_loads": 1}}, "global_loads must be true or false"),
    ({"parallel.placement": {0: [0, 1], 1: [1], 2: [0], 3: [1]}}, "leave parallel.placement unset"),
    ({"model.moe.dispatcher": "dense", "model.moe.capacity_factor": 1.0}, "dispatcher='sparse'"),
])
def test_bad_options_fail_before_launch(over, msg):
    cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": 2, **FSDP, **over})
    with pytest.raises(ConfigError, match=msg):
        cfg.validate()


def test_registered():
    from moelab.registry import get, get_update, known_strategies
    from moelab.sim.graphs import get_graph
    from moelab.strategies.fsdp_expert import FsdpExpertOptions, FsdpExpertUpdate
    from moelab.strategies.fsdp_expert.sim_graph import fsdp_expert_iteration_graph

    assert "fsdp_expert" in known_strategies() and get_update("fsdp_expert") is FsdpExpertUpdate
    assert get_graph("fsdp_expert") is fsdp_expert_iteration_graph
    assert get("fsdp_expert").conformance == ({}, {"reshard_after_forward": True})
    o = FsdpExpertOptions.from_dict({})
    assert (o.reshard_after_forward, o.global_loads) == (False, True)


# ---- the layer vs the fp64 reference ---------------------------------------------------------------------------
def _reference(world):
    from moelab.moe.reference import ReferenceMoE
    from moelab.testing import reference_grads

    xs, gys = rank_inputs(TOKENS[world], D, seed=3)
    return reference_grads(ReferenceMoE(D, F, MoEConfig(**MOE), layer_id=2, seed=5), xs, gys)


@pytest.mark.parametrize("reshard", [False, True])
def test_layer_matches_reference_and_shards_hold_the_reduced_grads(runs, reshard):
    world, res = runs
    ref = _reference(world)
    got = [r["layer"][int(reshard)] for r in res]
    E = MOE["num_experts"]
    # the reference's expert gradients in the runtime's flat layout: stacked w1, b1, w2, b2, then padding
    want = torch.cat([torch.stack([ref["eg"][e][i] for e in range(E)]).reshape(-1) for i in range(4)])
    assert want.numel() == got[0]["numel"] == E * (2 * D * F + F + D)
    padded = got[0]["padded"]
    assert padded % world == 0 and padded - want.numel() < world
    want = torch.cat([want, want.new_zeros(padded - want.numel())])
    n = padded // world
    for rank, g in enumerate(got):
        torch.testing.assert_close(g["y"], ref["y"][rank], **TOL)
        torch.testing.assert_close(g["gx"], ref["gx"][rank], **TOL)
        torch.testing.assert_close(g["shard_grad"], want[rank * n:(rank + 1) * n], **TOL)
    for i in range(4):  # the local (unreduced) stack gradients sum to the reference's, as ZeRO's do
        torch.testing.assert_close(sum(g["local"][i] for g in got),
                                   torch.stack([ref["eg"][e][i] for e in range(E)]), **TOL)


@pytest.mark.parametrize("reshard", [False, True])
def test_layer_bytes_are_n_minus_1_over_n_of_s(runs, reshard):
    world, res = runs
    for g in (r["layer"][int(reshard)] for r in res):
        S = g["S"]
        assert S == g["padded"] * 8
        ops = [(op, ph) for op, ph, _ in g["records"]]  # the count gather is unrecorded metric traffic
        want = [("all_gather", "param_gather")] + ([("all_gather", "param_gather_bwd")] if reshard else [])
        assert ops == want + [("reduce_scatter", "grad_reduce_scatter")]
        for _, _, b in g["records"]:
            assert b["intra"] + b["inter"] == (world - 1) * S // world and b["local"] == S // world


@pytest.mark.parametrize("reshard", [False, True])
def test_gathered_storage_lifecycle(runs, reshard):
    world, res = runs
    for g in (r["layer"][int(reshard)] for r in res):
        assert g["before"] == 0  # only the shard is resident before the call
        if reshard:  # freed when the forward ends, gathered again only when the layer's backward starts
            assert g["after_fwd"] == 0 and g["bwd_start"] == 0
        else:
            assert g["after_fwd"] == g["bwd_start"] == g["S"]
        assert g["after_bwd"] == 0 and g["resident"] is False


# ---- training: equivalence with EP, bytes, memory ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fsdp", "reshard"])
def test_three_adam_steps_equal_ep(runs, name):
    world, res = runs
    ep, got = [r["train"]["ep"] for r in res], [r["train"][name] for r in res]
    assert got[0]["cls"] == "FsdpExpertMoELayer" and got[0]["update"] == "FsdpExpertUpdate"
    torch.testing.assert_close(torch.tensor([row["loss"] for row in got[0]["rows"]]),
                               torch.tensor([row["loss"] for row in ep[0]["rows"]]), rtol=1e-10, atol=0)
    ep_experts = {k: v for r in ep for k, v in r["experts"].items()}
    for r in got:
        assert set(r["experts"]) == set(ep_experts)  # resident_params gathers every expert on every rank
        for key, v in ep_experts.items():
            torch.testing.assert_close(r["experts"][key], v, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(r["dense"], ep[0]["dense"], rtol=1e-10, atol=1e-10)
        assert all(r["released_after"])


@pytest.mark.parametrize("name", ["fsdp", "reshard"])
def test_training_bytes_per_layer(runs, name):
    world, res = runs
    k_ag = 2 if name == "reshard" else 1
    for r in (x["train"][name] for x in res):
        S = r["S"]
        for it in range(TINY_TRAIN["train.iters"]):
            for li, s in enumerate(S):
                recs = [(op, b) for i, layer, op, _, b in r["records"] if i == it and layer == li]
                assert [op for op, _ in recs].count("all_gather") == k_ag
                assert [op for op, _ in recs].count("reduce_scatter") == 1 and len(recs) == k_ag + 1
                assert all(b["intra"] + b["inter"] == (world - 1) * s // world for _, b in recs)
            others = [op for i, layer, op, _, _ in r["records"] if i == it and layer is None]
            assert others == ["all_reduce"]  # the dense gradients, nothing else
        dense_ar = [b["intra"] + b["inter"] for i, _, op, _, b in r["records"] if op == "all_reduce" and i == 0][0]
        for row in r["rows"]:
            assert row["bytes_intra"] + row["bytes_inter"] == r["analytic"] + dense_ar


@pytest.mark.parametrize("name", ["fsdp", "reshard"])
def test_memory_holds_dense_plus_shards(runs, name):
    world, res = runs
    for r in (x["train"][name] for x in res):
        owned = r["dense_numel"] + sum(r["shard_numel"])
        S = sum(r["S"])
        assert all(n * world * 8 == s for n, s in zip(r["shard_numel"], r["S"]))
        for row in r["rows"]:
            assert row["mem_params_bytes"] == owned * 8  # after the step: dense + own shards only
            assert row["mem_optim_bytes"] == 2 * owned * 8 + 4 * (r["dense_tensors"] + len(r["S"]))
            # without resharding both layers' experts are resident from the second gather to the backward;
            # with it, one layer's at a time
            assert row["mem_params_peak_bytes"] == owned * 8 + (max(r["S"]) if name == "reshard" else S)


def test_sim_graph_bytes_equal_the_measured_ones(runs):
    import numpy as np

    from moelab.comm.topology import Topology
    from moelab.sim import get_profile, simulate
    from moelab.sim.graphs import graph_bytes
    from moelab.strategies.fsdp_expert.sim_graph import fsdp_expert_iteration_graph

    world, res = runs
    over = {"train.batch_size": 1} if world == 4 else {}
    peak = {}
    for name in ("fsdp", "reshard"):
        cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": world, **TRAIN[name], **over}).validate()
        loads = np.full((2, world, TINY_TRAIN["model.moe.num_experts"]), 4)
        g = fsdp_expert_iteration_graph(cfg, get_profile("johnny"), loads)
        gb = graph_bytes(g, Topology(world, world))
        for rank, r in enumerate(x["train"][name] for x in res):
            row = r["rows"][0]
            assert gb[rank]["intra"] + gb[rank]["inter"] == row["bytes_intra"] + row["bytes_inter"]
        assert g.meta["layer_flat_bytes"] == res[0]["train"][name]["S"][0]
        peak[name] = simulate(g).peak_memory()["params"].max()
    assert peak["fsdp"] - peak["reshard"] == res[0]["train"]["fsdp"]["S"][0]  # one layer's buffer fewer
