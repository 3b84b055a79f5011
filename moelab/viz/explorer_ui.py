"""The placement explorer's widget: ipywidgets controls over the pure functions of
:mod:`moelab.viz.explorer` (every control calls one of them; nothing here computes a result)."""
from __future__ import annotations

import dataclasses
import html
from typing import Optional

from moelab.viz.explorer import (
    SYNTHETIC_KINDS,
    ExplorerState,
    bytes_figure,
    edit_placement,
    evaluate,
    load_figure,
    placement_of,
    reset_ep,
    set_owner,
    set_replicas,
    shadow_hottest,
    summary_text,
    toggle_replica,
    trace_shape,
    world_of,
)


class ExplorerUI:
    """ipywidgets over the pure functions above. ``state`` is the current :class:`ExplorerState`;
    every control calls one of ``on_*`` (plain methods: tests call them, or set a control's value)."""

    def __init__(self, state: ExplorerState, runs=(), profiles=None):
        import ipywidgets as w

        from moelab.sim import PROFILES

        self.state = state
        self._quiet = False
        self.last: Optional[dict] = None
        self.figures: dict = {}
        self.error: Optional[str] = None
        profiles = list(profiles or sorted(n for n, p in PROFILES.items() if p.world_size <= 64))
        if state.profile not in profiles:
            profiles.insert(0, state.profile)
        traces = [f"synthetic:{k}" for k in SYNTHETIC_KINDS] + [f"run:{r}" for r in runs]
        if state.trace not in traces:
            traces.append(state.trace)
        self.profile = w.Dropdown(options=profiles, value=state.profile, description="profile")
        self.trace = w.Dropdown(options=traces, value=state.trace, description="loads",
                                layout=w.Layout(width="420px"))
        self.seed = w.IntText(value=state.seed, description="seed", layout=w.Layout(width="160px"))
        self.iteration = w.IntSlider(value=state.iteration, min=0, max=0, description="iteration")
        self.layer = w.IntSlider(value=state.layer, min=0, max=0, description="layer")
        self.reset = w.Button(description="reset to EP", icon="undo")
        self.shadow = w.Button(description="shadow hottest", tooltip="replicate the hottest expert on every rank")
        self.edit = w.Text(description="edit", placeholder="expert: owner replicas…; e.g. 3: 5 12 (Enter)",
                           continuous_update=False, layout=w.Layout(width="420px"))
        self.summary = w.HTML()
        self.load_out, self.bytes_out = w.Output(), w.Output()
        self.experts_box = w.VBox()
        self.owner: list = []
        self.replicas: list = []
        self.profile.observe(lambda ch: self.on_profile(ch["new"]), names="value")
        self.trace.observe(lambda ch: self.on_trace(ch["new"]), names="value")
        self.seed.observe(lambda ch: self.on_seed(ch["new"]), names="value")
        self.iteration.observe(lambda ch: self.on_iteration(ch["new"]), names="value")
        self.layer.observe(lambda ch: self.on_layer(ch["new"]), names="value")
        self.reset.on_click(lambda _: self.on_reset())
        self.shadow.on_click(lambda _: self.on_shadow())
        self.edit.observe(lambda ch: self.on_edit(ch["new"]), names="value")
        self.widget = w.VBox([
            w.HBox([self.profile, self.trace, self.seed]),
            w.HBox([self.iteration, self.layer, self.reset, self.shadow]), self.edit,
            self.summary, w.HBox([self.load_out, self.bytes_out]),
            w.HTML("<b>placement</b>: owner and replica ranks of each expert"), self.experts_box])
        self._sync_controls(rebuild=True)
        self.refresh()

    # ---- callbacks: each applies a pure function, then refreshes ----
    def apply(self, fn, *args) -> ExplorerState:
        if self._quiet:
            return self.state
        try:
            self.state = fn(self.state, *args)
            self.error = None
        except (ValueError, KeyError, FileNotFoundError) as e:
            self.error = str(e)
        self._sync_controls()
        self.refresh()
        return self.state

    def on_owner(self, e: int, r: int):
        return self.apply(set_owner, e, r)

    def on_replicas(self, e: int, ranks):
        return self.apply(set_replicas, e, ranks)

    def on_toggle(self, e: int, r: int):
        return self.apply(toggle_replica, e, r)

    def on_edit(self, text: str):
        return self.apply(edit_placement, text) if text.strip() else self.state

    def on_reset(self):
        return self.apply(reset_ep)

    def on_shadow(self):
        return self.apply(shadow_hottest)

    def on_profile(self, name: str):
        return self._replace(profile=name, nodes=None, holders=(), iteration=0, layer=0)

    def on_trace(self, trace: str):
        return self._replace(trace=trace, holders=(), iteration=0, layer=0)

    def on_seed(self, seed: int):
        return self.apply(lambda s: dataclasses.replace(s, seed=int(seed)))

    def on_iteration(self, it: int):
        return self.apply(lambda s: dataclasses.replace(s, iteration=int(it)))

    def on_layer(self, layer: int):
        return self.apply(lambda s: dataclasses.replace(s, layer=int(layer)))

    def _replace(self, **kw):
        if self._quiet:
            return self.state
        old = self.state
        try:
            new = dataclasses.replace(old, **kw)
            trace_shape(new)
            self.state, self.error = new, None
        except (ValueError, KeyError, FileNotFoundError) as e:
            self.error = str(e)
        self._sync_controls(rebuild=True)
        self.refresh()
        return self.state

    # ---- view ----
    def _sync_controls(self, rebuild: bool = False):
        import ipywidgets as w

        self._quiet = True
        try:
            s = self.state
            iters, layers, E = trace_shape(s)
            N = world_of(s)
            self.profile.value, self.trace.value, self.seed.value = s.profile, s.trace, s.seed
            self.iteration.max, self.layer.max = iters - 1, layers - 1
            self.iteration.value, self.layer.value = s.iteration, s.layer
            if rebuild or len(self.owner) != E or (self.owner and len(self.owner[0].options) != N):
                self.owner, self.replicas, rows = [], [], []
                for e in range(E):
                    o = w.Dropdown(options=list(range(N)), description=f"expert {e}", layout=w.Layout(width="170px"))
                    rp = w.SelectMultiple(options=list(range(N)), rows=min(N, 4), description="replicas",
                                          layout=w.Layout(width="200px"))
                    o.observe(lambda ch, e=e: self.on_owner(e, ch["new"]), names="value")
                    rp.observe(lambda ch, e=e: self.on_replicas(e, ch["new"]), names="value")
                    self.owner.append(o)
                    self.replicas.append(rp)
                    rows.append(w.HBox([o, rp]))
                self.experts_box.children = rows
            for e, h in enumerate(placement_of(s).holders):
                self.owner[e].value = h[0]
                self.replicas[e].value = tuple(h[1:])
        finally:
            self._quiet = False

    def refresh(self) -> dict:
        """Evaluate the current state; update the summary and redraw both figures (``self.figures``)."""
        ev = evaluate(self.state)
        base = evaluate(reset_ep(self.state)) if self.state.holders else None
        self.last = ev
        err = (f"<br><span style='color:#c00'>{html.escape(self.error, quote=False)} "
               "(kept the last valid placement)</span>" if self.error else "")
        self.summary.value = f"<b>{ev['label']}</b><br>{summary_text(ev)}{err}"
        self.figures = {"load": load_figure(ev, baseline=base), "bytes": bytes_figure(ev)}
        if _in_kernel():  # outside a kernel (tests, scripts) an Output area would just print the figure
            import plotly.graph_objects as go
            from IPython.display import display

            for out, fig in ((self.load_out, self.figures["load"]), (self.bytes_out, self.figures["bytes"])):
                out.clear_output(wait=True)
                with out:  # two side by side: each a fixed half of a notebook's width
                    display(go.Figure(fig).update_layout(width=560, height=420))
        return ev

    def _repr_mimebundle_(self, **kw):
        return self.widget._repr_mimebundle_(**kw)


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def build_widget(state: Optional[ExplorerState] = None, runs=(), profiles=None):
    """The explorer UI (:class:`ExplorerUI`: ``display(ui)`` or ``ui.widget``);
    ``runs``: run folders offered as load traces."""
    return ExplorerUI(state or ExplorerState(), runs=runs, profiles=profiles)
