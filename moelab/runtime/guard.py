"""The launcher's watchdog: torchrun and every rank go, and the half-written folder with them, when the
process that called :func:`moelab.launch` dies without cleaning up (a Jupyter kernel restarted or
killed mid-run, ``kill -9`` of a script).

The launcher starts ``python -m moelab.runtime.guard PARENT_PID SIDE TMP -- torchrun ...`` in a session
of its own; the guard runs torchrun in its own process group and exits with torchrun's exit code. If
its parent disappears first (``os.getppid()`` changes), it stops torchrun and each rank (SIGTERM,
then SIGKILL after a grace period) and deletes ``TMP``. A live launcher does its own cleanup
(:func:`moelab.runtime.processes.kill` signals the guard's group, which holds torchrun), so the guard
only acts for a dead one.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from moelab.runtime.processes import TORCHRUN_PID, stop
from moelab.runtime.results import atomic_write_text

POLL_S = 0.2


def _orphaned(parent: int) -> bool:
    return os.getppid() != parent


def _stop_everything(proc: subprocess.Popen, side: Path) -> None:
    """Stop torchrun (our group) and every rank (their own groups), as the launcher's
    :func:`moelab.runtime.processes.kill` would."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # our own group gets the SIGTERM too
    stop(proc, side, [os.getpgrp()], [])


def main(argv: list[str]) -> int:
    parent, side, tmp = int(argv[0]), Path(argv[1]), Path(argv[2])
    command = argv[argv.index("--") + 1:]
    if _orphaned(parent):  # the launcher died before we even started
        shutil.rmtree(tmp, ignore_errors=True)
        return 1
    proc = subprocess.Popen(command)  # inherits our stdout (the launcher's pipe), stderr and group
    atomic_write_text(side / TORCHRUN_PID, str(proc.pid))  # the launcher's kill() waits for it to be gone
    while proc.poll() is None:
        if _orphaned(parent):
            _stop_everything(proc, side)
            shutil.rmtree(tmp, ignore_errors=True)
            return 1
        time.sleep(POLL_S)
    rc = proc.returncode
    return rc if rc >= 0 else 128 - rc  # killed by a signal: the shell's convention


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
