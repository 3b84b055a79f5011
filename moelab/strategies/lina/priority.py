"""Strict priority between blocking all-to-alls and background all-reduces, per rank (Lina §2.2).

A :class:`PriorityScheduler` is a :class:`moelab.comm.scheduler.Scheduler` that also owns a
low-priority FIFO of all-reduce work and a communication thread that launches it. Every call of the
door is *high* priority (the all-to-alls, count exchanges) unless it carries the tag
``priority="low"``, which only this scheduler's thread sets.

Rules (``mode="priority"``, Lina's scheduler):

- a low op is launched only while no high call waits or runs and no high call is *imminent*
  (:meth:`imminent`: the combine backward of a MoE layer has started, its all-to-all follows), and
  while fewer than ``max_inflight`` low ops are in flight;
- an arriving high call overtakes every queued low op; with ``waits_for_inflight`` it waits for the
  low ops in flight (non-preemptive: at most ``max_inflight`` micro-ops ahead of it);
- :meth:`drain` (after backward, before the optimizer: no high call can arrive) lifts the bound to
  ``drain_inflight`` (default ``max_inflight``, the spec's one bound);
- inside :meth:`hold` (a pipelined layer's backward: its chunks' all-to-alls follow one another with
  compute between them) no low op is launched, not even in the gaps between those high calls (with
  ``plan`` there is no hold: those gaps are windows).

``mode="fixed"`` (the rejected "deferred" design): queued low ops are released only at release points
- after every second backward all-to-all, i.e. between MoE layers - and then all at once, ungated.

**A finding the spec's pseudocode misses: the non-preemptive wait can deadlock across ranks.** The
scheduler is local: rank A may launch micro-op k just before its all-to-all arrives while rank B,
whose all-to-all arrived first, holds k back. A then waits for k, which needs B; B's all-to-all needs
A. So the wait is bounded: a high call waits for the ops in flight at most ``stall_s`` (default:
three times the median duration of the last 16 low ops completed, at least 5 ms) - longer than an
in-flight op alone needs, so past it the op is stalled on a peer that is itself inside this
all-to-all (the median, so that the stalled ops' own long durations do not lengthen the next bound).
The release is logged (``released``) and counted, never silent. A stalled op stays stalled until
the peer's all-to-alls are through, so the high calls after a release do not wait for the ops it
gave up on again (``released``, not counted): a pipelined layer's chunks would otherwise each pay the
bound for the same op.

``agreement`` (optional) replaces the bounded wait's escape by a leader per group deciding every
launch (see ``__init__``); followers' launches are recorded with ``forced``.

``plan`` (optional, a departure from the paper's local rule that keeps its intent) makes every rank
launch the same micro-ops in the same window, so that no rank can start an op its peers reach only
after their all-to-all. A *window* is the stretch of backward before each backward high call: from the
backward's start or the end of the last high call in flight to the first of the combine marker and the
call (zero for a call that arrives while another is in flight; a call ends when it is waited, so a
pipelined layer, whose chunks' calls are waited after its last chunk, has no window inside it: an op
launched there would share the links with a chunk's call; :meth:`hold` does not apply). After each step,
two small all-gathers over every rank agree on each window's free time (the least over ranks) and each
op's duration (the most over ranks). The next step launches, in window ``w``, the FIFO's next ops whose agreed durations
fit its agreed free time, never an op the rank had not queued by that window's call (the same count on
every rank: gradients are queued in program order); after the last planned window, every op at once
(no high call is left to protect). A high call waits for the ops planned up to its window, launched for
it if its window closed early; ops launch only in an open window otherwise. The first step plans nothing
(all at the drain). The cost: two small calls per step, and a window shorter than planned delays its call
(recorded as ``plan_wait``).

``records``: one dict per call - high: ``wait`` (arrival), ``start``, ``end``, ``released``; low:
``enqueue``, ``start``, ``end``, ``nbytes``, ``group``, ``name`` (``forced``) - ``marks``: the times
:meth:`imminent` was called, and ``held``: each :meth:`hold`'s ``[start, end]``, so tests can check the rules
from the log (spec §5 I5, I6).
"""
from __future__ import annotations

