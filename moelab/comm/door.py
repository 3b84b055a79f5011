"""The one communication door.

Strategy code never calls ``torch.distributed`` directly: it calls a :class:`Communicator`. Every
call is recorded (:mod:`moelab.comm.record`: op, group, per-group sequence number, bytes sent and
received per peer and per link class by :mod:`moelab.comm.bytes`, issue and completion time, the
issuing thread, iteration/layer/phase tags). The records feed the tracer (Chrome/Perfetto
timelines), the byte checks of the tests, and the simulator's validation.

- **Groups** are real process groups, one per declared instance, created once at build
  (:mod:`moelab.comm.groups`), so two threads may run collectives on two groups at once.
  ``close()`` hands them to a per-process pool that the next communicator over the same rank sets
  takes from (a process that runs many configurations keeps a bounded number of groups).
- **Async**: every collective takes ``async_op=True`` and returns a :class:`Handle`; ``wait()``
  returns the result and completes the record. A sync call is issue + wait.
- **Scheduler hook**: ``Communicator.scheduler`` (:mod:`moelab.comm.scheduler`) admits every call
  before it is issued and hears when it is done.
- **Link emulation** (optional, labelled EMULATED): a call priced by :mod:`moelab.comm.pricing`; the
  rank's ports are shared by concurrent calls (:mod:`moelab.comm.links`); at ``wait()`` the rank
  sleeps until its emulated finish, and a collective ends on every member at its slowest member's
  emulated finish.
"""
from __future__ import annotations

import itertools
import math
import os
import threading
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from moelab.comm import pricing
from moelab.comm.board import Board, Boards
from moelab.comm.bytes import peer_bytes, recv_bytes
from moelab.comm.collectives import collective
from moelab.comm.groups import BUILTIN, default_groups, validate_groups
from moelab.comm.links import Ports
from moelab.comm.pricing import chain_edges  # noqa: F401 - re-exported (the chain the door emulates)
from moelab.comm.record import CommRecord, Recorder, Span  # noqa: F401 - re-exported
from moelab.comm.scheduler import Call
from moelab.comm.topology import Topology

# torch >= 2.12 renamed the flat collectives; keep older torch working
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle:
    """An issued call. ``wait()`` finishes it (real completion, emulated delay, record) and returns
    its result; waiting again returns the same result."""

    __slots__ = ("comm", "op", "group", "ranks", "work", "result", "peers", "t0", "tags", "stream", "seq", "call",
                 "flows", "_done", "_value")

    def __init__(self, comm, op, group, ranks, work, result, peers, t0, tags, stream, seq, call):
        self.comm, self.op, self.group, self.ranks = comm, op, group, ranks
        self.work, self.result = work, result
        self.peers = peers  # (sent_to, recv_from) or the byte rule that returns them
        self.t0, self.tags, self.stream, self.seq, self.call = t0, tags, stream, seq, call
        self.flows = None  # ids of this call's flows on the rank's emulated ports
        self._done, self._value = False, None

    def wait(self):
        if self._done:
            return self._value
        work = self.work
        works = () if work is None else work if isinstance(work, list) else (work,)
        comm = self.comm
        rec = comm.rec
        t_call = time.time()
        # finished before this wait (an async call waited late)? Asked only where the record keeps the answer
        early = rec.enabled and all(getattr(w, "is_completed", lambda: False)() for w in works)
        for w in works:
            w.wait()
        value = self.result() if self.result is not None else None
        t_real = time.time()
        emulated, finish = comm._emulate(self) if self.flows is not None else (0.0, None)
        if rec.enabled:
            t_end = time.time()
            if early:  # done at its emulated finish, or (the door cannot know when) by the wait's start
                done = t_call if finish is None else max(finish, self.t0)
            else:  # done during this wait: its real completion, or its emulated finish after it
                done = t_real if finish is None else max(t_real, finish)
            rec.comm.append(CommRecord(self.op, self.group, self.t0, t_end, self.tags, emulated, self.stream,
                                       self.seq, self.peers, comm._fold, t_done=min(done, t_end)))
        if self.call is not None:
            comm.scheduler.done(self.call)
        self._done, self._value = True, value
        return value


