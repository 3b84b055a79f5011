"""What one call costs on the emulated links (EMULATED), priced as the simulator prices the same
declared hardware (:mod:`moelab.comm.costs` with one NIC per rank): rings for the ring collectives, the
pipelined chain for broadcast / reduce, a port per link class for everything else.

Pure functions of the topology, the ``EmulationConfig`` and the call's bytes; the door
(:class:`moelab.comm.door.Communicator`) turns :func:`port_flows` into flows on the rank's shared ports
and waits until their emulated finish.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

from moelab.comm.collectives import collective
from moelab.comm.costs import ring_channels
from moelab.comm.topology import Topology


def link_keys(e) -> tuple:
    """``((intra, inter) bytes/s, (intra, inter) latency s)`` of an ``EmulationConfig``."""
    return (e.intra_bw_GBps * 1e9, e.inter_bw_GBps * 1e9), (e.intra_latency_us * 1e-6, e.inter_latency_us * 1e-6)


def _group_latency(topo: Topology, ranks, lat: tuple) -> float:
    """One step's latency of a collective over ``ranks``: inter-node if the group spans nodes."""
    return lat[1 if len({topo.node_of(r) for r in ranks}) > 1 else 0]


def _direct_latency(topo: Topology, op, ranks, lat: tuple, i: int) -> float:
    """A non-ring flow's latency on link class ``i``: that class's, or a chain's (n-1) steps of the
    group's class (sent / recv are then the chain's edges, :func:`chain_edges`)."""
    if op is not None and ranks is not None and len(ranks) > 1 and collective(op).pricing == "chain":
        return (len(ranks) - 1) * _group_latency(topo, ranks, lat)
    return lat[i]


@functools.lru_cache(maxsize=256)
def _ring_shape(topo: Topology, op: str, ranks: tuple, bw: tuple, lat: tuple):
    """Latency and per-(rank, class, direction) byte shares of a ring collective over ``ranks``: the
    simulator's rings (:func:`moelab.comm.costs.ring_channels` with one NIC per rank, as the emulator
    declares; node-major, across nodes one channel per member of the fullest node, each carrying 1/C
    of the bytes). ``bw``/``lat``: (intra, inter). Returns (latency, shares, slowest share / bw)."""
    rings = ring_channels(list(ranks), topo, topo.ranks_per_node)
    share: dict = {}  # (rank, class, direction) -> fraction of the per-rank ring bytes
    for order in rings:
        for a, b in zip(order, order[1:] + order[:1]):
            cls = topo.link_class(a, b)
            share[(a, cls, "out")] = share.get((a, cls, "out"), 0.0) + 1.0 / len(rings)
            share[(b, cls, "in")] = share.get((b, cls, "in"), 0.0) + 1.0 / len(rings)
    steps = (2 if op == "all_reduce" else 1) * (len(ranks) - 1)
    bws = dict(zip(("intra", "inter"), bw))
    latency = steps * _group_latency(topo, ranks, lat)
    return latency, share, max(f / bws[cls] for (_, cls, _), f in share.items())


def chain_edges(op: str, ranks, me: int, sent: dict, recv: dict) -> tuple:
    """A broadcast / reduce as the simulator's pipelined chain (:func:`moelab.comm.costs.broadcast_demand`:
    ranks in order from the root, every edge carrying S once): ``me``'s own edges, ``(sent, received)``
    per peer - S to its successor and from its predecessor (reduce: the other way). Root and S come from
    the call's flat-tree byte rule (``sent`` / ``recv`` per peer, what the record keeps)."""
    if len(ranks) <= 1:
        return {}, {}
    sends_out = any(r != me for r in sent)
    if op == "broadcast":
        root = me if sends_out else next(iter(recv))
    else:
        root = next(iter(sent)) if sends_out else me
    S = max([*sent.values(), *recv.values()])
    order = sorted(ranks)
    k = order.index(root)
    order = order[k:] + order[:k]
    i = order.index(me)
    nxt = {order[i + 1]: S} if i + 1 < len(order) else {}
    prev = {order[i - 1]: S} if i > 0 else {}
    return (nxt, prev) if op == "broadcast" else (prev, nxt)


