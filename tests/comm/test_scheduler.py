"""The scheduler hook gates every collective's issue; the comm stream runs tasks in order on its
own thread, carrying the submitter's tags."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from moelab.comm.scheduler import Scheduler
from moelab.comm.stream import CommStream
from moelab.comm.topology import Topology
from moelab.runtime.ranks import run_ranks


class HoldUntilDone(Scheduler):
    """Toy scheduler: a call tagged ``hold`` is not issued before the call tagged ``first`` is done."""

    def __init__(self):
        self.first_done = threading.Event()
        self.admitted, self.finished = [], []

    def admit(self, call):
        self.admitted.append((call.op, call.group, call.tags.get("name"), call.stream))
        if call.tags.get("name") == "hold":
            assert self.first_done.wait(30), "the first call never completed"

    def done(self, call):
        self.finished.append(call.tags.get("name"))
        if call.tags.get("name") == "first":
            self.first_done.set()


def _gated(rank, world):
    from moelab.comm.door import Communicator

    comm = Communicator(Topology(world, world))
    comm.scheduler = HoldUntilDone()
    a = torch.full((4,), float(rank + 1))
    b = torch.full((4,), 100.0 * (rank + 1))

    def held():
        with comm.rec.tagged(name="hold"):
            comm.all_reduce_(a, group="ep")

    t = threading.Thread(target=held, name="holder")
    t.start()  # issued first in time ...
    time.sleep(0.05)
    with comm.rec.tagged(name="first"):
        comm.all_reduce_(b, group="ep")  # ... but this one reaches the group first, on every rank
    t.join(30)
    recs = {r.tags["name"]: r for r in comm.rec.comm}
    return dict(a=float(a[0]), b=float(b[0]), seq={k: r.seq for k, r in recs.items()},
                held_after=recs["hold"].t_start >= recs["first"].t_end,
                admitted=comm.scheduler.admitted, finished=comm.scheduler.finished)


@pytest.mark.parametrize("world", [2, 4])
def test_scheduler_hook_gates_issue_order(world):
    tri = world * (world + 1) / 2
    for r in run_ranks(_gated, world, timeout=60):
        # on one group, the held call was issued second everywhere: correct sums, seq 1 after seq 0
        assert r["a"] == tri and r["b"] == 100 * tri
        assert r["seq"] == {"first": 0, "hold": 1} and r["held_after"]
        assert r["admitted"] == [("all_reduce", "ep", "hold", "holder"), ("all_reduce", "ep", "first", "MainThread")]
        assert r["finished"] == ["first", "hold"]


def test_no_scheduler_by_default_and_every_call_passes_it():
    from moelab.comm.door import Communicator

    comm = Communicator(Topology(1, 1))
    assert comm.scheduler is None
    comm.scheduler = s = HoldUntilDone()
    x = torch.ones(4, 2)
    comm.all_to_all_raw(x, [4], [4])
    comm.all_gather(x)
    h = comm.reduce_scatter(x, async_op=True)
    assert s.finished == [None, None]  # done() at completion: the async call is not done yet
    h.wait()
    comm.all_reduce_(x)
    comm.broadcast_(x, 0)
    comm.reduce_(x, 0)
    comm.exchange({0: x}, {0: torch.empty_like(x)})
    assert [a[0] for a in s.admitted] == ["all_to_all", "all_gather", "reduce_scatter", "all_reduce", "broadcast",
                                          "reduce", "p2p"]
    assert len(s.finished) == 7


def test_comm_stream_runs_in_order_on_its_thread_with_the_submitters_tags():
    from moelab.comm.record import Recorder

    rec = Recorder(0)
    seen = []

    def task(i):
        time.sleep(0.002 * (5 - i))  # later tasks are quicker: order must still hold
        seen.append((i, threading.current_thread().name, dict(rec.tags)))
        return i * i

    s = CommStream(recorder=rec, name="cs")
    with rec.tagged(layer=4):
        tasks = [s.submit(task, i, name=f"t{i}") for i in range(5)]
    assert rec.tags == {}
    assert [t.wait() for t in tasks] == [0, 1, 4, 9, 16]
    assert seen == [(i, "cs", {"layer": 4}) for i in range(5)]
    bad = s.submit(lambda: 1 / 0, name="bad")
    with pytest.raises(RuntimeError, match="comm task bad failed"):
        bad.wait()
    s.close()
    inline = CommStream(threaded=False)
    assert inline.submit(lambda: threading.current_thread().name).wait() == threading.current_thread().name
