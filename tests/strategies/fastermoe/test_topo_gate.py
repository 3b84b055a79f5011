"""FasterMoE topology-aware gate (§2.6): spec §5 invariant 12. Single process."""
from __future__ import annotations

import math

import pytest
import torch

from moelab.comm.topology import Topology
from moelab.config import MoEConfig
from moelab.moe.gates import Gate
from moelab.placement import Placement
from moelab.runtime.ranks import run_ranks
from moelab.strategies.fastermoe.topo_gate import TopoGate, remote_mask, topo_fraction, topo_route

CFG = MoEConfig(num_experts=8, top_k=2, gate="topk", balance_loss_coef=0.01, z_loss_coef=0.001)
D = 12


def make_gate(rank=1, world=4, rpn=2, fraction=0.14, strict=False, cfg=CFG, seed=0):
    """A gate with seeded weights (not the global RNG's state, which depends on the tests run before)."""
    topo = Topology(world, rpn)
    pl = Placement.expert_parallel(cfg.num_experts, world)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        g = TopoGate(D, cfg, topo=topo, placement=pl, rank=rank, fraction=fraction, strict=strict,
                     dtype=torch.float64)
    ref = Gate(D, cfg, dtype=torch.float64)
    ref.load_state_dict(g.state_dict())
    return g, ref, topo, pl


def tokens(T, seed=0):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_fraction_rule_matches_the_code_default():
    assert topo_fraction(6.25, 11.0, 4) == pytest.approx(0.142, abs=5e-4)


@pytest.mark.parametrize("T, fraction, shadowed", [(64, 0.14, ()), (50, 0.3, ()), (40, 0.14, (5,)), (33, 0.0, ()),
                                                   (64, 0.14, (4, 6))])
def test_cap_is_exact_and_keeps_the_most_confident(T, fraction, shadowed):
    g, ref, topo, pl = make_gate(fraction=fraction)
    with torch.no_grad():  # push most tokens towards remote experts so the cap binds
        g.wg.weight[4:] += 0.5
    x = tokens(T)
    r = g(x, shadowed=shadowed)
    assert g.last_active
    remote = remote_mask(pl, topo, 1, shadowed)
    assert remote.tolist() == [False] * 4 + [e not in shadowed for e in range(4, 8)]  # rank 1 is on node 0
    q = math.floor(fraction * T)
    leaving = remote[r.idx]  # [T, 2]
    assert int(leaving.sum()) == q
    assert not leaving[:, 0].any()  # the remote choice is always in slot 1
    logits = g.wg(x).detach()
    v1, t1 = logits.max(-1)
    pref = remote[t1]
    assert int(pref.sum()) >= q
    kept = leaving[:, 1].nonzero().squeeze(1)
    assert (r.idx[kept, 1] == t1[kept]).all()  # the remote favourite itself
    others = pref.nonzero().squeeze(1)
    others = others[~torch.isin(others, kept)]
    if len(kept) and len(others):
        assert v1[kept].min() >= v1[others].max()  # the most confident remote-preferring tokens
    # everything else on local or shadowed experts; 2 distinct experts; scores sum to 1
    assert (r.idx[:, 0] != r.idx[:, 1]).all()
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(T, dtype=torch.float64))
    # non-kept tokens take the best two local experts
    masked = logits.masked_fill(remote, float("-inf"))
    rest = torch.ones(T, dtype=torch.bool)
    rest[kept] = False
    assert (r.idx[rest] == torch.topk(masked, 2, -1).indices[rest]).all()
    # weights are the softmax over the two chosen logits, differentiable to the gate
    torch.testing.assert_close(r.weights, torch.softmax(logits.gather(1, r.idx), -1))
    r.weights.sum().backward()
    assert g.wg.weight.grad is not None


def test_large_fraction_or_single_node_is_plain_top2():
    x = tokens(40, seed=3)
    for kw in (dict(fraction=2.0), dict(world=4, rpn=4), dict(fraction=1.5, strict=False)):
        g, ref, *_ = make_gate(**kw)
        r, r0 = g(x), ref(x)
        assert torch.equal(r.idx, r0.idx)
        torch.testing.assert_close(r.weights, r0.weights, rtol=0, atol=0)
        torch.testing.assert_close(r.aux_loss, r0.aux_loss)


def test_fallback_when_few_tokens_prefer_remote_and_strict_variant():
    g, ref, topo, pl = make_gate(fraction=0.9)
    with torch.no_grad():  # make local experts preferred
        g.wg.weight[:4] += 0.5
    ref.load_state_dict(g.state_dict())
    x = tokens(30, seed=1)
    r = g(x)
    assert not g.last_active and torch.equal(r.idx, ref(x).idx)
    gs, *_ = make_gate(fraction=0.9, strict=True)
    gs.load_state_dict(g.state_dict())
    rs = gs(x)
    remote = remote_mask(pl, topo, 1)
    _, t1 = g.wg(x).max(-1)
    assert gs.last_active
    assert int(remote[rs.idx].sum()) == int(remote[t1].sum()) < math.floor(0.9 * 30)


