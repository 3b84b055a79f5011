"""Run one notebook headless: papermill on a ``python3`` kernel, a watchdog that interrupts it at the
deadline (SIGINT, so :func:`moelab.launch` stops its ranks) and kills it ``KILL_GRACE_S`` later, and the
failure's last lines without terminal colours. :mod:`moelab.papers.kit.reproduce` runs the batch."""
from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

KERNEL = "python3"
KILL_GRACE_S = 30.0  # after the timeout's SIGINT, SIGKILL the kernel if it is still running
ERROR_TAIL_LINES = 15
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _watched_kernel_manager_class(holder: dict):
    """An AsyncKernelManager that tells ``holder`` its kernel, so a watchdog can interrupt it."""
    from jupyter_client.manager import AsyncKernelManager

    class WatchedKernelManager(AsyncKernelManager):
        async def start_kernel(self, **kw):
            await super().start_kernel(**kw)
            holder["km"] = self

    return WatchedKernelManager


def _kernel_pid(km) -> int | None:
    prov = getattr(km, "provisioner", None)
    pid = getattr(prov, "pid", None)
    if pid is None and getattr(prov, "process", None) is not None:
        pid = prov.process.pid
    return pid


def _watchdog(holder: dict, timeout: float, done: threading.Event) -> threading.Thread:
    def watch():
        if done.wait(timeout):
            return
        holder["timed_out"] = True
        for sig, grace in ((signal.SIGINT, KILL_GRACE_S), (signal.SIGKILL, None)):
            pid = _kernel_pid(holder.get("km"))
            if pid is not None:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    return
            if grace is None or done.wait(grace):
                return

    t = threading.Thread(target=watch, name="moelab-reproduce-watchdog", daemon=True)
    t.start()
    return t


def _error_tail(exc: BaseException, n: int = ERROR_TAIL_LINES) -> str:
    """The last lines of a failure, without terminal colours."""
    tb = getattr(exc, "traceback", None)
    if isinstance(tb, list):  # papermill's PapermillExecutionError: the kernel's traceback lines
        lines = [ln for ln in _ANSI.sub("", "\n".join(tb)).rstrip().splitlines() if ln.strip()]
        return "\n".join([f"in cell [{getattr(exc, 'exec_count', '?')}]:", *lines[-n:]])
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return "\n".join(_ANSI.sub("", text).rstrip().splitlines()[-n:])


def execute(nb: Path, executed: Path, params: dict, cwd: Path, timeout: float | None = None) -> tuple[str, str]:
    """Run ``nb`` with papermill into ``executed``; return (status, error tail): ``ok``, ``failed`` or
    ``timeout``. Never raises for a failure inside the notebook."""
    import papermill as pm

    holder: dict = {}
    done = threading.Event()
    if timeout:
        _watchdog(holder, timeout, done)
    try:
        pm.execute_notebook(str(nb), str(executed), parameters=params, kernel_name=KERNEL, cwd=str(cwd),
                            progress_bar=False, log_output=False,
                            kernel_manager_class=_watched_kernel_manager_class(holder))
        return "ok", ""
    except Exception as e:  # noqa: BLE001 - any failure of one notebook is recorded, the rest run
        if holder.get("timed_out"):
            return "timeout", f"timed out after {timeout:g} s and was interrupted\n{_error_tail(e)}"
        return "failed", _error_tail(e)
    finally:
        done.set()


def declared_parameters(nb: Path) -> dict:
    """The notebook's ``parameters`` cell: name -> {default, type, help} (papermill's inspection)."""
    try:
        import papermill as pm

        found = pm.inspect_notebook(str(nb))
    except Exception:  # noqa: BLE001 - a notebook papermill cannot inspect still runs (or fails) later
        return {}
    return {k: {"default": v.get("default"), "type": v.get("inferred_type_name"), "help": v.get("help")}
            for k, v in found.items()}
