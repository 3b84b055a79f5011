"""Event simulator: per-rank streams, collectives that span ranks, links shared fairly.

Model (what a GPU job looks like to the scheduler):

- Every rank has serial **streams** ("compute", "comm", or any other name: a second comm channel
  is just another stream). Ops on one (rank, stream) run in the order they were added, as kernels
  on a CUDA stream or calls on an NCCL communicator do.
- An **op** covers one or more ranks (a collective covers its group) and occupies its stream on all
  of them. It starts when its dependencies are done and it is at the head of every member's
  stream; so a collective starts when its last member is ready, and ranks that issue collectives
  in different orders deadlock (reported, not hung).
- An op takes ``duration`` seconds (compute; the latency of a transfer), then, if it has
  ``links`` (bytes per shared link, from :mod:`moelab.comm.costs`), it flows: while k transfers
  use a link each gets 1/k of it (equal fair share), and a transfer advances at the pace of its
  slowest link share. Alone, a transfer takes ``duration + max bytes/capacity``.

Refinements of the sharing rule, each off unless a graph asks for it:

- **Stream priority** (``OpGraph.stream_priority``: stream name -> int, default 0). On a link used
  by flows of several priorities, only the highest-priority ones share it; a lower-priority flow
  waits there (rate 0) until they are gone (strict priority, as Lina's all-to-all preempting the
  gradient all-reduce). A waiting flow may leave capacity unused when the preempting flow is
  bottlenecked elsewhere: chunked real schedules behave the same way at chunk granularity.
  A stream in ``OpGraph.nonpreemptive`` is held back the same way until it starts, but a flow of
  it that has started moving is never preempted: it keeps an equal share beside the higher
  priority (a whole bucket or one micro-op in flight when an all-to-all arrives).
- **Call gate** (``OpGraph.call_gate = (high streams, low streams, high_waits)``): a per-rank
  scheduler's rule at the level of calls, not links (Lina's, :mod:`moelab.strategies.lina.priority`). A low op
  does not start while, on one of its ranks, a high op waits or runs; with ``high_waits`` a high op
  that becomes ready while low ops run on its ranks waits until they end (non-preemptive: the call in
  flight finishes first), else it starts beside them. Stream priority above still shares the links
  among what does run. ``OpGraph.gate_holds`` (``[(first, last), ...]``) extends a high stretch over the
  compute between calls: from ``first``'s start to ``last``'s start, ``first``'s ranks count as a high
  op waiting (a pipelined layer's backward holds the scheduler until its last chunk's call is issued).
- **Per-flow limits** (``OpGraph.flow_limits``: link -> the most capacity one flow may take). A
  pool of C CPU cores shared by single-threaded ranks is a link of capacity C with limit 1: k ranks
  computing at once each run at ``min(1, C/k)`` of their own speed (the local profile's
  ``shared_cores``).
- **Interference** (:meth:`OpGraph.interfere`: streams, gamma >= 1). A flow of one of those streams
  that shares a link with a *moving* flow of another of them gets 1/gamma of its share there (so two
  such flows alone on a link each move at capacity/(2 gamma)): NCCL's channel and SM contention beyond
  fair sharing, Lina's gamma. A preempted flow does not move, so it does not interfere. An entry may
  be a tuple of streams, one class: its streams do not interfere among themselves (several all-reduce
  streams against the all-to-all's).

- **Alternative dependencies** (``OpGraph.any_of``: op -> tuple of op-id tuples): beside its deps, an
  op waits until every op of *one* alternative has ended (a scheduler's bound that changes at an event:
  Lina's micro-op n after micro-op n - k during backward, or after n - k' once the drain began).

Events go through one heap. A flow is re-rated only when a flow sharing one of its links joins or
leaves (once per instant however many do), and re-scheduled only if its rate changed, so the cost
is O(ops log ops + changes x flows sharing the changed links), with no per-token or per-byte work.
Price an all-to-all as one multi-link op (as :mod:`moelab.sim.graphs` does): it gives the same
time as N(N-1) concurrent sends (tested) for the cost of one flow; 4k unequal sends on 64 ranks
take seconds.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from moelab.comm.bytes import moved_bytes
from moelab.sim.result import SimResult


@dataclass(slots=True, repr=False, eq=False)
class Op:
    id: int
    name: str
    ranks: tuple
    stream: str
    duration: float  # seconds: compute time, or a transfer's latency
    links: Optional[dict]  # link -> bytes, for a transfer
    deps: tuple
    category: str
    kind: str  # compute | comm
    alloc: Optional[dict]  # category -> bytes added at start (per member rank)
    free: Optional[dict]  # category -> bytes released at end
    comm: Optional[dict]  # the runtime's record of the call, for byte accounting
    meta: dict

    def __repr__(self):
        more = "..." if len(self.ranks) > 4 else ""
        return f"Op({self.id}, {self.name!r}, ranks={list(self.ranks)[:4]}{more})"


class OpGraph:
    """Ops with ranks, stream, duration or link bytes, deps, category; plus link capacities (bytes/s).

    ``comm`` on an op records what the runtime would record for it (``op``, ``group``, and
    ``nbytes``/``splits``/``root``) so byte accounting can be replayed with the shared rule.
    """

    def __init__(self, world_size: int, capacities: Optional[dict] = None, meta: Optional[dict] = None,
                 stream_priority: Optional[dict] = None, flow_limits: Optional[dict] = None):
        self.world_size = world_size
        self.capacities = dict(capacities or {})
        self.meta = dict(meta or {})
        self.stream_priority = dict(stream_priority or {})  # stream -> int; higher wins a shared link
        self.flow_limits = dict(flow_limits or {})  # link -> most capacity one flow may take
        self.nonpreemptive: set = set()  # streams whose started flows a higher priority cannot stop
        self.ops: list = []
        self.cpu_pool = None  # set by share_cores(): compute ops then draw on this shared link
        self.op_overhead_s = 0.0  # fixed seconds added to every compute op (launch / interpreter cost)
        self.call_overhead_s = 0.0  # fixed seconds added to every collective call (transfer)
        self.phase_overhead_s = 0.0  # fixed seconds per phase of a phased call (each a batched p2p round), if > 0
        self.emulated_sync_s: Optional[float] = None  # not None: fixed costs run beside the links (see transfer)
        self.busy_fixed: Optional[tuple] = None  # (call_s, sync_s) of a call issued while its ranks compute
        self.software_cpu_share: Optional[float] = None  # a number: fixed costs are CPU work on the pool (transfer)
        self.cpu_s_per_byte = 0.0  # ... and so is every byte a member moves, at this many CPU seconds per byte
        self.interference: Optional[tuple] = None  # (classes: tuples of streams, gamma): see interfere()
        self.call_gate: Optional[tuple] = None  # (high streams, low streams, high_waits): see the module doc
        self.any_of: dict = {}  # op -> alternatives (tuples of op ids), one of which must have ended: module doc
        self.gate_holds: list = []  # [(first op, last op)]: the call gate's holds, see the module doc
        self.call_heads: dict = {}  # a call's last op (what transfer returns) -> the ops that start it

    def also_after(self, call: int, deps) -> None:
        """Make ``call`` (an op id :meth:`transfer` returned, or any op) also wait for ``deps``, which may be
        ops added after it: a schedule decided once the graph exists (Lina's planned windows, a call that
        waits for the micro-ops planned before it). Every op that starts the call gets the dependency."""
        for h in self.call_heads.get(call, (call,)):
            o = self.ops[h]
            o.deps = tuple(dict.fromkeys(o.deps + tuple(deps)))

    def interfere(self, streams, gamma) -> None:
        """Flows of different streams among ``streams`` slow each other by ``gamma`` (a number >= 1, or
        op -> number: a per-op draw) wherever both move on one link; an entry that is a tuple of
        streams is one class (no interference inside it); see the module docstring."""
        classes = tuple(dict.fromkeys(tuple(c) if isinstance(c, (tuple, list)) else (c,) for c in streams))
        if len(classes) < 2:
            raise ValueError(f"interference needs two streams or more, got {tuple(streams)}")
        names = [x for c in classes for x in c]
        if len(names) != len(set(names)):
            raise ValueError(f"a stream in two interference classes: {tuple(streams)}")
        if not callable(gamma) and not gamma >= 1:
            raise ValueError(f"gamma must be >= 1 (interference cannot speed a flow up), got {gamma}")
        self.interference = (classes, gamma)

    def share_cores(self, cores: float, op_overhead_s: float = 0.0, pool=("cpu", 0)) -> None:
        """Make every later :meth:`compute` op run on a pool of ``cores`` shared by all ranks (one
        core at most per op: single-threaded ranks), after ``op_overhead_s`` of fixed cost each.
        ``cores=0`` keeps the ranks independent (GPUs) and only adds the overhead."""
        self.op_overhead_s = float(op_overhead_s)
        if cores and cores > 0:
            self.cpu_pool = pool
            self.capacities[pool] = float(cores)
            self.flow_limits[pool] = 1.0

    def __len__(self):
        return len(self.ops)

    def add(self, name: str, ranks, *, stream: str = "compute", duration: float = 0.0,
            links: Optional[dict] = None, deps: Sequence[int] = (), category: str = "other",
            alloc: Optional[dict] = None, free: Optional[dict] = None, comm: Optional[dict] = None,
            kind: Optional[str] = None, **meta) -> int:
        """Add an op; ``kind`` (compute / comm) defaults to comm when it has links or a comm record."""
        ranks = (ranks,) if isinstance(ranks, (int, np.integer)) else tuple(ranks)
        if kind is None:
            kind = "comm" if links is not None or comm is not None else "compute"
        op = Op(len(self.ops), name, ranks, stream, float(duration), links or None, tuple(deps), category,
                kind, alloc, free, comm, meta)
        self.ops.append(op)
        return op.id

    def compute(self, rank: int, name: str, seconds: float, deps=(), category: str = "compute", **kw) -> int:
        """``seconds`` of work on one rank (plus the graph's per-op overhead; on the CPU pool if shared)."""
        seconds = float(seconds) + self.op_overhead_s
        if self.cpu_pool is not None:
            return self.add(name, (rank,), stream=kw.pop("stream", "compute"), duration=0.0,
                            links={self.cpu_pool: seconds}, deps=deps, category=category, kind="compute", **kw)
        return self.add(name, (rank,), stream=kw.pop("stream", "compute"), duration=seconds, deps=deps,
                        category=category, **kw)

    def transfer(self, name: str, ranks, demands, deps=(), category: str = "comm", stream: str = "comm",
                 comm: Optional[dict] = None, call_overhead: bool = True, phased: bool = False,
                 beside_compute: bool = False, **kw) -> int:
        """A collective as one op per demand phase, chained; returns the last op's id.

        Fixed software cost: the first phase pays the graph's ``call_overhead_s``, unless
        ``call_overhead`` is False (a later step of one call priced as several transfers); a
        ``phased`` call (each phase its own round of batched point-to-point, as Parm's SAA) pays
        ``phase_overhead_s`` per phase instead where that is set. Where it goes:

        - ``emulated_sync_s is None`` (hardware): before the phase's link time, added to it;
        - a number (the comm door's EMULATED links, :mod:`moelab.comm.door`): the link model runs on
          the wall clock from the call's issue, beside the real call, so the software cost and the
          link time overlap (the call takes the longer of the two), then the members agree on the
          finish (a shadow all-reduce): ``emulated_sync_s`` more.

        ``beside_compute``: the call is issued while its ranks compute (a comm thread's call during
        backward); where :attr:`busy_fixed` is set (ranks sharing a host's cores, where such a call
        waits for a core) it pays those fixed costs instead.

        :attr:`software_cpu_share` (EMULATED links on a shared CPU pool): the fixed costs are CPU work on
        that pool instead of plain durations, so a call waits for a core as long as ranks compute and
        the compute waits for the call's software in turn; each member rank draws ``share × cost`` CPU
        seconds (the held-out cost was measured with every rank calling at once on the pool, where each
        got ``share`` of a core), plus :attr:`cpu_s_per_byte` for every byte it sends to or receives from
        another member (``comm``'s record, :func:`moelab.comm.bytes.moved_bytes`: loopback transports copy
        them on the same cores). :attr:`busy_fixed` then does not apply: the pool prices a busy host.

        ``comm`` (the accounting record) goes on the first phase only, so bytes are counted once.
        """
        first, deps = len(self.ops), tuple(deps)
        last = self._transfer(name, ranks, demands, deps, category, stream, comm, call_overhead, phased,
                              beside_compute, kw)
        self.call_heads[last] = tuple(i for i in range(first, len(self.ops)) if self.ops[i].deps == deps)
        return last

    def _transfer(self, name, ranks, demands, deps, category, stream, comm, call_overhead, phased, beside_compute, kw):
        call_s, sync_s = self.call_overhead_s, self.emulated_sync_s
        on_cores = self.software_cpu_share is not None and self.cpu_pool is not None and sync_s is not None
        if beside_compute and self.busy_fixed is not None and not on_cores:
            call_s, sync_s = self.busy_fixed[0], (self.busy_fixed[1] if sync_s is not None else None)
        fixed = [0.0] * len(demands)
        if call_overhead and demands:
            if phased and self.phase_overhead_s > 0:
                fixed = [self.phase_overhead_s] * len(demands)
            else:
                fixed[0] = call_s
        beside = sync_s is not None
        last = None
        for i, d in enumerate(demands):
            last = self.add(name if len(demands) == 1 else f"{name}#{i}", ranks, stream=stream,
                            duration=d.alpha + (0.0 if beside else fixed[i]), links=d.links,
                            deps=tuple(deps) if last is None else (last,), category=category,
                            comm=comm if i == 0 else None, kind="comm", **kw)
        if on_cores and (sum(fixed) > 0 or sync_s > 0):
            return self._software_on_cores(name, ranks, sum(fixed), sync_s, deps, last, stream, category, kw, comm)
        if beside and (sum(fixed) > 0 or sync_s > 0):
            sw = self.add(f"{name}.software", ranks, stream=f"{stream}.software", duration=sum(fixed), deps=deps,
                          category=category, kind="comm", **kw)
            last = self.add(f"{name}.sync", ranks, stream=stream, duration=sync_s,
                            deps=(sw,) if last is None else (last, sw), category=category, kind="comm", **kw)
        return last

    def _software_on_cores(self, name, ranks, call_s, sync_s, deps, links_done, stream, category, kw, comm=None) -> int:
        """A call's software and sync as each member rank's CPU work on the shared pool (see :meth:`transfer`):
        the software beside the link time, then the sync once both are done; returns the call's last op."""
        share, pool = float(self.software_cpu_share), self.cpu_pool
        moved = moved_bytes(comm) if comm and self.cpu_s_per_byte > 0 else {}
        sw = tuple(self.add(f"{name}.software.{r}", (r,), stream=f"{stream}.software",
                            links={pool: call_s * share + self.cpu_s_per_byte * moved.get(r, 0)},
                            deps=deps, category=category, kind="comm", **kw) for r in ranks)
        ready = sw if links_done is None else (links_done, *sw)
        syncs = tuple(self.add(f"{name}.sync.{r}", (r,), stream=stream, links={pool: sync_s * share}, deps=ready,
                               category=category, kind="comm", **kw) for r in ranks)
        return self.add(f"{name}.sync", ranks, stream=stream, duration=0.0, deps=syncs, category=category,
                        kind="comm", **kw)


class DeadlockError(RuntimeError):
    """Ops remain that can never start (collectives issued in different orders, or a cycle)."""


class _Crowding:
    """Who uses which link, as counts per (priority level, link): a flow over thousands of links (an
    all-to-all of a large cluster) is rated by one array pass instead of a Python loop per link.

    A flow's rate on a link is an equal share among the flows of the highest priority present and
    the started non-preemptive ones (0 when it is preempted there), capped by the link's per-flow
    limit, divided by its gamma where a moving flow of another interfering stream shares the link;
    its rate is the smallest over its links."""

    def __init__(self, ops, caps: dict, limits: dict, prio: list, holds: list, interference=None):
        levels = sorted(set(prio))
        self.prioritised = len(levels) > 1
        self.level = [levels.index(p) for p in prio] if self.prioritised else [0] * len(ops)
        self.holds, self.pinned = holds, [False] * len(ops)  # pinned: a started non-preemptive flow
        index: dict = {}  # link -> column
        entry: dict = {}  # id(links dict) -> its entry: graphs hand many ops one demand's dict
        for o in ops:
            if o.links and id(o.links) not in entry:
                keys = [l for l, b in o.links.items() if b > 0]
                entry[id(o.links)] = (o.links, keys, [index.setdefault(l, len(index)) for l in keys])
        inf = float("inf")
        cap = np.asarray([caps[l] for l in index], dtype=np.float64)
        lim = np.asarray([limits.get(l, inf) for l in index], dtype=np.float64)
        for k, (links, keys, cols) in entry.items():  # (columns, capacity / bytes, limit / bytes, columns as a list)
            c, nbytes = np.asarray(cols, dtype=np.int64), np.asarray([links[l] for l in keys], dtype=np.float64)
            entry[k] = (c, cap[c] / nbytes, lim[c] / nbytes, cols) if keys else None
        self.of = [entry[id(o.links)] if o.links else None for o in ops]  # per op, or None
        self.users = [set() for _ in index]
        self.count = np.zeros((len(levels), len(index)), dtype=np.int64)  # flows per (level, link)
        self.pinned_count = np.zeros((len(levels), len(index)), dtype=np.int64) if any(holds) else None
        self.klass = None  # interference: per op the index of its stream's class among the interfering ones, or -1
        if interference is not None:
            classes, gamma = interference
            of = {x: k for k, c in enumerate(classes) for x in c}
            self.klass = [of.get(o.stream, -1) for o in ops]
            self.gamma = [(gamma(o) if callable(gamma) else gamma) if k >= 0 else 1.0 for o, k in zip(ops, self.klass)]
            if min(self.gamma) < 1:
                raise ValueError(f"gamma must be >= 1, an op drew {min(self.gamma)}")
            shape = (len(classes), len(levels), len(index))
            self.kcount, self.kpinned = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)

    def has_links(self, i) -> bool:
        return self.of[i] is not None

    def _interferes(self, i) -> bool:
        return self.klass is not None and self.klass[i] >= 0

    def sharing(self, i) -> set:
        """Flows on any link of i (i included once it has joined)."""
        users = self.users
        return set().union(*(users[c] for c in self.of[i][3]))

    def join(self, i):
        self.count[self.level[i], self.of[i][0]] += 1
        if self._interferes(i):
            self.kcount[self.klass[i], self.level[i], self.of[i][0]] += 1
        for c in self.of[i][3]:
            self.users[c].add(i)

    def leave(self, i):
        cols, lv = self.of[i][0], self.level[i]
        self.count[lv, cols] -= 1
        if self.pinned[i]:
            self.pinned_count[lv, cols] -= 1
        if self._interferes(i):
            self.kcount[self.klass[i], lv, cols] -= 1
            if self.pinned[i]:
                self.kpinned[self.klass[i], lv, cols] -= 1
        for c in self.of[i][3]:
            self.users[c].discard(i)

    def started_moving(self, i):
        """A flow of a non-preemptive stream got a rate: it keeps a share from now on."""
        if self.holds[i] and not self.pinned[i]:
            self.pinned[i] = True
            self.pinned_count[self.level[i], self.of[i][0]] += 1
            if self._interferes(i):
                self.kpinned[self.klass[i], self.level[i], self.of[i][0]] += 1

    def rate(self, i) -> float:
        cols, cb, lim, _ = self.of[i]
        if not self.prioritised:
            n = self.count[0, cols]
            if self._interferes(i):
                n = n * self._slowdown(i, self.kcount[:, 0, cols])
            return float(np.minimum(cb / n, lim).min())
        sub = self.count[:, cols]
        P = len(sub)
        top = P - 1 - np.argmax(sub[::-1] > 0, axis=0)  # highest level present on each link
        if not self.pinned[i] and (top > self.level[i]).any():
            return 0.0  # preempted on some link until the higher-priority flows leave it
        k = np.arange(len(cols))
        n = sub[top, k]
        if self.pinned_count is not None:  # started non-preemptive flows below the top level count too
            below = np.cumsum(self.pinned_count[:, cols], axis=0)
            n = n + np.where(top > 0, below[np.maximum(top - 1, 0), k], 0)
        if self._interferes(i):  # moving flows per interfering stream: top + pinned below
            kc = self.kcount[:, top, cols]
            below = np.cumsum(self.kpinned[:, :, cols], axis=1)
            moving = kc + np.where(top > 0, below[:, np.maximum(top - 1, 0), k], 0)
            n = n * self._slowdown(i, moving)
        return float(np.minimum(cb / n, lim).min())

    def _slowdown(self, i, moving):
        """Per link of i: its gamma where a moving flow of another interfering stream is there, else 1
        (``moving``: flows per interfering stream and link)."""
        other = moving.sum(0) - moving[self.klass[i]] > 0
        return np.where(other, self.gamma[i], 1.0)


