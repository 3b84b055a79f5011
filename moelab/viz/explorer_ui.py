"""The placement explorer's widget: ipywidgets controls over the pure functions of
:mod:`moelab.viz.explorer` (every control calls one of them; nothing here computes a result).

The grid editor is a plotly ``FigureWidget`` heatmap (experts x ranks) listening to clicks: plotly is
already the figures' library, a heatmap of 256 x 64 cells is one trace that plotly.js draws on a canvas-like
SVG image in well under a second, its click events arrive in the kernel through ``anywidget`` (plotly's
own widget transport since plotly 6), and an update sends only the changed ``z`` array. A click toggles a
holder (mode "toggle holder") or makes the clicked rank the owner (mode "set owner": the row action); the
text edit stays for exact input. Figures are sized to the notebook's width (no fixed pixel widths).
"""
from __future__ import annotations

import dataclasses
import html
import time
from typing import Optional

from moelab.models.presets import PRESETS
from moelab.sim import PROFILES
from moelab.viz.explorer import (
    STRATEGIES,
    SYNTHETIC_KINDS,
    ExplorerState,
    ab_figure,
    ab_table,
    bytes_figure,
    check_fits,
    edit_placement,
    evaluate,
    load_figure,
    memory_figure,
    placement_of,
    reset_ep,
    set_owner,
    set_replicas,
    shadow_hottest,
    summary_text,
    toggle_replica,
    trace_shape,
    with_preset,
    with_strategy,
    world_of,
)
from moelab.viz.explorer_figures import GRID_COLOURS
from moelab.viz.explorer_fit import fit_widget, responsive
from moelab.viz.explorer_nodes import view_arrays, view_figure
from moelab.viz.explorer_panel import RunPanel
from moelab.viz.explorer_policies import POLICIES, decide

# pixels the figures' titles and labels are wrapped for (the figures then autosize to their boxes): a half of a
# notebook's width beside a 1,280 px window's file browser, and the whole of it for the grid
HALF_PX, FULL_PX = 400, 780
LIST_MAX_EXPERTS = 32  # up to this many experts the per-expert owner / replica list is shown too
MODES = ("toggle holder", "set owner")
VIEWS = ("ranks", "nodes")  # the grid: experts x ranks, or experts x nodes with a drill-down into a node


