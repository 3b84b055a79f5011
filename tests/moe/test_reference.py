"""The fp64 reference's routing (written independently of moelab.moe.gates) and the production gates
agree: idx, weights, capacity positions, capacity, losses and the router's gradient, over many random
cases; plus hand-worked cases that pin the reference itself down (no code shared with the gates)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from moelab.config import MoEConfig
from moelab.moe.experts import seeded_generator
from moelab.moe.gates import Gate
from moelab.moe.layer import init_gate_
from moelab.moe.reference import ReferenceRouter, positions, reference_capacity

D = 6


def _pair(cfg, seed, layer):
    prod = Gate(D, cfg, dtype=torch.float64)
    init_gate_(prod, seed, layer)
    ref = ReferenceRouter(D, cfg, seed=seed, layer_id=layer)
    assert torch.equal(prod.wg.weight, ref.wg.weight)  # same seeded init
    return prod, ref


def _route(gate, x, cfg, seed, layer, rank):
    rng = seeded_generator("route", seed, layer, 0, rank) if cfg.random_routing else None
    r = gate(x, rng=rng)
    g = torch.Generator().manual_seed(rank)
    probe = torch.randn(r.weights.shape, generator=g, dtype=torch.float64)
    ((r.weights * probe).sum() + r.aux_loss).backward()  # the router's gradient through weights and losses
    return r, gate.wg.weight.grad.clone()


def _agree(cfg, T, seed, rank=0, shift=0.0):
    prod, ref = _pair(cfg, seed, layer=seed % 3)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1000 * seed + T), dtype=torch.float64) + shift
    a, ga = _route(prod, x, cfg, seed, seed % 3, rank)
    b, gb = _route(ref, x, cfg, seed, seed % 3, rank)
    case = f"{cfg} T={T} seed={seed}"
    assert torch.equal(a.idx, b.idx), case
    assert a.capacity == b.capacity, case
    valid = a.idx >= 0
    assert torch.equal(a.loc[valid], b.loc[valid]), case
    tol = dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(a.weights, b.weights, **tol, msg=case)
    for f in ("aux_loss", "balance_loss", "z_loss"):
        torch.testing.assert_close(getattr(a, f), getattr(b, f), **tol, msg=f"{f}: {case}")
    torch.testing.assert_close(ga, gb, **tol, msg=case)
    return b


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_topk_gate_agrees_with_reference(k):
    dropped = 0
    for E, cf, T, seed in itertools.product((8, 12), (None, 0.5, 1.0, 1.25), (0, 1, 7, 24), range(3)):
        cfg = MoEConfig(num_experts=E, top_k=k, gate="topk", capacity_factor=cf, min_capacity=2 if seed == 2 else 0,
                        balance_loss_coef=0.01, z_loss_coef=0.001)
        r = _agree(cfg, T, seed, shift=1.5 if seed == 1 else 0.0)
        dropped += int((r.idx < 0).sum())
    assert dropped > 0  # capacity really dropped slots in some cases


@pytest.mark.parametrize("random_routing", [False, True])
def test_gshard_gate_agrees_with_reference(random_routing):
    second_dropped = 0
    for E, cf, T, seed, rank in itertools.product((4, 8), (None, 0.75, 1.5), (0, 5, 32), range(3), (0, 3)):
        cfg = MoEConfig(num_experts=E, top_k=2, gate="gshard", capacity_factor=cf, random_routing=random_routing,
                        balance_loss_coef=0.02, z_loss_coef=0.01)
        r = _agree(cfg, T, seed, rank)
        second_dropped += int((r.idx[:, 1] < 0).sum())
    assert second_dropped > 0


def test_switch_gate_agrees_with_reference():
    for E, cf, T, seed in itertools.product((2, 4, 8), (None, 0.5, 1.0, 2.0), (0, 3, 40), range(3)):
        cfg = MoEConfig(num_experts=E, top_k=1, gate="switch", capacity_factor=cf, balance_loss_coef=0.1)
        _agree(cfg, T, seed, shift=2.0 if seed else 0.0)


@pytest.mark.parametrize("training", [True, False])
def test_base_gate_agrees_with_reference(training):
    for E, T, seed in itertools.product((2, 4), (8, 16, 24), range(3)):
        cfg = MoEConfig(num_experts=E, top_k=1, gate="base", balance_loss_coef=0.1, z_loss_coef=0.1)
        prod, ref = _pair(cfg, seed, 0)
        prod.train(training)
        ref.train(training)
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        a, ga = _route(prod, x, cfg, seed, 0, 0)
        b, gb = _route(ref, x, cfg, seed, 0, 0)
        assert torch.equal(a.idx, b.idx) and float(b.aux_loss.detach()) == 0.0
        torch.testing.assert_close(a.weights, b.weights, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(a.balance_loss, b.balance_loss, rtol=1e-12, atol=1e-14)


def test_base_assignment_checked_with_an_independent_solver():
    """The auction (the one piece the reference takes from production) against scipy's exact solver:
    exactly balanced, within T*eps of the optimum, and the optimum itself once eps is small."""
    from scipy.optimize import linear_sum_assignment

    from moelab.moe.base_gate import auction_assignment, default_eps

    for T, E, seed in itertools.product((8, 12, 32), (2, 4), range(4)):
        if T % E:
            continue
        s = torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        slots = [e for e in range(E) for _ in range(T // E)]  # expert e repeated T/E times
        rows, cols = linear_sum_assignment(s[:, slots].numpy(), maximize=True)
        best = float(s[rows, [slots[c] for c in cols]].sum())
        got = auction_assignment(s)
        assert torch.bincount(got, minlength=E).tolist() == [T // E] * E
        assert float(s[torch.arange(T), got].sum()) >= best - T * default_eps(s) - 1e-12
        fine = auction_assignment(s, min_eps=1e-9)
        assert float(s[torch.arange(T), fine].sum()) == pytest.approx(best, abs=1e-7)
        assert fine.tolist() == [slots[c] for c in cols]  # the optimum is unique on random scores


# ---- the reference itself, on hand-worked cases ------------------------------------------------------
def test_positions_are_choice_major():
    idx = torch.tensor([[0, 1], [1, 0], [0, 1], [2, -1]])
    # first choices in token order (t0:e0->0, t1:e1->0, t2:e0->1, t3:e2->0), then second choices
    assert positions(idx, 3).tolist() == [[0, 1], [0, 2], [1, 2], [0, 0]]


def test_capacity_is_exact_decimal():
    assert reference_capacity(10, 4, 1, 1.2) == 3  # 1.2 * 10 / 4 is 3 exactly; the float product is 3.0000000000000004
    assert reference_capacity(10, 4, 2, 1.0) == 5 and reference_capacity(9, 4, 2, 1.0) == 5
    assert reference_capacity(8, 8, 1, 0.5, min_capacity=4) == 4
    assert reference_capacity(8, 8, 1, None) is None


def test_uniform_router_losses_and_drops():
    """Zero router weights: every prob is 1/E, so balance = 1 and z = log(E)^2 whatever the routing;
    ties go to the lower expert id, so with capacity 2 on expert 0 all but 2 tokens are dropped."""
    E, T = 4, 6
    cfg = MoEConfig(num_experts=E, top_k=1, gate="switch", capacity_factor=4 / 3, balance_loss_coef=0.5,
                    z_loss_coef=0.25)
    ref = ReferenceRouter(D, cfg)
    with torch.no_grad():
        ref.wg.weight.zero_()
    r = ref(torch.randn(T, D, dtype=torch.float64))
    assert r.capacity == 2 and r.idx[:, 0].tolist() == [0, 0, -1, -1, -1, -1]
    assert r.weights[:, 0].tolist() == [0.25, 0.25, 0, 0, 0, 0]
    assert float(r.balance_loss) == pytest.approx(1.0)
    assert float(r.z_loss) == pytest.approx(math.log(E) ** 2)
    assert float(r.aux_loss.detach()) == pytest.approx(0.5 + 0.25 * math.log(E) ** 2)


def test_gshard_renormalizes_over_survivors():
    cfg = MoEConfig(num_experts=2, top_k=2, gate="gshard", capacity_factor=0.5)  # capacity 1 per expert at T=2
    ref = ReferenceRouter(2, cfg)
    with torch.no_grad():
        ref.wg.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64))
    x = torch.tensor([[2.0, 0.0], [1.0, 0.0]], dtype=torch.float64)  # both prefer expert 0
    r = ref(x)
    # t0 takes e0's only slot, t1's first choice (e0) is dropped; second choices: t0 -> e1 (pos 0 kept),
    # t1 -> e1 (pos 1 dropped). t0 keeps both slots, renormalized to p0/(p0+p1) = softmax; t1 keeps none.
    assert r.idx.tolist() == [[0, 1], [-1, -1]]
    p = torch.softmax(torch.tensor([2.0, 0.0], dtype=torch.float64), 0)
    torch.testing.assert_close(r.weights[0], p)
    assert r.weights[1].tolist() == [0.0, 0.0]
