"""Export a figure: an HTML page that loads one shared plotly.js, and PNG/SVG/PDF through kaleido when a
Chromium exists.

**One plotly.js per folder tree.** A figure's ``<stem>.html`` holds the figure as JSON and a relative
``<script src>`` to ``assets/plotly-<version>.min.js``, copied once from the installed plotly package
(:func:`shared_plotlyjs`): the first copy found in the figure's folder or up to three folders above it, else
a new one in the nearest folder named ``figures`` (``figures/assets/``), else beside the figure. ``moelab
reproduce`` writes ``<out>/assets/`` before any notebook runs, so a report holds one copy. A page moved away
from its ``assets/`` says so instead of drawing nothing; ``plotlyjs="inline"`` writes a page that needs
nothing else (4.8 MB each).

**Images.** kaleido 1.x renders with a Chrome/Chromium it does not ship. Without one the HTML is still
written and a single warning (:data:`NO_CHROMIUM`) says what was skipped and how to get it, so a headless
batch run without Chromium degrades instead of failing. :func:`image_session` keeps one Chromium open for
many exports (starting one costs seconds; :mod:`moelab.viz.chromium` keeps its page loaded between images and
runs it at the lowest CPU priority); :func:`export_images` renders a batch of figures in it.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from html import escape
from pathlib import Path

from moelab.runtime.results import atomic_write_bytes, atomic_write_text
from moelab.viz.chromium import Chromium

_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
ASSETS = "assets"
IMAGE_FORMATS = ("png", "svg")  # what ``moelab reproduce`` writes of every figure
IMAGE_WIDTH, IMAGE_HEIGHT = 1200, 600  # an image's size when the figure sets none: labels wrap for 1,200 px
NO_CHROMIUM = ("no Chromium found (apt install chromium, or set BROWSER_PATH to a Chrome/Chromium; "
               "plotly_get_chrome downloads one)")
_warned = False
_chromium = None  # the renderer of this process (moelab.viz.chromium.Chromium), opened on first use
_DATA = re.compile(r'<script type="application/json" id="fig-data">(.*?)</script>', re.S)


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


# ---- plotly.js, once ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def plotlyjs_name() -> str:
    """``plotly-<plotly.js version>.min.js``: a versioned name, so figures of two plotly versions never share
    a file that fits only one of them."""
    from plotly.offline import get_plotlyjs_version

    return f"plotly-{get_plotlyjs_version()}.min.js"


def plotlyjs_source() -> Path:
    """The installed plotly package's own ``plotly.min.js`` (offline: nothing is downloaded)."""
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def write_plotlyjs(assets: str | Path) -> Path:
    """``assets/plotly-<version>.min.js``, copied from the plotly package unless an intact copy is there."""
    src, dst = plotlyjs_source(), Path(assets) / plotlyjs_name()
    if not (dst.is_file() and dst.stat().st_size == src.stat().st_size):
        atomic_write_bytes(dst, src.read_bytes())
    return dst


def shared_plotlyjs(folder: str | Path) -> Path:
    """The one plotly.js that a figure written into ``folder`` loads (see the module doc), written if needed."""
    folder = Path(folder).resolve()
    up = [folder, *folder.parents][:4]
    for d in up:
        if (d / ASSETS / plotlyjs_name()).is_file():
            return d / ASSETS / plotlyjs_name()
    home = next((d for d in up[:3] if d.name == "figures"), folder)
    return write_plotlyjs(home / ASSETS)


