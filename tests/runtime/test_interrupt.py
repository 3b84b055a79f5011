"""Stopping a run from outside: Ctrl-C (a notebook's stop button), the launching process killed, a Jupyter
kernel interrupted or restarted mid-run. Every rank goes within seconds, no half-written folder stays."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moelab.runtime.launch import RunInterrupted, launch
from tests.fake_worker import leftover_processes, ranks_started, use_fake_worker, wait_for

pytest.importorskip("psutil")
pytestmark = pytest.mark.timing  # wall-clock assertions: run alone (scripts/test.sh)
TINY = {"train": {"iters": 4}}
STOP_S = 10  # "within a few seconds": SIGTERM, a 3 s grace, SIGKILL, with room for a loaded machine


def _clean(root: Path, kernel=None) -> bool:
    """No process of the run (the kernel itself, a child of this test, excepted) and nothing in ``root``."""
    pids = {kernel.provisioner.process.pid} if kernel is not None and kernel.has_kernel else set()
    return not [p for p in leftover_processes(str(root)) if p.pid not in pids] and not any(root.iterdir())


@pytest.mark.timeout(90)
def test_ctrl_c_stops_every_rank_and_says_so_in_one_line(tmp_path, monkeypatch):
    worker = use_fake_worker(monkeypatch)
    monkeypatch.setenv("MOELAB_FAKE_HANG_RANK", "1")  # the run would go on for an hour
    sent = {}

    def interrupt():
        wait_for(lambda: ranks_started(tmp_path), 60, "the ranks to start")
        sent["t"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(RunInterrupted) as info:
        launch(TINY, 2, out_root=tmp_path, worker=worker, progress=False, timeout=300)
    assert time.monotonic() - sent["t"] < STOP_S
    msg = str(info.value)
    assert ("\n" not in msg and msg.startswith("moelab: run ")
            and "interrupted: all 2 ranks stopped, nothing stored" in msg)
    assert info.value._render_traceback_() == [msg]  # what a notebook shows: the line, no launcher frames
    assert isinstance(info.value, KeyboardInterrupt)  # scripts and papermill still see an interrupt
    assert _clean(tmp_path)


_LAUNCHER = """
import sys
from moelab.runtime.launch import launch
launch({"train": {"iters": 4}}, 2, out_root=sys.argv[1], worker="tests.fake_worker", progress=False, timeout=300)
"""


@pytest.mark.timeout(90)
def test_killed_launcher_leaves_no_rank_and_no_folder(tmp_path, monkeypatch):
    """kill -9 of the launching process (a kernel that dies hard): the guard cleans up after it."""
    use_fake_worker(monkeypatch)
    monkeypatch.setenv("MOELAB_FAKE_HANG_RANK", "1")
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path)])
    try:
        wait_for(lambda: ranks_started(tmp_path), 60, "the ranks to start")
        assert leftover_processes(str(tmp_path))  # the run is really going
        proc.kill()
        proc.wait()
        wait_for(lambda: _clean(tmp_path), STOP_S, "every rank and the temp folder to go")
    finally:
        proc.kill()


# ---- the same through a real Jupyter kernel ---------------------------------------------------------------
_CELL = """
from moelab.runtime.launch import launch
launch({{"train": {{"iters": 4}}}}, 2, out_root={root!r}, worker="tests.fake_worker", timeout=300)
"""


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    jupyter_client = pytest.importorskip("jupyter_client")
    use_fake_worker(monkeypatch)
    monkeypatch.setenv("MOELAB_FAKE_HANG_RANK", "1")
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")})
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    root = tmp_path / "runs"
    root.mkdir()
    yield km, kc, root
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def _outputs_until_idle(kc, msg_id: str, timeout: float) -> str:
    text = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        msg = kc.get_iopub_msg(timeout=max(end - time.monotonic(), 0.1))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        c = msg["content"]
        if msg["msg_type"] == "stream":
            text.append(c["text"])
        elif msg["msg_type"] == "error":
            text.append("\n".join(c["traceback"]))
        elif msg["msg_type"] == "status" and c["execution_state"] == "idle":
            return "".join(text)
    raise AssertionError("the cell did not finish")


@pytest.mark.timeout(120)
def test_kernel_interrupt_stops_the_run(kernel):
    km, kc, root = kernel
    msg_id = kc.execute(_CELL.format(root=str(root)))
    wait_for(lambda: ranks_started(root), 60, "the ranks to start")
    t = time.monotonic()
    km.interrupt_kernel()  # the stop button
    shown = _outputs_until_idle(kc, msg_id, 30)
    assert time.monotonic() - t < STOP_S
    assert "interrupted: all 2 ranks stopped, nothing stored" in shown
    assert "_run(" not in shown and "Traceback" not in shown  # one line, not the launcher's frames
    assert _clean(root, km)


@pytest.mark.timeout(120)
def test_kernel_restart_mid_run_stops_the_run(kernel):
    km, kc, root = kernel
    kc.execute(_CELL.format(root=str(root)))
    wait_for(lambda: ranks_started(root), 60, "the ranks to start")
    km.restart_kernel(now=False)  # what the browser's "restart kernel" does: ask, then kill
    wait_for(lambda: _clean(root, km), STOP_S + 10, "every rank and the temp folder to go")  # + the kernel's own grace
