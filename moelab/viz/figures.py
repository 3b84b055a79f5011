"""Plotly figure builders over the frames of a run (``RunResult.metrics``, ``.loads``, ``.comm``,
``.trace()``) or the simulator's frames of the same shape.

Every builder takes a required keyword ``label`` that says what the numbers are and puts it under
the title: it must start with REAL, EMULATED, SIMULATED, SUBSTITUTE or PAPER (the papers' own
numbers), e.g. ``"REAL: 4 ranks, gloo"`` or ``"SIMULATED: trevor"``. ``RunResult.label`` gives the
right one for a stored run. A figure without its provenance therefore cannot be built.
A new builder takes the same keyword, is decorated with :func:`labelled` and returns through
:func:`finish`.
"""
from __future__ import annotations

import functools

import plotly.graph_objects as go
from plotly.colors import qualitative

LABEL_KINDS = ("REAL", "EMULATED", "SIMULATED", "SUBSTITUTE", "PAPER")
LINK_COLOURS = {"local": "#9aa5b1", "intra": "#3b82c4", "inter": "#e4572e"}


def check_label(label: str) -> str:
    """Return ``label`` stripped, or raise ValueError if it does not say what the figure shows."""
    if not isinstance(label, str) or not label.strip().startswith(LABEL_KINDS):
        raise ValueError(f"a figure label must start with one of {LABEL_KINDS} "
                         f"(e.g. 'REAL: 4 ranks, gloo'), got {label!r}")
    return label.strip()


def labelled(builder):
    """Check the label before any work, so a bad label fails the same way for every builder."""
    @functools.wraps(builder)
    def build(*args, label: str, **kw):
        return builder(*args, label=check_label(label), **kw)

    return build


WIDTH = 1200  # the width (px) titles and labels are wrapped for, when a figure sets none (and its images')
PX_PER_CHAR = {"title": 9.5, "label": 7.0}  # generous mean glyph widths: 17 px title, the label in <sup>


def wrap(text: str, width_px: float, px_per_char: float) -> list[str]:
    """``text`` in lines that fit ``width_px`` at ``px_per_char``, broken at spaces (and at existing ``<br>``);
    a word longer than a line stays whole."""
    import textwrap

    chars = max(20, int(width_px / px_per_char))
    return [ln for part in text.split("<br>") for ln in
            (textwrap.wrap(part, chars, break_long_words=False, break_on_hyphens=False) or [part])]


def finish(fig: go.Figure, title: str, label: str, **layout) -> go.Figure:
    """Title with the label underneath (and in ``layout.meta``), one template for every figure. Both wrap
    inside the figure's width (``width``, else :data:`WIDTH`); more than two lines hang from the top, the top
    margin (unless ``margin`` sets one) growing to hold them above the plot and its subplot titles."""
    room = min(layout.get("width") or WIDTH, WIDTH) - 90  # the title starts 5 % in; a little to spare
    head = wrap(title, room, PX_PER_CHAR["title"])
    sub = wrap(label, room, PX_PER_CHAR["label"])
    text = "<br>".join(head + [f"<sup>{ln}</sup>" for ln in sub])
    lines = len(head) + len(sub)
    over = any((a.y or 0) >= 0.99 and a.yref in (None, "paper") for a in fig.layout.annotations or ())  # subplot titles
    margin = dict(layout.pop("margin", None) or {})
    title = {"text": text}
    if lines > 2:  # from the top down, every line 22 px (plotly spaces <sup> lines as title lines)
        title.update(yref="container", y=1, yanchor="top", pad={"t": 24})
        margin.setdefault("t", 30 + 22 * lines + (36 if over else 16))
    fig.update_layout(title=title, template="plotly_white", meta={"label": label},
                      **({"margin": margin} if margin else {}), **layout)
    return fig


@labelled
def loss_curve(metrics, *, label: str, by: str | None = None, title: str = "Training loss") -> go.Figure:
    """Loss per iteration; ``by`` names a column (e.g. ``run``, ``strategy``) giving one line each."""
    fig = go.Figure()
    groups = metrics.groupby(by, sort=False) if by else [(None, metrics)]
    for name, g in groups:
        fig.add_scatter(x=g["iter"], y=g["loss"], mode="lines", name=str(name) if by else "loss")
    return finish(fig, title, label, xaxis_title="iteration", yaxis_title="loss", showlegend=bool(by))


