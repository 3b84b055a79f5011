"""The one migration routine (moelab.moe.migrate): experts move between gloo ranks with their Adam
state bitwise, layers end up holding any number of experts (0 included), the optimizer keeps stepping
the moved experts, and nothing is sent when nothing moves."""
from __future__ import annotations

import pytest
import torch

from moelab.runtime.ranks import run_ranks

D, F, E = 4, 8, 8


def _snapshot(layers, opt):
    """(layer, expert) -> (params, exp_avg, exp_avg_sq) flat, of the experts this rank holds."""
    out = {}
    for li, layer in enumerate(layers):
        ps = layer.experts.stacked()
        for s, e in enumerate(layer.experts.experts):
            parts = []
            for key in (None, "exp_avg", "exp_avg_sq"):
                ts = [p if key is None else opt.state[p][key] for p in ps if p is not None]
                parts.append(torch.cat([t[s].detach().reshape(-1) for t in ts]).clone())
            out[(li, e)] = parts
    return out


def _migrate(rank, world, new_owners):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.config import MoEConfig
    from moelab.moe.layer import MoELayer
    from moelab.moe.migrate import migrate_owners

    torch.set_num_threads(1)
    comm = Communicator(Topology(world, world))
    cfg = MoEConfig(num_experts=E, top_k=2)
    layers = [MoELayer(D, F, cfg, layer_id=i, seed=3, comm=comm, dtype=torch.float64) for i in range(2)]
    params = [p for l in layers for p in l.parameters()]
    opt = torch.optim.Adam(params, lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):  # real Adam state first
        x = torch.randn(6, D, generator=g, dtype=torch.float64)
        sum(l(x).square().sum() for l in layers).backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    before = _snapshot(layers, opt)
    n0 = len(comm.rec.comm)
    moves = migrate_owners(comm, layers, new_owners, opt)
    again = migrate_owners(comm, layers, new_owners, opt)  # already there: no collective
    recs = comm.rec.comm[n0:]
    after = _snapshot(layers, opt)
    x = torch.randn(6, D, generator=g, dtype=torch.float64)  # the optimizer still drives the moved experts
    sum(l(x).square().sum() for l in layers).backward()
    live = [p for l in layers for p in l.parameters()]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt.step()
    stepped = (all(p in opt.state for p in live)
               and all(any(q is p for q in opt.param_groups[0]["params"]) for p in live))
    return dict(before=before, after=after, moves=moves, again=again, ops=[r.op for r in recs],
                held=[l.experts.experts for l in layers], stepped=stepped,
                sent=sum(v for r in recs for q, v in r.sent_to.items() if q != rank))


@pytest.mark.parametrize("world", [2, 4])
def test_migration_moves_params_and_adam_state_bitwise(world):
    if world == 2:
        new = [[1, 1, 1, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]]  # layer 0: rank 0 gets 3, rank 1 gets 5
    else:
        new = [[3, 3, 3, 1, 1, 0, 2, 2], [0, 0, 1, 1, 2, 2, 3, 3]]  # layer 0: rank 0 owns 1, rank 3 owns 3
    res = run_ranks(_migrate, world, new, timeout=120)
    before = {k: v for r in res for k, v in r["before"].items()}
    after = {k: v for r in res for k, v in r["after"].items()}
    assert set(after) == set(before) == {(li, e) for li in range(2) for e in range(E)}
    for k in before:  # params, exp_avg, exp_avg_sq, bitwise
        assert all(torch.equal(a, b) for a, b in zip(before[k], after[k])), k
    for r, out in enumerate(res):
        assert out["held"] == [tuple(e for e in range(E) if new[li][e] == r) for li in range(2)]
        assert out["ops"] == ["all_to_all"] and out["again"] == [] and out["stepped"]
        numel = 2 * D * F + F + D
        moved_out = sum(1 for li, e, s, d in out["moves"] if s == r)
        assert out["sent"] == moved_out * 3 * numel * 8  # one row of params + 2 moments, fp64
    assert res[0]["moves"] == res[-1]["moves"] and res[0]["moves"]


def test_migrate_owners_rejects_replicas_and_bad_owners():
    from moelab.config import MoEConfig
    from moelab.moe.layer import MoELayer
    from moelab.moe.migrate import migrate_owners

    layer = MoELayer(D, F, MoEConfig(num_experts=2, top_k=1))
    with pytest.raises(ValueError, match="not a rank"):
        migrate_owners(layer.comm, [layer], [[0, 1]])
    assert migrate_owners(layer.comm, [layer], [[0, 0]]) == []