class ExplorerUI:
    """ipywidgets over the pure functions above. ``state`` is the current :class:`ExplorerState`;
    every control calls one of ``on_*`` (plain methods: tests call them, or set a control's value)."""

    def __init__(self, state: ExplorerState, runs=(), profiles=None, runs_root: str = "runs",
                 export_path: str = "explorer_run.yaml"):
        import ipywidgets as w

        self.state = state
        self.pinned: Optional[ExplorerState] = None
        self._quiet = False
        self.last: Optional[dict] = None
        self.figures: dict = {}
        self.error: Optional[str] = None
        self.note = ""  # what the last policy said about its decision
        self.redraw_s: Optional[float] = None  # the kernel's time of the latest refresh (evaluate + figures)
        profiles = list(profiles or sorted(n for n, p in PROFILES.items() if p.world_size <= 64))
        if state.profile not in profiles:
            profiles.insert(0, state.profile)

        traces = ([f"synthetic:{k}" for k in SYNTHETIC_KINDS] + [f"preset:{n}" for n in sorted(PRESETS)]
                  + [f"run:{r}" for r in runs])
        if state.trace not in traces:
            traces.append(state.trace)
        full = w.Layout(max_width="100%")  # block children fill the width; a 100% width plus margins would overflow
        self.profile = w.Dropdown(options=profiles, value=state.profile, description="profile")
        self.nodes = w.BoundedIntText(value=state.nodes or 0, min=0, max=512, description="nodes",
                                      tooltip="0: as published", layout=w.Layout(width="150px"))
        self.gpus = w.BoundedIntText(value=state.gpus_per_node or 0, min=0, max=64, description="GPUs/node",
                                     tooltip="0: as published", layout=w.Layout(width="170px"))
        self.trace = w.Dropdown(options=traces, value=state.trace, description="loads", layout=w.Layout(width="380px"))
        self.seed = w.IntText(value=state.seed, description="seed", layout=w.Layout(width="150px"))
        self.skew = w.FloatSlider(value=state.skew, min=0.0, max=3.0, step=0.1, description="skew",
                                  continuous_update=False, tooltip="preset loads: Zipf exponent of expert popularity")
        self.iteration = w.IntSlider(value=state.iteration, min=0, max=0, description="iteration")
        self.layer = w.IntSlider(value=state.layer, min=0, max=0, description="layer")
        self.strategy = w.Dropdown(options=STRATEGIES, value=state.strategy, description="priced as",
                                   tooltip="ep: replicas' gradient sync; hecate: spAG / spRS (Hecate's own graph)",
                                   layout=w.Layout(width="200px"))
        self.reset = w.Button(description="reset to EP", icon="undo")
        self.shadow = w.Button(description="shadow hottest", tooltip="replicate the hottest expert on every rank")
        self.policy_buttons = {name: w.Button(description=name, tooltip=doc) for name, (_, doc) in POLICIES.items()}
        self.edit = w.Text(description="edit", placeholder="expert: owner replicas…; e.g. 3: 5 12 (Enter)",
                           continuous_update=False, layout=w.Layout(width="90%", max_width="640px"))
        self.mode = w.ToggleButtons(options=MODES, value=MODES[0], description="click")
        self.colour = w.ToggleButtons(options=("tokens", "holders"), value="tokens", description="colour")
        self.view = w.ToggleButtons(options=VIEWS, value=VIEWS[0], description="grid",
                                    tooltip="experts x ranks, or experts x nodes (click a node to see its ranks)")
        self.back = w.Button(description="all nodes", icon="arrow-up", disabled=True)
        self.node: Optional[int] = None  # the node drilled into in the node view
        self.pin = w.Button(description="pin as A", icon="thumb-tack", tooltip="keep this placement to compare")
        self.unpin = w.Button(description="clear A")
        self.summary = w.HTML(layout=full)
        self.ab = w.HTML(layout=full)
        half = w.Layout(flex="1 1 0%", min_width="0")  # two side by side share the width
        self.load_out, self.bytes_out = w.Output(layout=half), w.Output(layout=half)
        self.grid = None  # the FigureWidget, built on the first refresh (needs anywidget)
        self._grid_key = None  # (shape, label, GPUs per node) it was built for
        # a VBox: its children stretch to its width (in a Box, a flex row, the FigureWidget would size to its
        # content, and plotly.js then autosizes to that: its 700 px default)
        self.grid_box = w.VBox(layout=full)
        self.live: dict = {}  # key -> FigureWidget of the figures updated in place (memory, A vs B)
        self.memory_box = w.VBox(layout=half)
        self.ab_out = w.Output(layout=half)  # shown when a placement is pinned (a FigureWidget added later
        # into a box does not size to it: plotly measures it before it is attached, and falls back to 700 px)
        self.experts_box = w.VBox()
        self.owner: list = []
        self.replicas: list = []
        self.profile.observe(lambda ch: self.on_profile(ch["new"]), names="value")
        self.nodes.observe(lambda ch: self.on_nodes(ch["new"]), names="value")
        self.gpus.observe(lambda ch: self.on_gpus(ch["new"]), names="value")
        self.trace.observe(lambda ch: self.on_trace(ch["new"]), names="value")
        self.seed.observe(lambda ch: self.on_seed(ch["new"]), names="value")
        self.skew.observe(lambda ch: self.on_skew(ch["new"]), names="value")
        self.iteration.observe(lambda ch: self.on_iteration(ch["new"]), names="value")
        self.layer.observe(lambda ch: self.on_layer(ch["new"]), names="value")
        self.strategy.observe(lambda ch: self.on_strategy(ch["new"]), names="value")
        self.reset.on_click(lambda _: self.on_reset())
        self.shadow.on_click(lambda _: self.on_shadow())
        for name, b in self.policy_buttons.items():
            b.on_click(lambda _, name=name: self.on_policy(name))
        self.edit.observe(lambda ch: self.on_edit(ch["new"]), names="value")
        self.colour.observe(lambda ch: self.refresh(), names="value")
        self.view.observe(lambda ch: self.on_view(), names="value")
        self.back.on_click(lambda _: self.on_node(None))
        self.pin.on_click(lambda _: self.on_pin())
        self.unpin.on_click(lambda _: self.on_unpin())
        self.run_panel = RunPanel(self, export_path, runs_root)
        self.fit = fit_widget()  # plotly's FigureWidgets sized to the notebook's width (moelab.viz.explorer_fit)
        wrap = w.Layout(flex_flow="row wrap")
        self.widget = w.VBox([
            w.HBox([self.profile, self.nodes, self.gpus, self.trace, self.seed], layout=wrap),
            w.HBox([self.iteration, self.layer, self.skew, self.strategy], layout=wrap),
            w.HBox([self.reset, self.shadow, *self.policy_buttons.values()], layout=wrap),
            w.HBox([self.mode, self.colour, self.view, self.back], layout=wrap), self.edit,
            self.summary, self.grid_box, w.HBox([self.load_out, self.bytes_out], layout=full),
            w.HBox([self.pin, self.unpin], layout=wrap), self.ab, w.HBox([self.memory_box, self.ab_out], layout=full),
            w.HTML("<b>from drawing to run</b>: export a run config, or run it on this machine's ranks"),
            self.run_panel.widget, self.experts_box, *([self.fit] if self.fit is not None else [])], layout=full)
        self._sync_controls(rebuild=True)
        self.refresh()

    # ---- callbacks: each applies a pure function, then refreshes ----
    def apply(self, fn, *args) -> ExplorerState:
        """``fn(state, *args)``: the new state if it is a valid placement that fits memory, else the
        message and the last valid state kept."""
        if self._quiet:
            return self.state
        try:
            new = fn(self.state, *args)
            check_fits(evaluate(new))
            self.state, self.error = new, None
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

    def on_cell(self, e: int, r: int):
        """A click on the grid's cell (expert ``e``, rank ``r``), by the click mode."""
        if self.mode.value == "set owner":
            return self.on_owner(e, r)
        return self.on_toggle(e, r)

    def on_edit(self, text: str):
        return self.apply(edit_placement, text) if text.strip() else self.state

    def on_reset(self):
        return self.apply(reset_ep)

    def on_shadow(self):
        return self.apply(shadow_hottest)

    def on_policy(self, name: str):
        """The policy's placement for the current loads, and what it said about it (shown under the summary)."""
        said = []

        def policy(s):
            new, note = decide(s, name)
            said.append(note)
            return new

        self.note = ""
        out = self.apply(policy)
        if said and said[0] and self.error is None:
            self.note = f"{name}: {said[0]}" if not said[0].startswith(name.split()[0]) else said[0]
            self.summary.value += f"<br><i>{html.escape(self.note, quote=False)}</i>"
        return out

    def on_view(self):
        if self._quiet:
            return self.state
        self.node = None
        self.back.disabled = True
        return self.refresh()

    def on_strategy(self, name: str):
        """Price the same placement as ``name`` (ep: replicas' gradient sync; hecate: Hecate's spAG / spRS)."""
        return self.apply(with_strategy, name)

    def on_pin(self):
        self.pinned = self.state
        return self.refresh()

    def on_unpin(self):
        self.pinned = None
        return self.refresh()

    def on_profile(self, name: str):
        return self._replace(profile=name, nodes=None, gpus_per_node=None, holders=(), moved_from=(), iteration=0,
                             layer=0)

    def on_nodes(self, nodes: int):
        return self._replace(nodes=int(nodes) or None, holders=(), moved_from=())

    def on_gpus(self, gpus: int):
        return self._replace(gpus_per_node=int(gpus) or None, holders=(), moved_from=())

    def on_trace(self, trace: str):
        src, _, name = trace.partition(":")
        if src == "preset":  # the model's MoE shape comes with its loads
            return self._replace(lambda s: with_preset(s, name))
        return self._replace(trace=trace, holders=(), moved_from=(), iteration=0, layer=0)

    def on_skew(self, skew: float):
        return self._replace(skew=float(skew), holders=(), moved_from=())

    def on_seed(self, seed: int):
        return self.apply(lambda s: dataclasses.replace(s, seed=int(seed)))

    def on_iteration(self, it: int):
        return self.apply(lambda s: dataclasses.replace(s, iteration=int(it)))

    def on_layer(self, layer: int):
        return self.apply(lambda s: dataclasses.replace(s, layer=int(layer)))

    def _replace(self, fn=None, **kw):
        """A new cluster or loads (``fn(state)``, or fields ``kw``): the placement starts again from EP."""
        if self._quiet:
            return self.state
        old = self.state
        self.node, self.back.disabled = None, True  # a new cluster: back to all nodes
        try:
            new = fn(old) if fn is not None else dataclasses.replace(old, **kw)
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
            self.skew.value, self.skew.disabled = s.skew, not s.trace.startswith("preset:")
            self.nodes.value, self.gpus.value = s.nodes or 0, s.gpus_per_node or 0
            self.iteration.max, self.layer.max = iters - 1, layers - 1
            self.iteration.value, self.layer.value = s.iteration, s.layer
            self.strategy.value = s.strategy
            if E > LIST_MAX_EXPERTS:  # the grid alone: hundreds of list rows would not be usable
                self.owner, self.replicas, self.experts_box.children = [], [], ()
                return
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
                self.experts_box.children = [w.HTML("<b>placement</b>: owner and replica ranks of each expert"), *rows]
            for e, h in enumerate(placement_of(s).holders):
                self.owner[e].value = h[0]
                self.replicas[e].value = tuple(h[1:])
        finally:
            self._quiet = False

    def grid_view(self):
        """What the grid shows: ``"ranks"``, ``"nodes"``, or the node drilled into (an int)."""
        if self.view.value == "ranks":
            return "ranks"
        return "nodes" if self.node is None else self.node

    def _grid(self, ev: dict):
        """Build the grid's FigureWidget once; a new view, shape, cluster or loads replaces its trace and layout in
        place (a FigureWidget added after the widget is shown would be measured unattached: plotly's 700 px);
        otherwise only ``z``, ``text`` and the title travel (the redraw of a click)."""
        import plotly.graph_objects as go

        colour, view = self.colour.value, self.grid_view()
        v = view_arrays(ev, colour, view)
        key = (view, v["z"].shape, ev["label"], ev["profile"].gpus_per_node)
        if self.grid is None or key != self._grid_key:
            fig = view_figure(ev, colour=colour, view=view, width=FULL_PX).update_layout(width=None, autosize=True)
            self.figures["grid"] = fig
            if self.grid is not None:
                with self.grid.batch_update():
                    src = fig.data[0]
                    self.grid.data[0].update(z=src.z, x=src.x, y=src.y, text=src.text, colorscale=src.colorscale,
                                             showscale=src.showscale, xgap=src.xgap, ygap=src.ygap,
                                             hovertemplate=src.hovertemplate)
                    self.grid.update(layout=fig.layout.to_plotly_json(), overwrite=True)
            else:
                try:
                    self.grid = responsive(go.FigureWidget(fig))
                except ImportError:  # plotly's widget needs anywidget: the list and the text edit still work
                    self.grid = None
                    return
                self.grid.data[0].on_click(self._clicked)
                self.grid_box.children = (self.grid,)
            self._grid_key = key
            self.figures["grid"] = self.grid
            if self.fit is not None:  # the rebuilt grid sized to the notebook's width again
                self.fit.tick += 1
            return
        rest = str(self.grid.layout.title.text).split("<br>", 1)[1:]
        with self.grid.batch_update():
            trace = self.grid.data[0]
            trace.z, trace.text = v["z"], v["text"]
            trace.colorscale, trace.showscale = GRID_COLOURS[colour], colour == "tokens"
            self.grid.layout.title.text = "<br>".join([v["headline"]] + rest)

    def _live(self, key: str, box, fig) -> None:
        """Show ``fig`` in ``box`` as a FigureWidget, updated in place when its traces keep their kinds."""
        import plotly.graph_objects as go

        fig.update_layout(width=None, height=420, autosize=True)
        fw = self.live.get(key)
        if fw is not None and [(t.type, t.name) for t in fw.data] == [(t.type, t.name) for t in fig.data]:
            with fw.batch_update():  # only what a placement changes: the bars, the title, the lines
                for old, t in zip(fw.data, fig.data):
                    old.x, old.y = t.x, t.y
                fw.layout.title.text, fw.layout.shapes = fig.layout.title.text, fig.layout.shapes
                fw.layout.annotations = fig.layout.annotations
            return
        try:
            fw = responsive(go.FigureWidget(fig))
        except ImportError:  # no anywidget: the figure is still in self.figures
            return
        self.live[key] = fw
        box.children = (fw,)
        if getattr(self, "fit", None) is not None:
            self.fit.tick += 1

    def _clicked(self, trace, points, selector):
        for x, y in zip(points.xs, points.ys):
            if self.grid_view() == "nodes":  # a node's column: drill into its ranks
                return self.on_node(int(x))
            self.on_cell(int(y), int(x))  # x is the global rank in the rank view and in a node's

    def on_node(self, node: Optional[int]):
        """Drill into ``node``'s ranks (the node view), or back to all nodes (None)."""
        self.node = None if node is None else int(node)
        if self.node is not None and self.view.value != "nodes":
            self._quiet, self.view.value, self._quiet = True, "nodes", False
        self.back.disabled = self.node is None
        return self.refresh()

    def refresh(self) -> dict:
        """Evaluate the current state; update the summary, the grid and every figure (``self.figures``)."""
        t0 = time.perf_counter()
        ev = evaluate(self.state)
        base = evaluate(reset_ep(self.state)) if self.state.holders else None
        self.last = ev
        err = (f"<br><span style='color:#c00'>{html.escape(self.error, quote=False)} "
               "(kept the last valid placement)</span>" if self.error else "")
        warn = ("" if ev["fits_memory"] else
                "<br><span style='color:#c00'>this placement does not fit memory (export refuses it)</span>")
        self.summary.value = f"<b>{ev['label']}</b><br>{summary_text(ev)}{err}{warn}"
        self.figures.update(load=load_figure(ev, baseline=base, width=HALF_PX), bytes=bytes_figure(ev, width=HALF_PX),
                            memory=memory_figure(ev, width=HALF_PX))
        self._grid(ev)
        self._live("memory", self.memory_box, self.figures["memory"])
        if self.pinned is not None:
            a = evaluate(self.pinned)
            self.figures["ab"] = ab_figure(a, ev, width=HALF_PX)
            self.ab.value = ("<b>A (pinned) vs B (current)</b>" +
                             ab_table(a, ev).to_html(float_format=lambda v: f"{v:.3f}", classes="moelab-ab"))
        else:
            self.figures.pop("ab", None)
            self.ab_out.clear_output()
            self.ab.value = "<i>pin a placement as A to compare it with the one you edit (B)</i>"
        if _in_kernel():  # outside a kernel (tests, scripts) an Output area would just print the figure
            import plotly.graph_objects as go
            from IPython.display import display

            for out, key in ((self.load_out, "load"), (self.bytes_out, "bytes"), (self.ab_out, "ab")):
                if key not in self.figures:
                    continue
                out.clear_output(wait=True)
                with out:  # each half of the notebook's width: autosize, no fixed pixels
                    display(go.Figure(self.figures[key]).update_layout(width=None, height=420, autosize=True))
        self.redraw_s = time.perf_counter() - t0
        return ev

    def _repr_mimebundle_(self, **kw):
        return self.widget._repr_mimebundle_(**kw)


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def build_widget(state: Optional[ExplorerState] = None, runs=(), profiles=None, runs_root: str = "runs",
                 export_path: str = "explorer_run.yaml"):
    """The explorer UI (:class:`ExplorerUI`: ``display(ui)`` or ``ui.widget``); ``runs``: run folders offered
    as load traces; ``runs_root``: where its run button stores runs; ``export_path``: the config it writes."""
    return ExplorerUI(state or ExplorerState(), runs=runs, profiles=profiles, runs_root=runs_root,
                      export_path=export_path)