def port_flows(topo: Topology, emulation, rank: int, op: str, ranks: Sequence[int], sent: dict, recv: dict) -> list:
    """``rank``'s share of one call as flows on its ports: ``[(latency, {(class, dir): bytes})]``.

    Ring collectives (declared ``pricing="ring"``, :mod:`moelab.comm.collectives`): one flow after the ring's step
    latencies, with this
    rank's ring edges' bytes (the ring's slowest link elsewhere is reached through the members'
    finish-time reduction, so alone every member ends at :func:`emulated_time`). Every other call:
    one flow per link class in use, after that class's latency, ``sent`` out and ``recv`` in.
    """
    bw, lat = link_keys(emulation)
    if collective(op).pricing == "ring" and len(ranks) > 1:
        v = sent.get("intra", 0) + sent.get("inter", 0)
        if v <= 0:
            return []
        latency, share, _ = _ring_shape(topo, op, tuple(ranks), bw, lat)
        return [(latency, {(cls, d): v * f for (r, cls, d), f in share.items() if r == rank})]
    flows = []
    for i, cls in enumerate(("intra", "inter")):
        if max(sent.get(cls, 0), recv.get(cls, 0)) > 0:
            flows.append((_direct_latency(topo, op, ranks, lat, i),
                          {(cls, "out"): sent.get(cls, 0), (cls, "in"): recv.get(cls, 0)}))
    return flows


def emulated_time(topo: Topology, emulation, sent: dict, recv: dict, op: Optional[str] = None,
                  ranks: Optional[Sequence[int]] = None, phases: Optional[Sequence] = None) -> float:
    """Seconds the declared links need for one call *alone* (EMULATED).

    Declared hardware (``EmulationConfig``), the same the simulator prices
    (:mod:`moelab.comm.costs` with ``nics_per_node = ranks_per_node``, as
    :func:`moelab.measure.validate.emulation_profile` sets): every rank has its own intra-node port
    of ``intra_bw_GBps`` and its own inter-node NIC of ``inter_bw_GBps``, each per direction.

    - ``all_reduce`` / ``all_gather`` / ``reduce_scatter`` over ``ranks``: rings
      (:func:`_ring_shape`). Time = steps x latency (``n-1``, all-reduce ``2(n-1)``; inter latency
      if the group spans nodes) + the ring's bytes per rank (= this rank's recorded non-local
      bytes) times the slowest link's share / bandwidth. Every member gets the same time.
    - ``broadcast`` / ``reduce``: the pipelined chain from the root; pass this member's chain
      edges (:func:`chain_edges`), priced as below with ``(n-1)`` latencies of the group's class.
    - every other call: per link class, ``max(sent, received) / bandwidth + latency`` of this
      rank's own port/NIC, the larger class wins.

    - a phased call (``phases``: per phase, the class-folded ``(sent, received)``): the sum of
      its phases' times, each priced as above.

    Concurrent calls share the ports (:func:`port_flows`, :class:`moelab.comm.links.Ports`);
    alone, the emulator waits exactly this long.
    """
    if phases is not None:
        return sum(emulated_time(topo, emulation, s, r, op, ranks) for s, r in phases)
    bw, lat = link_keys(emulation)
    if op is not None and collective(op).pricing == "ring" and ranks is not None and len(ranks) > 1:
        v = sent.get("intra", 0) + sent.get("inter", 0)
        if v <= 0:
            return 0.0
        latency, _, per_byte = _ring_shape(topo, op, tuple(ranks), bw, lat)
        return latency + v * per_byte
    t = 0.0
    for i, cls in enumerate(("intra", "inter")):
        b = max(sent.get(cls, 0), recv.get(cls, 0))
        if b > 0:
            t = max(t, b / bw[i] + _direct_latency(topo, op, ranks, lat, i))
    return t