# ---- the HTML page -------------------------------------------------------------------------------------
def figure_json(fig) -> str:
    """The figure as JSON safe inside a ``<script>`` (plotly escapes ``<``, ``>`` and ``/``)."""
    text = fig if isinstance(fig, str) else (json.dumps(fig) if isinstance(fig, dict) else fig.to_json())
    return text.replace("</", "<\\/")


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width,initial-scale=1">
<style>html,body{{margin:0;height:100%}}#fig{{width:100%;height:100%}}
.missing{{font:15px/1.5 system-ui,sans-serif;padding:24px;color:#9c2a00}}</style>
{script}</head><body><div id="fig" class="moelab-figure"></div>
<script type="application/json" id="fig-data">{data}</script>
<script>(function () {{
  var f = JSON.parse(document.getElementById("fig-data").textContent), el = document.getElementById("fig");
  if (typeof Plotly === "undefined") {{
    el.className = "missing";
    el.textContent = "This figure needs {need}, which is not beside it: keep the figure in its report " +
      "folder, or export a section as one file (moelab report PAPER --single-file out.html).";
    return;
  }}
  Plotly.newPlot(el, f.data, f.layout || {{}}, Object.assign({{responsive: true}}, f.config || {{}}));
}})();</script>
</body></html>
"""


def figure_page(fig, *, plotlyjs: str, title: str = "figure") -> str:
    """A page drawing ``fig`` (a figure, its dict or its JSON); ``plotlyjs`` is the relative URL of plotly.js,
    or ``"inline"`` to put plotly.js itself in the page."""
    if plotlyjs == "inline":
        script = f"<script>{plotlyjs_source().read_text(encoding='utf-8')}</script>"
        need = "plotly.js"
    else:
        script = f'<script src="{escape(plotlyjs)}" charset="utf-8"></script>'
        need = escape(plotlyjs).replace('"', "")
    return _PAGE.format(title=escape(title), script=script, data=figure_json(fig), need=need)


def _title(fig) -> str:
    text = getattr(getattr(fig.layout, "title", None), "text", None) or "figure"
    return re.sub(r"<[^>]+>", " ", text.split("<br>")[0]).strip() or "figure"


def write_figure_html(fig, path: str | Path, *, plotlyjs: str = "shared") -> Path:
    """Write ``path`` (an ``.html``): the figure and a link to the shared plotly.js (``"shared"``), or plotly.js
    inlined (``"inline"``)."""
    path = Path(path)
    if plotlyjs == "shared":
        path.parent.mkdir(parents=True, exist_ok=True)
        plotlyjs = os.path.relpath(shared_plotlyjs(path.parent), path.parent.resolve()).replace(os.sep, "/")
    return atomic_write_text(path, figure_page(fig, plotlyjs=plotlyjs, title=_title(fig)))


def read_figure(path: str | Path) -> dict | None:
    """The figure (a dict: data, layout, config) in a page :func:`write_figure_html` wrote; None for another
    page (e.g. plotly's own ``to_html``)."""
    try:
        m = _DATA.search(Path(path).read_text(encoding="utf-8", errors="replace"))
        return json.loads(m[1]) if m else None
    except (OSError, ValueError):
        return None


# ---- images --------------------------------------------------------------------------------------------
def _warn_no_chromium(what: str) -> None:
    global _warned
    if not _warned:
        warnings.warn(f"{what} export skipped: {NO_CHROMIUM}; HTML written", RuntimeWarning, stacklevel=3)
        _warned = True


def _renderer():
    """The process's :class:`moelab.viz.chromium.Chromium` (one browser for every image until closed), started
    if none is open."""
    global _chromium
    if _chromium is None:
        import atexit

        _chromium = Chromium()
        atexit.register(_close_renderer)  # no browser outlives the process
    return _chromium


def renderer_cpu_s() -> float:
    """The CPU seconds this process's Chromium has used on images so far (0.0 when none is open)."""
    return _chromium.cpu_s() if _chromium is not None else 0.0


def _close_renderer() -> None:
    global _chromium
    if _chromium is not None:
        _chromium.close()
        _chromium = None


@contextmanager
def image_session():
    """One Chromium for every image exported inside, closed at the end (unless it was open before); yields
    False, and opens nothing, when there is no Chromium. Outside a session the first export opens one that
    stays open until the process ends (a notebook exporting figure after figure)."""
    browser = find_chromium()
    if browser is None:
        yield False
        return
    os.environ.setdefault("BROWSER_PATH", browser)  # where kaleido looks first
    opened = _chromium is None
    try:
        yield True
    finally:
        if opened:
            _close_renderer()


def smaller_png(data: bytes) -> bytes:
    """The same PNG, its pixel data deflated again at zlib level 6 (Chromium writes it fast): a fifth
    smaller for a plot, losslessly. Anything that is not a plain PNG comes back as it was."""
    import struct
    import zlib

    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return data
    chunks, pos = [], 8
    try:
        while pos < len(data):
            (n,) = struct.unpack(">I", data[pos:pos + 4])
            chunks.append((data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]))
            pos += 12 + n
        packed = zlib.compress(zlib.decompress(b"".join(b for t, b in chunks if t == b"IDAT")), 6)
    except (struct.error, zlib.error):
        return data
    out, first = [data[:8]], True
    for typ, body in chunks:
        if typ == b"IDAT":
            if not first:
                continue
            body, first = packed, False
        out.append(struct.pack(">I", len(body)) + typ + body + struct.pack(">I", zlib.crc32(typ + body)))
    small = b"".join(out)
    return small if len(small) < len(data) else data


def _as_dict(fig) -> dict:
    if isinstance(fig, dict):
        return fig
    return json.loads(fig.to_json())  # plain JSON (typed arrays as plotly.js reads them)


def export_images(jobs, formats=IMAGE_FORMATS) -> list[Path]:
    """Render each ``(figure or its dict, path_stem)`` of ``jobs`` to ``<stem>.<fmt>`` for every format, in one
    Chromium; return the files written. Sized as the figure's layout says, else
    :data:`IMAGE_WIDTH` x :data:`IMAGE_HEIGHT`. A figure that fails to render is warned about, not fatal."""
    jobs = list(jobs)
    if not jobs or not formats:
        return []
    if find_chromium() is None:
        _warn_no_chromium("/".join(formats).upper())
        return []
    if _chromium is not None and _chromium.broken:  # it stopped answering: the HTML is written, no images
        return []
    specs, final = [], []
    for fig, stem in jobs:
        d = _as_dict(fig)
        lay = d.get("layout") or {}
        for fmt in formats:
            part = Path(f"{stem}.{fmt}.part")
            specs.append({"fig": d, "path": part, "opts": {
                "format": fmt, "width": lay.get("width") or IMAGE_WIDTH, "height": lay.get("height") or IMAGE_HEIGHT}})
            final.append((part, Path(f"{stem}.{fmt}")))
    os.environ.setdefault("BROWSER_PATH", find_chromium())  # where kaleido looks first
    errors = _renderer().render(specs, timeout=120 + 10 * len(specs))
    written = []
    for part, path in final:
        if part.is_file() and part.stat().st_size:
            if path.suffix == ".png":
                part.write_bytes(smaller_png(part.read_bytes()))
            os.replace(part, path)
            written.append(path)
        else:
            part.unlink(missing_ok=True)
    if errors or len(written) < len(final):
        missing = [p.name for _, p in final if p not in written]
        warnings.warn(f"image export failed for {', '.join(missing)}: {'; '.join(map(str, errors))[:300]}",
                      RuntimeWarning, stacklevel=2)
    return written


def export_figure(fig, path_stem: str | Path, formats=("html", "png"), *, plotlyjs: str = "shared") -> list[Path]:
    """Write ``<path_stem>.html`` (loading the shared plotly.js, see the module doc; ``plotlyjs="inline"``: a
    page that needs nothing else) and each image format asked for; return the paths."""
    stem = Path(path_stem)
    written = [write_figure_html(fig, f"{stem}.html", plotlyjs=plotlyjs)]
    images = [f for f in formats if f != "html"]
    if images:
        written += export_images([(fig, stem)], images)
    return written
