"""Checks that a figure reads: every series its own colour, titles and labels that fit the width.

Used by ``tests/viz/test_figures_read.py`` (every registered product's figure at smoke) and by the notebook and
report tests (the figures a run exported). A figure is a plotly figure, its dict or its JSON.
"""
from __future__ import annotations

import json
import re

from plotly.colors import qualitative

SKIP_TYPES = {"heatmap", "table", "surface", "contour", "histogram2d", "histogram2dcontour", "image", "sankey",
              "parcoords", "parcats", "sunburst", "treemap", "icicle", "pie", "funnelarea", "indicator", "choropleth",
              "densitymapbox", "splom"}
_HEX = re.compile(r"^#([0-9a-f]{3}|[0-9a-f]{6})$")
_RGB = re.compile(r"^rgba?\(([^)]*)\)$")


def as_dict(fig) -> dict:
    if isinstance(fig, dict):
        return fig
    if isinstance(fig, str):
        return json.loads(fig)
    return json.loads(fig.to_json())


def colour_key(c) -> object:
    """A colour as one comparable value: hex and rgb() of the same colour are equal; None for no single colour
    (a list of per-point colours, a colour scale)."""
    if not isinstance(c, str):
        return None
    c = c.strip().lower().replace(" ", "")
    if m := _HEX.match(c):
        h = m[1] if len(m[1]) == 6 else "".join(ch * 2 for ch in m[1])
        return tuple(int(h[i:i + 2], 16) for i in (0, 2, 4)) + (1.0,)
    if m := _RGB.match(c):
        parts = [float(x) for x in m[1].split(",")]
        return tuple(parts[:3]) + ((parts[3],) if len(parts) > 3 else (1.0,))
    return c


def _colourway(d: dict) -> list:
    lay = d.get("layout") or {}
    template = (lay.get("template") or {}).get("layout") or {}
    return lay.get("colorway") or template.get("colorway") or qualitative.Plotly


def trace_colour(trace: dict, index: int, colourway: list):
    """The colour a trace is drawn in: its line or marker colour, else plotly's default (the colourway by the
    trace's index); None for a trace without one series colour."""
    kind = trace.get("type", "scatter")
    if kind in SKIP_TYPES:
        return None
    line, marker = trace.get("line") or {}, trace.get("marker") or {}
    lines = kind in ("scatter", "scattergl", "scatterpolar") and "lines" in (trace.get("mode") or "lines")
    for c in ((line.get("color"), marker.get("color")) if lines else (marker.get("color"), line.get("color"))):
        if c is not None:
            return colour_key(c)
    if trace.get("fillcolor"):
        return colour_key(trace["fillcolor"])
    if "color" in marker or "color" in line:  # an explicit array or scale
        return None
    return colour_key(colourway[index % len(colourway)])


def system_of(trace: dict) -> str | None:
    """What series a trace draws: its legend group, else its name; None for an unnamed helper (a reference line)."""
    return trace.get("legendgroup") or trace.get("name") or None


def shared_colours(fig) -> list[str]:
    """Colours that two traces of different systems share (one line per colour), empty when every series has its
    own colour. Traces of one system (same legend group or name) may share one."""
    d = as_dict(fig)
    way = _colourway(d)
    by: dict = {}
    for i, t in enumerate(d.get("data") or []):
        c, who = trace_colour(t, i, way), system_of(t)
        if c is None or who is None:
            continue
        by.setdefault(c, {}).setdefault(who, i)
    return [f"{_show(c)} drawn for {', '.join(repr(w) for w in who)}" for c, who in by.items() if len(who) > 1]


def _show(c) -> str:
    if isinstance(c, tuple):
        return "#%02x%02x%02x" % tuple(int(v) for v in c[:3]) + ("" if c[3] == 1.0 else f" at alpha {c[3]:g}")
    return str(c)


def title_lines(fig) -> list[tuple[str, bool]]:
    """The title's lines without markup, each with whether it is the label's (in ``<sup>``)."""
    d = as_dict(fig)
    title = (d.get("layout") or {}).get("title") or {}
    text = title.get("text", "") if isinstance(title, dict) else str(title)
    return [(re.sub(r"<[^>]+>", "", ln), "<sup>" in ln) for ln in text.split("<br>")]


def too_wide(fig, width: int = 1200, px: dict | None = None) -> list[str]:
    """Title or label lines that would not fit the figure at ``width`` px (or its own smaller width), at mean glyph
    widths measured in Chromium with plotly's default font (5.6 px a label character, 8.6 a title's)."""
    px = px or {"title": 8.6, "label": 5.6}
    d = as_dict(fig)
    room = min((d.get("layout") or {}).get("width") or width, width) - 60  # the title starts 5 % in
    return [f"{len(ln)} characters ({len(ln) * px['label' if sup else 'title']:.0f} px > {room} px): {ln[:60]}..."
            for ln, sup in title_lines(d) if len(ln) * px["label" if sup else "title"] > room]
