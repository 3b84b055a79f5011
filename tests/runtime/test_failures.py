"""timed_out (a timed-out run's message): each started rank's stack, and how many ranks had not started at all,
which on a loaded host is start-up outlasting the timeout, not a hang in the worker."""
from __future__ import annotations

from moelab.runtime.failures import timed_out

DUMP = ("Current thread 0x1 (most recent call first):\n  File \"w.py\", line 9 in main\n"
        '  File "<frozen runpy>", line 198 in _run_module_as_main\n')


def _run(tmp_path, started: list[int]):
    side, logs = tmp_path / ".launch", tmp_path / "logs"
    side.mkdir()
    logs.mkdir()
    (logs / "torchrun.stderr").write_text("Sending process 1 closing signal SIGTERM\n")
    for r in started:
        (side / f"pid_rank{r}").write_text(str(1000 + r))
        (logs / f"rank{r}.stderr").write_text(DUMP)
    return logs, side


def test_a_timeout_names_the_ranks_that_had_not_started(tmp_path):
    logs, side = _run(tmp_path, [0])
    e = timed_out("r", 10, logs, side, nproc=2)
    assert "1 of 2 ranks had not started yet" in str(e) and e.rank is None
    assert "--- rank0 ---" in e.traceback_tail and 'w.py", line 9 in main' in e.traceback_tail


def test_a_timeout_after_every_rank_started_shows_each_stack_and_no_start_up_note(tmp_path):
    logs, side = _run(tmp_path, [0, 1])
    e = timed_out("r", 10, logs, side, nproc=2)
    assert "had not started" not in str(e)
    assert "--- rank0 ---" in e.traceback_tail and "--- rank1 ---" in e.traceback_tail
    assert "closing signal" not in e.traceback_tail


def test_no_rank_started_shows_torchruns_tail_and_says_why(tmp_path):
    logs, side = _run(tmp_path, [])
    e = timed_out("r", 10, logs, side, nproc=2)
    assert "2 of 2 ranks had not started yet" in str(e) and "closing signal SIGTERM" in e.traceback_tail
