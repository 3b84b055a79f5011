"""Export a figure: self-contained HTML always; PNG/SVG/PDF through kaleido when a Chromium exists.

kaleido 1.x renders with a Chrome/Chromium it does not ship. Without one the HTML is still
written (it needs nothing but a browser to view) and a single warning says the images were skipped,
so a headless batch run without Chromium degrades instead of failing.
"""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from moelab.runtime.results import atomic_write_bytes, atomic_write_text

_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
_warned = False


def find_chromium() -> str | None:
    """A Chrome/Chromium executable: $BROWSER_PATH, the usual names on PATH, then kaleido's own search."""
    if os.environ.get("BROWSER_PATH") and os.access(os.environ["BROWSER_PATH"], os.X_OK):
        return os.environ["BROWSER_PATH"]
    for name in _BROWSERS:
        if path := shutil.which(name):
            return path
    try:
        from choreographer.browsers.chromium import Chromium

        return Chromium.find_browser(skip_local=False) or None
    except Exception:  # an optional, best-effort search in kaleido's dependency
        return None


def export_figure(fig, path_stem: str | Path, formats=("html", "png")) -> list[Path]:
    """Write ``<path_stem>.html`` (plotly.js inlined) and each image format asked for; return the paths."""
    global _warned
    stem = Path(path_stem)
    written = [atomic_write_text(f"{stem}.html", fig.to_html(include_plotlyjs=True, full_html=True))]
    images = [f for f in formats if f != "html"]
    if not images:
        return written
    browser = find_chromium()
    if browser is None:
        if not _warned:
            what = "/".join(images).upper()
            warnings.warn(f"{what} export skipped: no Chromium found; HTML written", RuntimeWarning, stacklevel=2)
            _warned = True
        return written
    os.environ.setdefault("BROWSER_PATH", browser)  # where kaleido looks first
    for fmt in images:
        written.append(atomic_write_bytes(f"{stem}.{fmt}", fig.to_image(format=fmt)))
    return written
