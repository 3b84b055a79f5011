"""Asynchronous collectives with handles; records hold sent and received bytes per peer, per-group
sequence numbers, the issuing stream; tags are thread-local; the trace has one row per stream."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from moelab.comm.topology import Topology
from moelab.runtime.ranks import run_ranks


def _all_ops(comm, rank, world, async_op):
    """Every collective of the door once, with rank-dependent (uneven) inputs; results in order."""
    g = torch.Generator().manual_seed(0)
    send_rows = torch.randint(0, 5, (world, world), generator=g)  # send_rows[i][j]: rows rank i sends to j
    x = torch.arange(int(send_rows[rank].sum()) * 3, dtype=torch.float64).view(-1, 3) + 100 * rank
    out = []
    hs = [comm.all_to_all_raw(x, send_rows[:, rank].tolist(), send_rows[rank].tolist(), async_op=async_op),
          comm.all_gather(torch.full((2, 3), float(rank)), group="ep", async_op=async_op),
          comm.reduce_scatter(torch.arange(world * 4.0) * (rank + 1), group="dp", async_op=async_op),
          comm.all_reduce_(torch.full((5,), rank + 1.0), async_op=async_op),
          comm.broadcast_(torch.full((3,), float(rank)), root=world - 1, async_op=async_op),
          comm.reduce_(torch.full((3,), rank + 1.0), root=0, async_op=async_op)]
    peer = (rank + 1) % world
    src = (rank - 1) % world
    buf = torch.zeros(4 + src)
    hs.append(comm.exchange({peer: torch.full((4 + rank,), float(rank))}, {src: buf}, tag=7, async_op=async_op))
    for h in hs:
        out.append(h.wait() if async_op else h)
    out[-1] = buf
    return out


def _async_vs_sync(rank, world):
    from moelab.comm.door import Communicator

    comm = Communicator(Topology(world, 2 if world == 4 else world))
    sync = _all_ops(comm, rank, world, False)
    asy = _all_ops(comm, rank, world, True)
    recs = comm.rec.comm
    same = [bool(torch.equal(a, b)) for k, (a, b) in enumerate(zip(sync, asy)) if k != 5 or rank == 0]
    return dict(same=same, sync=sync,
                recs=[(r.op, r.group, r.seq, r.sent_to, r.recv_from, r.bytes, r.recv, r.stream) for r in recs])


@pytest.mark.parametrize("world", [2, 4])
def test_async_equals_sync_and_bytes_pair_up(world):
    res = run_ranks(_async_vs_sync, world, timeout=120)
    tri = world * (world + 1) / 2
    for rank, r in enumerate(res):
        assert all(r["same"]), r["same"]
        a2a, ag, rs, ar, bc, red, p2p = r["sync"]
        assert torch.equal(ag[:, 0, 0], torch.arange(world, dtype=torch.float32))
        assert torch.equal(ar, torch.full((5,), tri)) and torch.equal(bc, torch.full((3,), world - 1.0))
        assert torch.equal(rs, torch.arange(4.0 * rank, 4.0 * rank + 4) * tri)
        if rank == 0:  # the non-roots' buffers are scratch after a gloo reduce
            assert float(red[0]) == tri
        assert torch.equal(p2p, torch.full((4 + (rank - 1) % world,), float((rank - 1) % world)))
    # received bytes on j from i == sent bytes on i to j, for every call (matched by position)
    n = len(res[0]["recs"])
    assert n == 14 and all(len(r["recs"]) == n for r in res)
    for k in range(n):
        for i in range(world):
            op, group, seq, sent_to, _, sent, recv, stream = res[i]["recs"][k]
            assert stream == "MainThread"
            for j in range(world):
                assert sent_to.get(j, 0) == res[j]["recs"][k][4].get(i, 0), (op, i, j)
            assert (sum(sent_to.values()) == sum(sent.values())
                    and sum(res[i]["recs"][k][4].values()) == sum(recv.values()))
        assert len({res[i]["recs"][k][2] for i in range(world)}) == 1  # seq agrees across ranks
    total_a2a = sum(sum(r["recs"][0][3].values()) for r in res)
    assert total_a2a > 0
    # per-group sequence numbers: 0, 1, 2, .. in issue order (world: all_reduce, broadcast, reduce, x2)
    seqs = {}
    for op, group, seq, *_ in res[0]["recs"]:
        if op != "p2p":
            seqs.setdefault(group, []).append(seq)
        else:
            assert seq == -1
    assert seqs == {"ep": [0, 1, 2, 3], "dp": [0, 1], "world": [0, 1, 2, 3, 4, 5]}


def _completion_at_wait(rank, world):
    from moelab.comm.door import Communicator

    comm = Communicator(Topology(world, world))
    h = comm.all_reduce_(torch.ones(4), async_op=True)
    time.sleep(0.05)
    y = h.wait()
    again = h.wait()
    r = comm.rec.comm
    return dict(dt=r[0].t_end - r[0].t_start, n=len(r), same=y is again, val=float(y[0]))


@pytest.mark.parametrize("world", [2, 4])
def test_async_record_completes_at_wait(world):
    for r in run_ranks(_completion_at_wait, world, timeout=60):
        assert r["dt"] >= 0.05 and r["n"] == 1 and r["same"] and r["val"] == world


def _done_before_wait(rank, world):
    from moelab.comm.door import Communicator
    from moelab.config import EmulationConfig

    emu = EmulationConfig(enabled=True, intra_bw_GBps=0.002, inter_bw_GBps=0.002)  # 2 MB/s per port
    comm = Communicator(Topology(world, world), emulation=emu)
    comm.all_reduce_(torch.ones(1))  # the ranks start together
    x = torch.ones(world * 10_000)  # 40 KB to each peer: 20 ms per peer on the links
    alone = comm.emulated_time({p: 40_000 for p in range(world) if p != rank},
                               {p: 40_000 for p in range(world) if p != rank}, "all_to_all")
    comm.all_to_all_raw(x.view(-1, 1), [10_000] * world, [10_000] * world, group="world")  # waited at once
    h = comm.all_to_all_raw(x.view(-1, 1), [10_000] * world, [10_000] * world, group="world", async_op=True)
    time.sleep(1.0)  # long after the links finished
    h.wait()
    return dict(alone=alone, calls=[(r.t_start, r.t_done, r.t_end) for r in comm.rec.comm[1:]])


@pytest.mark.parametrize("world", [2, 4])
def test_a_call_waited_late_is_done_at_its_finish(world):
    """``t_done`` is when a call finished, ``t_end`` when its issuer took the result: the same for a call waited
    at once; for an async call waited a second later, ``t_done`` stays at its emulated finish."""
    for r in run_ranks(_done_before_wait, world, timeout=120):
        (s0, d0, e0), (s1, d1, e1) = r["calls"]
        assert 0.9 * r["alone"] <= d0 - s0 and e0 - d0 < 0.02  # waited at once: done at its end
        assert e1 - s1 >= 1.0 and 0.9 * r["alone"] <= d1 - s1 < 0.5  # waited late: done at the links' finish


def _tags_per_thread(rank, world):
    from moelab.comm.door import Communicator
    from moelab.comm.stream import CommStream

    comm = Communicator(Topology(world, world))
    stream = CommStream(recorder=comm.rec, name="comm-x")
    started = threading.Event()

    def on_thread():
        started.wait()
        comm.all_reduce_(torch.ones(2), group="dp")  # untagged: the main thread's tags must not leak here
        with comm.rec.tagged(layer=9, phase="own"):
            comm.all_reduce_(torch.ones(2), group="dp")

    t = threading.Thread(target=on_thread, name="side")
    t.start()
    with comm.rec.tagged(iter=3, layer=1, phase="fwd"):
        started.set()
        t.join(30)
        comm.all_reduce_(torch.ones(2), group="ep")
        task = stream.submit(comm.all_reduce_, torch.ones(2), "ep", name="s")  # inherits the submitter's tags
    task.wait()
    stream.close()
    with comm.rec.span("experts"):
        pass
    ev = comm.rec.chrome_events()
    rows = {e["tid"]: e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    placed = sorted({(e["name"], rows[e["tid"]]) for e in ev if e.get("ph") == "X"})
    return dict(recs=[(r.stream, r.tags) for r in comm.rec.comm], rows=rows, placed=placed)


@pytest.mark.parametrize("world", [2, 4])
def test_tags_are_thread_local_and_streams_get_rows(world):
    for r in run_ranks(_tags_per_thread, world, timeout=60):
        by_stream = {}
        for stream, tags in r["recs"]:
            by_stream.setdefault(stream, []).append(tags)
        assert by_stream["side"] == [{}, {"layer": 9, "phase": "own"}]
        assert by_stream["MainThread"] == [{"iter": 3, "layer": 1, "phase": "fwd"}]
        assert by_stream["comm-x"] == [{"iter": 3, "layer": 1, "phase": "fwd"}]
        assert sorted(r["rows"].values()) == ["comm: MainThread", "comm: comm-x", "comm: side", "compute: MainThread"]
        assert ("all_reduce L1", "comm: comm-x") in r["placed"] and ("experts", "compute: MainThread") in r["placed"]
        assert ("all_reduce L9", "comm: side") in r["placed"]


def test_records_and_spans_survive_pickling():
    """Records work their bytes out lazily; spans know their thread: both cross process boundaries."""
    import pickle

    from moelab.comm.door import Communicator

    comm = Communicator(Topology(1, 1))
    with comm.rec.tagged(layer=2), comm.rec.span("experts"):
        comm.all_to_all_raw(torch.ones(3, 2), [3], [3])
    rec, span = pickle.loads(pickle.dumps((comm.rec.comm[0], comm.rec.spans[0])))
    assert rec.sent_to == {0: 24} and rec.bytes == {"local": 24, "intra": 0, "inter": 0} and rec.recv == rec.bytes
    assert rec.tags == {"layer": 2} and rec.seq == 0 and rec.stream == "MainThread"
    assert span[0] == "experts" and span[4] == {"layer": 2} and span.stream == "MainThread" and len(span) == 5
