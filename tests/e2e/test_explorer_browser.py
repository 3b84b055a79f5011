"""The placement explorer in a real JupyterLab driven by a real Chromium (Playwright), at 64 experts x 16 ranks:
a click on the grid editor changes the numbers to what ``moelab.viz.explorer`` computes; a policy button; A vs B;
export and a run of the exported file on this machine's 4 ranks with REAL beside SIMULATED; the window fits
1,280 px; and the redraw time of a click at 64 x 16 and at 256 x 64 (printed, not asserted). Screenshots go to
``test-artifacts/browser/``. Needs the ``chromium`` executable (README: browser tests)."""
from __future__ import annotations

import time

import pytest
import yaml

from tests.browser_kit import screenshot
from tests.e2e.test_browser import _parameterized, _saved_errors, lab  # noqa: F401 (the module's lab fixture)
from tests.fake_worker import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.slow]

E, WIDTH = 64, 1280
TIMES: dict = {}  # what the redraws took in the browser, printed at the end


@pytest.fixture(scope="module")
def page():
    from tests.browser_kit import chromium

    with chromium(width=WIDTH, height=900) as p:
        yield p


@pytest.fixture(scope="module")
def state():
    from moelab.viz import explorer as X

    return X.ExplorerState(profile="fastermoe_johnny", trace="synthetic:hot_expert", num_experts=E,
                           tokens_per_rank=2048, top_k=2, d_model=1024, d_ff=4096)


@pytest.fixture(scope="module")
def nb(lab, page, tmp_path_factory):  # noqa: F811
    from tests.browser_kit import Notebook

    tmp = tmp_path_factory.mktemp("explorer")
    name = _parameterized(lab, "placement_explorer.ipynb", "explorer64.ipynb", {
        "scale": "smoke", "out_dir": str(tmp / "figs"), "runs_root": str(tmp / "runs"), "num_experts": E,
        "export_path": str(tmp / "drawn.yaml"), "show_widget": True, "png": False})
    n = Notebook(page, lab, name)
    n.run_all(300)
    assert _saved_errors(n) == []
    n.tmp = tmp
    return n


def _widget(page):
    return page.locator(".jp-Notebook .jp-CodeCell").last.locator(".jp-OutputArea-output .widget-vbox").first


def _summary(page):
    return _widget(page).locator(".widget-html").filter(has_text="layer time").first


def _grid_cell_xy(page, e: int, r: int):
    """Page coordinates of the grid's cell (expert e, rank r): plotly's own axis maps, on the FigureWidget whose
    title says 'Placement:'."""
    return page.evaluate("""([e, r]) => {
        const gd = Array.from(document.querySelectorAll('.js-plotly-plot'))
            .find(g => g.layout && g.layout.title && String(g.layout.title.text).includes('Placement:'));
        if (!gd) return null;
        const fl = gd._fullLayout, box = gd.getBoundingClientRect();
        return [box.left + fl._size.l + fl.xaxis.l2p(r), box.top + fl._size.t + fl.yaxis.l2p(e)];
    }""", [e, r])


def _grid_z(page, e: int, r: int):
    return page.evaluate("""([e, r]) => {
        const gd = Array.from(document.querySelectorAll('.js-plotly-plot'))
            .find(g => g.layout && g.layout.title && String(g.layout.title.text).includes('Placement:'));
        if (!gd) return null;
        const v = gd.data[0].z[e][r];  // a blank (not held) cell: NaN, or 'nan' as the widget serializes it
        return [gd.data[0].z.length, gd.data[0].z[0].length, typeof v === 'number' && !isNaN(v) ? v : null];
    }""", [e, r])


def _click_cell(page, e: int, r: int):
    _grid_cell_xy(page, e, r) or pytest.fail("no grid in the widget")
    page.evaluate("""([e, r]) => {
        const gd = Array.from(document.querySelectorAll('.js-plotly-plot'))
            .find(g => g.layout && g.layout.title && String(g.layout.title.text).includes('Placement:'));
        gd.scrollIntoView({block: 'center'});
    }""", [e, r])
    x, y = _grid_cell_xy(page, e, r)
    page.mouse.move(x, y)  # plotly clicks what it hovers
    page.wait_for_timeout(150)
    page.mouse.click(x, y)


