"""The timing harness of real-rank experiments (moelab.runtime.timing): a step's time is the slowest rank's,
every rank gets the same number, and the harness's own traffic is neither recorded nor emulated."""
from __future__ import annotations

import time

import pytest

from moelab.runtime.ranks import run_ranks


def _rank(rank, world):
    import torch

    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.config import EmulationConfig
    from moelab.runtime.timing import timed

    torch.set_num_threads(1)
    emu = EmulationConfig(enabled=True, intra_bw_GBps=1e-6, inter_bw_GBps=1e-6)  # 1 kB/s: any recorded byte shows
    comm = Communicator(Topology(world, world), emulation=emu)
    n0 = len(comm.rec.comm)
    t_wall = time.perf_counter()
    _, t = timed(comm, lambda: time.sleep(0.05 + 0.15 * (rank == world - 1)))
    return dict(t=t, wall=time.perf_counter() - t_wall, records=len(comm.rec.comm) - n0)


@pytest.mark.timeout(120)
def test_slowest_rank_time_everywhere_and_no_recorded_traffic():
    res = run_ranks(_rank, 3, timeout=90)
    per = res[0]["t"].per_rank_s
    assert all(r["t"].per_rank_s == per for r in res)  # every rank sees the same numbers
    assert all(r["t"].slowest_s == max(per) for r in res)
    assert per[2] >= 0.2 - 1e-3 and max(per[:2]) < per[2]  # the slow rank is the step's time
    assert [round(r["t"].own_s, 6) for r in res] == [round(v, 6) for v in per]
    assert all(r["records"] == 0 for r in res) and all(r["wall"] < 5 for r in res)  # unrecorded, hence not emulated


def _measure_rank(rank, world):
    import torch

    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.runtime.timing import measure

    torch.set_num_threads(1)
    comm = Communicator(Topology(world, world))
    x = torch.ones(4, 8, dtype=torch.float32)

    def step():
        with comm.rec.span("work", "expert"):
            comm.all_to_all_raw(x, [2] * world, [2] * world)

    before = measure(comm, lambda: None)
    m = measure(comm, step)
    return dict(before=len(before.comm), n=len(m.comm), a2a_bytes=m.op_bytes("all_to_all"),
                spans=[s[0] for s in m.spans], left=len(comm.rec.comm), t=m.time.slowest_s,
                a2a_s=m.op_seconds("all_to_all"))


@pytest.mark.timeout(120)
def test_measure_keeps_the_steps_records_and_clears_the_recorder():
    res = run_ranks(_measure_rank, 2, timeout=90)
    for r in res:
        assert r["before"] == 0 and r["n"] == 1 and r["spans"] == ["work"] and r["left"] == 0
        assert r["a2a_bytes"] == 4 * 8 * 4  # 2 rows of 8 fp32 to each of 2 members (self included)
        assert 0 <= r["a2a_s"] <= r["t"] + 1e-3


def test_op_seconds_counts_an_async_call_to_its_finish_not_to_its_late_wait():
    from moelab.comm.record import CommRecord
    from moelab.runtime.timing import Measured, StepTime

    late = CommRecord("all_to_all", "world", 10.0, 10.9, t_done=10.2)  # waited 0.7 s after it finished
    sync = CommRecord("all_to_all", "world", 11.0, 11.1)
    other = CommRecord("all_reduce", "world", 11.0, 12.0)
    m = Measured(StepTime(1.0, 1.0, (1.0,)), 10.0, (late, sync, other), ())
    assert m.op_seconds("all_to_all") == pytest.approx(0.3)
