"""MoE layer on real gloo ranks vs the single-process fp64 brute-force reference."""
from __future__ import annotations

import pytest
import torch

from moelab.comm.door import Communicator
from moelab.comm.topology import Topology
from moelab.config import MoEConfig
from moelab.moe.layer import MoELayer
from moelab.moe.reference import ReferenceMoE
from moelab.moe.sync import sync_dense_grads, sync_replica_grads
from moelab.placement import Placement
from moelab.runtime.ranks import run_ranks
from moelab.testing import assert_matches_reference, expert_grads, rank_inputs, reference_grads

D, F = 8, 16
TOL = dict(rtol=1e-9, atol=1e-10)


def make_inputs(tokens, seed=0, hot=None):
    return rank_inputs(tokens, D, seed, shift=4.0 if hot is not None else 0.0)  # hot: push tokens to it


def bias_gate(gate, hot):
    """Make every token's top-1 expert ``hot`` (inputs are shifted by +4 in make_inputs)."""
    if hot is None:
        return
    with torch.no_grad():
        gate.wg.weight[hot] += 1.0


def _run_case(rank, world, case):
    cfg = MoEConfig(**case["moe"])
    xs, gys = make_inputs(case["tokens"], case.get("seed", 0), case.get("hot"))
    comm = Communicator(Topology(world, case.get("rpn", world)))
    pl = Placement.from_mapping(case["placement"], cfg.num_experts, world) if case.get("placement") else None
    layer = MoELayer(D, F, cfg, layer_id=3, seed=7, comm=comm, placement=pl, dtype=torch.float64)
    bias_gate(layer.gate, case.get("hot"))
    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    loss = (y * gys[rank]).sum() + layer.aux_loss
    loss.backward()
    sync_dense_grads(list(layer.gate.parameters()), comm)
    sync_replica_grads(layer, comm)
    eg = expert_grads(layer.experts)  # an idle expert has a zero grad
    a2a = [r.bytes for r in comm.rec.comm if r.op == "all_to_all"]
    comm.close()  # one spawn runs every case: hand the groups on to the next
    return dict(y=y.detach(), gx=x.grad, gg=layer.gate.wg.weight.grad, eg=eg, a2a=a2a,
                counts=layer.last_global_counts)


def _run_cases(rank, world, cases):
    return [_run_case(rank, world, c) for c in cases]


def reference(case):
    cfg = MoEConfig(**case["moe"])
    xs, gys = make_inputs(case["tokens"], case.get("seed", 0), case.get("hot"))
    ref = ReferenceMoE(D, F, cfg, layer_id=3, seed=7)
    bias_gate(ref.gate, case.get("hot"))
    return reference_grads(ref, xs, gys)


def check(case, results):
    ref = reference(case)
    assert_matches_reference(results, ref, bias=case["moe"].get("expert_bias", True), **TOL)
    return ref


def moe(**kw):
    base = dict(num_experts=4, top_k=2, gate="topk", capacity_factor=None, dispatcher="sparse", balance_loss_coef=0.01,
                z_loss_coef=0.001)
    base.update(kw)
    return base


CASES = {
    "sparse-k2-dropless": dict(moe=moe(), tokens=[12, 12, 12, 12]),
    "sparse-k1-dropless": dict(moe=moe(top_k=1), tokens=[12, 12, 12, 12]),
    "sparse-k2-drops": dict(moe=moe(capacity_factor=0.5), tokens=[16, 16, 16, 16]),
    "sparse-k1-drops": dict(moe=moe(top_k=1, capacity_factor=0.5), tokens=[16, 16, 16, 16]),
    "dense-k2-drops": dict(moe=moe(dispatcher="dense", capacity_factor=0.75), tokens=[16, 16, 16, 16]),
    "dense-k1": dict(moe=moe(dispatcher="dense", top_k=1, capacity_factor=1.25), tokens=[16, 16, 16, 16]),
    "gshard-sparse": dict(moe=moe(gate="gshard", capacity_factor=1.0), tokens=[16, 16, 16, 16]),
    "gshard-dense-random": dict(moe=moe(gate="gshard", capacity_factor=1.0, dispatcher="dense", random_routing=True),
                                tokens=[16, 16, 16, 16]),
    "switch-dense": dict(moe=moe(gate="switch", top_k=1, capacity_factor=1.0, dispatcher="dense"),
                         tokens=[16, 16, 16, 16]),
    "switch-sparse-nobias": dict(moe=moe(gate="switch", top_k=1, capacity_factor=1.0, expert_bias=False),
                                 tokens=[16, 16, 16, 16]),
    "8-experts-2-per-rank": dict(moe=moe(num_experts=8), tokens=[10, 10, 10, 10]),
}
EDGE = {
    "zero-token-rank": dict(moe=moe(), tokens=[0, 14, 9, 5]),
    "zero-token-rank-dense": dict(moe=moe(dispatcher="dense", capacity_factor=1.0), tokens=[0, 14, 9, 5]),
    "all-to-one-expert": dict(moe=moe(top_k=1), tokens=[9, 9, 9, 9], hot=2),
    "all-to-one-expert-k2": dict(moe=moe(), tokens=[9, 9, 9, 9], hot=0),
    "all-to-one-dense-drops": dict(moe=moe(top_k=1, dispatcher="dense", capacity_factor=1.0),
                                   tokens=[9, 9, 9, 9], hot=1),
    "uneven": dict(moe=moe(), tokens=[3, 17, 1, 8]),
    "single-token-everywhere": dict(moe=moe(), tokens=[1, 1, 1, 1]),
}