FINISH_AGREEMENTS = ("auto", "allreduce")  # auto: a shared-memory board for groups on one host


class _GroupPool:
    """Process groups closed communicators gave back, by rank tuple, reused oldest first. Every rank
    builds and closes communicators in the same order (both are collective), so every rank, member or
    not (a non-member keeps the placeholder ``new_group`` gave it), takes the same entry or calls
    ``new_group`` at the same point. Emptied when the default group changes (a re-initialised world):
    its groups died with the old one."""

    def __init__(self):
        self._world, self._free = None, {}

    def _current(self) -> dict:
        world = dist.group.WORLD
        if world is not self._world:
            self._world, self._free = world, {}
        return self._free

    def take(self, key: tuple):
        """The group given back over ``key`` earliest, or None: call ``new_group`` (which never
        returns None; a non-member's placeholder is a value too)."""
        free = self._current().get(key)
        return free.pop(0) if free else None

    def give(self, key: tuple, pg) -> None:
        self._current().setdefault(key, []).append(pg)


_GROUP_POOL = _GroupPool()


class Communicator:
    """Collectives over named groups of a declared topology, recorded and optionally link-emulated.

    Groups: ``world``, ``ep``, ``dp`` (all ranks, each its own process group), ``node`` (the
    caller's node-local ranks) and every group of ``groups`` (``{name: [[ranks], [ranks], ..]}``,
    each a partition of the ranks, :func:`moelab.comm.groups.validate_groups`); ``group(name)`` is the
    caller's instance. With ``world_size == 1`` and no process group initialised, every op is a local
    identity, so the same layer code runs single-process. ``finish_agreement`` (emulation only; default
    ``$MOELAB_FINISH_AGREEMENT`` or ``auto``): how a collective's members agree on its emulated finish,
    ``auto`` through shared memory for groups on one host, ``allreduce`` always with a MAX all-reduce.
    """

    def __init__(self, topo: Topology, emulation=None, recorder: Optional[Recorder] = None,
                 groups: Optional[dict] = None, finish_agreement: Optional[str] = None):
        self.topo = topo
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if self.world_size != topo.world_size:
            raise ValueError(f"topology declares {topo.world_size} ranks, the process group has {self.world_size}")
        self.emulation = emulation if (emulation is not None and emulation.enabled) else None
        self.rec = recorder or Recorder(self.rank)
        self.scheduler = None  # a moelab.comm.scheduler.Scheduler; None: calls pass straight through
        # NCCL only moves CUDA tensors: small CPU-side tensors (counts) travel through this device
        self.device = torch.device("cuda", torch.cuda.current_device()) if (
            self.distributed and dist.get_backend() == "nccl") else torch.device("cpu")
        declared = validate_groups(groups or {}, self.world_size)
        decl = {**default_groups(topo), **declared}
        self._groups: dict = {}
        self._made: list = []  # the process groups this communicator created, destroyed by close()
        self._seq: dict = {}
        self._shadow: dict = {}  # group -> what agrees on a call's emulated finish: a Board or a process group
        self._replica_names: dict = {}  # rank set -> name of its on-demand group (replica_group)
        agreement = finish_agreement or os.environ.get("MOELAB_FINISH_AGREEMENT", "auto")
        self._boards = self._board_setup(agreement) if self.emulation is not None else None
        for name in list(BUILTIN) + sorted(declared):  # new_group is collective: same order everywhere
            for inst in decl[name]:
                pg = self._new_group(inst)
                shadow = self._agreement(name, inst)
                if self.rank in inst:
                    self.add_group(name, inst, pg)
                    self._shadow[name] = shadow
        self._boards_mapped()
        self._peer_class = [topo.link_class(self.rank, r) for r in range(self.world_size)]
        self._ports = None
        if self.emulation is not None:
            (bi, be), _ = pricing.link_keys(self.emulation)
            self._ports = Ports({("intra", "out"): bi, ("intra", "in"): bi, ("inter", "out"): be, ("inter", "in"): be},
                                gamma=getattr(self.emulation, "interference_gamma", 1.0))

    def _fold(self, per_peer: dict) -> dict:
        """:func:`moelab.comm.bytes.by_link_class` for this rank, with the peers' classes looked up once."""
        acc = {"local": 0, "intra": 0, "inter": 0}
        cls = self._peer_class
        for r, b in per_peer.items():
            acc[cls[r]] += b
        return acc

    def _new_group(self, ranks):
        # every rank creates every instance; a one-rank instance never communicates: none is made
        if not (self.distributed and len(ranks) > 1):
            return None
        key = tuple(ranks)
        pg = _GROUP_POOL.take(key)
        if pg is None:
            pg = dist.new_group(ranks)
        self._made.append((key, pg))
        return pg

    def close(self) -> None:
        """Give the process groups this communicator made back to the process's pool, after a barrier
        on the world (no peer is still in a call on one); the next communicator over the same rank sets
        takes them instead of creating new ones. Collective; call it once the run's last collective is
        done. A process that runs many configurations in turn (a benchmark, a test's cases, a
        reproduction suite) otherwise keeps every run's groups and their gloo threads: ~15 threads per
        run and rank, whose idle wake-ups took ~13 % of a core per rank after 24 short serving runs on
        4 ranks, and ~950 threads per rank after the conformance suite's 84 layers. Pooled rather than
        destroyed: destroying a gloo group took ~27 ms (creating one ~4 ms). Idempotent."""
        made, self._made = self._made, []
        if made and dist.is_initialized():
            dist.barrier()
            for key, pg in made:
                _GROUP_POOL.give(key, pg)
        # drop this communicator's references too: its groups may now serve another communicator
        self._groups, self._shadow, self._replica_names = {}, {}, {}

    # ---- the emulator's finish-time agreement ------------------------------------------------
    def _board_setup(self, mode: str):
        """The shared-memory boards (one collective at build), or None when the all-reduce is asked for
        (``finish_agreement="allreduce"``) or there is no process group."""
        if mode not in FINISH_AGREEMENTS:
            raise ValueError(f"finish_agreement must be one of {FINISH_AGREEMENTS}, got {mode!r}")
        if mode == "allreduce" or not self.distributed or self.world_size < 2:
            return None
        return Boards.setup(dist, self.world_size)

    def _agreement(self, name: str, inst):
        """What the members of ``inst`` agree on a call's emulated finish with: a shared-memory
        :class:`moelab.comm.board.Board` when they can share one (one host), else a shadow process group
        for a MAX all-reduce (None without emulation). Collective like ``new_group``: every rank calls it
        for every instance."""
        if self.emulation is None or not self.distributed or len(inst) < 2:
            return None
        if self._boards is None or not self._boards.shared(inst):
            return self._new_group(list(inst))
        return self._boards.open(name, inst, self.rank) if self.rank in inst else None

    def _boards_mapped(self) -> None:
        if self._boards is not None:
            self._boards.mapped(dist)

    # ---- groups ------------------------------------------------------------------------------
    def add_group(self, name: str, ranks: Sequence[int], pg=None) -> None:
        """Register an existing process group ``pg`` over ``ranks`` (prefer declaring groups: the
        communicator then creates them)."""
        self._groups[name] = (pg, list(ranks))
        self._seq[name] = itertools.count()

    def replica_group(self, ranks: Sequence[int]) -> str:
        """The name of a group over ``ranks`` (any subset of the world), created on first use and cached
        (one process group per distinct rank set, never one per call): FlexMoE's replica sets, which
        change as the scheduler runs, so they cannot be declared at build. Collective like
        ``new_group``: every rank calls it with the same rank sets in the same order (pure plans
        agree). A member may then call any collective with ``group=name`` (records, emulation, the
        per-group seq as for declared groups); a non-member gets the name only."""
        key = tuple(sorted({int(r) for r in ranks}))
        if not key or key[0] < 0 or key[-1] >= self.world_size:
            raise ValueError(f"replica_group ranks {list(ranks)} must be a non-empty subset of "
                             f"0..{self.world_size - 1}")
        cache = self._replica_names
        if key not in cache:
            name = "replica:" + ",".join(map(str, key))
            pg = self._new_group(list(key))
            shadow = self._agreement(name, list(key))
            if self.rank in key:
                self.add_group(name, key, pg)
                self._shadow[name] = shadow
            self._boards_mapped()
            cache[key] = name
        return cache[key]

    def group(self, name: str):
        return self._groups[name]

    def group_ranks(self, name: str) -> list:
        return self._groups[name][1]

    # ---- the one path every call takes ---------------------------------------------------------
    def _call(self, op, group, issue, peers, result=None, async_op=False, ranks=None, phases=None):
        """Admit (scheduler), number (per-group seq), issue, emulate; return a handle or its result.

        ``peers()`` -> (bytes sent to, bytes received from) each global rank: the byte rule, evaluated
        only when needed (a scheduler or the emulator asks before the issue; otherwise the record
        works it out when read), so a call pays almost nothing for its accounting. ``phases()`` ->
        the same per phase, for a collective that runs as phases one after the other (emulated so)."""
        if ranks is None:
            ranks = self._groups[group][1]
        call = None
        if self.scheduler is not None:
            peers = peers() if callable(peers) else peers
            call = Call(op, group, tuple(ranks), peers[0], peers[1], dict(self.rec.tags),
                        threading.current_thread().name)
            self.scheduler.admit(call)
        seq = next(self._seq[group]) if op != "p2p" else -1
        emulate = self._ports is not None and self.rec.enabled  # unrecorded (metric) traffic is not emulated
        if emulate:
            peers = peers() if callable(peers) else peers
        t0 = time.time()
        if emulate:  # the link model runs from the issue, beside the real call, even one that blocks (SAA)
            if phases is not None and len(ranks) > 1:
                flows = self._phase_flows(op, ranks, t0, phases())
            else:
                sent, recv = (chain_edges(op, ranks, self.rank, *peers) if collective(op).pricing == "chain"
                              else peers)
                flows = [self._ports.add(t0 + lat, ports, op) for lat, ports in
                         self.port_flows(op, ranks, self._fold(sent), self._fold(recv))]
        work = issue()
        h = Handle(self, op, group, ranks, work, result, peers, t0, dict(self.rec.tags),
                   threading.current_thread().name, seq, call)
        if emulate:
            h.flows = flows
        return h if async_op else h.wait()

    def _phase_flows(self, op, ranks, t0: float, phases) -> list:
        """A phased call's flows: each phase's (per link class) after the previous phase's have ended."""
        ids, prev = [], []
        for sent, recv in phases:
            flows = self.port_flows(op, ranks, self._fold(sent), self._fold(recv))
            if not flows:
                continue
            cur = [self._ports.add_after(prev, lat, ports, op) if prev else self._ports.add(t0 + lat, ports, op)
                   for lat, ports in flows]
            ids += cur
            prev = cur
        return ids

    # ---- emulation -----------------------------------------------------------------------------
    def port_flows(self, op: str, ranks: Sequence[int], sent: dict, recv: dict) -> list:
        """This rank's share of one call as flows on its ports (:func:`moelab.comm.pricing.port_flows`)."""
        return pricing.port_flows(self.topo, self.emulation, self.rank, op, ranks, sent, recv)

    def _emulate(self, h: Handle) -> tuple:
        """Sleep until the call's emulated finish; return the seconds added after the real completion and
        that finish (``time.time`` seconds).

        A collective's members agree on its finish, the maximum of their own finishes: through a
        shared-memory :class:`moelab.comm.board.Board` when they run on one host, else with a MAX
        all-reduce on a shadow process group of the same ranks (see ``benchmarks/comm_door.py``), so
        the calls of one group must be waited in the same order on every member - as SPMD code does."""
        t_real = time.time()
        finish = max((self._ports.wait(i) for i in h.flows), default=h.t0)
        shadow = self._shadow.get(h.group) if h.op != "p2p" else None
        if isinstance(shadow, Board):  # a collective ends on every member at its slowest member's finish
            finish = shadow.agree(finish)
        elif shadow is not None:
            t = torch.tensor([finish], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=shadow)
            finish = float(t)
        left = finish - time.time()
        if left > 0:
            time.sleep(left)
        return time.time() - t_real, finish

    def emulated_time(self, sent: dict, recv: dict, op: Optional[str] = None,
                      ranks: Optional[Sequence[int]] = None, phases: Optional[Sequence] = None) -> float:
        """Seconds the declared links need for one call *alone* (EMULATED;
        :func:`moelab.comm.pricing.emulated_time`)."""
        return pricing.emulated_time(self.topo, self.emulation, sent, recv, op, ranks, phases)

    # ---- any declared collective ----------------------------------------------------------------
    def run(self, op: str, group: str, issue, result=None, async_op: bool = False, **args):
        """Run a collective declared in :mod:`moelab.comm.collectives` through the door (scheduler,
        sequence number, record with its byte rule, emulation with its pricing).

        ``issue(pg, ranks)`` posts it on the group's process group asynchronously and returns its
        work (or a list of works; None when there is nothing to wait for); ``result()`` makes the
        value ``wait()`` returns; ``args``: the byte rule's arguments (``nbytes``, ``splits``, ``root``)."""
        pg, ranks = self._groups[group]
        c = collective(op)
        return self._call(op, group, lambda: issue(pg, ranks),
                          lambda: (c.sent(ranks, self.rank, **args), c.received(ranks, self.rank, **args)),
                          result, async_op, ranks,
                          phases=(lambda: c.phases(ranks, self.rank, **args)) if c.phases is not None else None)

    # ---- raw (non-autograd) collectives ------------------------------------------------------
    def _remote(self, ranks) -> bool:
        return self.distributed and len(ranks) > 1

    def _rule(self, op, ranks, nbytes, root=None):
        """The byte rule of a same-size collective, evaluated when the door asks (after the issue)."""
        return lambda: (peer_bytes(op, ranks, self.rank, nbytes, root=root),
                        recv_bytes(op, ranks, self.rank, nbytes, root=root))

    def all_to_all_raw(self, x: torch.Tensor, out_rows: Sequence[int], in_rows: Sequence[int], group: str = "ep",
                       async_op: bool = False):
        """Uneven all-to-all along dim 0: send ``in_rows[i]`` rows to member i, receive ``out_rows[i]``."""
        pg, ranks = self._groups[group]
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        outs, ins = [int(v) for v in out_rows], [int(v) for v in in_rows]
        out = torch.empty((sum(outs),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)

        def issue():
            if self._remote(ranks):
                return dist.all_to_all_single(out, x.contiguous(), outs, ins, group=pg, async_op=True)
            out.copy_(x)

        return self._call("all_to_all", group, issue,
                          lambda: (peer_bytes("all_to_all", ranks, self.rank, splits=[v * row_bytes for v in ins]),
                                   recv_bytes("all_to_all", ranks, self.rank, splits=[v * row_bytes for v in outs])),
                          lambda: out, async_op, ranks)

    def all_gather(self, x: torch.Tensor, group: str = "world", async_op: bool = False):
        """Concatenate every member's ``x`` along a new leading dim: [n, *x.shape] (on x's device)."""
        pg, ranks = self._groups[group]
        home = x.device
        x = x.to(self.device).contiguous()
        flat = torch.empty(len(ranks) * x.numel(), dtype=x.dtype, device=x.device)

        def issue():
            if self._remote(ranks):
                return _ALL_GATHER(flat, x.reshape(-1), group=pg, async_op=True)
            flat.copy_(x.reshape(-1))

        nb = x.numel() * x.element_size()
        return self._call("all_gather", group, issue, self._rule("all_gather", ranks, nb),
                          lambda: flat.view((len(ranks),) + tuple(x.shape)).to(home), async_op, ranks)

    def reduce_scatter(self, x: torch.Tensor, group: str = "world", async_op: bool = False):
        """Sum over members, each keeps its 1/n block of dim 0."""
        pg, ranks = self._groups[group]
        n = len(ranks)
        if x.shape[0] % n:
            raise ValueError(f"reduce_scatter needs dim 0 ({x.shape[0]}) divisible by group size {n}")
        out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)

        def issue():
            if self._remote(ranks):
                return _REDUCE_SCATTER(out, x.contiguous(), group=pg, async_op=True)
            out.copy_(x)

        nb = x.numel() * x.element_size()
        return self._call("reduce_scatter", group, issue, self._rule("reduce_scatter", ranks, nb), lambda: out,
                          async_op, ranks)

    def all_reduce_(self, x: torch.Tensor, group: str = "world", async_op: bool = False):
        """In-place sum over the group."""
        pg, ranks = self._groups[group]
        nb = x.numel() * x.element_size()
        return self._call("all_reduce", group,
                          lambda: dist.all_reduce(x, group=pg, async_op=True) if self._remote(ranks) else None,
                          self._rule("all_reduce", ranks, nb), lambda: x, async_op, ranks)

    def broadcast_(self, x: torch.Tensor, root: int, group: str = "world", async_op: bool = False):
        pg, ranks = self._groups[group]
        nb = x.numel() * x.element_size()
        return self._call("broadcast", group,
                          lambda: dist.broadcast(x, src=root, group=pg, async_op=True) if self._remote(ranks) else None,
                          self._rule("broadcast", ranks, nb, root), lambda: x, async_op, ranks)

    def reduce_(self, x: torch.Tensor, root: int, group: str = "world", async_op: bool = False):
        pg, ranks = self._groups[group]
        nb = x.numel() * x.element_size()
        return self._call("reduce", group,
                          lambda: dist.reduce(x, dst=root, group=pg, async_op=True) if self._remote(ranks) else None,
                          self._rule("reduce", ranks, nb, root), lambda: x, async_op, ranks)

    def exchange(self, sends: dict, recvs: dict, tag: int = 0, async_op: bool = False, group: str = "world"):
        """Point-to-point: ``sends[peer] = tensor`` and ``recvs[peer] = buffer`` (global ranks, members of
        ``group``), posted together as one batch on the group's process group so no ordering can
        deadlock and two threads may exchange on two groups at once. Self-exchange is a local copy
        (gloo cannot send to itself)."""
        pg, ranks = self._groups[group]
        if any(p not in ranks for p in (*sends, *recvs)):
            raise ValueError(f"exchange on group {group!r}: peers {sorted({*sends, *recvs} - set(ranks))} "
                             f"are not members {ranks}")

        def issue():
            ops = []
            for peer, buf in recvs.items():
                if peer == self.rank:
                    buf.copy_(sends[peer])
                else:
                    ops.append(dist.P2POp(dist.irecv, buf, peer, group=pg, tag=tag))
            for peer, t in sends.items():
                if peer != self.rank:
                    ops.append(dist.P2POp(dist.isend, t.contiguous(), peer, group=pg, tag=tag))
            return list(dist.batch_isend_irecv(ops)) if ops else None

        return self._call("p2p", group, issue,
                          ({p: t.numel() * t.element_size() for p, t in sends.items()},  # now: no tensor
                           {p: t.numel() * t.element_size() for p, t in recvs.items()}),  # stays referenced
                          None, async_op, ranks)

    # ---- autograd-aware ------------------------------------------------------------------------
    def all_to_all(self, x: torch.Tensor, out_rows: Sequence[int], in_rows: Sequence[int],
                   group: str = "ep") -> torch.Tensor:
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