class _CallGate:
    """The call gate's per-rank state (see the module doc): high ops waiting or running, low ops running."""

    def __init__(self, graph: OpGraph):
        high, low, self.high_waits = graph.call_gate
        self.ops = graph.ops
        self.kind = [1 if o.stream in high else -1 if o.stream in low else 0 for o in graph.ops]
        self.high = np.zeros(graph.world_size, dtype=np.int64)  # high ops waiting or running, per rank
        self.low = np.zeros(graph.world_size, dtype=np.int64)  # low ops running, per rank
        self.held: list = []  # ready ops the gate holds back (a held high op already counts in self.high)
        self.hold_step = {}  # op -> +1 (its start opens a hold on its ranks) or -1 (closes the hold on them)
        for first, last in graph.gate_holds:
            ranks = tuple(self.ops[first].ranks)
            self.hold_step[first], self.hold_step[last] = (1, ranks), (-1, ranks)

    def admit(self, ready) -> list:
        """Of the ready ops (and those held), the ones that start now: high ones first, then low ones."""
        held = set(self.held)
        cand = sorted(set(ready) | held, key=lambda i: (self.kind[i] != 1, i))
        self.held, go = [], []
        for i in cand:
            r, k = list(self.ops[i].ranks), self.kind[i]
            if k == 1:
                if i not in held:  # newly ready: it waits or runs from now on
                    self.high[r] += 1
                if self.high_waits and self.low[r].any():
                    self.held.append(i)
                    continue
            elif k == -1:
                if self.high[r].any():
                    self.held.append(i)
                    continue
                self.low[r] += 1
            go.append(i)
            if i in self.hold_step:
                step, ranks = self.hold_step[i]
                self.high[list(ranks)] += step
        return go

    def ended(self, i) -> list:
        """Op i ended: release its ranks; the held ops go back to the ready list (re-admitted at once)."""
        k = self.kind[i]
        if k:
            (self.high if k == 1 else self.low)[list(self.ops[i].ranks)] -= 1
        return list(self.held) if k else []


