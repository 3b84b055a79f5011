"""A communicator seen through one of its groups: expert parallelism over a sub-group.

``GroupView(comm, {"ep": "lina_ep2"})`` is ``comm`` for code written against the whole world (the
core MoE layer and dispatchers): its ``rank`` and ``world_size`` are the caller's index in and the
size of the mapped ``ep`` instance, and every collective named with a mapped group runs on the real
group instead. Records, the scheduler, link emulation and the per-group sequence numbers are the
underlying communicator's, so nothing is counted twice or missed. Lina packs q experts per rank:
EP over blocks of E/q contiguous ranks, each block a full copy of the experts.
"""
from __future__ import annotations


class GroupView:
    def __init__(self, comm, mapping: dict):
        if "ep" not in mapping:
            raise ValueError(f"GroupView needs the 'ep' group mapped, got {mapping}")
        self._comm, self._map = comm, dict(mapping)
        self.base = comm  # the whole world's communicator (what the view maps onto)
        ranks = comm.group_ranks(mapping["ep"])
        self.rank, self.world_size = ranks.index(comm.rank), len(ranks)
        self.global_ranks = list(ranks)

    def _g(self, group: str) -> str:
        return self._map.get(group, group)

    def __getattr__(self, name):  # everything else (rec, scheduler, topo, emulation, ...) is the comm's
        return getattr(self._comm, name)

    def group(self, name: str):
        return self._comm.group(self._g(name))

    def group_ranks(self, name: str) -> list:
        return self._comm.group_ranks(self._g(name))

    def all_to_all(self, x, out_rows, in_rows, group: str = "ep"):
        return self._comm.all_to_all(x, out_rows, in_rows, group=self._g(group))

    def all_to_all_raw(self, x, out_rows, in_rows, group: str = "ep", async_op: bool = False):
        return self._comm.all_to_all_raw(x, out_rows, in_rows, group=self._g(group), async_op=async_op)

    def all_gather(self, x, group: str = "world", async_op: bool = False):
        return self._comm.all_gather(x, group=self._g(group), async_op=async_op)

    def all_reduce_(self, x, group: str = "world", async_op: bool = False):
        return self._comm.all_reduce_(x, group=self._g(group), async_op=async_op)

    def reduce_scatter(self, x, group: str = "world", async_op: bool = False):
        return self._comm.reduce_scatter(x, group=self._g(group), async_op=async_op)
