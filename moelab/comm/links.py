"""Contention-aware link emulation: one rank's ports as shared resources (fluid sharing).

The declared hardware (``EmulationConfig``) gives every rank an intra-node port and an inter-node
NIC, each per direction. A call becomes *flows*: a flow starts after its latency and needs some
bytes on some of this rank's ports (:meth:`moelab.comm.door.Communicator.port_flows`). Flows that
overlap in time share a port's bandwidth (processor sharing): a flow progresses at the rate its
busiest port allows, ``min over its ports p of (capacity_p / active flows on p) / bytes_p``, and
the rates are recomputed whenever a flow starts or ends. Alone, a flow takes ``latency + max_p
bytes_p / capacity_p``: exactly today's price of a call alone. The model runs on the wall clock and
is advanced lazily (whenever a flow is added or someone waits), so a flow leaves its ports at its
emulated finish even if nobody waits for it then.

A flow starts at this rank's issue. A collective whose peers issue later (a micro-op one rank launched
before its peers reached it) therefore shares this rank's ports from the early issue on, before any real
byte could move; its finish is still the slowest member's (the door agrees on it), so only the calls beside
it on the early rank pay for the early start. (Not modelled: a flow starting when its last member issues.)

Interference (off unless ``gamma > 1``): a flow of one of the ``interfering`` kinds (by default an
all-to-all and an all-reduce) that shares a port with a flow of another of those kinds gets 1/gamma
of its fair share there, as the simulator's :meth:`moelab.sim.engine.OpGraph.interfere` (Lina's
gamma: NCCL's channel and SM contention, which makes overlapping the two costlier than sharing).
"""
from __future__ import annotations

import itertools
import threading
import time


class _Flow:
    __slots__ = ("start", "bytes", "done", "finish", "after", "ready", "delay", "kind")

    def __init__(self, start, nbytes: dict, after=(), ready: float = 0.0, delay: float = 0.0, kind=None):
        self.start, self.bytes = start, nbytes  # start None: waiting for the flows in ``after``
        self.done = 0.0  # fraction of the bytes moved
        self.finish = None  # absolute time, once finished
        self.after, self.ready, self.delay = set(after), ready, delay  # ready: latest finish among ``after``
        self.kind = kind  # the call's op (interference)

    def copy(self) -> "_Flow":
        f = _Flow(self.start, self.bytes, self.after, self.ready, self.delay, self.kind)
        f.done = self.done
        return f


