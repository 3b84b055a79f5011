"""One Chromium for many static images: kaleido's renderer on an event loop of its own, kept open between batches.

Where the time of an export goes (measured on parm's 16 smoke figures, PNG and SVG, 2 cores): starting Chromium
costs about 2 s once; after that kaleido's own server reloads its page, and with it plotly.js (3.6 MB parsed
again), after *every* image, about as long as drawing the image. :class:`Chromium` keeps its tab loaded between
images (plotly.js draws each figure into a fresh element it removes afterwards, so nothing carries over), which
halves an export's CPU time, and runs the browser's processes at the lowest CPU priority (nice 19): exported
beside a running notebook, the images take the cycles the notebook leaves, not the notebook's own.
"""
from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

NICE = 19  # the browser's processes: the lowest CPU priority, below a notebook (and its ranks) it runs beside


def _kaleido_class():
    """kaleido's renderer, its tab kept loaded between images (kaleido reloads it after each one)."""
    import kaleido

    if not hasattr(kaleido.Kaleido, "_return_kaleido_tab"):  # another kaleido: its own behaviour, still correct
        return kaleido.Kaleido

    class WarmKaleido(kaleido.Kaleido):
        async def _return_kaleido_tab(self, tab) -> None:
            if hasattr(getattr(tab, "js_logger", None), "reset"):
                tab.js_logger.reset()  # what the reload also did: the page's console log starts afresh
            await self.tabs_ready.put(tab)

    return WarmKaleido


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``; just ``pid`` elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            ppid = int(text[text.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) that ``pid`` and its living descendants have used (Linux; 0.0 elsewhere)."""
    total = 0.0
    for p in descendants(pid):
        try:
            text = Path(f"/proc/{p}/stat").read_text()
            total += sum(int(x) for x in text[text.rindex(")") + 2:].split()[11:13])
        except (OSError, ValueError, IndexError):
            continue
    return total / os.sysconf("SC_CLK_TCK") if total else 0.0


def lower_priority(pid: int, nice: int = NICE) -> int:
    """Set the niceness of ``pid`` and its descendants to ``nice`` (never raise one's priority); return how many
    processes were changed. Processes they start later inherit it."""
    n = 0
    for p in descendants(pid):
        try:
            if os.getpriority(os.PRIO_PROCESS, p) < nice:
                os.setpriority(os.PRIO_PROCESS, p, nice)
                n += 1
        except OSError:  # gone meanwhile, or not ours
            continue
    return n


class Chromium:
    """kaleido's renderer (one Chromium, one tab) on a daemon thread's event loop: :meth:`render` sends it a
    batch and waits at most ``timeout`` seconds; :meth:`close` ends it. ``broken`` says why it stopped answering
    (a render past its deadline), after which it renders nothing more."""

    def __init__(self, nice: int | None = NICE):
        self.nice = nice
        self.broken: str | None = None
        self._k = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="moelab-chromium", daemon=True)
        self._thread.start()

    def _call(self, coro, timeout: float):
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    async def _open(self) -> None:
        k = _kaleido_class()(n=1, mathjax=False)  # mathjax=False: no CDN, offline
        await k.open()
        self._k = k
        proc = getattr(k, "subprocess", None)
        if self.nice is not None and proc is not None:
            lower_priority(proc.pid, self.nice)

    def render(self, specs: list, timeout: float) -> tuple:
        """kaleido's ``write_fig_from_object`` of ``specs`` (opening the browser first if needed): the errors."""
        if self.broken:
            return (RuntimeError(self.broken),)
        try:
            if self._k is None:
                self._call(self._open(), timeout)
            return tuple(self._call(self._k.write_fig_from_object(specs), timeout) or ())
        except TimeoutError:
            self.broken = f"Chromium did not render {len(specs)} image(s) in {timeout:.0f} s"
            return (TimeoutError(self.broken),)
        except Exception as e:  # noqa: BLE001 - reported by the caller with the figures it concerns
            return (e,)

    def cpu_s(self) -> float:
        """The CPU seconds the browser's processes have used so far (0.0 before it opens)."""
        proc = getattr(self._k, "subprocess", None)
        return cpu_seconds(proc.pid) if proc is not None else 0.0

    @property
    def is_open(self) -> bool:
        return self._k is not None

    def close(self, timeout: float = 30.0) -> None:
        """Close the browser (kill it if it stopped answering) and stop the loop."""
        try:
            if self._k is not None and not self.broken:
                self._call(self._k.close(), timeout)
            elif self._k is not None and getattr(self._k, "subprocess", None) is not None:
                self._k.subprocess.kill()  # it stopped answering: its children end with it
        except Exception:  # noqa: BLE001 - closing is best effort; the daemon thread ends with the process
            pass
        finally:
            self._k = None
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