import collections
import contextlib
import random
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moelab.comm.cpu_priority import as_comm_thread
from moelab.comm.scheduler import Call, Scheduler

LOW = "low"


@dataclass
class LowOp:
    """One queued low-priority collective: ``issue()`` posts it through the door (async) and returns its handle."""

    issue: Callable
    nbytes: int
    group: str
    name: str = ""
    tags: Optional[dict] = None  # set at submit: the submitting thread's record tags


class PriorityScheduler(Scheduler):
    def __init__(self, comm, mode: str = "priority", max_inflight: int = 1, waits_for_inflight: bool = True,
                 block_on_imminent: bool = True, stall_s: Optional[float] = None,
                 jitter_s: float = 0.0, seed: int = 0, agreement: Optional[dict] = None, plan: bool = False,
                 drain_inflight: Optional[int] = None):
        if mode not in ("priority", "fixed"):
            raise ValueError(f"PriorityScheduler mode must be 'priority' or 'fixed', got {mode!r}")
        if plan and (mode != "priority" or agreement):
            raise ValueError("plan applies to mode 'priority' without a leader agreement")
        if max_inflight < 1 or (drain_inflight is not None and drain_inflight < 1):
            raise ValueError(f"max_inflight and drain_inflight must be >= 1, got {max_inflight}, {drain_inflight}")
        self.comm, self.mode, self.max_inflight = comm, mode, max_inflight
        # the drain's bound: no high call can arrive before the optimizer, so the bound that keeps an all-to-all's
        # wait short protects nothing there; more ops in flight overlap the calls' fixed costs (None: max_inflight)
        self.drain_inflight = max_inflight if drain_inflight is None else drain_inflight
        self.waits_for_inflight, self.block_on_imminent, self.stall_s = waits_for_inflight, block_on_imminent, stall_s
        # a random delay before each launch (robustness tests: order must not depend on timing)
        self.jitter_s = jitter_s
        # agreement: {op group: control group over the same ranks}. The op group's first rank (the leader)
        # decides when each op launches, by the rules above, and says so with a 1-element broadcast on the
        # control group; the other members launch it as soon as they hear (a "forced" launch, even during
        # their own all-to-all). The cross-rank stall of the local design cannot happen: every rank reaches
        # op k before its next all-to-all (same backward order), so the wait needs no bound in practice.
        self.agreement = dict(agreement or {})
        self.plan = plan
        self.planned: list = []  # plan: cumulative ops launched by the end of each window (this step)
        self.plans: list = []  # plan: every step's windows' op counts, for the log
        self._win = self._submitted = 0
        self._win_open = 0.0
        self._win_free: list = []  # plan: this step's measured free time per window
        self._win_queued: list = []  # plan: ops queued by each window's call
        self._win_opened = False  # plan: a window opened since the last backward high call's arrival
        self._need = 0  # plan: the ops a waiting backward high call needs launched (its window's and before)
        self._draining = False
        self._step_low: list = []  # this step's launched low ops' records (their count drives the plan)
        self._flag = None
        self._popped = 0
        self._rng = random.Random(seed)
        self.cv = threading.Condition()
        self.queue: collections.deque = collections.deque()
        self.waiting = self.running = self.inflight = 0
        self.blocked = False  # a high call is imminent
        self.released_at = 0  # fixed mode: queue entries allowed out
        self.bwd_high = 0  # fixed mode: backward all-to-alls seen this step
        self.records: list = []
        self.marks: list = []
        self.held: list = []  # [start, end] of each hold
        self.holds = 0
        self.stalls = 0
        self.launched = 0  # low ops launched so far (this rank)
        self.stalled_upto = 0  # the ops launched before the last release: known stalled on a peer
        self._low_s: list = []  # durations of completed low ops (stall bound)
        self._handles: collections.deque = collections.deque()
        self._error: Optional[BaseException] = None
        self._closed = False
        # one op in flight (the default): the launcher waits for it itself, no thread hand-off per op
        self.inline_wait = mode == "priority" and max(max_inflight, self.drain_inflight) == 1
        self._launcher = threading.Thread(target=self._launch_loop, name="lina-comm", daemon=True)
        self._launcher.start()
        if not self.inline_wait:
            self._waiter = threading.Thread(target=self._wait_loop, name="lina-comm-wait", daemon=True)
            self._waiter.start()

    # ---- classification --------------------------------------------------------------------------
    @staticmethod
    def is_low(call: Call) -> bool:
        return call.tags.get("priority") == LOW

    # ---- the door's hooks ------------------------------------------------------------------------
    def admit(self, call: Call) -> None:
        if self.is_low(call):
            return  # gated before the issue, on the launcher thread
        rec = {"kind": "high", "op": call.op, "group": call.group, "wait": time.perf_counter(), "released": False,
               "phase": call.tags.get("phase"), "layer": call.tags.get("layer")}
        with self.cv:
            self.waiting += 1
            if self.plan:
                if rec["phase"] == "bwd":
                    self._plan_admit(rec)
            elif self.mode == "priority" and self.waits_for_inflight and self.inflight:
                if self.launched <= self.stalled_upto:  # only ops a release already gave up on
                    rec["released"] = True
                elif not self.cv.wait_for(lambda: self.inflight == 0, timeout=self._stall_bound()):
                    rec["released"] = True
                    self.stalls += 1
                    self.stalled_upto = self.launched
            self.waiting -= 1
            self.running += 1
            rec["start"] = time.perf_counter()
            call.priority_record = rec
            self.records.append(rec)

    def done(self, call: Call) -> None:
        rec = getattr(call, "priority_record", None)
        if rec is None:
            return
        with self.cv:
            rec["end"] = time.perf_counter()
            self.running -= 1
            self.blocked = False
            if self.plan and rec["phase"] == "bwd":  # the next window; it opens once no high call is in flight
                self._win += 1
                if not self.running:
                    self._win_open, self._win_opened = rec["end"], True
            if self.mode == "fixed" and rec["phase"] == "bwd" and call.op == "all_to_all":
                self.bwd_high += 1
                if self.bwd_high % 2 == 0:  # between two MoE layers
                    self.released_at = len(self.queue)
            self.cv.notify_all()

    # ---- what the strategy calls -------------------------------------------------------------------
    def imminent(self) -> None:
        """A high call follows shortly (Lina's CombineMarker in backward): stop launching low ops."""
        if self.mode == "priority" and self.block_on_imminent:
            with self.cv:
                self.blocked = True
                self.marks.append(time.perf_counter())

    @contextlib.contextmanager
    def hold(self):
        """High calls follow one another with compute between them (a pipelined layer's backward): launch
        no low op until the block ends, as :meth:`imminent` does before one call - the next chunk is
        imminent in every gap between two. Not with ``plan``: there every rank launches the same ops in the
        same window, so the stall the hold avoids cannot happen, and no window opens while a chunk's call is
        in flight (not yet waited) anyway."""
        if self.mode != "priority" or not self.block_on_imminent or self.plan:
            yield
            return
        span = [time.perf_counter(), None]
        with self.cv:
            self.holds += 1
            self.held.append(span)
        try:
            yield
        finally:
            with self.cv:
                self.holds -= 1
                span[1] = time.perf_counter()
                self.cv.notify_all()

    def submit(self, op: LowOp) -> None:
        """Queue a low op (FIFO); every rank must submit the same ops in the same order per group."""
        op.tags = dict(self.comm.rec.tags)  # the submitter's (iteration, layer): tags are thread-local
        with self.cv:
            self._raise()
            self._submitted += 1
            self.queue.append((op, {"kind": "low", "enqueue": time.perf_counter(), "nbytes": op.nbytes,
                                    "group": op.group, "name": op.name, "iter": op.tags.get("iter")}))
            self.cv.notify_all()

    def new_step(self) -> None:
        """A backward starts: reset the per-step counters (fixed mode's release points)."""
        with self.cv:
            self.bwd_high = 0
            self.released_at = 0
            self._win = self._submitted = 0
            self._win_open, self._draining = time.perf_counter(), False
            self._win_opened = True
            self._win_free, self._win_queued, self._step_low = [], [], []

    def drain(self, timeout: float = 600.0) -> None:
        """Release everything queued and return once every low op completed (before the optimizer)."""
        with self.cv:
            self.released_at = len(self.queue)
            self.blocked = False
            self._draining = True
            self.cv.notify_all()
            ok = self.cv.wait_for(lambda: self._error is not None or (not self.queue and self.inflight == 0 and
                                                                       not self._popped and not self._handles),
                                  timeout=timeout)
            self._raise()
            if not ok:
                raise TimeoutError(f"priority scheduler: {len(self.queue)} queued and {self.inflight} in-flight low "
                                   f"ops did not finish within {timeout:.0f}s")
        if self.plan:
            self._agree()

    def close(self) -> None:
        with self.cv:
            self._closed = True
            self.cv.notify_all()

    # ---- plan (cross-rank agreed launches) ---------------------------------------------------------------
    @property
    def _step_launched(self) -> int:
        return len(self._step_low)

    def _planned(self, w: int) -> int:
        """Ops launched by the end of window ``w`` in this step's plan (0 before a plan exists)."""
        if not self.planned:
            return 0
        return self.planned[min(w, len(self.planned) - 1)]

    def _plan_admit(self, rec: dict) -> None:
        """The ``w``-th backward high call closes window ``w``: record its free time and queued count, then
        wait (lock held by the caller) for the ops planned up to window ``w`` - launched and completed - on
        this rank. (A window opens when no high call is in flight; a call issued while one is - a pipelined
        layer's chunks - closes a window of zero.)"""
        w, now = len(self._win_free), time.perf_counter()
        end = now
        for t in reversed(self.marks):  # or the first marker since it opened
            if t < self._win_open:
                break
            end = min(end, t)
        free = end - self._win_open if self._win_opened else 0.0
        self._win_free.append(free)  # zero too for a call that arrives while another is in flight (chunks)
        self._win_queued.append(self._submitted)
        self._win_opened = False
        # every op planned up to this window, the same on every rank (a peer's call waits for the same ops, so
        # none of them can be held back by a peer inside this call); the launcher starts them for this wait
        # even while an earlier call is in flight (a window the plan counted on closed early)
        target = self._need = min(self._planned(w), self._submitted)
        self.cv.notify_all()
        ok = self.cv.wait_for(lambda: self._error is not None or (self._step_launched >= target and not self.inflight),
                              timeout=600.0)
        self._need = 0
        self._raise()
        if not ok:
            raise TimeoutError(f"priority scheduler (plan): window {w}'s {target} planned ops did not finish in 600 s")
        rec["window"], rec["plan_wait"] = w, time.perf_counter() - now

    def _agree(self) -> None:
        """After the drain: agree with every rank on the windows' free time (least) and the ops' durations
        (most), and plan the next step (:func:`plan_windows`). Two small all-gathers over every rank."""
        durs = [r["end"] - r["start"] for r in self._step_low]
        mine = torch.tensor([len(self._win_free), len(durs)], dtype=torch.float64)
        with self.comm.rec.tagged(phase="plan", name="lina_plan"):
            shapes = self.comm.all_gather(mine, group="world")
            if not bool((shapes == mine).all()):
                raise RuntimeError(f"priority scheduler (plan): ranks saw different (windows, ops) this step: "
                                   f"{shapes.tolist()}")
            data = torch.tensor(self._win_free + [float(q) for q in self._win_queued] + durs, dtype=torch.float64)
            every = self.comm.all_gather(data, group="world")
        W = len(self._win_free)
        free, queued = every[:, :W].min(0).values, every[:, W:2 * W].min(0).values
        durations = every[:, 2 * W:].max(0).values.tolist()
        self.planned = plan_windows(free.tolist(), [int(q) for q in queued.tolist()], durations)
        self.plans.append(list(self.planned))

    # ---- internals -----------------------------------------------------------------------------------
    def _stall_bound(self) -> float:
        if self.stall_s is not None:
            return self.stall_s
        typical = statistics.median(self._low_s[-16:]) if self._low_s else 0.0
        return max(0.005, 3.0 * typical)

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"priority scheduler's communication thread failed: {self._error!r}") from self._error

    def _leader(self, group: str) -> bool:
        return group not in self.agreement or self.comm.group_ranks(group)[0] == self.comm.rank

    def _may_launch(self) -> bool:
        if not self.queue:
            return False
        if not self._leader(self.queue[0][0].group):
            return True  # a follower is told when: it waits in the control broadcast
        if self.mode == "fixed":
            return self.released_at > 0
        if self.plan:  # in an open window (no high call in flight), for a waiting call, or after the last window
            return self.inflight < self._bound() and (
                self._draining or self._step_launched < self._need
                or (not self.running and self._step_launched < self._planned(self._win))
                or (bool(self.planned) and self._win >= len(self.planned)))
        return (self.waiting == 0 and self.running == 0 and not self.blocked and not self.holds
                and self.inflight < self._bound())

    def _bound(self) -> int:
        return self.drain_inflight if self._draining else self.max_inflight

    def _launch_loop(self) -> None:
        as_comm_thread()
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self._closed or self._may_launch())
                if self._closed:
                    return
                op, rec = self.queue.popleft()
                if self.mode == "fixed":
                    self.released_at -= 1
                leader = self._leader(op.group)
                self._popped += 1  # taken from the queue, not yet in flight (a follower awaiting its go)
                if leader:
                    self.inflight += 1
                    self.launched += 1
                    self._step_low.append(rec)
                    rec["start"], rec["window"] = time.perf_counter(), self._win
                    self.records.append(rec)
            if self.jitter_s:
                time.sleep(self._rng.uniform(0.0, self.jitter_s))
            try:
                with self.comm.rec.tagged(**{**op.tags, "priority": LOW, "phase": "grad_sync", "name": op.name}):
                    if op.group in self.agreement:  # the leader's go (followers block here until it comes)
                        self._flag = torch.zeros(1) if self._flag is None else self._flag
                        self.comm.broadcast_(self._flag, self.comm.group_ranks(op.group)[0],
                                             group=self.agreement[op.group])
                    if not leader:
                        with self.cv:
                            self.inflight += 1
                            self.launched += 1
                            rec["start"], rec["forced"] = time.perf_counter(), True
                            self.records.append(rec)
                    handle = op.issue()
                with self.cv:
                    self._popped -= 1
            except BaseException as e:  # surfaced by submit/drain on the training thread
                with self.cv:
                    self._error = e
                    self.cv.notify_all()
                return
            if self.inline_wait:  # one op in flight: wait here, no hand-off to the waiter thread
                if not self._finish(handle, rec):
                    return
                continue
            with self.cv:
                self._handles.append((handle, rec))
                self.cv.notify_all()

    def _wait_loop(self) -> None:
        as_comm_thread()
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self._closed or self._handles)
                if self._closed and not self._handles:
                    return
                handle, rec = self._handles[0]
            if not self._finish(handle, rec, queued=True):
                return

    def _finish(self, handle, rec, queued: bool = False) -> bool:
        """Wait for a launched low op and release its slot; False (error recorded) if it failed."""
        try:
            handle.wait()
        except BaseException as e:
            with self.cv:
                self._error = e
                self.cv.notify_all()
            return False
        with self.cv:
            if queued:
                self._handles.popleft()
            rec["end"] = time.perf_counter()
            self._low_s.append(rec["end"] - rec["start"])
            self.inflight -= 1
            self.cv.notify_all()
        return True


def plan_windows(free: list, queued: list, durations: list) -> list:
    """Cumulative count of FIFO ops launched by the end of each window: window ``w`` takes the next ops
    while their summed ``durations`` fit its ``free`` seconds, never past the ``queued[w]``-th (the ops
    queued by its closing call); an op that fits no window waits for the drain, and so do the ops behind it."""
    out, k = [], 0
    for f, n in zip(free, queued):
        t, stop = 0.0, min(int(n), len(durations))
        while k < stop and t + durations[k] <= f:
            t += durations[k]
            k += 1
        out.append(k)
    return out
