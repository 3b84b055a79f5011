"""dump_stacks (what a timed-out run reports): it waits for each live rank's stack dump, not a fixed pause,
and never longer than its bound. Plain child processes stand in for ranks (no torch)."""
from __future__ import annotations

import subprocess
import sys
import time

from moelab.runtime.processes import DUMP_SETTLE_S, dump_complete, dump_stacks

CHILD = """
import os, signal, sys, time
from pathlib import Path
side, log, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
def slow_dump(*_):
    time.sleep(1.0)  # a loaded host: the dump comes a second after the signal
    log.write_text("Thread 0x00007f (most recent call first):\\n  File fake.py, line 1 in hang\\n"
                   '  File "<frozen runpy>", line 198 in _run_module_as_main\\n')
def chunked_dump(*_):  # the header first, the frames a moment later (faulthandler writes as it walks)
    with open(log, "a", buffering=1) as f:
        f.write("Thread 0x00007f (most recent call first):\\n")
        f.flush()
        time.sleep(0.1)
        f.write("  File fake.py, line 1 in hang\\n")
        f.write('  File "<frozen runpy>", line 198 in _run_module_as_main\\n')
def stalled_dump(*_):  # faulthandler's real end (the main thread's runpy frame), after a stall of 2 settle times
    with open(log, "a", buffering=1) as f:
        f.write("Thread 0x00007f (most recent call first):\\n  File fake.py, line 1 in hang\\n\\n")
        f.write("Current thread 0x00007e (most recent call first):\\n  File fake.py, line 2 in main\\n")
        f.flush()
        time.sleep(2 * float(sys.argv[4]))  # descheduled mid-dump on a loaded host
        f.write('  File "<frozen runpy>", line 198 in _run_module_as_main\\n')
handlers = {"slow": slow_dump, "chunked": chunked_dump, "stalled": stalled_dump}
signal.signal(signal.SIGUSR1, handlers.get(mode, signal.SIG_IGN))
(side / "pid.tmp").write_text(str(os.getpid()))
os.replace(side / "pid.tmp", side / "pid_rank0")  # whole, after the handler, as the launcher's ranks do
time.sleep(60)
"""


def _rank(tmp_path, mode):
    side, logs = tmp_path / "side", tmp_path / "logs"
    side.mkdir()
    logs.mkdir()
    (tmp_path / "stand_in_rank.py").write_text(CHILD)  # run with -m, as torchrun runs a rank
    proc = subprocess.Popen([sys.executable, "-u", "-m", "stand_in_rank", str(side), str(logs / "rank0.stderr"),
                             mode, str(DUMP_SETTLE_S)], cwd=tmp_path)
    end = time.monotonic() + 120  # a loaded host may take long to start Python; the wait ends with the pid file
    while not (side / "pid_rank0").exists():
        assert time.monotonic() < end and proc.poll() is None, "the stand-in rank did not start"
        time.sleep(0.02)
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


def test_a_dump_stalled_mid_write_is_waited_for_until_its_last_frame(tmp_path):
    proc, side, log = _rank(tmp_path, "stalled")
    try:
        dump_stacks(side, wait_s=60)
        assert dump_complete(log.read_text()) and "_run_module_as_main" in log.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_a_dump_is_complete_at_the_main_threads_runpy_frame():
    head = "Thread 0x1 (most recent call first):\n  File \"w.py\", line 3 in run\n\n"
    main = "Current thread 0x2 (most recent call first):\n  File \"w.py\", line 9 in main\n"
    end = '  File "<frozen runpy>", line 198 in _run_module_as_main\n'
    assert not dump_complete("") and not dump_complete(head) and not dump_complete(head + main)
    assert dump_complete(head + main + end) and dump_complete("earlier output\n" + head + main + end + "later\n")
    assert not dump_complete(end + head)  # the frame must be in the latest dump
