"""What the comm door remembers: one :class:`CommRecord` per call, compute spans, thread-local tags.

Tags (iteration, layer, phase) belong to the thread that sets them: a layer tagging its forward on
the main thread must not label what a comm thread issues meanwhile. Every record and span carries
the name of the thread (stream) that issued it, and the Chrome/Perfetto trace draws one row per
stream, so overlap between compute and communication streams is visible.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Optional

from moelab.comm.topology import LINK_CLASSES


class CommRecord:
    """One call. Bytes are kept as the byte rule's inputs and worked out on first read (``bytes`` /
    ``recv``: by link class; ``sent_to`` / ``recv_from``: per global rank), so recording costs the
    call almost nothing; pickling a record works them out."""

    __slots__ = ("op", "group", "t_start", "t_end", "t_done", "tags", "emulated_s", "stream", "seq", "_peers", "_fold",
                 "_bytes")

    def __init__(self, op: str, group: str, t_start: float, t_end: float, tags: Optional[dict] = None,
                 emulated_s: float = 0.0, stream: str = "MainThread", seq: int = -1, peers=None, fold=None,
                 t_done: Optional[float] = None):
        self.op, self.group, self.t_start, self.t_end = op, group, t_start, t_end  # seconds (time.time)
        # t_end: when the issuer took the result (an async call's wait); t_done: when the call had finished as far
        # as the door knows - the same for a call waited before it finished, earlier for one waited after
        self.t_done = t_end if t_done is None else t_done
        self.tags = tags if tags is not None else {}
        self.emulated_s = emulated_s  # time added by link emulation after the real completion
        self.stream = stream  # name of the issuing thread
        self.seq = seq  # per-group collective sequence number (same on every member); -1: p2p
        self._peers = peers  # (sent_to, recv_from) or a zero-argument function returning them
        self._fold = fold  # per-peer dict -> {"local","intra","inter"}
        self._bytes = None

    def _all(self) -> tuple:
        if self._bytes is None:
            sent_to, recv_from = self._peers() if callable(self._peers) else self._peers
            self._bytes = (sent_to, recv_from, self._fold(sent_to), self._fold(recv_from))
            self._peers = self._fold = None
        return self._bytes

    @property
    def sent_to(self) -> dict:
        return self._all()[0]

    @property
    def recv_from(self) -> dict:
        return self._all()[1]

    @property
    def bytes(self) -> dict:
        """{"local","intra","inter"} -> bytes sent by this rank."""
        return self._all()[2]

    @property
    def recv(self) -> dict:
        """{"local","intra","inter"} -> bytes received by this rank."""
        return self._all()[3]

    def __getstate__(self):
        self._all()
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state):
        for k, v in state.items():
            setattr(self, k, v)

    def __repr__(self) -> str:
        return (f"CommRecord({self.op!r}, group={self.group!r}, seq={self.seq}, stream={self.stream!r}, "
                f"bytes={self.bytes}, recv={self.recv}, tags={self.tags})")


class Span(tuple):
    """A compute span ``(name, cat, t_start, t_end, tags)`` that also knows its thread (``.stream``)."""

    def __new__(cls, name, cat, t0, t1, tags, stream="MainThread"):
        self = super().__new__(cls, (name, cat, t0, t1, tags))
        self.stream = stream
        return self

    def __getnewargs__(self):  # pickling (results cross processes)
        return (*self, self.stream)


class Recorder:
    """Per-rank record of communication calls and compute spans; writes a Chrome trace."""

    def __init__(self, rank: int):
        self.rank = rank
        self.comm: list[CommRecord] = []
        self.spans: list[Span] = []  # (name, cat, t_start, t_end, tags), .stream
        self.enabled = True
        self._local = threading.local()

    @property
    def tags(self) -> dict:
        """This thread's tags."""
        t = getattr(self._local, "tags", None)
        if t is None:
            t = self._local.tags = {}
        return t

    @contextlib.contextmanager
    def tagged(self, **tags):
        old = dict(self.tags)
        self._local.tags = {**old, **tags}
        try:
            yield
        finally:
            self._local.tags = old

    @contextlib.contextmanager
    def paused(self):
        """``with rec.paused(): ...`` - bookkeeping traffic (metrics, evaluation, checkpoint flags, load
        gathers) is not training traffic: not recorded, hence not link-emulated either."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute"):
        t0 = time.time()
        try:
            yield
        finally:
            if self.enabled:
                self.spans.append(Span(name, cat, t0, time.time(), dict(self.tags), threading.current_thread().name))

    def bytes_by_class(self, since: int = 0) -> dict:
        acc = dict.fromkeys(LINK_CLASSES, 0)
        for r in self.comm[since:]:
            for k, v in r.bytes.items():
                acc[k] += v
        return acc

    def chrome_events(self, iters=None) -> list:
        """Complete events, one row (tid) per stream: compute threads first, then comm streams. With
        ``iters`` (a set), only events of those iterations and events without one."""
        def keep(tags: dict) -> bool:
            return iters is None or "iter" not in tags or tags["iter"] in iters

        rows: dict = {}

        def tid(stream: str, kind: str) -> int:
            return rows.setdefault((kind, stream), len(rows))

        ev = []
        for s in self.spans:
            name, cat, t0, t1, tags = s
            if not keep(tags):
                continue
            ev.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank,
                       "tid": tid(getattr(s, "stream", "MainThread"), "compute"),
                       "ts": t0 * 1e6, "dur": max(t1 - t0, 0) * 1e6, "args": tags})
        for r in self.comm:
            if not keep(r.tags):
                continue
            name = f"{r.op}" + (f" L{r.tags['layer']}" if "layer" in r.tags else "")
            ev.append({"name": name, "cat": "comm", "ph": "X", "pid": self.rank, "tid": tid(r.stream, "comm"),
                       "ts": r.t_start * 1e6, "dur": max(r.t_end - r.t_start, 0) * 1e6,
                       "args": {"group": r.group, "seq": r.seq, **r.bytes,
                                **{f"recv_{k}": v for k, v in r.recv.items()}, **r.tags, "emulated_s": r.emulated_s,
                                "done_ms": round((r.t_done - r.t_start) * 1e3, 3)}})
        ev.append({"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}})
        for (kind, stream), t in rows.items():
            ev.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": t,
                       "args": {"name": f"{kind}: {stream}"}})
            ev.append({"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": t, "args": {"sort_index": t}})
        return ev

    def write_chrome_trace(self, path, iters=None) -> None:
        """The trace as Chrome/Perfetto JSON; ``iters`` limits it (:func:`sampled_iters`)."""
        with open(path, "w") as f:
            json.dump({"traceEvents": self.chrome_events(iters), "displayTimeUnit": "ms"}, f)

    def comm_rows(self) -> list[dict]:
        return [{"op": r.op, "group": r.group, **{f"bytes_{k}": v for k, v in r.bytes.items()},
                 **{f"recv_{k}": r.recv.get(k, 0) for k in LINK_CLASSES},
                 "t_start": r.t_start, "t_end": r.t_end, "t_done": r.t_done, "emulated_s": r.emulated_s,
                 "stream": r.stream, "seq": r.seq,
                 "iter": r.tags.get("iter", -1), "layer": r.tags.get("layer", -1),
                 "phase": r.tags.get("phase", "")} for r in self.comm]


def sampled_iters(iters, keep: int):
    """At most ``keep`` of ``iters``, evenly spaced with the first and the last, so a long run's trace
    stays bounded; None (all) when ``keep`` is 0 or there are no more than ``keep``."""
    iters = list(iters)
    n = len(iters)
    if keep <= 0 or n <= keep:
        return None
    if keep == 1:
        return {iters[-1]}
    return {iters[round(i * (n - 1) / (keep - 1))] for i in range(keep)}