def test_capacity_and_validation():
    cfg = MoEConfig(num_experts=8, top_k=2, gate="topk", capacity_factor=0.5)
    g, *_ = make_gate(cfg=cfg)
    r = g(tokens(64))
    assert (r.idx < 0).any() and ((r.idx >= 0) | (r.weights == 0)).all()
    with pytest.raises(ValueError, match="top-2 gate"):
        make_gate(cfg=MoEConfig(num_experts=8, top_k=1, gate="topk"))
    with pytest.raises(ValueError, match="at least 2 experts per node"):
        make_gate(cfg=MoEConfig(num_experts=4, top_k=2), world=4, rpn=1)
    with pytest.raises(ValueError, match=">= 0"):
        make_gate(fraction=-1)


def test_topo_route_pure():
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.5], [2.0, 0.0, 3.0, 1.0], [1.0, 2.0, 0.0, 4.0], [3.0, 2.0, 1.0, 0.0]])
    remote = torch.tensor([False, False, True, True])
    idx, t1, active = topo_route(logits, remote, fraction=0.25)  # q = 1: token 0 (v1 = 5) keeps its remote pick
    assert active and t1.tolist() == [2, 2, 3, 0]
    assert idx.tolist() == [[1, 2], [0, 1], [1, 0], [0, 1]]


# ---- in the layer, on real ranks (2 emulated nodes x 2) -------------------------------------------
LAYER_CFG = dict(num_experts=8, top_k=2, gate="topk", balance_loss_coef=0.01, z_loss_coef=0.001)


def _inputs(world, T=24):
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(T, D, generator=g, dtype=torch.float64) for _ in range(world)]
    gys = [torch.randn(T, D, generator=g, dtype=torch.float64) for _ in range(world)]
    return xs, gys


def _bias(gate):
    with torch.no_grad():  # experts 6, 7 (node 1) popular: node-0 ranks must cap
        gate.wg.weight[6:] += 0.4


def _layer_ranks(rank, world, option_sets):
    return [_layer_rank(rank, world, o) for o in option_sets]


def _layer_rank(rank, world, options):
    from moelab.comm.door import Communicator
    from moelab.moe.sync import sync_dense_grads
    from moelab.strategies.fastermoe.layer import FasterMoELayer

    torch.set_num_threads(1)
    comm = Communicator(Topology(world, 2))
    layer = FasterMoELayer(D, 16, MoEConfig(**LAYER_CFG), layer_id=1, seed=3, comm=comm, dtype=torch.float64,
                           options=options)
    _bias(layer.gate)
    xs, gys = _inputs(world)
    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    ((y * gys[rank]).sum() + layer.aux_loss).backward()
    sync_dense_grads(list(layer.gate.parameters()), comm)
    ex = layer.experts
    eg = {e: ex.w1.grad[s].clone() for s, e in enumerate(ex.experts)}
    return dict(y=y.detach(), gx=x.grad, gg=layer.gate.wg.weight.grad, eg=eg, idx=layer.last_routing.idx,
                active=layer.gate.last_active)


OPTION_SETS = [dict(topo_gate=True, topo_fraction=0.25), dict(topo_gate=True, topo_fraction=0.25, shadow_force=[6]),
               dict(topo_gate=True, topo_fraction=0.25, smart=True, group_size=2)]


def test_topo_gate_layer_matches_reference():
    world = 4
    results = run_ranks(_layer_ranks, world, OPTION_SETS, timeout=120)
    for i, options in enumerate(OPTION_SETS):
        check_topo_layer(options, [r[i] for r in results], world)


def check_topo_layer(options, res, world):
    from moelab.moe.reference import ReferenceMoE

    cfg = MoEConfig(**LAYER_CFG)
    ref = ReferenceMoE(D, 16, cfg, layer_id=1, seed=3)
    _bias(ref.gate)
    topo, pl = Topology(world, 2), Placement.expert_parallel(8, world)
    hint = tuple(options.get("shadow_force", ()))
    xs, gys = _inputs(world)
    xs = [x.clone().requires_grad_() for x in xs]
    loss = 0
    for rank in range(world):
        tg = TopoGate(D, cfg, topo=topo, placement=pl, rank=rank, fraction=0.25, dtype=torch.float64)
        tg.wg = ref.gate.wg  # one shared router, as in the layer after the dense all-reduce
        ref.gate = tg
        orig = TopoGate.forward
        ref.gate.forward = lambda x, rng=None, _g=tg: orig(_g, x, rng, shadowed=hint)
        y, r = ref.forward_chunk(xs[rank], rank)
        assert torch.equal(r.idx, res[rank]["idx"])
        remote = remote_mask(pl, topo, rank, hint)
        if res[rank]["active"]:
            assert int(remote[r.idx].sum()) == math.floor(0.25 * 24)
        torch.testing.assert_close(res[rank]["y"], y.detach(), rtol=1e-9, atol=1e-10)
        loss = loss + (y * gys[rank]).sum() + r.aux_loss
    assert res[0]["active"] and res[1]["active"]  # node 0 really was capped
    loss.backward()
    for rank in range(world):
        torch.testing.assert_close(res[rank]["gx"], xs[rank].grad, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(res[rank]["gg"], ref.gate.wg.weight.grad, rtol=1e-9, atol=1e-10)
        for e, g in res[rank]["eg"].items():
            torch.testing.assert_close(g, ref.expert(e)[0].grad, rtol=1e-9, atol=1e-10)