def _reset(page):
    before = _summary(page).inner_text()
    _widget(page).get_by_role("button", name="reset to EP").click()
    wait_for(lambda: _summary(page).inner_text() != before or "0 replica(s)" in before, 30, "the reset")
    wait_for(lambda: " 0 replica(s)" in _summary(page).inner_text(), 30, "expert parallelism after the reset")


@pytest.mark.timeout(500)
def test_a_grid_click_changes_the_numbers_to_what_the_explorer_computes(nb, page, state):
    from moelab.viz import explorer as X

    summary = _summary(page)
    assert f"layer time {X.evaluate(state)['layer_time_s'] * 1e3:.2f} ms" in summary.inner_text()
    assert _grid_z(page, 0, 0)[:2] == [E, 16]
    _, width, widget_width, _ = _grid_view(page)
    assert widget_width - 40 <= width <= widget_width, (width, widget_width)  # the grid fills the notebook's width
    hot = X.hottest_expert(state)
    topo = X.profile_of(state).topology()
    owner = X.placement_of(state).owner(hot)
    far = next(r for r in range(16) if topo.node_of(r) != topo.node_of(owner))
    want = X.evaluate(X.toggle_replica(state, hot, far))
    expected = f"layer time {want['layer_time_s'] * 1e3:.2f} ms"
    assert _grid_z(page, hot, far)[2] is None  # not held yet: a blank cell
    t = time.monotonic()
    _click_cell(page, hot, far)
    wait_for(lambda: expected in summary.inner_text(), 30, f"the summary to show {expected!r}")
    wait_for(lambda: _grid_z(page, hot, far)[2] is not None, 30, "the grid to redraw")
    TIMES["click at 64 x 16"] = time.monotonic() - t
    text = summary.inner_text()
    assert f"max/mean tokens per rank {want['max_load']}/" in text
    assert f"replica sync {want['replica_sync_s'] * 1e3:.2f})" in text and "not simulated" not in text
    assert f"peak memory {want['memory']['total'].max() / 1e9:.3f} GB" in text
    assert _grid_z(page, hot, far)[2] == X.expert_rank_tokens(want["placement"], want["loads"])[hot, far]
    screenshot(page, "explorer_grid_click")


@pytest.mark.timeout(300)
def test_a_policy_button(nb, page, state):
    from moelab.viz import explorer as X
    from moelab.viz.explorer_policies import apply_policy

    _reset(page)
    want = X.evaluate(apply_policy(state, "Lina popularity"))
    _widget(page).get_by_role("button", name="Lina popularity").click()
    expected = f"layer time {want['layer_time_s'] * 1e3:.2f} ms"
    wait_for(lambda: expected in _summary(page).inner_text(), 30, f"the summary to show {expected!r}")
    assert f"{want['placement'].num_replicas} replica(s)" in _summary(page).inner_text()


@pytest.mark.timeout(300)
def test_a_vs_b(nb, page, state):
    from moelab.viz import explorer as X
    from moelab.viz.explorer_policies import apply_policy

    _reset(page)
    w = _widget(page)
    w.get_by_role("button", name="pin as A").click()
    wait_for(lambda: "A (pinned) vs B (current)" in w.inner_text(), 30, "the A/B table")
    w.get_by_role("button", name="FasterMoE shadowing").click()
    a, b = X.evaluate(state), X.evaluate(apply_policy(state, "FasterMoE shadowing"))
    delta = X.ab_table(a, b).loc["layer time (ms)", "B - A"]
    wait_for(lambda: f"{delta:.3f}" in w.locator(".widget-html").filter(has_text="A (pinned)").first.inner_text(),
             30, f"B - A = {delta:.3f} ms in the table")
    def titles():  # the A vs B figure is displayed in its Output area after the table is updated
        return page.evaluate("""() => Array.from(document.querySelectorAll('.js-plotly-plot'))
            .map(g => g.layout && g.layout.title ? String(g.layout.title.text) : '')""")

    wait_for(lambda: any(t.startswith("A vs B: layer time") and f"{delta:+.2f} ms" in t for t in titles()), 30,
             "the A vs B figure")
    screenshot(page, "explorer_a_vs_b")
    w.get_by_role("button", name="clear A").click()


