"""dump_stacks (what a timed-out run reports): it waits for each live rank's stack dump, not a fixed pause,
and never longer than its bound. Plain child processes stand in for ranks (no torch)."""
from __future__ import annotations

import subprocess
import sys
import time

from moelab.runtime.processes import dump_stacks

CHILD = """
import os, signal, sys, time
from pathlib import Path
side, log, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
def slow_dump(*_):
    time.sleep(1.0)  # a loaded host: the dump comes a second after the signal
    log.write_text("Thread 0x00007f (most recent call first):\\n  File fake.py, line 1 in hang\\n")
def chunked_dump(*_):  # the header first, the frames a moment later (faulthandler writes as it walks)
    with open(log, "a", buffering=1) as f:
        f.write("Thread 0x00007f (most recent call first):\\n")
        f.flush()
        time.sleep(0.1)
        f.write("  File fake.py, line 1 in hang\\n")
handlers = {"slow": slow_dump, "chunked": chunked_dump}
signal.signal(signal.SIGUSR1, handlers.get(mode, signal.SIG_IGN))
(side / "pid_rank0").write_text(str(os.getpid()))
time.sleep(60)
"""


def _rank(tmp_path, mode):
    side, logs = tmp_path / "side", tmp_path / "logs"
    side.mkdir()
    logs.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(side), str(logs / "rank0.stderr"), mode])
    end = time.monotonic() + 30
    while not (side / "pid_rank0").exists() and time.monotonic() < end:
        time.sleep(0.02)
    time.sleep(0.1)  # the pid is written after the handler is installed, and the write is not atomic
    return proc, side, logs / "rank0.stderr"


def test_waits_for_a_rank_that_dumps_late(tmp_path):
    proc, side, log = _rank(tmp_path, "slow")
    try:
        t0 = time.monotonic()
        dump_stacks(side, wait_s=20)
        assert log.is_file() and "Thread 0x" in log.read_text()
        assert time.monotonic() - t0 < 20
    finally:
        proc.kill()
        proc.wait()


def test_a_rank_that_never_dumps_costs_the_bound_and_a_dead_one_nothing(tmp_path):
    proc, side, log = _rank(tmp_path, "ignore")
    try:
        t0 = time.monotonic()
        dump_stacks(side, wait_s=1.0)
        assert 1.0 <= time.monotonic() - t0 < 10 and not log.exists()
    finally:
        proc.kill()
        proc.wait()
    t0 = time.monotonic()
    dump_stacks(side, wait_s=30)  # its pid file is still there; the process is gone
    assert time.monotonic() - t0 < 5


def test_a_dump_is_read_whole_not_while_it_is_written(tmp_path):
    proc, side, log = _rank(tmp_path, "chunked")
    try:
        dump_stacks(side, wait_s=20)
        assert "in hang" in log.read_text()  # the frames after the header arrived before dump_stacks returned
    finally:
        proc.kill()
        proc.wait()
