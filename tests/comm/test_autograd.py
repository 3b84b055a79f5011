"""The door's autograd blocks on named groups (gather/split/reduce/all-to-all) and its group-aware
batched point-to-point, on 4 real gloo ranks: each forward and backward against the same maths done
locally on the full (all-ranks) tensors."""
from __future__ import annotations

import pytest
import torch

from moelab.runtime.ranks import run_ranks

GROUPS = {"pair": [[0, 1], [2, 3]], "strided": [[0, 2], [1, 3]]}


def _data(world, rows=4, cols=4):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(rows, cols, generator=g, dtype=torch.float64) for _ in range(world)]
    gs = [torch.randn(rows * 2, cols, generator=g, dtype=torch.float64) for _ in range(world)]  # up to 2x rows
    return xs, gs


def _blocks(rank, world):
    from moelab.comm import autograd as ag
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology

    comm = Communicator(Topology(world, 2), groups=GROUPS)
    xs, gs = _data(world)
    out = {}
    for name, fn, kw in (("gather", ag.gather_rows, {}), ("gather1", ag.gather_rows, {"dim": 1}),
                         ("split", ag.split_rows, {}), ("split1", ag.split_rows, {"dim": 1}),
                         ("rfwd", ag.reduce_fwd, {}), ("rbwd", ag.reduce_bwd, {}), ("a2a", ag.all_to_all, {})):
        for group in GROUPS:
            x = xs[rank].clone().requires_grad_()
            y = fn(comm, x, group, **kw) if kw else fn(comm, x, group)
            g = gs[rank].reshape(-1)[: y.numel()].reshape(y.shape)
            (y * g).sum().backward()
            out[(name, group)] = (y.detach(), x.grad.clone())
    # a constant input still runs the backward collective its peers run (anchor): no hang
    y = ag.split_rows(comm, xs[rank], "pair")
    out["const_requires_grad"] = y.requires_grad
    # batched point-to-point on a named group: swap with the pair partner
    partner = rank ^ 1
    buf = torch.empty(3, dtype=torch.float64)
    comm.exchange({partner: torch.full((3,), float(rank), dtype=torch.float64)}, {partner: buf}, group="pair")
    out["p2p"] = buf.clone()
    rec = [r for r in comm.rec.comm if r.op == "p2p"][-1]
    out["p2p_rec"] = (rec.group, rec.sent_to)
    try:
        comm.exchange({(rank + 2) % world: buf}, {}, group="pair")
        out["bad_peer"] = None
    except ValueError as e:
        out["bad_peer"] = str(e)
    return out


def test_autograd_blocks_match_local_maths():
    world = 4
    res = run_ranks(_blocks, world, timeout=120)
    xs, gs = _data(world)
    for group, insts in GROUPS.items():
        for inst in insts:
            n = len(inst)
            for pos, r in enumerate(inst):
                out = res[r]
                # gather_rows: concatenation; grad = own block of the upstream grad (grads are replicated)
                y, gx = out[("gather", group)]
                torch.testing.assert_close(y, torch.cat([xs[q] for q in inst], 0), rtol=0, atol=0)
                torch.testing.assert_close(gx, gs[r][pos * 4:(pos + 1) * 4], rtol=0, atol=0)
                y, gx = out[("gather1", group)]
                torch.testing.assert_close(y, torch.cat([xs[q] for q in inst], 1), rtol=0, atol=0)
                gfull = gs[r].reshape(-1)[: 4 * 4 * n].reshape(4, 4 * n)
                torch.testing.assert_close(gx, gfull[:, pos * 4:(pos + 1) * 4], rtol=0, atol=0)
                # split_rows: own block; grad = the members' upstream grads concatenated
                y, gx = out[("split", group)]
                torch.testing.assert_close(y, xs[r][pos * 2:(pos + 1) * 2], rtol=0, atol=0)
                torch.testing.assert_close(gx, torch.cat([gs[q].reshape(-1)[:8].reshape(2, 4) for q in inst], 0),
                                           rtol=0, atol=0)
                y, gx = out[("split1", group)]
                torch.testing.assert_close(y, xs[r][:, pos * 2:(pos + 1) * 2], rtol=0, atol=0)
                torch.testing.assert_close(gx, torch.cat([gs[q].reshape(-1)[:8].reshape(4, 2) for q in inst], 1),
                                           rtol=0, atol=0)
                # reduce_fwd: sum; grad = the upstream grad (identity)
                y, gx = out[("rfwd", group)]
                torch.testing.assert_close(y, sum(xs[q] for q in inst), rtol=1e-15, atol=1e-15)
                torch.testing.assert_close(gx, gs[r][:4], rtol=0, atol=0)
                # reduce_bwd: identity; grad = the sum of the members' upstream grads
                y, gx = out[("rbwd", group)]
                torch.testing.assert_close(y, xs[r], rtol=0, atol=0)
                torch.testing.assert_close(gx, sum(gs[q][:4] for q in inst), rtol=1e-15, atol=1e-15)
                # all_to_all: block i of member p lands as block p of member i; grad is the reverse
                y, gx = out[("a2a", group)]
                b = 4 // n
                torch.testing.assert_close(y, torch.cat([xs[q][pos * b:(pos + 1) * b] for q in inst], 0),
                                           rtol=0, atol=0)
                torch.testing.assert_close(gx, torch.cat([gs[q][:4][pos * b:(pos + 1) * b] for q in inst], 0),
                                           rtol=0, atol=0)
    for r, out in enumerate(res):
        assert out["const_requires_grad"] is True
        assert out["p2p"].tolist() == [float(r ^ 1)] * 3
        assert out["p2p_rec"] == ("pair", {r ^ 1: 24})
        assert "not members" in out["bad_peer"]


def test_split_rows_rejects_an_uneven_split():
    from moelab.comm import autograd as ag
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology

    comm = Communicator(Topology(1, 1))
    assert torch.equal(ag.split_rows(comm, torch.ones(3, 2), "world"), torch.ones(3, 2))  # 1 member: itself
    comm._groups["fake"] = (None, [0, 1])  # a 2-member view, only to reach the size check
    with pytest.raises(ValueError, match="does not split over group 'fake' of 2"):
        ag.split_rows(comm, torch.ones(3, 2), "fake")
