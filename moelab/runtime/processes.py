"""A run's processes seen from outside: torchrun and every rank, each in a process group of its own.

Each rank records its pid in the launch's side folder (``pid_rank{r}``) and the guard records
torchrun's (``pid_torchrun``); the launcher (:mod:`moelab.runtime.launch`) and the guard
(:mod:`moelab.runtime.guard`) stop them from these files: SIGTERM to every group, SIGKILL after
``GRACE_S``, then wait until every pid is gone (a zombie counts as gone).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from moelab.runtime.failures import STACK_DUMP, read_text

GRACE_S = 3.0  # SIGTERM -> SIGKILL
TORCHRUN_PID = "pid_torchrun"


def rank_pids_by_rank(side: Path) -> dict[int, int]:
    """``{rank: pid}`` of every rank that has started (its ``pid_rank{r}`` file)."""
    return {int(p.name[len("pid_rank"):]): int(p.read_text()) for p in side.glob("pid_rank*")}


def rank_pids(side: Path) -> list[int]:
    return list(rank_pids_by_rank(side).values())


def signal_groups(groups: list[int], sig: int) -> None:
    for g in groups:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill(proc: subprocess.Popen, side: Path) -> None:
    """The launcher's stop: torchrun's group (the guard's, ``proc``) and every rank's group, :func:`stop`."""
    stop(proc, side, [proc.pid], [proc.pid])


def stop(proc: subprocess.Popen, side: Path, term_groups: list[int], kill_groups: list[int]) -> None:
    """SIGTERM ``term_groups`` and every rank's group; after ``GRACE_S`` SIGKILL ``kill_groups``, every rank's
    group (one that started meanwhile too) and ``proc``; reap ``proc`` and wait until torchrun and every rank
    are gone. The guard is in the group it SIGTERMs, so it SIGKILLs only the others."""
    signal_groups([*term_groups, *rank_pids(side)], signal.SIGTERM)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    ranks = rank_pids(side)
    signal_groups([*kill_groups, *ranks], signal.SIGKILL)
    proc.kill()
    proc.wait()
    pids = [*ranks, *torchrun_pid(side)]
    end = time.monotonic() + GRACE_S
    while any(alive(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.02)


def torchrun_pid(side: Path) -> list[int]:
    path = side / TORCHRUN_PID
    return [int(path.read_text())] if path.exists() else []


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, waiting for its reaper) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


DUMP_WAIT_S = 30.0  # at most this long for a live rank's dump: a loaded host may take seconds to answer SIGUSR1
DUMP_SETTLE_S = 1.0  # a dump that has no end to wait for is complete once its file has not grown for this long
# the last frame faulthandler writes for a rank: the main thread's block comes last and its outermost frame is
# runpy's (torchrun starts every rank with ``python -m``), so a dump that holds it is complete
DUMP_END = re.compile(r"^  File .*, line \d+ in _run_module_as_main\n", re.M)
_TRUNCATED = re.compile(r"^ *\.\.\.\n\Z", re.M)  # faulthandler's "..." past 100 frames or threads: no end frame


def _has_dump_end(pid: int) -> bool:
    """The process was started with ``python -m`` (every rank is), so its dump ends with :data:`DUMP_END`."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:]
    except OSError:
        return False
    for a in args:  # the interpreter's options, up to the script, -c or -m (torchrun: python -u -m MODULE)
        if a in (b"-m", b"-c") or not a.startswith(b"-"):
            return a == b"-m"
    return False


def dump_complete(text: str) -> bool:
    """The rank's latest stack dump in ``text`` (its stderr) has been written to its end."""
    starts = [m.start() for m in STACK_DUMP.finditer(text)]
    return bool(starts) and DUMP_END.search(text, starts[-1]) is not None


def dump_stacks(side: Path, wait_s: float = DUMP_WAIT_S) -> None:
    """SIGUSR1 every rank (each dumps its stacks into ``logs/rank{r}.stderr``), then wait until every
    live rank's dump is there and complete, at most ``wait_s``: complete once it holds its last frame
    (:data:`DUMP_END`), or, for a dump that has none (a process not started with ``-m``, a truncated dump),
    once its file has stopped growing for :data:`DUMP_SETTLE_S`.
    A fixed pause lost the dumps of a busy host, and a dump read while still being written lost its frames;
    the bound is only reached by a rank that is alive but never answers (stopped, or stuck in the kernel)."""
    logs = side.parent / "logs"
    waiting, has_end = {}, {}
    for rank, pid in rank_pids_by_rank(side).items():
        has_end[pid] = _has_dump_end(pid)
        try:
            os.kill(pid, signal.SIGUSR1)
            waiting[pid] = logs / f"rank{rank}.stderr"
        except ProcessLookupError:
            pass
    end = time.monotonic() + wait_s
    seen: dict = {}  # pid -> (size of its dump file, when that size was first seen)
    while waiting and time.monotonic() < end:
        time.sleep(0.05)
        now = time.monotonic()
        for pid, f in list(waiting.items()):
            text = read_text(f)
            if not alive(pid) or dump_complete(text):
                del waiting[pid]
            elif STACK_DUMP.search(text) and (not has_end[pid] or _TRUNCATED.search(text)):
                size, since = seen.get(pid, (-1, now))
                if size != len(text):
                    seen[pid] = (len(text), now)
                elif now - since >= DUMP_SETTLE_S:
                    del waiting[pid]