def shrink(case, world):
    c = dict(case)
    c["tokens"] = case["tokens"][:world]
    return c


@pytest.mark.parametrize("world", [2, 4])
def test_layer_matches_reference(world):
    cases = [shrink(c, world) for c in CASES.values()]
    results = run_ranks(_run_cases, world, cases, timeout=180)
    for i, (name, case) in enumerate(zip(CASES, cases)):
        try:
            check(case, [r[i] for r in results])
        except AssertionError as e:
            raise AssertionError(f"case {name} (world {world}): {e}") from None


@pytest.mark.parametrize("world", [2, 4])
def test_edge_loads(world):
    cases = [shrink(c, world) for c in EDGE.values()]
    results = run_ranks(_run_cases, world, cases, timeout=180)
    for i, (name, case) in enumerate(zip(EDGE, cases)):
        try:
            ref = check(case, [r[i] for r in results])
        except AssertionError as e:
            raise AssertionError(f"case {name} (world {world}): {e}") from None
        if case.get("hot") is not None:  # the case really is degenerate
            top1 = torch.cat([r.idx[:, 0] for r in ref["routes"]])
            assert (top1[top1 >= 0] == case["hot"]).all(), name


def test_drops_really_happen():
    ref = reference(CASES["sparse-k2-drops"])
    assert any((r.idx < 0).any() for r in ref["routes"])


def test_single_process_layer_matches_reference():
    case = dict(moe=moe(capacity_factor=0.75), tokens=[20])
    check(case, [_run_case(0, 1, case)])


