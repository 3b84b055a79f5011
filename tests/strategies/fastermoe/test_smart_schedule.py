"""FasterMoE smart schedule on real gloo ranks: spec §5 invariants 2 (smart = plain all-to-all:
outputs, input grads, gate and expert grads, for several Gs, E in {1, 2}, uneven and empty splits)
and 3 (runtime part: every run finishes under a timeout; the p2p traffic is exactly the plain
all-to-all's). Also smart + shadowing together, threaded and on the main thread."""
from __future__ import annotations

import pytest
import torch

from moelab.comm.door import Communicator
from moelab.comm.topology import Topology
from moelab.config import MoEConfig
from moelab.moe.reference import ReferenceMoE
from moelab.moe.sync import sync_dense_grads
from moelab.runtime.ranks import run_ranks
from moelab.testing import assert_matches_reference, expert_grads, rank_inputs, reference_grads

D, F = 8, 16
TOL = dict(rtol=1e-9, atol=1e-10)


def moe(**kw):
    base = dict(num_experts=4, top_k=2, gate="topk", capacity_factor=None, dispatcher="sparse", balance_loss_coef=0.01,
                z_loss_coef=0.001)
    base.update(kw)
    return base


def make_inputs(tokens, seed=0, hot=None):
    return rank_inputs(tokens, D, seed, shift=1.0 if hot is not None else 0.0)


def bias_gate(gate, hot, strength=0.5):
    if hot is not None:
        with torch.no_grad():
            gate.wg.weight[hot] += strength


def _layer_run(rank, world, case, options):
    from moelab.strategies.fastermoe.layer import FasterMoELayer

    cfg = MoEConfig(**case["moe"])
    xs, gys = make_inputs(case["tokens"], case.get("seed", 0), case.get("hot"))
    comm = Communicator(Topology(world, world))
    layer = FasterMoELayer(D, F, cfg, layer_id=case.get("layer_id", 2), seed=7, comm=comm, dtype=torch.float64,
                           options=options)
    bias_gate(layer.gate, case.get("hot"), case.get("strength", 0.5))
    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    ((y * gys[rank]).sum() + layer.aux_loss).backward()
    sync_dense_grads(list(layer.gate.parameters()), comm)
    eg = expert_grads(layer.experts)
    recs = [(r.op, r.tags.get("phase"), dict(r.bytes)) for r in comm.rec.comm]
    comm.close()  # one spawn runs every case: hand the groups on to the next
    return dict(y=y.detach(), gx=x.grad, gg=layer.gate.wg.weight.grad, eg=eg, recs=recs, S=layer.last_shadowed)


def _run_cases(rank, world, cases):
    torch.set_num_threads(1)
    return [[_layer_run(rank, world, c, o) for o in c["variants"]] for c in cases]


def reference(case):
    cfg = MoEConfig(**case["moe"])
    xs, gys = make_inputs(case["tokens"], case.get("seed", 0), case.get("hot"))
    ref = ReferenceMoE(D, F, cfg, layer_id=case.get("layer_id", 2), seed=7)
    bias_gate(ref.gate, case.get("hot"), case.get("strength", 0.5))
    return reference_grads(ref, xs, gys)


def check(case, results, ref):
    assert_matches_reference(results, ref, bias=case["moe"].get("expert_bias", True), **TOL)


def traffic(res, phase):
    acc = dict.fromkeys(("local", "intra", "inter"), 0)
    for op, ph, b in res["recs"]:
        if (op == "p2p" or op == "all_to_all") and ph == phase:
            for k, v in b.items():
                acc[k] += v
    return acc


def variants(world):
    gss = sorted({1, 2, world} & set(g for g in range(1, world + 1) if world % g == 0))
    v = [{}]  # plain FastMoE path
    v += [dict(smart=True, group_size=gs) for gs in gss]
    v += [dict(smart=True, group_size=gss[0], smart_threaded=False)]
    return v


CASES = {
    "uneven-k2": dict(moe=moe(), tokens=[7, 13, 1, 9]),
    "zero-token-rank-k1": dict(moe=moe(top_k=1), tokens=[0, 11, 6, 3]),
    "empty-splits-hot": dict(moe=moe(top_k=1), tokens=[9, 9, 9, 9], hot=2, strength=3.0),  # one expert gets all
    "two-experts-per-rank": dict(moe=moe(num_experts=8), tokens=[10, 4, 12, 7]),
    "drops-no-bias": dict(moe=moe(capacity_factor=0.5, expert_bias=False), tokens=[16, 12, 16, 5], layer_id=5),
}


@pytest.mark.parametrize("world", [2, 4])
def test_smart_schedule_matches_plain_and_reference(world):
    cases = [dict(c, tokens=c["tokens"][:world], variants=variants(world)) for c in CASES.values()]
    results = run_ranks(_run_cases, world, cases, timeout=150)
    for i, (name, case) in enumerate(zip(CASES, cases)):
        ref = reference(case)
        for vi, opts in enumerate(case["variants"]):
            per_rank = [r[i][vi] for r in results]
            try:
                check(case, per_rank, ref)
                if opts:  # p2p traffic == the plain all-to-all's, forward and backward
                    plain = [r[i][0] for r in results]
                    for rank in range(world):
                        for phase in ("fwd", "bwd"):
                            assert traffic(per_rank[rank], phase) == traffic(plain[rank], phase)
                        assert not any(op == "all_to_all" for op, _, _ in per_rank[rank]["recs"])
            except AssertionError as e:
                raise AssertionError(f"case {name}, options {opts} (world {world}): {e}") from None


SHADOW_SMART = {
    "hot-shadowed": dict(moe=moe(), tokens=[12, 12, 12, 12], hot=0, shadow=[0]),
    "all-shadowed": dict(moe=moe(top_k=1), tokens=[5, 0, 8, 3], shadow=[0, 1, 2, 3]),
    "zero-token-shadow": dict(moe=moe(top_k=1, num_experts=8), tokens=[9, 9, 9, 9], hot=1, strength=3.0,
                              shadow=[1, 6]),
}


def test_smart_with_shadowing_matches_reference_on_4_ranks():
    world = 4
    cases = []
    for c in SHADOW_SMART.values():
        cases.append(dict(c, variants=[dict(smart=True, group_size=2, shadow_force=c["shadow"]),
                                       dict(smart=True, group_size=1, shadow_force=c["shadow"], smart_threaded=False),
                                       dict(shadow_force=c["shadow"])]))
    results = run_ranks(_run_cases, world, cases, timeout=150)
    for i, (name, case) in enumerate(zip(SHADOW_SMART, cases)):
        ref = reference(case)
        for vi, opts in enumerate(case["variants"]):
            per_rank = [r[i][vi] for r in results]
            try:
                check(case, per_rank, ref)
                for res in per_rank:
                    assert res["S"] == tuple(case["shadow"])
                    ops = [op for op, _, _ in res["recs"]]
                    assert ops.count("broadcast") == ops.count("reduce") == len(case["shadow"])
            except AssertionError as e:
                raise AssertionError(f"case {name}, options {opts}: {e}") from None