@pytest.mark.timeout(300)
def test_the_window_fits_1280_px(nb, page):
    over = page.evaluate("""(root) => {
        const w = root.getBoundingClientRect().width;
        const right = root.getBoundingClientRect().right;
        const wide = Array.from(root.querySelectorAll('*'))
            .filter(el => el.getBoundingClientRect().width > 0 && el.getBoundingClientRect().right > right + 1)
            .map(el => el.tagName + ' ' + String(el.textContent || '').slice(0, 50));
        return [w, root.scrollWidth - root.clientWidth, wide.slice(0, 8)];
    }""", _widget(page).element_handle())
    assert over[0] <= WIDTH and over[1] <= 1 and over[2] == [], over


@pytest.mark.timeout(400)
def test_export_then_run_that_file_shows_real_beside_simulated(nb, page):
    w = _widget(page)

    def set_int(label, value):
        box = w.get_by_role("spinbutton", name=label)
        box.fill(str(value))
        box.press("Enter")

    w.get_by_role("combobox", name="profile").select_option("lina")
    wait_for(lambda: "lina" in _summary(page).inner_text(), 60, "the lina profile")
    set_int("nodes", 2)
    set_int("GPUs/node", 2)  # this machine's 4 ranks as 2 nodes x 2
    wait_for(lambda: "(2 x 2)" in _summary(page).inner_text(), 60, "a 2 x 2 cluster")
    w.get_by_role("button", name="export").click()
    drawn = nb.tmp / "drawn.yaml"
    wait_for(drawn.exists, 30, "the exported config")  # written whole (a rename)
    cfg = yaml.safe_load(drawn.read_text())
    assert cfg["parallel"]["nproc"] == 4 and len(cfg["parallel"]["placement"]) == E
    w.get_by_role("button", name="run").click()
    status = w.locator(".widget-html").filter(has_text="config").last
    wait_for(lambda: "REAL" in w.inner_text() and "beside" in w.inner_text() or "run failed" in w.inner_text(),
             300, "the run and its comparison")
    text = w.inner_text()
    assert "run failed" not in text and "export refused" not in text, text
    assert "REAL: 4 ranks" in text and "SIMULATED" in text
    runs = list((nb.tmp / "runs").glob("*/config.json"))
    assert len(runs) == 1
    import json

    ran = json.loads(runs[0].read_text())
    assert {str(k): v for k, v in ran["parallel"]["placement"].items()} == \
        {str(k): v for k, v in cfg["parallel"]["placement"].items()}  # the run is the exported file
    print("\n" + next(line for line in text.splitlines() if "REAL" in line and "beside" in line))
    del status
    screenshot(page, "explorer_run")


def _deepseek_on_64_ranks(page, profile: str, shape: str, shape_8_nodes: str):
    """The widget on ``profile`` at 8 nodes (64 ranks) with DeepSeek-V3's loads: a 256 x 64 grid, drawn."""
    w = _widget(page)
    w.get_by_role("combobox", name="profile").select_option(profile)
    wait_for(lambda: shape in _summary(page).inner_text(), 60, profile)
    box = w.get_by_role("spinbutton", name="nodes")
    box.fill("8")
    box.press("Enter")
    wait_for(lambda: shape_8_nodes in _summary(page).inner_text(), 60, "64 ranks")
    w.get_by_role("combobox", name="loads").select_option("preset:deepseek_v3")
    wait_for(lambda: (_grid_z(page, 0, 0) or [0])[0] == 256, 120, "a 256 x 64 grid")
    return w


@pytest.mark.timeout(400)
def test_redraw_at_256_experts_x_64_ranks(nb, page):
    from moelab.viz import explorer as X

    _deepseek_on_64_ranks(page, "fastermoe_johnny", "fastermoe_johnny (2 x 8)", "fastermoe_johnny (8 x 8)")
    s = X.with_preset(X.ExplorerState(profile="fastermoe_johnny", nodes=8, num_experts=E, tokens_per_rank=2048),
                      "deepseek_v3")
    hot = X.hottest_expert(s)
    far = (X.placement_of(s).owner(hot) + 32) % 64
    want = X.evaluate(X.toggle_replica(s, hot, far))
    expected = f"layer time {want['layer_time_s'] * 1e3:.2f} ms"
    t = time.monotonic()
    _click_cell(page, hot, far)
    wait_for(lambda: expected in _summary(page).inner_text(), 60, f"the summary to show {expected!r}")
    wait_for(lambda: _grid_z(page, hot, far)[2] is not None, 60, "the grid to redraw")
    TIMES["click at 256 x 64"] = time.monotonic() - t
    screenshot(page, "explorer_256x64")
    print("\nredraw after a click (browser, click to summary and grid updated): "
          + ", ".join(f"{k}: {v:.2f} s" for k, v in TIMES.items()))