def test_recorded_a2a_bytes_match_counts():
    case = dict(moe=moe(), tokens=[11, 6, 0, 9], rpn=2)
    results = [r[0] for r in run_ranks(_run_cases, 4, [case], timeout=120)]
    ref = reference(case)
    topo = Topology(4, 2)
    for rank, res in enumerate(results):
        idx = ref["routes"][rank].idx
        per_dest = torch.bincount(idx[idx >= 0] // 1, minlength=4)  # EP: expert e lives on rank e
        want = {"local": 0, "intra": 0, "inter": 0}
        for dst, n in enumerate(per_dest.tolist()):
            want[topo.link_class(rank, dst)] += n * D * 8
        assert res["a2a"][0] == want  # dispatch forward
        assert len(res["a2a"]) == 4  # dispatch + combine, forward and backward


# ---- stages, registries and plan records (issue #8 item 14) --------------------------------------
class IdentityExperts(MoELayer):
    """Overrides one stage (expert compute -> identity) and one decision (this call's placement:
    the same holders routed by Hecate's locality-first rule instead of the static holder order)."""

    def compute_experts(self, xe, plan):
        return xe * 1

    def place(self, counts):
        from moelab.placement import LocalityFirst

        return self.placement.with_rule(LocalityFirst(2)), ()


def _identity_round_trip(rank, world):
    comm = Communicator(Topology(world, 2))
    holders = {0: [0, 1], 1: [1], 2: [world - 1, 0], 3: [0]}
    pl = Placement.from_mapping(holders, 4, world)
    layer = IdentityExperts(D, F, MoEConfig(**moe()), layer_id=1, comm=comm, placement=pl, dtype=torch.float64)
    xs, gys = make_inputs([7, 0, 12, 5][:world], seed=2)
    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    (gx,) = torch.autograd.grad((y * gys[rank]).sum(), x)
    return dict(x=xs[rank], y=y.detach(), gx=gx, gy=gys[rank], record=layer.plan_record(),
                sent=layer.last_plan.send_split, counts=layer.last_global_counts)


@pytest.mark.parametrize("world", [2, 4])
def test_overridden_stages_round_trip_with_a_per_call_placement(world):
    from moelab.placement import LocalityFirst

    res = run_ranks(_identity_round_trip, world, timeout=60)
    pl = Placement.from_mapping({0: [0, 1], 1: [1], 2: [world - 1, 0], 3: [0]}, 4, world)
    for rank, r in enumerate(res):  # identity experts, weights summing to 1: y = x, grad_x = grad_y
        torch.testing.assert_close(r["y"], r["x"], **TOL)
        torch.testing.assert_close(r["gx"], r["gy"], **TOL)
        assert r["record"]["placement"]["rule"] == "locality_first"
        assert torch.equal(r["sent"], torch.from_numpy(pl.with_rule(LocalityFirst(2)).split(r["counts"].numpy())[rank]))


def test_plan_records_are_json_and_say_what_the_call_did():
    import json

    cfg = MoEConfig(**moe(capacity_factor=1.0))
    layer = MoELayer(D, F, cfg, dtype=torch.float64)
    x = torch.randn(6, D, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="forward call first"):
        layer.plan_record()
    layer(x)
    layer(x)
    rec = json.loads(json.dumps(layer.plan_record()))
    assert rec == {"layer": 0, "call": 1, "dispatcher": "sparse", "counts": layer.last_global_counts.tolist()}
    assert sum(rec["counts"][0]) == int((layer.last_routing.idx >= 0).sum())
    dense = MoELayer(D, F, MoEConfig(**moe(capacity_factor=1.0, dispatcher="dense")), layer_id=4, dtype=torch.float64)
    dense(x)
    assert dense.plan_record()["capacity"] == dense.last_routing.capacity == 3

    from moelab.strategies.fastermoe.layer import FasterMoELayer

    fm = FasterMoELayer(D, F, MoEConfig(**moe()), dtype=torch.float64, options={"shadow_force": [2, 1]})
    fm(x)
    assert json.loads(json.dumps(fm.plan_record()))["shadowed"] == [1, 2]


def test_gates_and_dispatchers_resolve_by_name_from_registries():
    from moelab.moe.dispatch import DISPATCHERS, SparseDispatcher, register_dispatcher
    from moelab.moe.gates import GATES, register_gate
    from moelab.moe.routing import finish_routing

    calls = []

    @register_gate("round_robin_test")
    def round_robin(gate, x, logits, rng):  # token t -> expert t mod E, weight 1
        idx = (torch.arange(x.shape[0]) % gate.num_experts).unsqueeze(1)
        return finish_routing(logits, idx, torch.ones_like(idx, dtype=logits.dtype), gate.cfg)

    @register_dispatcher("counting_test")
    class Counting(SparseDispatcher):
        def token_dispatch(self, rows, plan):
            calls.append(rows.shape[0])
            return super().token_dispatch(rows, plan)

    try:
        cfg = MoEConfig(**moe(top_k=1, gate="round_robin_test", dispatcher="counting_test"))
        layer = MoELayer(D, F, cfg, dtype=torch.float64)
        x = torch.randn(9, D, dtype=torch.float64)
        layer(x)
        assert calls == [9] and layer.last_routing.idx[:, 0].tolist() == [t % 4 for t in range(9)]
        assert layer.last_global_counts.tolist() == [[3, 2, 2, 2]]
    finally:
        del GATES["round_robin_test"], DISPATCHERS["counting_test"]
    with pytest.raises(ValueError, match="model.moe.gate='nope'"):
        MoELayer(D, F, MoEConfig(**moe(gate="nope")))
    with pytest.raises(ValueError, match="model.moe.dispatcher='nope'"):
        MoELayer(D, F, MoEConfig(**moe(dispatcher="nope")))


def test_a_per_call_placement_must_fit_the_expert_slots():
    """Until parameters are materialized per call, a call's placement may only re-route (same
    holders per rank, e.g. another rule), not move experts away from their slots."""
    class Moving(MoELayer):
        def place(self, counts):
            return Placement(4, 2, ((0,), (0,), (0,), (1,))), ()

    layer = Moving(D, F, MoEConfig(**moe()))
    with pytest.raises(ValueError, match=r"puts experts \(0, 1, 2\) on rank 0, whose expert slots hold \(0, 1, 2, 3\)"):
        layer(torch.randn(3, D))


def test_no_import_cycles_and_no_private_copies():
    """gates -> base_gate -> routing (never back); fastermoe.layer -> smart_schedule (never back);
    FasterMoE keeps no copy of the layer's forward stages or its plan."""
    import ast
    import inspect

    import moelab.moe.base_gate as base_gate
    import moelab.moe.routing as routing
    import moelab.strategies.fastermoe.smart_schedule as smart
    from moelab.strategies.fastermoe.layer import FasterMoELayer

    def imported(mod):
        names = set()
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            if isinstance(node, ast.ImportFrom):
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return names

    assert "moelab.moe.gates" not in imported(base_gate) | imported(routing)
    assert not any(m.startswith("moelab.strategies.fastermoe.layer") for m in imported(smart))
    own = set(vars(FasterMoELayer))
    assert not own & {"plan", "exchange_counts", "dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                      "combine_preprocess", "token_combine", "compute_experts"}
    assert {"place", "route", "combine_postprocess", "dispatch_compute_combine"} <= own
