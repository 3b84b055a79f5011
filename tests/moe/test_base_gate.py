"""BASE-layer balanced assignment gate (``gate="base"``): exact balance, optimal assignment (brute
force / linear assignment on tiny cases), the spec's auction bound, and the MoE layer with it
matching the fp64 single-process reference on real ranks."""
from __future__ import annotations

import itertools

import pytest
import torch

from moelab.config import ConfigError, MoEConfig, RunConfig
from moelab.moe.base_gate import auction_assignment, balanced_capacities, default_eps
from moelab.moe.gates import Gate
from moelab.runtime.ranks import run_ranks
from moelab.testing import reference_grads


def total(a, assign):
    return float(a[torch.arange(a.shape[0]), assign].sum())


def brute_force(a, cap):
    """The best total affinity over every assignment with exactly cap[e] tokens on expert e."""
    T, E = a.shape
    slots = [e for e in range(E) for _ in range(int(cap[e]))]
    return max(sum(float(a[t, e]) for t, e in enumerate(p)) for p in set(itertools.permutations(slots)))


SHAPES = [(4, 2), (6, 2), (6, 3), (4, 4), (8, 4), (8, 2), (5, 2), (7, 3)]  # the last two: remainder rule


# ---- balance ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,E", [(8, 4), (64, 8), (256, 16), (1024, 32), (0, 4), (12, 1)])
def test_exact_balance(T, E):
    g = torch.Generator().manual_seed(T + E)
    a = torch.randn(T, E, generator=g, dtype=torch.float64) * 3
    assign = auction_assignment(a)
    assert assign.shape == (T,) and assign.dtype == torch.int64
    assert torch.bincount(assign, minlength=E).tolist() == [T // E] * E


def test_balance_when_everyone_prefers_one_expert():
    a = torch.zeros(16, 4, dtype=torch.float64)
    a[:, 2] = 10.0
    a += torch.linspace(0, 1, 16, dtype=torch.float64).unsqueeze(1) * torch.tensor([0.0, 0.1, 1.0, 0.2])
    assign = auction_assignment(a)
    assert torch.bincount(assign, minlength=4).tolist() == [4, 4, 4, 4]
    assert set(assign[12:].tolist()) == {2}  # the 4 tokens that gain most from expert 2 get it


def test_remainder_rule_and_explicit_capacities():
    assert balanced_capacities(7, 3).tolist() == [3, 2, 2]
    a = torch.randn(7, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.bincount(auction_assignment(a), minlength=3).tolist() == [3, 2, 2]
    cap = torch.tensor([0, 5, 2])
    assign = auction_assignment(a, cap)
    assert torch.bincount(assign, minlength=3).tolist() == [0, 5, 2]
    with pytest.raises(ValueError, match="summing to T"):
        auction_assignment(a, torch.tensor([1, 1, 1]))


def test_out_of_rounds_is_still_exactly_balanced():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(64, 8, generator=g, dtype=torch.float64)
    assign = auction_assignment(a, max_iters=1)  # leftovers filled greedily
    assert torch.bincount(assign, minlength=8).tolist() == [8] * 8


def test_non_finite_scores():
    a = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a[0, 1], a[3, 2], a[5, 0] = float("nan"), float("-inf"), float("inf")
    assert torch.bincount(auction_assignment(a), minlength=4).tolist() == [2, 2, 2, 2]


# ---- optimality ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,E", SHAPES)
def test_assignment_is_optimal_vs_brute_force(T, E):
    g = torch.Generator().manual_seed(100 * T + E)
    cap = balanced_capacities(T, E)
    for _ in range(6):
        a = torch.randn(T, E, generator=g, dtype=torch.float64)
        best = brute_force(a, cap)
        exact = auction_assignment(a, min_eps=1e-9)  # eps-scaling down to 1e-9: exact here
        assert abs(total(a, exact) - best) < 1e-9
        spec = auction_assignment(a)  # the spec's eps and 100 rounds: within T * eps
        assert total(a, spec) >= best - T * default_eps(a) - 1e-12
        assert torch.equal(torch.bincount(spec, minlength=E), cap)


def test_assignment_vs_linear_sum_assignment():
    scipy_opt = pytest.importorskip("scipy.optimize")
    g = torch.Generator().manual_seed(5)
    for T, E in ((16, 4), (48, 6), (64, 8)):
        a = torch.randn(T, E, generator=g, dtype=torch.float64)
        slots = torch.repeat_interleave(torch.arange(E), balanced_capacities(T, E))  # replicated expert slots
        m = a[:, slots].numpy()
        r, c = scipy_opt.linear_sum_assignment(-m)
        best = float(m[r, c].sum())
        assert abs(total(a, auction_assignment(a, min_eps=1e-9, max_iters=10_000)) - best) < 1e-8
        spec = total(a, auction_assignment(a))
        assert best - T * default_eps(a) <= spec <= best + 1e-9


# ---- the gate ----------------------------------------------------------------------------------------------
def _gate(E=4, **kw):
    cfg = MoEConfig(num_experts=E, top_k=1, gate="base", balance_loss_coef=0.5, z_loss_coef=0.5, **kw)
    gate = Gate(8, cfg, dtype=torch.float64)
    with torch.no_grad():
        gate.wg.weight.copy_(torch.randn(E, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    return gate


def test_gate_weights_are_sigmoid_of_the_assigned_logit_and_no_aux_loss():
    gate = _gate()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    r = gate(x)
    logits = gate.wg(x)
    assert r.idx.shape == (16, 1) and torch.bincount(r.idx[:, 0], minlength=4).tolist() == [4] * 4
    torch.testing.assert_close(r.weights, torch.sigmoid(logits.gather(1, r.idx)))
    assert float(r.aux_loss) == 0.0 and r.capacity is None  # coefficients ignored: balance by construction
    assert torch.equal(r.idx[:, 0], auction_assignment(logits.detach()))  # affinity = gate logits
    r.weights.sum().backward()
    assert gate.wg.weight.grad is not None and gate.wg.weight.grad.abs().sum() > 0


def test_gate_eval_mode_is_greedy():
    gate = _gate().eval()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    r = gate(x)
    assert torch.equal(r.idx[:, 0], gate.wg(x).argmax(-1))


def test_gate_requires_top1():
    cfg = MoEConfig(num_experts=4, top_k=2, gate="base")
    with pytest.raises(ValueError, match="top-1"):
        Gate(8, cfg, dtype=torch.float64)(torch.randn(8, 8, dtype=torch.float64))


@pytest.mark.parametrize("over, msg", [({"model.moe.top_k": 2}, "top_k=1"),
                                       ({"model.moe.top_k": 1, "train.batch_size": 3, "model.seq_len": 5},
                                        "divisible")])
def test_config_validation(over, msg):
    base = {"model.moe.gate": "base", "model.moe.num_experts": 4, "parallel.nproc": 2}
    with pytest.raises(ConfigError, match=msg):
        RunConfig().with_overrides({**base, **over}).validate()
    RunConfig().with_overrides({**base, "model.moe.top_k": 1}).validate()


# ---- the MoE layer on real ranks vs the fp64 reference ---------------------------------------------------
D, F = 8, 16
TOKENS = [16, 12, 8, 20]


def _inputs(world):
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(n, D, generator=g, dtype=torch.float64) for n in TOKENS[:world]]
    gys = [torch.randn(n, D, generator=g, dtype=torch.float64) for n in TOKENS[:world]]
    return xs, gys


def _layer(rank, world):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.moe.layer import MoELayer
    from moelab.moe.sync import sync_dense_grads
    from moelab.strategies.zero.layer import ZeroMoELayer

    cfg = MoEConfig(num_experts=4, top_k=1, gate="base")
    xs, gys = _inputs(world)
    comm = Communicator(Topology(world, world))
    out = {}
    for name, cls in (("ep", MoELayer), ("zero", ZeroMoELayer)):
        layer = cls(D, F, cfg, layer_id=1, seed=3, comm=comm, dtype=torch.float64)
        x = xs[rank].clone().requires_grad_()
        y = layer(x)
        ((y * gys[rank]).sum() + layer.aux_loss).backward()
        sync_dense_grads(list(layer.gate.parameters()), comm)
        ex = layer.experts
        out[name] = dict(y=y.detach(), gx=x.grad, gg=layer.gate.wg.weight.grad, experts=ex.experts,
                         eg=[torch.zeros_like(p) if p.grad is None else p.grad.clone()
                             for p in (ex.w1, ex.b1, ex.w2, ex.b2)],
                         counts=layer.last_global_counts.clone())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_layer_with_base_gate_matches_reference(world):
    from moelab.moe.reference import ReferenceMoE

    res = run_ranks(_layer, world, timeout=120)
    cfg = MoEConfig(num_experts=4, top_k=1, gate="base")
    xs, gys = _inputs(world)
    ref = ReferenceMoE(D, F, cfg, layer_id=1, seed=3)
    want = reference_grads(ref, xs, gys)
    for r in want["routes"]:  # exact balance on every rank: T/E tokens per expert
        assert torch.bincount(r.idx[:, 0], minlength=4).tolist() == [r.idx.shape[0] // 4] * 4
    tol = dict(rtol=1e-10, atol=1e-12)
    for rank, per in enumerate(res):
        for name, o in per.items():
            torch.testing.assert_close(o["y"], want["y"][rank], **tol)
            torch.testing.assert_close(o["gx"], want["gx"][rank], **tol)
            torch.testing.assert_close(o["gg"], want["gg"], **tol)
            assert o["counts"].tolist() == [[n // 4] * 4 for n in TOKENS[:world]]
        for s, e in enumerate(per["ep"]["experts"]):  # EP: the owner holds the full expert grad
            for i, g in enumerate(want["eg"][e]):
                torch.testing.assert_close(per["ep"]["eg"][i][s], g, **tol)
    for e in range(4):  # zero: local partial grads, summed over ranks by its reduce-scatter
        for i, g in enumerate(want["eg"][e]):
            torch.testing.assert_close(sum(per["zero"]["eg"][i][e] for per in res), g, **tol)


def _train(rank, world):
    from moelab.runtime.train import Trainer

    cfg = RunConfig().with_overrides({
        "model.d_model": 16, "model.d_ff": 32, "model.n_layers": 2, "model.n_heads": 2, "model.seq_len": 16,
        "model.moe.num_experts": 4, "model.moe.top_k": 1, "model.moe.gate": "base", "train.iters": 2,
        "train.batch_size": 2, "train.dtype": "float64", "train.trace": False, "parallel.nproc": world}).validate()
    tr = Trainer.build(cfg)
    return dict(rows=tr.run(), loads=tr.loads)


def test_training_with_base_gate_is_exactly_balanced():
    res = run_ranks(_train, 2, timeout=120)
    assert {row["tokens"] for row in res[0]["loads"]} == {2 * 2 * 16 // 4}  # N*T/E for every expert, layer, iter
    assert res[0]["rows"][-1]["loss"] == res[1]["rows"][-1]["loss"]
