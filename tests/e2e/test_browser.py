"""moelab in a real JupyterLab, driven by a real Chromium (Playwright): the quickstart run from the Run menu,
the placement explorer's widget changed through its own controls, the stop button and a kernel restart
in the middle of a run, a failing rank's traceback in the cell. Screenshots go to ``test-artifacts/browser/``
(listed at the end of the pytest run). Needs the ``chromium`` executable (README: browser tests)."""
from __future__ import annotations

import json
import os
import time

import nbformat
import pytest

from tests.browser_kit import REPO, Notebook, chromium, chromium_path, jupyter_lab, screenshot
from tests.fake_worker import ranks_started, wait_for

pytest.importorskip("jupyterlab")
pytest.importorskip("playwright")
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timing]  # timing: stops within seconds
if chromium_path() is None:
    reason = "no chromium executable (apt install chromium, or set MOELAB_CHROMIUM)"
    if os.environ.get("CI"):  # CI installs it: a missing browser is a failure there, not a skip
        raise RuntimeError(reason)
    pytest.skip(reason, allow_module_level=True)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    with jupyter_lab(root, tmp_path_factory.mktemp("lab-home")) as server:
        yield server


@pytest.fixture(scope="module")
def page():
    with chromium() as p:
        yield p


def _parameterized(lab, notebook: str, name: str, params: dict) -> str:
    """A copy of ``notebooks/<notebook>`` in the server's root with papermill's injected parameters cell."""
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = parameterize_notebook(load_notebook_node(str(REPO / "notebooks" / notebook)), params)
    nbformat.write(nb, lab.root / name)
    return name


def _saved_errors(nb: Notebook) -> list[str]:
    """Save from the browser (File > Save Notebook), then read the error outputs of the saved file."""
    nb.menu("File", "Save Notebook")
    nb.page.wait_for_timeout(1000)
    cells = nb.lab.api(f"contents/{nb.name}")["content"]["cells"]
    return [f"{o['ename']}: {o['evalue']}" for c in cells for o in c.get("outputs", []) if o["output_type"] == "error"]


@pytest.mark.timeout(400)
def test_quickstart_runs_in_jupyterlab(lab, page, tmp_path):
    runs, figs = tmp_path / "runs", tmp_path / "figs"
    smoke = {"nproc": 4, "nodes": 2, "iters": 8}  # experiments/quickstart/smoke.yaml
    name = _parameterized(lab, "00_quickstart.ipynb", "quickstart.ipynb", {
        **smoke, "config": str(REPO / "experiments/core/quickstart.yaml"), "runs_root": str(runs),
        "out_dir": str(figs), "reuse": False, "png": False})
    nb = Notebook(page, lab, name)
    nb.run_all(300)
    assert _saved_errors(nb) == []
    done = [json.loads(p.read_text()) for p in runs.glob("*/summary.json")]
    assert len(done) == 1 and done[0]["iters"] == 8 and done[0]["label"] == "REAL: 4 ranks, 2 nodes x 2, gloo"
    assert page.locator(".jp-OutputArea-output.js-plotly-plot .main-svg").count() >= 4  # loss, load, timeline, bytes
    bar = page.locator(".jp-OutputArea-output .widget-hprogress")
    assert bar.count() == 1  # the live progress bar of the launch cell (tqdm's notebook widget)
    shown = page.locator(".jp-OutputArea-output .widget-hbox").first.inner_text()
    assert "8/8" in shown and "loss=" in shown and "step_time=" in shown
    screenshot(page, "quickstart")