def _grid_view(page):
    """The grid's columns (its x values), its width and the widget's: the grid fills the notebook's width."""
    return page.evaluate("""(root) => {
        const gd = Array.from(document.querySelectorAll('.js-plotly-plot'))
            .find(g => g.layout && g.layout.title && String(g.layout.title.text).includes('Placement:'));
        if (!gd) return null;
        return [Array.from(gd.data[0].x), gd._fullLayout.width, root.getBoundingClientRect().width,
                String(gd.layout.title.text)];
    }""", _widget(page).element_handle())


@pytest.mark.timeout(400)
def test_node_view_and_a_drill_down_at_256_experts_x_64_ranks(nb, page):
    from moelab.viz import explorer as X
    from moelab.viz.explorer_nodes import expert_node_tokens

    # hecate_B (A100-40GB) at 8 nodes: DeepSeek-V3's shape fits its memory as expert parallelism (on johnny's
    # 16 GB the hot rank's activations do not, and "reset to EP" is refused)
    w = _deepseek_on_64_ranks(page, "hecate_B", "hecate_B (4 x 8)", "hecate_B (8 x 8)")
    wait_for(lambda: " 0 replica(s)" in _summary(page).inner_text(), 30, "expert parallelism")
    s = X.with_preset(X.ExplorerState(profile="hecate_B", nodes=8, num_experts=E, tokens_per_rank=2048),
                      "deepseek_v3")
    ev = X.evaluate(s)
    hot = X.hottest_expert(s)
    owner = X.placement_of(s).owner(hot)
    t = time.monotonic()
    w.get_by_role("button", name="nodes", exact=True).click()
    wait_for(lambda: (_grid_z(page, 0, 0) or [0, 0])[1] == 8, 60, "the experts x nodes grid")
    TIMES["to the node view at 256 x 64"] = time.monotonic() - t
    x, width, widget_width, title = _grid_view(page)
    assert x == list(range(8)) and "8 nodes" in title
    assert widget_width - 40 <= width <= widget_width, (width, widget_width)  # not plotly's 700 px default
    node = owner // 8
    assert _grid_z(page, hot, node)[2] == expert_node_tokens(ev["placement"], ev["loads"], 8)[hot, node]
    screenshot(page, "explorer_nodes")
    t = time.monotonic()
    _click_cell(page, hot, node)  # a click on the owner's node: its ranks
    wait_for(lambda: (_grid_view(page) or [[]])[0] == list(range(8 * node, 8 * node + 8)), 60, "the node's ranks")
    TIMES["drill into a node at 256 x 64"] = time.monotonic() - t
    x, width, widget_width, title = _grid_view(page)
    assert f"node {node}" in title and widget_width - 40 <= width <= widget_width
    far = next(r for r in range(8 * node, 8 * node + 8) if r != owner)
    want = X.evaluate(X.toggle_replica(s, hot, far))
    expected = f"layer time {want['layer_time_s'] * 1e3:.2f} ms"
    _click_cell(page, hot, far)  # in the drill-down a click toggles a holder on that (global) rank
    wait_for(lambda: expected in _summary(page).inner_text(), 60, f"the summary to show {expected!r}")
    wait_for(lambda: _grid_z(page, hot, far - 8 * node)[2] is not None, 60, "the node's grid to redraw")
    assert _grid_z(page, hot, far - 8 * node)[2] == X.expert_rank_tokens(want["placement"], want["loads"])[hot, far]
    screenshot(page, "explorer_node_drill_down")
    w.get_by_role("button", name="all nodes").click()
    wait_for(lambda: (_grid_view(page) or [[]])[0] == list(range(8)), 60, "back to all nodes")
    print("\nnode view (browser): " + ", ".join(f"{k}: {v:.2f} s" for k, v in TIMES.items()))
