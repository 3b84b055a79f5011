"""A FastMoE-style comm stream: an in-order task queue served by one thread.

The CPU stand-in for a CUDA communication stream: work submitted here runs in submission order on
its own thread, so communication overlaps the submitting (compute) thread. A task carries the
submitter's record tags (layer, phase, iter) onto the stream's thread - the tags are thread-local
(:class:`moelab.comm.record.Recorder`), so this is the one place they cross threads, on purpose.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from typing import Callable, Optional

from moelab.comm.cpu_priority import as_comm_thread


class Task:
    def __init__(self, fn: Callable, args: tuple, name: str, tagged=None):
        self.fn, self.args, self.name = fn, args, name
        self.tagged = tagged  # a context manager factory: the submitter's tags, re-entered on the stream
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.result = None

    def run(self) -> None:
        try:
            with self.tagged() if self.tagged is not None else contextlib.nullcontext():
                self.result = self.fn(*self.args)
        except BaseException as e:  # surfaced by wait() on the main thread
            self.error = e
        finally:
            self.done.set()

    def wait(self):
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(f"comm task {self.name} failed: {self.error!r}") from self.error
        return self.result


class CommStream:
    """An in-order task queue served by one daemon thread (``threaded=False``: run at submit).

    ``recorder``: a :class:`moelab.comm.record.Recorder` whose tags each task inherits from its
    submitter; ``name``: the thread's name, which is the stream's row in the trace."""

    def __init__(self, threaded: bool = True, recorder=None, name: str = "comm-stream"):
        self.threaded, self.recorder, self.name = threaded, recorder, name
        self._q: "queue.Queue[Optional[Task]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def _loop(self) -> None:
        as_comm_thread()
        while True:
            task = self._q.get()
            if task is None:
                return
            task.run()

    def submit(self, fn: Callable, *args, name: str = "task") -> Task:
        tagged = None
        if self.recorder is not None and self.threaded:
            tags, rec = dict(self.recorder.tags), self.recorder
            tagged = lambda: rec.tagged(**tags)  # noqa: E731
        t = Task(fn, args, name, tagged)
        if not self.threaded:
            t.run()
            return t
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        self._q.put(t)
        return t

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout=5)


_STREAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def comm_stream(comm, threaded: bool = True, name: str = "comm-stream") -> CommStream:
    """One comm stream per communicator, mode and ``name``: every layer's pipeline uses the same thread
    (a strategy names its own stream to keep its order apart from another's)."""
    per = _STREAMS.setdefault(comm, {})
    if (threaded, name) not in per:
        per[(threaded, name)] = CommStream(threaded, recorder=getattr(comm, "rec", None), name=name)
    return per[(threaded, name)]
