"""Placement per iteration (issue #8 item 15): pure policies, and the materializer on real gloo ranks.

A layer whose ``place`` puts experts on ranks that do not hold them (the hottest expert on every
rank, or the two hottest on rank 0 only) must equal the single-process fp64 reference, forward
and every gradient, with one broadcast (forward) and one reduce (backward) per materialized expert.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.comm.door import Communicator
from moelab.comm.topology import Topology
from moelab.config import MoEConfig
from moelab.moe.layer import MoELayer
from moelab.moe.reference import ReferenceMoE
from moelab.moe.sync import sync_dense_grads
from moelab.placement import LocalityFirst, Placement
from moelab.placement.policy import ReplicateHottest, StaticPolicy, hottest, replicate
from moelab.runtime.ranks import run_ranks
from moelab.testing import assert_matches_reference, expert_grads, rank_inputs, reference_grads

D, F = 8, 16
TOL = dict(rtol=1e-9, atol=1e-10)


# ---- pure policies --------------------------------------------------------------------------------
def test_replicate_adds_holders_keeps_owner_and_rule():
    static = Placement.expert_parallel(8, 4).with_rule(LocalityFirst(2))
    pl = replicate(static, [5, 2])
    assert pl.holders[2] == (1, 0, 2, 3) and pl.holders[5] == (2, 0, 1, 3)
    assert all(pl.holders[e] == static.holders[e] for e in (0, 1, 3, 4, 6, 7))
    assert pl.rule == static.rule
    assert replicate(static, [5], ranks=[0, 2]).holders[5] == (2, 0)
    assert replicate(static, []) is static
    with pytest.raises(ValueError, match="outside 0..7"):
        replicate(static, [8])


def test_hottest_is_deterministic_with_id_tie_break():
    C = np.array([[3, 0, 5, 1], [2, 4, 0, 1]])  # totals 5, 4, 5, 2
    assert hottest(C, 1) == (0,)  # 0 and 2 tie: lower id
    assert hottest(C, 2) == (0, 2)
    assert hottest(C, 3) == (0, 1, 2)
    assert hottest(C, 0) == ()
    # identical on every rank: a function of the (all-gathered) counts only
    assert (ReplicateHottest(2)(C, Placement.expert_parallel(4, 2))
            == ReplicateHottest(2)(C.copy(), Placement.expert_parallel(4, 2)))


def test_policies_from_counts_to_placement():
    static = Placement.expert_parallel(4, 2)
    C = torch.tensor([[0, 1, 0, 9], [1, 0, 2, 3]])
    assert StaticPolicy()(C, static) is static
    pl = ReplicateHottest(1)(C, static)
    assert pl.holders == ((0,), (0,), (1,), (1, 0))
    # the default rule: a holder keeps its own tokens, so every rank computes expert 3's rows itself
    assert pl.split(C.numpy())[:, 3].tolist() == [[9, 0], [0, 3]]
    with pytest.raises(ValueError, match="ReplicateHottest.n"):
        ReplicateHottest(-1)


def test_materialization_lists_new_holders_only():
    from moelab.moe.materialize import Materialization

    static = Placement.from_mapping({0: [0], 1: [0, 1], 2: [1], 3: [1]}, 4, 2)
    C = torch.tensor([[1, 0, 0, 0], [2, 0, 0, 5]])
    m = Materialization.between(static, static.with_replicas({0: [1], 1: [0], 3: [0]}), C)
    assert (m.experts, m.owners, m.slots, m.totals) == ((0, 3), (0, 1), (0, 2), (3, 5))
    assert Materialization.between(static, static, C).experts == ()
    with pytest.raises(ValueError, match="differ in experts or ranks"):
        Materialization.between(static, Placement.expert_parallel(4, 4), C)


# ---- the materializer on real ranks ---------------------------------------------------------------
class PolicyLayer(MoELayer):
    """The core layer with a per-iteration placement policy (nothing else overridden)."""

    policy = None

    def place(self, counts):
        return self.policy(counts, self.placement), ()


def moe_cfg(**kw):
    base = dict(num_experts=4, top_k=2, gate="topk", capacity_factor=None, dispatcher="sparse",
                balance_loss_coef=0.01, z_loss_coef=0.001)
    base.update(kw)
    return MoEConfig(**base)


def _policy_run(rank, world, case):
    torch.set_num_threads(1)
    xs, gys = rank_inputs(case["tokens"], D, case.get("seed", 0), shift=1.0)
    comm = Communicator(Topology(world, world))
    layer = PolicyLayer(D, F, moe_cfg(**case.get("moe", {})), layer_id=2, seed=5, comm=comm, dtype=torch.float64)
    layer.policy = ReplicateHottest(case["n"], case.get("ranks"))
    with torch.no_grad():
        layer.gate.wg.weight[case["hot"]] += case.get("strength", 0.5)
    x = xs[rank].clone().requires_grad_()
    for _ in range(case.get("repeat", 1)):
        y = layer(x)
        ((y * gys[rank]).sum() + layer.aux_loss).backward()
    sync_dense_grads(list(layer.gate.parameters()), comm)
    eg = expert_grads(layer.experts)
    recs = [(r.op, r.tags.get("phase"), dict(r.bytes)) for r in comm.rec.comm]
    return dict(y=y.detach(), gx=x.grad, gg=layer.gate.wg.weight.grad, eg=eg, recs=recs, record=layer.plan_record(),
                sent=layer.last_plan.send_split.clone(), counts=layer.last_global_counts.clone(),
                slots=layer.experts.experts, left=dict(layer._call_materialized),
                n_param=sum(p[0].numel() for p in layer.experts.stacked()))


CASES = {
    "hottest-everywhere": dict(tokens=[12, 9, 11, 10], n=1, hot=1),
    "two-hottest-on-rank0": dict(tokens=[12, 9, 11, 10], n=2, hot=3, ranks=(0,)),
    "zero-token-rank-microbatches": dict(tokens=[10, 0, 7, 9], n=1, hot=2, repeat=2),
    "top1-all-everywhere": dict(tokens=[9, 8, 9, 8], n=4, hot=0, moe=dict(top_k=1), strength=3.0),
}


@pytest.mark.parametrize("world", [2, 4])
def test_per_iteration_placement_matches_reference(world):
    cases = [dict(c, tokens=c["tokens"][:world]) for c in CASES.values()]
    res = run_ranks(_run_all, world, cases, timeout=120)
    for ci, case in enumerate(cases):
        results = [r[ci] for r in res]
        ref_layer = ReferenceMoE(D, F, moe_cfg(**case.get("moe", {})), layer_id=2, seed=5)
        with torch.no_grad():
            ref_layer.gate.wg.weight[case["hot"]] += case.get("strength", 0.5)
        xs, gys = rank_inputs(case["tokens"], D, case.get("seed", 0), shift=1.0)
        ref = reference_grads(ref_layer, xs, gys)
        assert_matches_reference(results, ref, scale=case.get("repeat", 1), **TOL)
        counts = results[0]["counts"]
        hot = hottest(counts.numpy(), case["n"])
        ranks = case.get("ranks") or tuple(range(world))
        static = Placement.expert_parallel(4, world)
        new = [e for e in hot if set(ranks) - {static.owner(e)}]
        m = case.get("repeat", 1)
        assert new  # every case materializes something
        if case["n"] == 4:  # the strong hot expert takes every row: the others are materialized with none
            assert counts.sum(0).tolist().count(0) == 3
        for rank, r in enumerate(results):
            assert r["slots"] == static.local_experts(rank)  # the store is unchanged: owned slots only
            assert r["left"] == {}  # nothing of the call's materialized slots survives the call
            assert r["record"]["materialized"] == new
            assert r["record"]["placement"]["holders"] == {
                str(e): list(static.holders[e]) + ([q for q in ranks if q != static.owner(e)] if e in hot else [])
                for e in range(4)}
            bcast = [b for op, ph, b in r["recs"] if op == "broadcast"]
            red = [(ph, b) for op, ph, b in r["recs"] if op == "reduce"]
            assert len(bcast) == len(red) == m * len(new) and all(ph == "bwd" for ph, _ in red)
            for e, b in zip(new, bcast):
                assert b["intra"] + b["inter"] == ((world - 1) * r["n_param"] * 8 if rank == static.owner(e) else 0)
            # rows for a materialized expert stay on a rank that computes it (a holder keeps its own)
            for e in new:
                if rank in ranks:
                    assert int(r["sent"][e].sum()) == int(counts[rank, e]) == int(r["sent"][e, rank])


def _run_all(rank, world, cases):
    return [_policy_run(rank, world, c) for c in cases]


# ---- FasterMoE's dynamic shadowing is one instance ----------------------------------------------------
def test_fastermoe_issues_no_collective_or_owner_arithmetic_of_its_own():
    """The shadow broadcasts/reduces are the materializer's (plain path: the core's stage; smart
    path: its fetch/give_back as comm-stream tasks); owners come from the placement only."""
    import ast
    import inspect

    import moelab.strategies.fastermoe.layer as fl
    import moelab.strategies.fastermoe.smart_schedule as ss

    for mod in (fl, ss):
        tree = ast.parse(inspect.getsource(mod))
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not attrs & {"broadcast_", "reduce_", "owner", "owners", "slot_of"}, mod.__name__
    assert {"fetch", "give_back"} <= {n.attr for n in ast.walk(ast.parse(inspect.getsource(ss)))
                                      if isinstance(n, ast.Attribute)}


def _fastermoe_run(rank, world, smart):
    from moelab.strategies.fastermoe.layer import FasterMoELayer

    torch.set_num_threads(1)
    xs, gys = rank_inputs([12, 9, 0, 10][:world], D, 3, shift=1.0)
    comm = Communicator(Topology(world, world))
    opts = dict(shadow_force=[1, 3], smart=smart, group_size=1)
    layer = FasterMoELayer(D, F, moe_cfg(), layer_id=2, seed=5, comm=comm, dtype=torch.float64, options=opts)
    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    ((y * gys[rank]).sum() + layer.aux_loss).backward()
    sync_dense_grads(list(layer.gate.parameters()), comm)
    eg = expert_grads(layer.experts)
    ops = [(r.op, r.tags.get("phase")) for r in comm.rec.comm]
    return dict(y=y.detach(), gx=x.grad, gg=layer.gate.wg.weight.grad, eg=eg, record=layer.plan_record(), ops=ops)


@pytest.mark.parametrize("world", [2, 4])
def test_fastermoe_shadowing_is_replication_plus_materialization(world):
    res = run_ranks(_fastermoe_run, world, False, timeout=120) + run_ranks(_fastermoe_run, world, True, timeout=120)
    xs, gys = rank_inputs([12, 9, 0, 10][:world], D, 3, shift=1.0)
    ref = reference_grads(ReferenceMoE(D, F, moe_cfg(), layer_id=2, seed=5), xs, gys)
    static = Placement.expert_parallel(4, world)
    for half in (res[:world], res[world:]):
        assert_matches_reference(half, ref, **TOL)
        for r in half:
            rec = r["record"]
            assert rec["shadowed"] == rec["materialized"] == [1, 3]
            assert rec["placement"]["holders"] == {
                str(e): [static.owner(e)] + ([q for q in range(world) if q != static.owner(e)] if e in (1, 3) else [])
                for e in range(4)}
            assert [op for op, _ in r["ops"]].count("broadcast") == 2
            assert [ph for op, ph in r["ops"] if op == "reduce"] == ["bwd", "bwd"]


# ---- several Adam steps: the materialized copies are the owner's current parameters every call -------
def _adam_steps(rank, world, policy):
    torch.set_num_threads(1)
    comm = Communicator(Topology(world, world))
    layer = (PolicyLayer if policy else MoELayer)(D, F, moe_cfg(), layer_id=2, seed=5, comm=comm, dtype=torch.float64)
    if policy:
        layer.policy = ReplicateHottest(2)
    opt = torch.optim.Adam(layer.parameters(), lr=0.05)
    ys, materialized = [], []
    for step in range(3):
        xs, gys = rank_inputs([9, 6, 11, 7][:world], D, 10 + step, shift=0.5)
        opt.zero_grad()
        y = layer(xs[rank])
        ((y * gys[rank]).sum() + layer.aux_loss).backward()
        sync_dense_grads(list(layer.gate.parameters()), comm)
        opt.step()
        ys.append(y.detach())
        materialized.append(layer.last_materialized)
    return dict(ys=ys, params=[p.detach().clone() for p in layer.experts.stacked()], materialized=materialized)


@pytest.mark.parametrize("world", [2, 4])
def test_adam_steps_with_materialized_experts_equal_plain_ep(world):
    plain = run_ranks(_adam_steps, world, False, timeout=120)
    moved = run_ranks(_adam_steps, world, True, timeout=120)
    for p, m in zip(plain, moved):
        assert all(len(s) >= 1 for s in m["materialized"])  # every step brought experts
        assert all(s == () for s in p["materialized"])
        for a, b in zip(p["ys"], m["ys"]):
            torch.testing.assert_close(b, a, **TOL)
        for a, b in zip(p["params"], m["params"]):
            torch.testing.assert_close(b, a, **TOL)
