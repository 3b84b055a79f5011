"""Named process groups, declared as data and checked before any process starts.

A declaration maps a group name to its *instances*: ``{"esp": [[0, 1], [2, 3]]}`` says that ranks
0, 1 form one ``esp`` group and ranks 2, 3 another. Rule (the one Parm, Hecate and Lina need, and
the one that keeps every rank's view simple): **every declared group partitions the world** - each
rank belongs to exactly one instance, so ``group("esp")`` on a rank means "my instance". A group over
all ranks is ``[[0, 1, ..., N-1]]`` (a second one over the same ranks, like Hecate's sparse group or
Parm's SAA stream, is a second name). The communicator creates every instance on every rank, in
name order then instance order, because ``dist.new_group`` is collective.
"""
from __future__ import annotations

from moelab.comm.topology import Topology
from moelab.registry import get_groups

BUILTIN = ("world", "ep", "dp", "node")  # every communicator has these


def default_groups(topo: Topology) -> dict:
    """The built-in groups: world, ep and dp (all ranks, each its own process group) and node."""
    world = [list(range(topo.world_size))]
    return {"world": world, "ep": world, "dp": world, "node": [topo.node_ranks(n) for n in range(topo.nodes)]}


def validate_groups(groups: dict, world_size: int, option: str = "groups") -> dict:
    """Return ``groups`` normalised (lists of int lists) or raise ValueError naming the bad group.

    ``option`` prefixes messages (e.g. the config field that declared them)."""
    if not isinstance(groups, dict):
        raise ValueError(f"{option} must map group names to lists of rank lists, got {type(groups).__name__}")
    out = {}
    for name, instances in groups.items():
        where = f"{option}[{name!r}]"
        if not isinstance(name, str) or not name:
            raise ValueError(f"{option}: group names must be non-empty strings, got {name!r}")
        if name in BUILTIN:
            raise ValueError(f"{where}: {name!r} is a built-in group ({', '.join(BUILTIN)}); pick another name")
        if not isinstance(instances, (list, tuple)) or not instances or not all(
                isinstance(i, (list, tuple)) and i for i in instances):
            raise ValueError(f"{where} must be a non-empty list of non-empty rank lists, got {instances!r}")
        seen: dict = {}
        for k, inst in enumerate(instances):
            for r in inst:
                if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world_size:
                    raise ValueError(f"{where}: rank {r!r} is not a rank of a world of {world_size}")
                if r in seen:
                    raise ValueError(f"{where}: rank {r} is in instances {seen[r]} and {k}; "
                                     "the instances of a group must not overlap")
                seen[r] = k
        missing = sorted(set(range(world_size)) - set(seen))
        if missing:
            raise ValueError(f"{where}: ranks {missing} are in no instance; every group must partition "
                             f"all {world_size} ranks")
        out[name] = [sorted(int(r) for r in inst) for inst in instances]
    return out


def instance_of(instances: list, rank: int) -> list:
    """The instance (rank list) of a validated group that contains ``rank``."""
    for inst in instances:
        if rank in inst:
            return inst
    raise ValueError(f"rank {rank} is in no instance of {instances}")


def declared_group_errors(cfg) -> list:
    """Config validation's view: the messages (naming the strategy and group) for the process groups
    ``cfg``'s strategy declares, ``[]`` when they partition ``parallel.nproc`` ranks."""
    option = f"process groups of parallel.strategy {cfg.parallel.strategy!r}"
    try:
        validate_groups(get_groups(cfg), cfg.parallel.nproc, option=option)
    except Exception as e:  # noqa: BLE001 - a broken declaration is a config error too
        return [str(e) if isinstance(e, ValueError) else f"{option}: {e!r}"]
    return []
