"""The price of changing a placement: the bytes :func:`moelab.moe.migrate.migrate_holders` moves and the
time the simulator gives that one all-to-all on a cluster profile.

A migration sends, per (layer, expert, rank) in the new holders and not in the old
(:func:`moelab.moe.migrate.copies_between`), one row of ``3 × expert numel`` elements (parameters and Adam's
two moments) from the expert's first old holder, all layers in ONE uneven all-to-all. So its bytes are a
``[src, dst]`` matrix of whole rows, and its time is that all-to-all alone on the profile's links
(:func:`moelab.comm.costs.alltoall_demands`, the event engine's sharing; nothing else running).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from moelab.comm import costs
from moelab.comm.topology import Topology
from moelab.moe.migrate import copies_between
from moelab.sim.engine import simulate
from moelab.sim.graphs import new_graph

MIGRATION_ROW_PARTS = 3  # parameters, exp_avg, exp_avg_sq: one row per copy (moe/migrate.py)


def migration_row_bytes(expert_numel: int, elem_bytes: int) -> int:
    """Bytes of one copied expert: its parameters and Adam's two moments."""
    return MIGRATION_ROW_PARTS * int(expert_numel) * int(elem_bytes)


def migration_matrix(old_holders: Sequence, new_holders: Sequence, world: int, row_bytes: int,
                     layers: int = 1) -> np.ndarray:
    """``bytes[src, dst]`` of migrating from ``old_holders`` to ``new_holders`` (per expert ``(owner,
    replicas...)``), the same change in each of ``layers`` MoE layers."""
    mat = np.zeros((world, world), dtype=np.int64)
    for _, src, dst in copies_between(old_holders, new_holders):
        mat[src, dst] += int(row_bytes) * int(layers)
    return mat


def migration_time(matrix, profile, topo: Topology) -> float:
    """Seconds of the migration's one all-to-all of ``matrix`` (bytes) alone on ``profile``'s links
    (simulated: the event engine on the same demands as every graph's all-to-all). 0 when nothing moves."""
    M = np.asarray(matrix, dtype=np.int64)
    if not M.any():
        return 0.0
    ranks = list(range(topo.world_size))
    g = new_graph(profile, topo)
    g.transfer("migrate", ranks, costs.alltoall_demands(M, ranks, topo, profile), category="migrate",
               phase="migrate", comm={"op": "all_to_all", "group": ranks, "splits": M})
    return float(simulate(g).makespan)


__all__ = ["migration_row_bytes", "migration_matrix", "migration_time", "MIGRATION_ROW_PARTS"]
