"""The balance loss over the global batch (:func:`moelab.moe.layer.global_aux_losses`, what training adds) on
real gloo ranks equals the single-process fp64 reference's on the whole batch: its value (the mean of the
ranks' shares) and its gradient w.r.t. the gate weight (the ranks' gradients averaged, as the data-parallel
sync does), for any split of the batch. Two MoE layers of different E share the one all-reduce of counts,
recorded (and link-emulated) like any training collective (the simulator prices it: tests/sim/).
A rank's own ``layer.aux_loss`` (its tokens only) does not: the negative control that shows the test bites."""
from __future__ import annotations

import pytest
import torch

from moelab.comm.bytes import peer_bytes
from moelab.comm.door import Communicator
from moelab.comm.topology import Topology
from moelab.config import MoEConfig
from moelab.moe.layer import MoELayer, global_aux_losses
from moelab.moe.reference import ReferenceRouter
from moelab.runtime.ranks import run_ranks
from moelab.testing import rank_inputs

D, F = 8, 16
SEED = 7
TOL = dict(rtol=1e-12, atol=1e-15)


def moe(**kw):
    base = dict(num_experts=4, top_k=2, gate="topk", capacity_factor=None, balance_loss_coef=0.01, z_loss_coef=0.001)
    return {**base, **kw}


# tokens of 4 ranks (2 ranks: the first two); the z-loss (a per-rank mean) is exact only for even splits
CASES = {
    "topk-k2-dropless": dict(moe=moe(), tokens=[12, 12, 12, 12]),
    "switch-drops": dict(moe=moe(gate="switch", top_k=1, capacity_factor=0.5), tokens=[16, 16, 16, 16]),
    "gshard-capacity": dict(moe=moe(gate="gshard", capacity_factor=1.0, balance_loss_coef=0.1), tokens=[10] * 4),
    "uneven": dict(moe=moe(z_loss_coef=0.0, top_k=1), tokens=[3, 17, 1, 8]),
    "zero-token-rank": dict(moe=moe(z_loss_coef=0.0), tokens=[0, 14, 9, 5]),
    # shifted inputs: the E=8 layer sends every first choice to one expert, so f_e is the same on every
    # rank and the ranks' own losses average to the global one there (the one pair the control skips)
    "skewed": dict(moe=moe(balance_loss_coef=1.0), tokens=[12, 12, 12, 12], shift=3.0),
}
SAME_F_ON_EVERY_RANK = {("skewed", 1)}


def _cfgs(case):
    a = MoEConfig(**case["moe"])
    b = MoEConfig(**{**case["moe"], "num_experts": 8})  # a second layer, another E, the same all-reduce
    return ((a, 0), (b, 1))


def _inputs(case, world):
    xs, _ = rank_inputs(case["tokens"][:world], D, seed=3, shift=case.get("shift", 0.0))
    return xs


def _rank(rank, world, cases):
    torch.set_num_threads(1)
    out = []
    for case in cases:
        comm = Communicator(Topology(world, world))
        x = _inputs(case, world)[rank]
        layers = [MoELayer(D, F, cfg, layer_id=lid, seed=SEED, comm=comm, dtype=torch.float64)
                  for cfg, lid in _cfgs(case)]
        for layer in layers:
            layer(x)
        n0 = len(comm.rec.comm)
        shares = global_aux_losses(layers)
        calls = [(r.op, r.group, r.tags.get("phase"), sum(r.sent_to.values())) for r in comm.rec.comm[n0:]]
        res = []
        for layer, share in zip(layers, shares):
            w = layer.gate.wg.weight
            (g,) = torch.autograd.grad(share, w, retain_graph=True)
            (g_local,) = torch.autograd.grad(layer.aux_loss, w)
            res.append(dict(value=share.detach(), grad=g, local=layer.aux_loss.detach(), local_grad=g_local))
        comm.close()
        out.append(dict(layers=res, calls=calls))
    return out


def _reference(case, world, cfg, layer_id):
    """The whole batch through the fp64 reference router: ``coef * balance + coef_z * z`` and its gradient."""
    ref = ReferenceRouter(D, cfg, seed=SEED, layer_id=layer_id)
    x = torch.cat(_inputs(case, world))
    r = ref(x)
    (g,) = torch.autograd.grad(r.aux_loss, ref.wg.weight)
    return r.aux_loss.detach(), g


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_global_balance_loss_matches_the_whole_batch_reference(world):
    cases = list(CASES.values())
    results = run_ranks(_rank, world, cases, timeout=180)
    local_differs = set()
    for c, (name, case) in enumerate(CASES.items()):
        for j, (cfg, lid) in enumerate(_cfgs(case)):
            want, want_grad = _reference(case, world, cfg, lid)
            got = [results[r][c]["layers"][j] for r in range(world)]
            value = sum(g["value"] for g in got) / world  # the mean of the shares
            grad = sum(g["grad"] for g in got) / world  # the data-parallel mean of the gate's gradients
            msg = f"{name}, layer {lid} (E={cfg.num_experts}), {world} ranks"
            torch.testing.assert_close(value, want, **TOL, msg=msg)
            torch.testing.assert_close(grad, want_grad, **TOL, msg=msg)
            local = sum(g["local"] for g in got) / world
            local_grad = sum(g["local_grad"] for g in got) / world
            if not (torch.allclose(local, want, rtol=1e-9, atol=0)
                    and torch.allclose(local_grad, want_grad, rtol=1e-9, atol=0)):
                local_differs.add((name, lid))
        # one recorded (so link-emulated) all-reduce of both layers' int64 counts, 8 (4 + 8) bytes
        nbytes = 8 * sum(cfg.num_experts for cfg, _ in _cfgs(case))
        for r in range(world):
            sent = sum(peer_bytes("all_reduce", list(range(world)), r, nbytes).values())
            assert results[r][c]["calls"] == [("all_reduce", "dp", "fwd", sent)], name
    # the ranks' own (local) losses miss the global one: without the all-reduce this test fails
    assert local_differs == {(n, lid) for n in CASES for lid in (0, 1)} - SAME_F_ON_EVERY_RANK, local_differs


def test_a_single_rank_keeps_the_layers_own_loss():
    """One rank: its tokens are the batch; a gate without aux loss or a zero coefficient: nothing to do."""
    x = torch.randn(10, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    layers = [MoELayer(D, F, MoEConfig(**kw), layer_id=i, seed=SEED, dtype=torch.float64)
              for i, kw in enumerate([moe(), moe(balance_loss_coef=0.0), moe(gate="base", top_k=1)])]
    for layer in layers:
        layer(x)
    assert layers[2].last_routing.balance_stats is None  # base: balanced by construction, no aux loss
    assert all(a is layer.aux_loss for a, layer in zip(global_aux_losses(layers), layers))
    ref = ReferenceRouter(D, MoEConfig(**moe()), seed=SEED, layer_id=0)(x)
    torch.testing.assert_close(layers[0].aux_loss, ref.aux_loss, **TOL)