class Ports:
    """The ports of one rank, shared by every thread that communicates on it."""

    def __init__(self, capacity: dict, gamma: float = 1.0, interfering=("all_to_all", "all_reduce")):
        if not gamma >= 1:
            raise ValueError(f"interference gamma must be >= 1 (it cannot speed a flow up), got {gamma}")
        self.capacity = dict(capacity)  # port -> bytes/s
        self.gamma, self.interfering = float(gamma), frozenset(interfering)
        self._cv = threading.Condition()
        self._flows: dict = {}  # id -> _Flow, not yet finished
        self._finished: dict = {}  # id -> finish time, until collected
        self._ids = itertools.count()
        self._origin = time.time()  # the model keeps seconds since here: epoch floats are too coarse
        self._t = 0.0

    def _bytes(self, nbytes: dict) -> dict:
        """``nbytes`` as floats on known ports, empty entries dropped."""
        for p in nbytes:
            if p not in self.capacity:
                raise KeyError(f"unknown port {p!r}; ports: {sorted(self.capacity)}")
        return {p: float(b) for p, b in nbytes.items() if b > 0}

    def add(self, start: float, nbytes: dict, kind=None) -> int:
        """A flow that starts at ``start`` (absolute seconds) and moves ``nbytes[port]`` on each port;
        ``kind``: the call's op, for interference."""
        nb = self._bytes(nbytes)
        start -= self._origin
        with self._cv:
            self._advance(time.time() - self._origin)
            i = next(self._ids)
            if nb:
                self._flows[i] = _Flow(start, nb, kind=kind)
            else:
                self._finished[i] = start
            self._cv.notify_all()  # waiters' predicted finishes move
            return i

    def add_after(self, after, delay: float, nbytes: dict, kind=None) -> int:
        """A flow that starts ``delay`` seconds after every flow in ``after`` (ids of this rank's
        flows, added earlier) has finished: the next phase of a phased collective (Parm's SAA)."""
        nb = self._bytes(nbytes)
        if not nb:
            raise ValueError("a chained flow needs bytes on some port")
        with self._cv:
            self._advance(time.time() - self._origin)
            i = next(self._ids)
            f = _Flow(None, nb, delay=float(delay), kind=kind)
            for k in after:
                if k in self._flows:
                    f.after.add(k)
                elif k in self._finished:
                    f.ready = max(f.ready, self._finished[k])
                else:
                    raise KeyError(f"flow {k} is unknown or already collected")
            if not f.after:
                f.start = f.ready + f.delay
            self._flows[i] = f
            self._cv.notify_all()
            return i

    def wait(self, i: int) -> float:
        """Sleep until flow ``i`` has finished in the model; return its finish time."""
        with self._cv:
            while True:
                now = time.time() - self._origin
                self._advance(now)
                if i in self._finished:
                    return self._finished.pop(i) + self._origin
                self._cv.wait(max(self._predict(i) - now, 0.0) + 1e-5)

    # ---- the fluid model ------------------------------------------------------------------------
    def _rates(self, active: list) -> dict:
        users: dict = {}
        kinds: dict = {}  # port -> interfering kinds moving on it (only kept when gamma > 1)
        for f in active:
            for p in f.bytes:
                users[p] = users.get(p, 0) + 1
                if self.gamma > 1 and f.kind in self.interfering:
                    kinds.setdefault(p, set()).add(f.kind)

        def share(f, p, b):
            slowed = f.kind in self.interfering and len(kinds.get(p, ())) > 1
            return self.capacity[p] / users[p] / b / (self.gamma if slowed else 1.0)

        return {id(f): min(share(f, p, b) for p, b in f.bytes.items()) for f in active}

    def _step(self, flows: dict, t: float, until: float, stop=None) -> float:
        """Run ``flows`` from ``t`` to ``until`` (or until flow ``stop`` ends); return the time reached."""
        while t < until:
            active = [f for f in flows.values() if f.start is not None and f.start <= t]
            arrivals = [f.start for f in flows.values() if f.start is not None and f.start > t]
            nxt = min(arrivals, default=until)
            if not active:
                t = min(nxt, until)
                continue
            rates = self._rates(active)
            left = {id(f): (1.0 - f.done) / rates[id(f)] for f in active}
            dt = min(left.values())
            if nxt - t < dt or until - t < dt:  # an arrival or the horizon comes first: all progress
                t1 = min(nxt, until)
                for f in active:
                    f.done = min(1.0, f.done + (t1 - t) * rates[id(f)])
                t = t1
                continue
            t0, t = t, t + dt  # the first flow(s) to finish do, exactly; the others progress
            ended = []
            for k, f in list(flows.items()):
                if f.start is None or f.start > t0:  # not active in this step (t0, not t - dt: rounding)
                    continue
                if left[id(f)] <= dt * (1 + 1e-9):
                    f.done, f.finish = 1.0, t
                    del flows[k]
                    ended.append(k)
                else:
                    f.done += dt * rates[id(f)]
            for k in ended:  # flows chained after these may start now (after their delay)
                for f in flows.values():
                    if k in f.after:
                        f.after.discard(k)
                        f.ready = max(f.ready, t)
                        if not f.after:
                            f.start = f.ready + f.delay
            if stop in ended:
                return t
        return t

    def _advance(self, now: float) -> None:
        if now <= self._t:
            return
        before = dict(self._flows)
        self._step(self._flows, self._t, now)
        for k, f in before.items():
            if k not in self._flows:
                self._finished[k] = f.finish
        self._t = now

    def _predict(self, i: int) -> float:
        """Finish of flow ``i`` if no other flow arrives (a copy of the model is run forward)."""
        return self._step({k: f.copy() for k, f in self._flows.items()}, self._t, float("inf"), stop=i)
