"""Static images beside a run: the PNG and SVG of every figure recorded into a folder, exported on a thread while
the notebook runs (``moelab reproduce``) or afterwards (``moelab report --images``), in the one Chromium of
:func:`moelab.viz.export.image_session` (:mod:`moelab.viz.chromium`: kept warm, lowest CPU priority)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from moelab.papers.kit.report import _is_plotly_page
from moelab.viz.export import IMAGE_FORMATS, export_images, read_figure, renderer_cpu_s


# ---- images beside a run ------------------------------------------------------------------------
class Images:
    """PNG and SVG of every figure recorded into ``folder`` (its ``<stem>.json`` sidecar, written after the
    page): :meth:`start` exports on a thread while the notebook runs, :meth:`finish` waits for it and exports
    the rest. ``seconds`` is the time spent exporting, ``after_s`` the part after the notebook ended, ``cpu_s``
    the CPU time the browser spent on these images (a number the machine's load does not change much)."""

    def __init__(self, folder: Path, formats=None, poll_s: float = 2.0):
        self.folder, self.formats, self.poll_s = Path(folder), tuple(formats or IMAGE_FORMATS), poll_s
        self.written: list[Path] = []
        self.seconds = self.after_s = self.cpu_s = 0.0
        self._tried: set = set()
        self._stop = None
        self._thread = None

    def pending(self) -> list[tuple[tuple, Path]]:
        """``(missing formats, stem)`` of every recorded figure that lacks an image and was not tried yet."""
        out = []
        for side in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []:
            stem = side.with_suffix("")
            if stem in self._tried or not stem.with_suffix(".html").is_file():
                continue
            try:
                kind = json.loads(side.read_text()).get("kind")
            except (OSError, ValueError):
                continue
            if kind != "figure" and not (kind == "table" and _is_plotly_page(stem.with_suffix(".html"))):
                continue
            missing = tuple(f for f in self.formats if not stem.with_suffix(f".{f}").is_file())
            if missing:
                out.append((missing, stem))
        return out

    def export(self) -> int:
        """One pass: every pending figure, in one Chromium call per set of missing formats."""
        jobs = self.pending()
        if not jobs:
            return 0
        t0, cpu0 = time.monotonic(), renderer_cpu_s()
        by_formats: dict = {}
        for missing, stem in jobs:
            self._tried.add(stem)
            spec = read_figure(stem.with_suffix(".html"))
            if spec is not None:
                by_formats.setdefault(missing, []).append((spec, stem))
        n = 0
        for missing, batch in by_formats.items():
            made = export_images(batch, missing)
            self.written += made
            n += len(made)
        self.seconds += time.monotonic() - t0
        self.cpu_s += max(renderer_cpu_s() - cpu0, 0.0)  # a browser (re)opened here counts from 0
        return n

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.export()
            except Exception:  # noqa: BLE001 - finish() tries again and reports
                pass
            self._stop.wait(self.poll_s)

    def start(self) -> "Images":
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moelab-images", daemon=True)
        self._thread.start()
        return self

    def finish(self) -> "Images":
        t0 = time.monotonic()
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self.export()
        self.after_s = time.monotonic() - t0
        return self