def simulate(graph: OpGraph) -> SimResult:
    """Run ``graph`` to completion; raises :class:`DeadlockError` if some ops can never start."""
    ops = graph.ops
    n = len(ops)
    caps = graph.capacities
    start = np.full(n, np.nan)
    end = np.full(n, np.nan)
    blocker = np.full(n, -1, dtype=np.int64)
    waiting = [0] * n
    dependents: list = [[] for _ in range(n)]
    queues: dict = {}
    for o in ops:
        deps = set(o.deps)
        waiting[o.id] = len(deps) + len(o.ranks)
        for d in deps:
            dependents[d].append(o.id)
        for r in o.ranks:
            key = (r, o.stream)
            q = queues.get(key)
            if q is None:
                q = queues[key] = deque()
            q.append(o.id)

    heap: list = []  # (time, seq, kind, op, version)
    seq = 0
    ready: list = []

    def release(i, t, by):
        waiting[i] -= 1
        if waiting[i] == 0:
            blocker[i] = by
            ready.append(i)

    alt_left: dict = {}  # op -> ops still running per alternative (see OpGraph.any_of)
    alt_dependents: list = [[] for _ in range(n)]
    for i, alts in graph.any_of.items():
        alts = [set(a) for a in alts]
        if alts and all(alts):  # an empty alternative is met from the start
            waiting[i] += 1
            alt_left[i] = [len(a) for a in alts]
            for j, a in enumerate(alts):
                for d in a:
                    alt_dependents[d].append((i, j))

    for q in queues.values():
        release(q[0], 0.0, -1)

    # fluid flows: op -> (remaining fraction at t_ref, rate, t_ref). A flow's rate depends only on
    # how crowded its own links are, so a join or a leave re-rates just the flows sharing a link with it.
    active: dict = {}
    version = [0] * n
    flows = _Crowding(ops, caps, graph.flow_limits, [graph.stream_priority.get(o.stream, 0) for o in ops],
                      [o.stream in graph.nonpreemptive for o in ops], graph.interference)

    def rerate(dirty, t):
        """Bring each flow's progress to t at its old rate, then give it its new fair-share rate."""
        nonlocal seq
        push = heapq.heappush
        for i in dirty:  # a set of ints: its order is deterministic
            rem0, rate0, t0 = active[i]
            rate = flows.rate(i)
            if rate == rate0:
                continue  # its bottleneck did not change: the pending end event stays right
            rem = rem0 - rate0 * (t - t0)
            active[i] = (rem, rate, t)
            if rate > 0:
                flows.started_moving(i)
            version[i] += 1
            if rate > 0:  # a preempted flow gets no end event until it is re-rated
                seq += 1
                push(heap, (t + (rem if rem > 0 else 0.0) / rate, seq, 1, i, version[i]))

    gate = _CallGate(graph) if graph.call_gate else None

    def start_ready(t):
        nonlocal seq
        while ready:
            batch = sorted(ready) if gate is None else gate.admit(ready)
            ready.clear()
            for i in batch:
                start[i] = t
                seq += 1
                heapq.heappush(heap, (t + ops[i].duration, seq, 2 if flows.has_links(i) else 0, i, 0))

    def finish(i, t):
        end[i] = t
        o = ops[i]
        if gate is not None:
            ready.extend(gate.ended(i))
        for r in o.ranks:
            q = queues[(r, o.stream)]
            q.popleft()
            if q:
                release(q[0], t, i)
        for j in dependents[i]:
            release(j, t, i)
        for j, a in alt_dependents[i]:
            left = alt_left[j]
            if min(left) > 0:  # no alternative met yet
                left[a] -= 1
                if left[a] == 0:
                    release(j, t, i)

    start_ready(0.0)
    done = 0
    dirty: set = set()  # flows to re-rate once every event of this instant is in
    while heap:
        t, _, kind, i, ver = heapq.heappop(heap)
        if kind == 0:  # plain op (or transfer without bytes) done
            finish(i, t)
            done += 1
        elif kind == 2:  # latency over: join the links
            active[i] = (1.0, 0.0, t)
            flows.join(i)
            dirty |= flows.sharing(i)
        elif ver == version[i]:  # a flow's (still valid) predicted end
            dirty |= flows.sharing(i)
            dirty.discard(i)
            flows.leave(i)
            del active[i]
            finish(i, t)
            done += 1
        if not heap or heap[0][0] > t:  # the last event of this instant
            if dirty:
                rerate(dirty, t)
                dirty.clear()
            start_ready(t)
    if done < n:
        stuck = [ops[i] for i in range(n) if np.isnan(start[i])][:5]
        raise DeadlockError(f"{n - done} op(s) never ran; first stuck: {stuck}. Collectives issued in "
                            "different orders on different ranks, or a dependency cycle?")
    return SimResult(graph, start, end, blocker, float(end.max()) if n else 0.0)
