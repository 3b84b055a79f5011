"""The one communication door.

Strategy code never calls ``torch.distributed`` directly: it calls a :class:`Communicator`. Every
call is recorded (op, group, logical bytes per link class by :mod:`moelab.comm.bytes`, start/end
time, iteration/layer/phase tags). The records feed the tracer (Chrome/Perfetto timelines), the byte
checks of the tests, and the simulator's validation. Optional link emulation lives here too: after a
collective, the rank sleeps until the declared links would have finished (labelled EMULATED).
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from moelab.comm.bytes import by_link_class, peer_bytes
from moelab.comm.topology import LINK_CLASSES, Topology


# torch >= 2.12 renamed the flat collectives; keep older torch working
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommRecord:
    op: str
    group: str
    bytes: dict  # {"local","intra","inter"} -> bytes sent by this rank
    t_start: float  # seconds (time.time)
    t_end: float
    tags: dict = field(default_factory=dict)
    emulated_s: float = 0.0  # time added by link emulation


class Recorder:
    """Per-rank record of communication calls and compute spans; writes a Chrome trace."""

    def __init__(self, rank: int):
        self.rank = rank
        self.comm: list[CommRecord] = []
        self.spans: list[tuple] = []  # (name, cat, t_start, t_end, tags)
        self.tags: dict = {}
        self.enabled = True

    @contextlib.contextmanager
    def tagged(self, **tags):
        old = dict(self.tags)
        self.tags.update(tags)
        try:
            yield
        finally:
            self.tags = old

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute"):
        t0 = time.time()
        try:
            yield
        finally:
            if self.enabled:
                self.spans.append((name, cat, t0, time.time(), dict(self.tags)))

    def bytes_by_class(self, since: int = 0) -> dict:
        acc = dict.fromkeys(LINK_CLASSES, 0)
        for r in self.comm[since:]:
            for k, v in r.bytes.items():
                acc[k] += v
        return acc

    def chrome_events(self) -> list:
        ev = []
        for r in self.comm:
            name = f"{r.op}" + (f" L{r.tags['layer']}" if "layer" in r.tags else "")
            ev.append({"name": name, "cat": "comm", "ph": "X", "pid": self.rank, "tid": 1,
                       "ts": r.t_start * 1e6, "dur": max(r.t_end - r.t_start, 0) * 1e6,
                       "args": {"group": r.group, **r.bytes, **r.tags, "emulated_s": r.emulated_s}})
        for name, cat, t0, t1, tags in self.spans:
            ev.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": 0,
                       "ts": t0 * 1e6, "dur": max(t1 - t0, 0) * 1e6, "args": tags})
        ev.append({"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}})
        ev.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "compute"}})
        ev.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 1, "args": {"name": "comm"}})
        return ev

    def write_chrome_trace(self, path) -> None:
        with open(path, "w") as f:
            json.dump({"traceEvents": self.chrome_events(), "displayTimeUnit": "ms"}, f)

    def comm_rows(self) -> list[dict]:
        return [{"op": r.op, "group": r.group, **{f"bytes_{k}": v for k, v in r.bytes.items()},
                 "t_start": r.t_start, "t_end": r.t_end, "emulated_s": r.emulated_s,
                 "iter": r.tags.get("iter", -1), "layer": r.tags.get("layer", -1),
                 "phase": r.tags.get("phase", "")} for r in self.comm]


class Communicator:
    """Collectives over named groups of a declared topology, recorded and optionally link-emulated.

    Groups: ``world``; ``node`` (the caller's node-local ranks); ``ep`` and ``dp`` (both the world
    for the expert-parallel baseline; strategies with other layouts add their own via ``add_group``).
    With ``world_size == 1`` and no process group initialised, every op is a local identity, so the
    same layer code runs single-process.
    """

    def __init__(self, topo: Topology, emulation=None, recorder: Optional[Recorder] = None):
        self.topo = topo
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if self.world_size != topo.world_size:
            raise ValueError(f"topology declares {topo.world_size} ranks, the process group has {self.world_size}")
        self.emulation = emulation if (emulation is not None and emulation.enabled) else None
        self.rec = recorder or Recorder(self.rank)
        # NCCL only moves CUDA tensors: small CPU-side tensors (counts) travel through this device
        self.device = torch.device("cuda", torch.cuda.current_device()) if (
            self.distributed and dist.get_backend() == "nccl") else torch.device("cpu")
        self._groups: dict = {}
        world = list(range(self.world_size))
        self._groups["world"] = (None, world)
        self._groups["ep"] = (None, world)
        self._groups["dp"] = (None, world)
        node_ranks = None
        for n in range(topo.nodes):  # new_group is collective: every rank creates every node group
            ranks = topo.node_ranks(n)
            pg = dist.new_group(ranks) if self.distributed and topo.nodes > 1 else None
            if self.rank in ranks:
                node_ranks = (pg, ranks)
        self._groups["node"] = node_ranks

    # ---- groups ------------------------------------------------------------------------------
    def add_group(self, name: str, ranks: Sequence[int], pg=None) -> None:
        self._groups[name] = (pg, list(ranks))

    def group(self, name: str):
        return self._groups[name]

    def group_ranks(self, name: str) -> list:
        return self._groups[name][1]

    # ---- recording / emulation ---------------------------------------------------------------
    def _record(self, op: str, group: str, t0: float, per_peer: dict, recv_per_peer: Optional[dict] = None):
        sent = by_link_class(self.topo, self.rank, per_peer)
        emulated = 0.0
        if self.emulation is not None and self.rec.enabled:  # unrecorded (metric) traffic is not emulated
            recv = by_link_class(self.topo, self.rank, recv_per_peer) if recv_per_peer is not None else sent
            target = self.emulated_time(sent, recv, op, self._groups[group][1] if group in self._groups else None)
            emulated = target - (time.time() - t0)
            if emulated > 0:
                time.sleep(emulated)
            emulated = max(emulated, 0.0)
        if self.rec.enabled:
            self.rec.comm.append(CommRecord(op, group, sent, t0, time.time(), dict(self.rec.tags), emulated))

    def emulated_time(self, sent: dict, recv: dict, op: Optional[str] = None,
                      ranks: Optional[Sequence[int]] = None) -> float:
        """Seconds the declared links need for one call (EMULATED); the rank sleeps until then.

        Declared hardware (``EmulationConfig``), the same the simulator prices
        (:mod:`moelab.sim.costs` with ``nics_per_node = ranks_per_node``, as
        :func:`moelab.sim.validate.emulation_profile` sets): every rank has its own intra-node port
        of ``intra_bw_GBps`` and its own inter-node NIC of ``inter_bw_GBps``, each per direction
        (multi-NIC GPU servers, one NIC per GPU); nothing is shared between ranks.

        - ``all_reduce`` / ``all_gather`` / ``reduce_scatter`` over ``ranks`` (``op`` and ``ranks``
          given): rings as :func:`moelab.sim.costs.ring_channels` builds them: node-major; across
          nodes one channel per member of the fullest node, channel c leaving every node through a
          different rank's NIC, each carrying 1/C of the ring's bytes. Time = steps x latency
          (``n-1``, all-reduce ``2(n-1)``; inter latency if the group spans nodes) + the ring's
          bytes per rank (= this rank's recorded non-local bytes, which the pairwise rule makes
          equal to a ring's ``(n-1) S``, ``(n-1)/n S``, ``2(n-1)/n S``) times the slowest link's
          share / bandwidth. Every member gets the same time (a ring moves in lockstep). The link
          shares depend only on the group: computed once per (op, group) and cached.
        - every other call (all-to-all, p2p, broadcast, reduce): per link class,
          ``max(sent, received) / bandwidth + latency`` of this rank's own port/NIC, the larger
          class wins (direct transfers on per-rank links; broadcast/reduce as a flat tree from/to
          the root, while the simulator prices a pipelined chain: they agree inside one node only
          through ``emulation_profile``'s fits).

        Bytes (``sent``/``recv``: this rank's, by link class, from :mod:`moelab.comm.bytes`) are the
        pairwise accounting the records keep; only the time follows the algorithm.
        """
        e = self.emulation
        bw = {"intra": e.intra_bw_GBps * 1e9, "inter": e.inter_bw_GBps * 1e9}
        lat = {"intra": e.intra_latency_us * 1e-6, "inter": e.inter_latency_us * 1e-6}
        if op in ("all_reduce", "all_gather", "reduce_scatter") and ranks is not None and len(ranks) > 1:
            v = sent.get("intra", 0) + sent.get("inter", 0)
            if v <= 0:
                return 0.0
            cache = vars(self).setdefault("_ring_cost", {})
            key = (op, tuple(ranks), e.intra_bw_GBps, e.inter_bw_GBps, e.intra_latency_us, e.inter_latency_us)
            cost = cache.get(key)
            if cost is None:
                nodes: dict = {}
                for r in sorted(ranks):
                    nodes.setdefault(self.topo.node_of(r), []).append(r)
                C = max(len(m) for m in nodes.values()) if len(nodes) > 1 else 1
                share: dict = {}  # (rank, class, direction) -> fraction of the per-rank ring bytes
                for c in range(C):
                    order = []
                    for m in nodes.values():
                        k = (c + len(m) - 1) % len(m)  # the node is left by its member k
                        order += m[k + 1:] + m[:k + 1]
                    for a, b in zip(order, order[1:] + order[:1]):
                        cls = self.topo.link_class(a, b)
                        share[(a, cls, 0)] = share.get((a, cls, 0), 0.0) + 1.0 / C
                        share[(b, cls, 1)] = share.get((b, cls, 1), 0.0) + 1.0 / C
                steps = (2 if op == "all_reduce" else 1) * (len(ranks) - 1)
                cost = cache[key] = (steps * lat["inter" if len(nodes) > 1 else "intra"],
                                     max(f / bw[cls] for (_, cls, _), f in share.items()))
            return cost[0] + v * cost[1]
        t = 0.0
        for cls in ("intra", "inter"):
            b = max(sent.get(cls, 0), recv.get(cls, 0))
            if b > 0:
                t = max(t, b / bw[cls] + lat[cls])
        return t

    # ---- raw (non-autograd) collectives ------------------------------------------------------
    def all_to_all_raw(self, x: torch.Tensor, out_rows: Sequence[int], in_rows: Sequence[int], group: str = "ep") -> torch.Tensor:
        """Uneven all-to-all along dim 0: send ``in_rows[i]`` rows to member i, receive ``out_rows[i]``."""
        pg, ranks = self._groups[group]
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        out = torch.empty((int(sum(out_rows)),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        t0 = time.time()
        if self.distributed and len(ranks) > 1:
            dist.all_to_all_single(out, x.contiguous(), [int(v) for v in out_rows], [int(v) for v in in_rows], group=pg)
        else:
            out.copy_(x)
        self._record("all_to_all", group, t0,
                     peer_bytes("all_to_all", ranks, self.rank, splits=[int(v) * row_bytes for v in in_rows]),
                     peer_bytes("all_to_all", ranks, self.rank, splits=[int(v) * row_bytes for v in out_rows]))
        return out

    def all_gather(self, x: torch.Tensor, group: str = "world") -> torch.Tensor:
        """Concatenate every member's ``x`` along a new leading dim: [n, *x.shape] (on x's device)."""
        pg, ranks = self._groups[group]
        home = x.device
        x = x.to(self.device).contiguous()
        flat = torch.empty(len(ranks) * x.numel(), dtype=x.dtype, device=x.device)
        t0 = time.time()
        if self.distributed and len(ranks) > 1:
            _ALL_GATHER(flat, x.reshape(-1), group=pg)
        else:
            flat.copy_(x.reshape(-1))
        out = flat.view((len(ranks),) + tuple(x.shape)).to(home)
        self._record("all_gather", group, t0, peer_bytes("all_gather", ranks, self.rank, x.numel() * x.element_size()))
        return out

    def reduce_scatter(self, x: torch.Tensor, group: str = "world") -> torch.Tensor:
        """Sum over members, each keeps its 1/n block of dim 0."""
        pg, ranks = self._groups[group]
        n = len(ranks)
        if x.shape[0] % n:
            raise ValueError(f"reduce_scatter needs dim 0 ({x.shape[0]}) divisible by group size {n}")
        out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        t0 = time.time()
        if self.distributed and n > 1:
            _REDUCE_SCATTER(out, x.contiguous(), group=pg)
        else:
            out.copy_(x)
        self._record("reduce_scatter", group, t0, peer_bytes("reduce_scatter", ranks, self.rank, x.numel() * x.element_size()))
        return out

    def all_reduce_(self, x: torch.Tensor, group: str = "world") -> torch.Tensor:
        """In-place sum over the group."""
        pg, ranks = self._groups[group]
        t0 = time.time()
        if self.distributed and len(ranks) > 1:
            dist.all_reduce(x, group=pg)
        self._record("all_reduce", group, t0, peer_bytes("all_reduce", ranks, self.rank, x.numel() * x.element_size()))
        return x

    def broadcast_(self, x: torch.Tensor, root: int, group: str = "world") -> torch.Tensor:
        pg, ranks = self._groups[group]
        t0 = time.time()
        if self.distributed and len(ranks) > 1:
            dist.broadcast(x, src=root, group=pg)
        self._record("broadcast", group, t0, peer_bytes("broadcast", ranks, self.rank, x.numel() * x.element_size(), root=root),
                     {root: x.numel() * x.element_size()} if self.rank != root else {})
        return x

    def reduce_(self, x: torch.Tensor, root: int, group: str = "world") -> torch.Tensor:
        pg, ranks = self._groups[group]
        t0 = time.time()
        if self.distributed and len(ranks) > 1:
            dist.reduce(x, dst=root, group=pg)
        self._record("reduce", group, t0, peer_bytes("reduce", ranks, self.rank, x.numel() * x.element_size(), root=root))
        return x

    def exchange(self, sends: dict, recvs: dict, tag: int = 0) -> None:
        """Point-to-point: ``sends[peer] = tensor`` and ``recvs[peer] = buffer``, posted together so no
        ordering can deadlock. Self-exchange is a local copy (gloo cannot send to itself)."""
        t0 = time.time()
        ops = []
        for peer, buf in recvs.items():
            if peer == self.rank:
                buf.copy_(sends[peer])
            else:
                ops.append(dist.P2POp(dist.irecv, buf, peer, tag=tag))
        for peer, t in sends.items():
            if peer != self.rank:
                ops.append(dist.P2POp(dist.isend, t.contiguous(), peer, tag=tag))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        self._record("p2p", "world", t0, {p: t.numel() * t.element_size() for p, t in sends.items()},
                     {p: t.numel() * t.element_size() for p, t in recvs.items()})

    # ---- autograd-aware ------------------------------------------------------------------------
    def all_to_all(self, x: torch.Tensor, out_rows: Sequence[int], in_rows: Sequence[int], group: str = "ep") -> torch.Tensor:
        """Autograd-aware uneven all-to-all; backward is the reverse all-to-all of the gradient.

        Under grad mode the output always requires grad (a zero-size anchor input), so a rank whose
        own slice is empty or constant still runs the backward collective its peers run: no hang."""
        anchor = torch.empty(0, requires_grad=torch.is_grad_enabled())
        return _AllToAll.apply(x, anchor, self, tuple(int(v) for v in out_rows), tuple(int(v) for v in in_rows), group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, comm, out_rows, in_rows, group):
        ctx.comm, ctx.out_rows, ctx.in_rows, ctx.group = comm, out_rows, in_rows, group
        ctx.tags = dict(comm.rec.tags)
        return comm.all_to_all_raw(x, out_rows, in_rows, group)

    @staticmethod
    def backward(ctx, g):
        with ctx.comm.rec.tagged(**{**ctx.tags, "phase": "bwd"}):
            gx = ctx.comm.all_to_all_raw(g.contiguous(), ctx.in_rows, ctx.out_rows, ctx.group)
        return gx, None, None, None, None, None
