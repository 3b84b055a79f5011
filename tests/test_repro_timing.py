"""The timing harness of real-rank experiments (moelab.repro.timing): a step's time is the slowest rank's,
every rank gets the same number, and the harness's own traffic is neither recorded nor emulated."""
from __future__ import annotations

import time

import pytest

from moelab.testing import run_ranks


def _rank(rank, world):
    import torch

    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.config import EmulationConfig
    from moelab.repro.timing import timed

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
