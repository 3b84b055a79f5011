"""Training-level equivalences on real gloo ranks (fp64): replicas == EP, EP=1 == EP=N."""
from __future__ import annotations

import pytest
import torch

from moelab.runtime.ranks import run_ranks
from moelab.testing import train_snapshot


def gather_experts(results):
    """Every holder of an expert has the same parameters; return one copy per expert."""
    out = {}
    for res in results:
        for key, v in res["experts"].items():
            if key in out:
                torch.testing.assert_close(v, out[key], rtol=0, atol=1e-12)
            else:
                out[key] = v
    return out


def test_placement_with_replicas_trains_like_ep():
    replicas = {"parallel.placement": {0: [0, 1], 1: [0], 2: [1, 0], 3: [1]}}
    ep, rep = run_ranks(train_snapshot, 2, {}, timeout=120), run_ranks(train_snapshot, 2, replicas, timeout=120)
    assert ep[0]["losses"] == ep[1]["losses"]
    torch.testing.assert_close(torch.tensor(rep[0]["losses"]), torch.tensor(ep[0]["losses"]), rtol=1e-10, atol=0)
    e_ep, e_rep = gather_experts(ep), gather_experts(rep)
    assert set(e_ep) == set(e_rep)
    for key in e_ep:
        torch.testing.assert_close(e_rep[key], e_ep[key], rtol=1e-9, atol=1e-11)
    for r in range(2):
        torch.testing.assert_close(rep[r]["dense"], ep[0]["dense"], rtol=1e-9, atol=1e-11)
    # the replicas really were used: rank 1 holds expert 0 too
    assert (1, 0) in rep[1]["experts"] or (0, 0) in rep[1]["experts"]


@pytest.mark.parametrize("balance", [0.0, 0.01])
def test_ep1_equals_ep4(balance):
    """One process on the global batch == 4 ranks on its quarters (dropless), with or without the balance
    loss (taken over the global batch: :func:`moelab.moe.layer.global_aux_losses`)."""
    coef = {"model.moe.balance_loss_coef": balance}
    one = run_ranks(train_snapshot, 1, {**coef, "train.batch_size": 4}, timeout=120)[0]
    four = run_ranks(train_snapshot, 4, {**coef, "train.batch_size": 1}, timeout=120)
    torch.testing.assert_close(torch.tensor(four[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-10, atol=0)
    e1, e4 = gather_experts([one]), gather_experts(four)
    for key in e1:
        torch.testing.assert_close(e4[key], e1[key], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(four[2]["dense"], one["dense"], rtol=1e-8, atol=1e-10)
    assert four[0]["loads"] == one["loads"]  # global loads are the same routing


def _round_trip(rank, world):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.config import MoEConfig
    from moelab.moe.dispatch import DenseDispatcher, SparseDispatcher
    from moelab.moe.gates import Gate
    from moelab.placement import Placement

    out = []
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(5 + 3 * rank, 8, generator=g, dtype=torch.float64, requires_grad=True)
    comm = Communicator(Topology(world, 2))
    for disp, pl in (("sparse", Placement.expert_parallel(4, world)),
                     ("sparse", Placement.from_mapping({0: [0, 1], 1: [1], 2: [1, 0], 3: [0]}, 4, world)),
                     ("dense", Placement.expert_parallel(4, world))):
        cfg = MoEConfig(num_experts=4, top_k=2, capacity_factor=8.0)  # capacity large: nothing dropped
        gate = Gate(8, cfg, dtype=torch.float64)
        r = gate(x)
        d = {"sparse": SparseDispatcher, "dense": DenseDispatcher}[disp](comm, pl)
        n0 = len(comm.rec.comm)
        plan = d.plan(r)
        y = d.combine(d.dispatch(x, plan, r), plan, r)  # identity experts; weights sum to 1
        gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
        (gx,) = torch.autograd.grad((y * gy).sum(), x)
        out.append(dict(x=x.detach(), y=y.detach(), gx=gx, gy=gy, idx=r.idx,
                        a2a=[rec.bytes for rec in comm.rec.comm[n0:] if rec.op == "all_to_all"], cap=plan.capacity))
    return out


def test_dispatch_combine_round_trip_and_bytes():
    from moelab.comm.topology import Topology

    res = run_ranks(_round_trip, 4, timeout=120)
    topo = Topology(4, 2)
    for rank, per in enumerate(res):
        for case in per:
            torch.testing.assert_close(case["y"], case["x"], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(case["gx"], case["gy"], rtol=1e-12, atol=1e-12)
        # sparse EP: bytes sent to rank r = rows routed to experts on r; dense: E_local*cap rows to each
        idx = per[0]["idx"]
        want = dict.fromkeys(("local", "intra", "inter"), 0)
        for dst, n in enumerate(torch.bincount(idx.reshape(-1), minlength=4).tolist()):
            want[topo.link_class(rank, dst)] += n * 8 * 8
        assert per[0]["a2a"][0] == want
        cap = per[2]["cap"]
        dense_want = {"local": cap * 64, "intra": cap * 64, "inter": 2 * cap * 64}
        assert per[2]["a2a"][0] == dense_want
