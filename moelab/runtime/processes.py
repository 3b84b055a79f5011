"""A run's processes seen from outside: torchrun and every rank, each in a process group of its own.

Each rank records its pid in the launch's side folder (``pid_rank{r}``) and the guard records
torchrun's (``pid_torchrun``); the launcher (:mod:`moelab.runtime.launch`) and the guard
(:mod:`moelab.runtime.guard`) stop them from these files: SIGTERM to every group, SIGKILL after
``GRACE_S``, then wait until every pid is gone (a zombie counts as gone).
"""
from __future__ import annotations

import os
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


DUMP_WAIT_S = 5.0  # a loaded host may take seconds to answer SIGUSR1
DUMP_SETTLE_S = 0.2  # a dump whose file has not grown for this long is complete


def dump_stacks(side: Path, wait_s: float = DUMP_WAIT_S) -> None:
    """SIGUSR1 every rank (each dumps its stacks into ``logs/rank{r}.stderr``), then wait until every
    live rank's dump is there and complete (its file has stopped growing for :data:`DUMP_SETTLE_S`), at most
    ``wait_s``: a fixed pause lost the dumps of a busy host, and a dump read while still being written lost
    its frames."""
    logs = side.parent / "logs"
    waiting = {}
    for rank, pid in rank_pids_by_rank(side).items():
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
            if not alive(pid):
                del waiting[pid]
            elif STACK_DUMP.search(text):
                size, since = seen.get(pid, (-1, now))
                if size != len(text):
                    seen[pid] = (len(text), now)
                elif now - since >= DUMP_SETTLE_S:
                    del waiting[pid]