@labelled
def expert_load_heatmap(loads, *, label: str, layer: int = 0, share: bool = True,
                        title: str | None = None) -> go.Figure:
    """Tokens per expert over iterations for one MoE layer (Hecate Fig. 3, FasterMoE Fig. 4).

    ``share=True`` colours each cell by the expert's share of that iteration's tokens, which makes
    imbalance and drift comparable across batch sizes.
    """
    layers = sorted(loads["layer"].unique())
    if layer not in layers:
        raise ValueError(f"layer {layer} not in the loads; layers: {layers}")
    grid = loads[loads["layer"] == layer].pivot_table(index="expert", columns="iter", values="tokens",
                                                     aggfunc="sum", fill_value=0)
    if share:
        grid = grid / grid.sum(axis=0).where(lambda s: s > 0, 1)
    fig = go.Figure(go.Heatmap(z=grid.values, x=grid.columns, y=grid.index, colorscale="Viridis",
                               colorbar={"title": "share of tokens" if share else "tokens"}))
    return finish(fig, title or f"Expert load, layer {layer}", label,
                   xaxis_title="iteration", yaxis_title="expert", yaxis_dtick=1)


@labelled
def timeline(trace, *, label: str, iteration: int | None = None, title: str | None = None) -> go.Figure:
    """One iteration's per-rank timeline (a Gantt chart, one colour per event category).

    ``trace`` is ``RunResult.trace()``: Chrome events with ``rank``, ``name``, ``cat``, ``ts``,
    ``dur`` (µs), ``tid`` and, when the worker tags events with ``args.iter``, ``iter``.
    ``iteration=None`` shows the last one. Nested events are drawn thinner, on top of their parent.
    """
    ev = trace
    if "iter" in ev and ev["iter"].notna().any():
        iteration = int(ev["iter"].max()) if iteration is None else iteration
        kept = sorted(int(i) for i in ev["iter"].dropna().unique())
        ev = ev[ev["iter"] == iteration]
        if ev.empty:
            raise ValueError(f"no trace events for iteration {iteration}; the trace keeps iterations "
                             f"{kept[:8]}{' ...' if len(kept) > 8 else ''} (train.trace_iters)")
    elif iteration is not None:
        raise ValueError("these trace events carry no iteration (args.iter); pass iteration=None")
    ev = ev.assign(start_ms=(ev["ts"] - ev["ts"].min()) / 1e3, dur_ms=ev["dur"] / 1e3,
                   row=_rows(ev), depth=_depths(ev))
    palette = qualitative.Plotly
    colours = {c: palette[i % len(palette)] for i, c in enumerate(sorted(ev["cat"].unique()))}
    fig = go.Figure()
    for cat, g in sorted(ev.groupby("cat"), key=lambda kv: kv[1]["depth"].mean()):
        fig.add_bar(y=g["row"], x=g["dur_ms"], base=g["start_ms"], orientation="h", name=cat,
                    width=0.8 * 0.6 ** g["depth"], marker_color=colours[cat], customdata=g["name"],
                    hovertemplate="%{customdata}<br>start %{base:.3f} ms<br>%{x:.3f} ms<extra>" + cat + "</extra>")
    rows = sorted(ev["row"].unique(), key=lambda r: [int(x) for x in r.split() if x.isdigit()])
    it = "" if iteration is None else f", iteration {iteration}"
    return finish(fig, title or f"Per-rank timeline{it}", label, barmode="overlay",
                   xaxis_title="time (ms)", yaxis={"categoryorder": "array", "categoryarray": rows[::-1]})


def _rows(ev):
    """``rank r``, or ``rank r / tid t`` when a rank has several threads or streams."""
    multi = ev.groupby("rank")["tid"].transform("nunique") > 1
    return [f"rank {r} / tid {t}" if m else f"rank {r}" for r, t, m in zip(ev["rank"], ev["tid"], multi)]


def _depths(ev):
    """Nesting depth of each event within its (rank, tid) row, from the intervals alone."""
    depth = {}
    for _, g in ev.groupby(["rank", "tid"]):
        open_ends: list = []
        for idx, ts, dur in sorted(zip(g.index, g["ts"], g["dur"]), key=lambda e: (e[1], -e[2])):
            while open_ends and open_ends[-1] <= ts:
                open_ends.pop()
            depth[idx] = len(open_ends)
            open_ends.append(ts + dur)
    return [depth[i] for i in ev.index]


@labelled
def bytes_by_link(frame, *, label: str, by: str = "iter", title: str | None = None) -> go.Figure:
    """Bytes per link class (local / intra-node / inter-node), stacked, per ``by`` value.

    ``frame`` is ``metrics`` (``by="iter"``) or ``comm`` (``by="op"``, ``"layer"`` or ``"iter"``,
    summed over ranks).
    """
    sums = frame.groupby(by)[[f"bytes_{c}" for c in LINK_COLOURS]].sum()
    fig = go.Figure()
    for cls, colour in LINK_COLOURS.items():
        fig.add_bar(x=sums.index.astype(str) if by == "op" else sums.index, y=sums[f"bytes_{cls}"],
                    name=cls, marker_color=colour)
    return finish(fig, title or f"Bytes by link class per {by}", label, barmode="stack",
                   xaxis_title=by, yaxis_title="bytes")
