"""Each collective declared once: the byte rule, the emulator's pricing and the simulator's demand come
from one declaration, and a new collective is one declaration plus its issue."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.comm import costs
from moelab.comm.bytes import peer_bytes, recv_bytes
from moelab.comm.collectives import Collective, collective, known_collectives, register_collective
from moelab.comm.topology import Topology
from moelab.runtime.ranks import run_ranks


def _profile():
    import types

    caps = {"intra": 2e9, "inter": 0.5e9}
    lat = {"intra": 5e-6, "inter": 20e-6}
    return types.SimpleNamespace(bandwidth=caps.__getitem__, latency=lat.__getitem__, nics_per_node=2, fits={})


@pytest.mark.parametrize("group", [[0, 1], [0, 1, 2, 3], [1, 2, 3], [0, 2]])
def test_received_is_what_peers_send_for_every_builtin(group):
    rng = np.random.default_rng(len(group))
    M = rng.integers(0, 1000, size=(len(group), len(group)))
    for op in known_collectives():
        for me_i, me in enumerate(group):
            if op == "all_to_all":
                got = recv_bytes(op, group, me, splits=M[:, me_i].tolist())
                want = {j: peer_bytes(op, group, j, splits=M[i].tolist()).get(me, 0) for i, j in enumerate(group)}
            elif op in ("p2p", "send", "recv"):
                continue  # two-sided by construction (checked on real exchanges in tests/comm/test_async.py)
            else:
                got = recv_bytes(op, group, me, 800, root=group[-1])
                want = {j: peer_bytes(op, group, j, 800, root=group[-1]).get(me, 0) for j in group}
            assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.items() if v}, (op, me)


def test_simulator_demands_come_from_the_declarations():
    topo, prof = Topology(4, 2), _profile()
    g = [0, 1, 2, 3]
    M = np.arange(16).reshape(4, 4) * 1000.0
    caps = costs.link_capacities(prof, topo)
    t = lambda ds: sum(d.time(caps) for d in ds)  # noqa: E731
    assert t(costs.demands("all_to_all", g, topo, prof, splits=M)) == costs.alltoall_time(M, topo, prof)
    assert t(costs.demands("all_reduce", g, topo, prof, nbytes=4000)) == costs.allreduce_time(4000, topo, prof)
    assert t(costs.demands("all_gather", g, topo, prof, nbytes=4000)) == costs.allgather_time(4000, topo, prof)
    assert t(costs.demands("reduce_scatter", g, topo, prof, nbytes=4000)) == costs.reduce_scatter_time(4000, topo, prof)
    assert (t(costs.demands("broadcast", g, topo, prof, nbytes=4000, root=2))
            == costs.broadcast_time(4000, topo, prof, root=2))
    assert t(costs.demands("p2p", (1, 2), topo, prof, nbytes=4000)) == costs.p2p_time(4000, 1, 2, topo, prof)
    assert collective("all_reduce").pricing == "ring" and collective("all_to_all").pricing == "direct"
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        costs.demands("nope", g, topo, prof)
    with pytest.raises(ValueError, match="pricing must be"):
        Collective("x", dict, dict, "tree", list)


# ---- a new collective: one declaration ---------------------------------------------------------------
def _half(group, me, splits=None, **_):
    return {r: int(b) // 2 for r, b in zip(group, splits)}  # fp32 rows travel as fp16


HALF_A2A = Collective("fp16_all_to_all", _half, _half, "direct",
                      lambda group, topo, profile, splits=None, **_: costs.alltoall_demands(
                          np.asarray(splits) // 2, group, topo, profile))


def _compressed(rank, world):
    import torch.distributed as dist

    from moelab.comm.door import Communicator

    register_collective(HALF_A2A)
    comm = Communicator(Topology(world, world))
    rows = [(rank + j) % 3 + 1 for j in range(world)]  # uneven: rank sends rows[j] rows to j
    recv = [(j + rank) % 3 + 1 for j in range(world)]
    x = torch.randn(sum(rows), 4, generator=torch.Generator().manual_seed(rank))
    out = torch.empty(sum(recv), 4, dtype=torch.float16)

    def issue(pg, ranks):
        return dist.all_to_all_single(out, x.to(torch.float16), recv, rows, group=pg, async_op=True)

    h = comm.run("fp16_all_to_all", "ep", issue, result=lambda: out.float(), async_op=True,
                 splits=[r * 16 for r in rows])  # the rule's input: fp32 bytes per member
    y = h.wait()
    plain = comm.all_to_all_raw(x, recv, rows)
    r = comm.rec.comm[0]
    return dict(close=bool(torch.allclose(y, plain, atol=1e-2)), exact=bool(torch.equal(y, plain)),
                sent_to=r.sent_to, recv_from=r.recv_from, plain=comm.rec.comm[1].sent_to, op=r.op, seq=r.seq)


@pytest.mark.parametrize("world", [2, 4])
def test_a_new_collective_is_one_declaration(world):
    res = run_ranks(_compressed, world, timeout=90)
    for i, r in enumerate(res):
        assert r["close"] and not r["exact"] and r["op"] == "fp16_all_to_all" and r["seq"] == 0
        assert {j: 2 * b for j, b in r["sent_to"].items()} == r["plain"]  # its own byte rule: half
        for j in range(world):
            assert r["sent_to"][j] == res[j]["recv_from"][i]
    from moelab.comm import collectives

    topo, prof = Topology(4, 2), _profile()
    M = np.full((4, 4), 8000)
    register_collective(HALF_A2A)
    try:
        caps = costs.link_capacities(prof, topo)
        assert sum(d.time(caps) for d in costs.demands("fp16_all_to_all", range(4), topo, prof, splits=M)) == \
            pytest.approx(costs.alltoall_time(M // 2, topo, prof))
    finally:
        collectives._COLLECTIVES.pop("fp16_all_to_all")
