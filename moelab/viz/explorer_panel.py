"""The explorer widget's run panel: export the drawn placement as a run config, run it on this machine's
ranks (the quickstart's launcher and progress bar, in the panel's output area), then show the run's REAL MoE
layer time beside the SIMULATED one (:mod:`moelab.viz.explorer_run`)."""
from __future__ import annotations

import html
from typing import Optional

from moelab.runtime.project import project_path
from moelab.viz.explorer_run import export_config, launch_config, real_vs_simulated


class RunPanel:
    """``ui``: the :class:`moelab.viz.explorer_ui.ExplorerUI` whose current state is exported and run."""

    def __init__(self, ui, path: str = "explorer_run.yaml", runs_root: str = "runs"):
        import ipywidgets as w

        self.ui = ui
        self.path = w.Text(value=path, description="config", layout=w.Layout(width="90%", max_width="480px"))
        self.runs_root = runs_root
        self.export = w.Button(description="export", icon="download", tooltip="write the placement into a run config")
        self.run = w.Button(description="run", icon="play", tooltip="export, run it here, compare REAL and SIMULATED")
        self.status = w.HTML()
        self.out = w.Output()
        self.result: Optional[dict] = None
        self.exported: Optional[str] = None
        self.export.on_click(lambda _: self.on_export())
        self.run.on_click(lambda _: self.on_run())
        self.widget = w.VBox([w.HBox([self.path, self.export, self.run], layout=w.Layout(flex_flow="row wrap")),
                              self.status, self.out])

    def _say(self, text: str, error: bool = False):
        colour = "#c00" if error else "#222"
        self.status.value = f"<span style='color:{colour}'>{html.escape(text, quote=False)}</span>"

    def on_export(self) -> Optional[str]:
        """Write the current placement's run config; refuse (with the reason) an invalid one."""

        try:
            p = export_config(self.ui.state, project_path(self.path.value))
        except (ValueError, KeyError) as e:
            self.exported = None
            self._say(f"export refused: {e}", error=True)
            return None
        self.exported = str(p)
        self._say(f"exported to {p}: moelab run {p}")
        return self.exported

    def on_run(self) -> Optional[dict]:
        """Export, run on this machine's ranks (progress bar in the panel), compare with the simulator."""

        p = self.on_export()
        if p is None:
            return None
        self._say(f"running {p} …")
        self.out.clear_output()
        try:
            with self.out:
                run = launch_config(p, project_path(self.runs_root))
            r = real_vs_simulated(run)
        except Exception as e:  # a failed run is shown, the widget stays usable
            self._say(f"run failed: {type(e).__name__}: {e}", error=True)
            return None
        self.result = {**r, "path": str(run.path)}
        self.status.value = (f"<b>MoE layer time</b> (mean over timed iterations and layers): "
                             f"REAL {r['real_s'] * 1e3:.1f} ms <i>({html.escape(r['real_label'])})</i> beside "
                             f"SIMULATED {r['sim_s'] * 1e3:.1f} ms <i>({html.escape(r['sim_label'])})</i>, "
                             f"{r['rel_err'] * 100:+.1f} %<br>run folder {html.escape(str(run.path))}")
        return self.result
