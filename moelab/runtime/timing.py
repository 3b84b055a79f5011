"""The one timing harness of real-rank experiments: every rank starts together, and a step's time is the
slowest rank's (the step is done when the last rank is). The barrier and the reduction are bookkeeping:
they go through the comm door with recording paused, so they are neither logged nor link-emulated.

::

    out, t = timed(comm, lambda: layer(x).sum().backward())
    t.slowest_s, t.own_s, t.per_rank_s
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepTime:
    slowest_s: float  # the step's time: the slowest rank's
    own_s: float  # this rank's
    per_rank_s: tuple  # every member's, in group order


def barrier(comm, group: str = "world") -> None:
    """All members of ``group`` reach this point before any goes on (an unrecorded tiny all-gather)."""
    with comm.rec.paused():
        comm.all_gather(torch.zeros(1, dtype=torch.float64), group)


def gather_floats(comm, value: float, group: str = "world") -> tuple:
    """Every member's ``value`` (a time, a measured rate), in group order, on every member (unrecorded)."""
    with comm.rec.paused():
        got = comm.all_gather(torch.tensor([float(value)], dtype=torch.float64), group)
    return tuple(float(v) for v in got.reshape(-1))


def timed(comm, fn, group: str = "world"):
    """``(fn(), StepTime)``: a barrier, ``fn`` timed on this rank, then every member's time gathered."""
    barrier(comm, group)
    t0 = time.perf_counter()
    out = fn()
    own = time.perf_counter() - t0
    per = gather_floats(comm, own, group)
    return out, StepTime(max(per), own, per)


@dataclass(frozen=True)
class Measured:
    """One timed step with what the comm door recorded during it (records, compute spans) and its wall-clock
    start, so per-step traffic, timelines and compute can be read without hand-kept recorder offsets."""

    time: StepTime
    wall0: float  # time.time() when the step began (timeline origin)
    comm: tuple  # the door's records of this step
    spans: tuple  # (name, category, t0, t1, tags) spans of this step

    def op_seconds(self, op: str) -> float:
        return sum(r.t_done - r.t_start for r in self.comm if r.op == op)  # issue to finish, not to its wait

    def op_bytes(self, op: str) -> int:
        """Bytes this rank sent in ``op`` calls, every link class (local included)."""
        return int(sum(sum(r.bytes.values()) for r in self.comm if r.op == op))


def measure(comm, fn, group: str = "world", clear: bool = True) -> Measured:
    """:func:`timed` ``fn`` and keep the records and spans it produced; ``clear`` empties the recorder
    afterwards (a long replay does not accumulate every step's records)."""
    rec = comm.rec
    n_c, n_s = len(rec.comm), len(rec.spans)
    start = {}

    def step():
        start["wall"] = time.time()
        return fn()

    _, t = timed(comm, step, group)
    m = Measured(t, start["wall"], tuple(rec.comm[n_c:]), tuple(rec.spans[n_s:]))
    if clear:
        rec.comm.clear()
        rec.spans.clear()
    return m
