"""What a failed run says: the exceptions the launcher raises, and how it reads them from what the ranks left.

Each rank's stderr is ``logs/rank{r}.stderr`` (SIGUSR1 dumps its stacks there), each recorded exception
``failure_rank{r}.json`` in the side folder (with a precise time), and torchrun's own report
``logs/torchrun.stderr``: :func:`failure` names the rank that failed first, :func:`timed_out` shows
every rank's stack.
"""
from __future__ import annotations

import json
import re
import signal
from pathlib import Path

TAIL_LINES = 25  # lines of a traceback shown in a RunFailed message
_LAUNCH_FILE = str(Path(__file__).with_name("launch.py"))  # the per-rank entry's frames are not the rank's
STACK_DUMP = re.compile(r"^(Current thread|Thread) 0x", re.M)  # where faulthandler's dump of a rank begins


class RunFailed(RuntimeError):
    """A run that did not complete; ``rank`` is the rank that failed first (None if unknown)."""

    def __init__(self, run_id: str, rank: int | None, traceback_tail: str, what: str = ""):
        self.run_id, self.rank, self.traceback_tail = run_id, rank, traceback_tail
        what = what or (f"failed on rank {rank}" if rank is not None else "failed")
        super().__init__(f"run {run_id} {what}:\n{traceback_tail}")

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of the launcher's frames: what failed, and the rank's own traceback."""
        return [f"\x1b[31m{type(self).__name__}\x1b[0m: {line}" if i == 0 else line
                for i, line in enumerate(str(self).splitlines())]


class RunTimeout(RunFailed):
    """The run exceeded its timeout and was killed; ``traceback_tail`` holds each rank's stack."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C, or the notebook's stop button, while a run was going: every rank was stopped and no run
    folder was stored (a checkpointed run keeps its checkpoints). One line, in a notebook too."""

    def __init__(self, run_id: str, nproc: int, kept: Path | None = None):
        self.run_id, self.kept = run_id, kept
        more = f"; checkpoints kept in {kept}: continue with `moelab run --resume {kept}`" if kept else ""
        super().__init__(f"moelab: run {run_id} interrupted: all {nproc} ranks stopped, nothing stored{more}")

    def _render_traceback_(self) -> list[str]:
        return [str(self)]


def tail(text: str, n: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def read_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def stacks(logs: Path) -> str:
    """Each rank's faulthandler dump (innermost frame first), without the launcher's own frames."""
    parts = []
    for p in sorted(logs.glob("rank*.stderr"), key=lambda p: int(p.stem[4:])):
        text = read_text(p)
        m = STACK_DUMP.search(text)
        if m:
            lines = [ln for ln in text[m.start():].splitlines() if "runpy" not in ln and _LAUNCH_FILE not in ln]
        else:  # the rank never got going: show how far it got
            lines = text.splitlines()[-TAIL_LINES:]
        parts.append(f"--- {p.stem} ---\n" + "\n".join(lines[:TAIL_LINES]))
    return "\n".join(parts) or tail(read_text(logs / "torchrun.stderr"))


def records(side: Path) -> dict:
    """Each rank's recorded exception (rank -> {rank, time, traceback})."""
    return {r["rank"]: r for r in (json.loads(p.read_text()) for p in side.glob("failure_rank*.json"))}


def failure(run_id: str, rc: int, logs: Path, side: Path) -> RunFailed:
    """Name the rank that failed first.

    Once one rank is gone the others fail inside their collectives, so the earliest recorded
    exception wins. A rank that died without one (a signal, ``os._exit``) records nothing; torchrun,
    which watches every exit, lists it, and it is blamed first.
    """
    recs = records(side)
    text = read_text(logs / "torchrun.stderr")
    dead = crashed(text, recs)
    if dead is not None:
        rank, code = dead
        how = f"killed by {signal_name(-code)}" if code < 0 else f"exit code {code}"
        return RunFailed(run_id, rank, tail(read_text(logs / f"rank{rank}.stderr") or text),
                         f"failed on rank {rank} ({how}, no Python exception)")
    if recs:
        first = min(recs.values(), key=lambda r: r["time"])
        return RunFailed(run_id, first["rank"], tail(first["traceback"]))
    return RunFailed(run_id, None, tail(text), f"failed (torchrun exit code {rc})")


def crashed(torchrun_stderr: str, records: dict) -> tuple[int, int] | None:
    """(rank, exit code) of a rank in torchrun's failure report that died without a recorded
    exception and not by torchrun's own SIGTERM; torchrun's root cause first."""
    root = torchrun_stderr.find("Root Cause")
    found = []
    for m in re.finditer(r"rank\s*:\s*(\d+)\s*\(local_rank.*?exitcode\s*:\s*(-?\d+)", torchrun_stderr, re.S):
        rank, code = int(m[1]), int(m[2])
        if rank not in records and code != -signal.SIGTERM:
            found.append((0 <= root < m.start(), rank, code))
    return max(found, key=lambda f: f[0])[1:] if found else None


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def timed_out(run_id: str, timeout: float, logs: Path, side: Path, nproc: int | None = None) -> RunTimeout:
    """Every rank's stack at the timeout, after the first exception if a rank raised before the hang; ``nproc``
    (this node's ranks) also names how many had not even started (a loaded host: start-up alone took the time)."""
    first = min(records(side).values(), key=lambda r: r["time"], default=None)
    what = f"timed out after {timeout:g}s and was killed"
    started = len(list(side.glob("pid_rank*")))
    if nproc is not None and started < nproc:
        what += (f"; {nproc - started} of {nproc} ranks had not started yet (still starting Python and torch: "
                 "on a loaded host start-up alone can take that long)")
    if first is None:
        return RunTimeout(run_id, None, stacks(logs), what + "; each rank's stack at the timeout")
    return RunTimeout(run_id, first["rank"], tail(first["traceback"]) + "\n" + stacks(logs),
                      what + f" after rank {first['rank']} raised")
