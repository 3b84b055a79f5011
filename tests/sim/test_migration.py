"""The migration seam (moelab.sim.migration): its byte matrix equals what moe/migrate.py's all-to-all sends
between gloo ranks (replicas added, dropped and moved, two layers), and its time is that all-to-all's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.runtime.ranks import run_ranks
from moelab.sim.migration import migration_matrix, migration_row_bytes, migration_time

D, F, E, WORLD = 4, 8, 4, 4
OLD = ((0,), (1, 2), (2,), (3, 0))
NEW = ((1, 0), (1,), (2, 3, 0), (0,))  # owner moved + replica, replica dropped, two replicas, owner kept


def _migrate(rank, world):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.config import MoEConfig
    from moelab.moe.layer import MoELayer
    from moelab.moe.migrate import migrate_holders
    from moelab.placement import Placement

    torch.set_num_threads(1)
    comm = Communicator(Topology(world, 2))
    cfg = MoEConfig(num_experts=E, top_k=2)
    layers = [MoELayer(D, F, cfg, layer_id=i, seed=3, comm=comm, dtype=torch.float64,
                       placement=Placement(E, world, OLD)) for i in range(2)]
    n0 = len(comm.rec.comm)
    migrate_holders(comm, layers, [NEW, NEW])
    sent = {}
    for r in comm.rec.comm[n0:]:
        for q, v in r.sent_to.items():
            sent[q] = sent.get(q, 0) + v
    return sent


@pytest.mark.timeout(180)
def test_matrix_equals_the_bytes_migrate_holders_sends():
    res = run_ranks(_migrate, WORLD, timeout=150)
    numel = 2 * D * F + F + D  # the core expert: two matrices and their biases
    want = migration_matrix(OLD, NEW, WORLD, migration_row_bytes(numel, 8), layers=2)
    got = np.array([[res[s].get(d, 0) if d != s else 0 for d in range(WORLD)] for s in range(WORLD)])
    assert want.any() and np.array_equal(got, want)
    assert np.trace(want) == 0  # a rank never copies to itself


def test_time_is_the_all_to_all_alone():
    from moelab.comm import costs
    from moelab.sim import get_profile

    prof = get_profile("fastermoe_johnny")
    topo = prof.topology()
    N = topo.world_size
    old = tuple((e // 2,) for e in range(2 * N))
    new = tuple(((e // 2 + 8) % N,) if e < 4 else h for e, h in enumerate(old))  # 4 experts cross nodes
    M = migration_matrix(old, new, N, migration_row_bytes(1 << 20, 2))
    assert M.sum() == 4 * 3 * (1 << 20) * 2
    t = migration_time(M, prof, topo)
    assert t == pytest.approx(costs.alltoall_time(M, topo, prof), rel=1e-9) and t > 0
    assert migration_time(np.zeros_like(M), prof, topo) == 0.0
    # doubling the bytes on the same links doubles the bandwidth term
    assert migration_time(2 * M, prof, topo) > 1.8 * t - prof.inter_latency_us * 1e-6