@pytest.mark.timeout(300)
def test_placement_explorer_widget_follows_an_edit(lab, page, tmp_path):
    from moelab.viz import explorer as X

    name = _parameterized(lab, "placement_explorer.ipynb", "placement_explorer.ipynb", {
        "scale": "smoke", "out_dir": str(tmp_path / "figs"), "runs_root": str(tmp_path / "none"),
        "show_widget": True, "png": False})
    nb = Notebook(page, lab, name)
    nb.run_all(240)
    assert _saved_errors(nb) == []
    # the notebook's defaults (its parameters cell), evaluated here by the same pure functions
    state = X.ExplorerState(profile="fastermoe_johnny", trace="synthetic:hot_expert", num_experts=16,
                            tokens_per_rank=2048, top_k=2, d_model=1024, d_ff=4096)
    topo = X.profile_of(state).topology()
    hot = X.hottest_expert(state)
    owner = X.placement_of(state).owner(hot)
    far = next(r for r in range(X.world_of(state)) if topo.node_of(r) != topo.node_of(owner))
    want = X.evaluate(X.toggle_replica(state, hot, far))

    widget = page.locator(".jp-Notebook .jp-CodeCell").last.locator(".jp-OutputArea-output .widget-vbox").first
    summary = widget.locator(".widget-html").filter(has_text="layer time").first
    before = summary.inner_text()
    assert f"layer time {X.evaluate(state)['layer_time_s'] * 1e3:.2f} ms" in before
    # the user's action: in expert `hot`'s replica list, pick a rank of the other node
    widget.locator(".widget-select-multiple select").nth(hot).select_option(label=str(far))
    expected = f"layer time {want['layer_time_s'] * 1e3:.2f} ms"
    wait_for(lambda: expected in summary.inner_text(), 30, f"the summary to show {expected!r}")
    assert f"max/mean tokens per rank {want['max_load']}/" in summary.inner_text()

    def plotted():  # (title, {trace name: y}) of each figure in the widget's two Output areas
        return page.evaluate("""(root) => Array.from(root.querySelectorAll('.widget-output .js-plotly-plot'))
            .map(gd => [gd.layout.title.text, Object.fromEntries(gd._fullData.map(t => [t.name, Array.from(t.y)]))])""",
                             widget.element_handle())

    wait_for(lambda: len(plotted()) == 2 and f"{want['layer_time_s'] * 1e3:.2f} ms" in plotted()[1][0], 30,
              "the figures to redraw")
    (_, load), (_, sent) = plotted()
    assert load["this placement"] == [float(v) for v in want["rank_tokens"]]
    assert load["expert parallelism"] == [float(v) for v in X.evaluate(state)["rank_tokens"]]
    for cls in ("local", "intra", "inter"):
        assert sent[cls] == pytest.approx(list(want["bytes"][cls] / 1e6), rel=1e-9)
    # a typed edit that breaks the placement: a message in the widget, the last valid placement kept
    edit = widget.get_by_role("textbox", name="edit")
    edit.fill(f"{hot}: {X.world_of(state) + 3}")
    edit.press("Enter")
    wait_for(lambda: "outside 0..15" in summary.inner_text(), 30, "the widget to refuse the edit")
    assert expected in summary.inner_text() and "kept the last valid placement" in summary.inner_text()
    screenshot(page, "placement_explorer")


_STOP_CELLS = [
    "from moelab.runtime.launch import launch\nCONFIG, RUNS = {config!r}, {runs!r}\n"
    "small = {{'parallel.topology.nodes': 1, 'model.moe.num_experts': 4}}",
    "launch(CONFIG, 2, out_root=RUNS, overrides={{**small, 'train.iters': 3, 'train.fault_rank': 1}})",
    "launch(CONFIG, 2, out_root=RUNS, overrides={{**small, 'train.iters': 100000, 'train.timeout_s': 900}})",
]


@pytest.mark.timeout(300)
def test_stop_button_and_restart_stop_every_rank(lab, page, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    nb_node = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.format(
        config=str(REPO / "experiments/core/quickstart.yaml"), runs=str(runs))) for c in _STOP_CELLS])
    nb_node.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb_node, lab.root / "stop.ipynb")
    nb = Notebook(page, lab, "stop.ipynb")
    nb.run_all(120)  # stops at the failing cell
    failed = nb.cell_outputs(1)
    assert "RunFailed" in failed and "failed on rank 1" in failed
    assert "injected fault on rank 1 at iteration 0" in failed  # the rank's own traceback, in the cell
    assert not any(runs.iterdir())

    def start_long_run():
        page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        wait_for(lambda: ranks_started(runs, 2), 90, "the ranks to start")
        wait_for(lambda: "it/s" in nb.cell_outputs(2) or "s/it" in nb.cell_outputs(2), 90, "the progress bar")

    def clean() -> bool:  # no folder, no process of the run (torchrun, guard and ranks name it in their command)
        import psutil

        alive = [p for p in psutil.process_iter(["cmdline", "status"]) if p.info["status"] != psutil.STATUS_ZOMBIE
                 and str(runs) in " ".join(p.info["cmdline"] or [])]
        return not any(runs.iterdir()) and not alive

    start_long_run()
    t = time.monotonic()
    page.locator(".jp-NotebookPanel-toolbar [data-command='notebook:interrupt-kernel']").click()  # the stop button
    wait_for(lambda: "interrupted: all 2 ranks stopped, nothing stored" in nb.cell_outputs(2), 15,
              "the interrupt line")
    wait_for(clean, 10, "every rank and the temp folder to go")
    assert time.monotonic() - t < 15 and "Traceback" not in nb.cell_outputs(2)
    screenshot(page, "stop_button")

    start_long_run()
    nb.menu("Kernel", "Restart Kernel…")
    page.locator(".jp-Dialog").get_by_role("button", name="Confirm Kernel Restart").click()
    wait_for(clean, 30, "every rank and the temp folder to go after the restart")
    nb.wait_idle(60)
