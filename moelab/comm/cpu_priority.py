"""Communication before compute on a host whose cores the ranks share (``emulation.compute_yields``).

On a cluster a collective does not wait for compute: NICs and copy engines move the bytes, and the CPU
thread that issues a call is not the one computing. Here ranks time-share a few cores, so a
communication thread woken for its next call queues behind the ranks' compute threads. Measured on 4
ranks sharing 2 cores, a 1-element all-reduce through the emulated door cost 0.6 ms of software on idle
ranks and 2-5 ms beside a computing thread; with that thread at SCHED_IDLE, 0.6-0.8 ms again.

:func:`compute_yields` runs a block (a rank's training iterations, or its serving loop) with the calling
thread under Linux's SCHED_IDLE: every other ready thread of the host runs first - communication threads,
gloo's workers - and the compute threads share what is left, so a call no longer pays for a core. Threads
started inside the block inherit SCHED_IDLE; a communication thread calls :func:`as_comm_thread` first.
Leaving SCHED_IDLE needs CAP_SYS_NICE (root, or ``setcap cap_sys_nice``); :func:`available` says whether
this host can, and the config refuses the option where it cannot. SCHED_IDLE yields to every other ready
thread of the host, other people's work included: on a busy shared machine the ranks' compute slows with it.
Measured (``benchmarks/README.md``): on Lina's 4 ranks it lifted ``priority`` to what the simulator predicts;
on Hecate's 8 ranks every system got slower, so it is an option, off by default.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading


def _set(policy: int) -> None:
    os.sched_setscheduler(0, policy, os.sched_param(0))  # pid 0: the calling thread (Linux)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether this host has SCHED_IDLE and lets a thread leave it (tried on a throwaway thread)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    ok: list = []

    def probe():
        try:
            _set(os.SCHED_IDLE)
            _set(os.SCHED_OTHER)
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, name="moelab-sched-probe")
    t.start()
    t.join()
    return bool(ok)


UNAVAILABLE = ("needs Linux's SCHED_IDLE and the right to leave it (CAP_SYS_NICE: root or setcap); "
               "this host lacks one of them")


def yield_errors(cfg) -> list:
    """``emulation.compute_yields`` needs what :func:`available` probes for."""
    return ["emulation.compute_yields " + UNAVAILABLE] if cfg.emulation.compute_yields and not available() else []


def resolve(mode: str) -> bool:
    """A command line's ``on`` / ``off`` / ``auto`` (on where :func:`available`) as the config's bool."""
    if mode not in ("on", "off", "auto"):
        raise ValueError(f"compute_yields mode must be on, off or auto, got {mode!r}")
    return mode == "on" or (mode == "auto" and available())


@contextlib.contextmanager
def compute_yields(on: bool = True):
    """Run the block with the calling thread at SCHED_IDLE (``on``), its policy restored after, also on error."""
    if not on:
        yield
        return
    if not available():
        raise RuntimeError("compute_yields " + UNAVAILABLE)
    before, param = os.sched_getscheduler(0), os.sched_getparam(0)
    _set(os.SCHED_IDLE)
    try:
        yield
    finally:
        os.sched_setscheduler(0, before, param)


def as_comm_thread() -> None:
    """Called first on a communication thread: leave the SCHED_IDLE inherited from a yielding compute thread."""
    if hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(0) == os.SCHED_IDLE:
        try:
            _set(os.SCHED_OTHER)
        except OSError:  # no CAP_SYS_NICE: compute_yields could not have been on
            pass
