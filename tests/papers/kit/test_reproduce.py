"""``moelab reproduce``: discovery, parameter lookup, re-use, failure isolation and the report.

The end-to-end tests run the CLI in a subprocess as a user types it.
"""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pandas as pd
import plotly.graph_objects as go
import pytest

from moelab import __version__ as VERSION
from moelab.papers.kit import reproduce as rp
from moelab.papers.kit.page import build_index
from moelab.papers.kit.report import collect, label_kind, record_figure, record_table

REPO = Path(__file__).resolve().parents[3]
LABEL = "REAL: 4 ranks, 2 nodes x 2, gloo"


def moelab(*args, timeout=280):
    return subprocess.run([sys.executable, "-m", "moelab.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def notebook(path: Path, *cells: str, params: str = 'out_dir: str = "figures/x"  # where figures go') -> Path:
    first = nbformat.v4.new_code_cell(params)
    first.metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(cells=[first, *map(nbformat.v4.new_code_cell, cells)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


FINE = '''import plotly.graph_objects as go
from moelab.papers.kit.report import record_figure
fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4]), layout={"meta": {"label": "SUBSTITUTE: " + message}, "title": "tiny"})
record_figure(fig, f"{out_dir}/tiny", formats=("html",))'''


def _reran_for_a_source_edit(stdout: str) -> bool:
    """Another process edited moelab/ between two calls (a shared checkout): not a re-use failure."""
    return bool(re.search(r"running \(moelab/\S+ changed since the last run", stdout))


# ---- pure parts ----------------------------------------------------------------------------------
def test_names_and_discovery(tmp_path):
    assert rp.notebook_name("notebooks/00_quickstart.ipynb") == "quickstart"
    assert rp.notebook_name("placement_explorer.ipynb") == "placement_explorer"
    for n in ("10_b.ipynb", "a.ipynb", ".hidden.ipynb"):
        (tmp_path / n).write_text("{}")
    assert list(rp.discover(tmp_path)) == ["b", "a"]  # file-name order: 10_b < a
    (tmp_path / "b.ipynb").write_text("{}")
    with pytest.raises(rp.ReproduceError, match="two notebooks are named 'b'"):
        rp.discover(tmp_path)
    assert "quickstart" in rp.discover(REPO / "notebooks")


def test_parameter_lookup(tmp_path):
    ex = tmp_path / "experiments"
    (ex / "quickstart").mkdir(parents=True)
    (ex / "quickstart" / "smoke.yaml").write_text("iters: 3\n")  # flat, own folder
    (ex / "simulator").mkdir()
    (ex / "simulator" / "smoke.yaml").write_text(  # shared, keyed by notebook name
        "simulator: {gpus: 8}\nplacement_explorer: {experts: 4}\n")
    assert rp.find_parameters("quickstart", "smoke", ex) == ({"iters": 3}, ex / "quickstart" / "smoke.yaml")
    assert rp.find_parameters("simulator", "smoke", ex) == ({"gpus": 8}, ex / "simulator" / "smoke.yaml")
    assert rp.find_parameters("placement_explorer", "smoke", ex) == ({"experts": 4}, ex / "simulator" / "smoke.yaml")
    assert rp.find_parameters("lina", "smoke", ex, stem="05_lina") == ({}, None)
    (ex / "papers").mkdir()
    (ex / "papers" / "smoke.yaml").write_text("05_lina: {gpus: 2}\n")  # keyed by the full stem
    assert rp.find_parameters("lina", "smoke", ex, stem="05_lina")[0] == {"gpus": 2}
    assert rp.find_parameters("quickstart", "default", ex) == ({}, None)
    (ex / "other").mkdir()
    (ex / "other" / "smoke.yaml").write_text("placement_explorer: {experts: 8}\n")
    with pytest.raises(rp.ReproduceError, match="several files"):
        rp.find_parameters("placement_explorer", "smoke", ex)
    assert rp.parse_param("reuse=false") == ("reuse", False) and rp.parse_param("x=a=b") == ("x", "a=b")
    with pytest.raises(rp.ReproduceError):
        rp.parse_param("reuse")


def test_staleness_reasons(tmp_path):
    nb, executed, figs = tmp_path / "n.ipynb", tmp_path / "out.ipynb", tmp_path / "figs"
    for p in (nb, executed):
        p.write_text("{}")
    figs.mkdir()
    ok = {"status": "ok", "scale": "smoke", "parameters": {"a": 1}, "started_ts": time.time() + 5,
          "moelab_version": VERSION}

    def why(manifest, params=None, scale="smoke", force=False):
        return rp.staleness(manifest, executed, params or {"a": 1}, scale, [nb], tmp_path, figs, force)

    assert why(ok) is None
    assert why(ok, force=True) == "--force"
    assert why(None) == "no earlier run in this output folder"
    assert why({**ok, "status": "timeout"}) == "the earlier run timed out"
    assert why(ok, scale="default") == "scale changed (smoke -> default)"
    assert why({**ok, "moelab_version": "0.0.1"}) == f"made by moelab 0.0.1, this is moelab {VERSION}"
    assert "none recorded" in why({k: v for k, v in ok.items() if k != "moelab_version"})
    assert why(ok, params={"a": 2}) == "parameters changed: a"
    assert why({**ok, "started_ts": nb.stat().st_mtime - 1}) == "n.ipynb changed since the last run"
    figs.rmdir()
    assert why(ok) == "its exported files are gone"


def test_report_reads_labels_and_tables(tmp_path):
    out = tmp_path / "out"
    figs = out / "figures" / "demo"
    fig = go.Figure(go.Scatter(x=[0, 1], y=[1, 0]), layout={"meta": {"label": "SIMULATED: trevor"},
                                                            "title": "Iteration time<br><sup>x</sup>"})
    record_figure(fig, figs / "with_sidecar", formats=("html",))
    assert json.loads((figs / "with_sidecar.json").read_text()) == {
        "kind": "figure", "label": "SIMULATED: trevor", "title": "Iteration time", "files": ["with_sidecar.html"]}
    from moelab.viz.export import export_figure

    export_figure(go.Figure(layout={"meta": {"label": "PAPER: Table 3"}}), figs / "plain", formats=("html",))
    export_figure(go.Figure(), figs / "anonymous", formats=("html",))
    with pytest.raises(ValueError, match="label"):
        record_figure(go.Figure(), figs / "nolabel", formats=("html",))
    record_table(pd.DataFrame({"system": ["EP", "FasterMoE"], "paper": [1.0, 1.37], "moelab": [1.0, 1.29]}),
                 figs / "table_paper_vs_moelab", title="Speedup: paper vs moelab", label="SIMULATED: trevor")
    (figs / "table_notes.html").write_text("<html><body><p id=frag>a saved fragment</p></body></html>")
    (figs / "data.json").write_text("[1, 2]")

    found = collect(figs)
    assert {f["name"]: f["label"] for f in found["figures"]} == {
        "with_sidecar": "SIMULATED: trevor", "plain": "PAPER: Table 3", "anonymous": None}
    assert [label_kind(f["label"]) for f in found["figures"]] == ["SIMULATED", "PAPER", "UNLABELLED"]
    assert [t["name"] for t in found["tables"]] == ["table_paper_vs_moelab", "table_notes"]
    assert found["others"] == ["data.json"]

    manifest = {"name": "demo", "status": "ok", "outcome": "ran", "scale": "smoke", "wall_s": 1.5,
                "parameters": {"gpus": 8}, "declared": {"gpus": {"default": "4", "type": "int", "help": "GPUs"}},
                "figures_dir": "figures/demo", "executed": "notebooks/demo.ipynb", "reason": "--force"}
    (out / "notebooks").mkdir()
    (out / "notebooks" / "demo.run.json").write_text(json.dumps(manifest))
    page = build_index(out).read_text()
    assert 'href="figures/demo/with_sidecar.html"' in page and "SIMULATED: trevor" in page
    assert "PAPER: Table 3" in page and "UNLABELLED" in page
    assert "1.37" in page and "FasterMoE" in page and "Speedup: paper vs moelab" in page
    assert '<p id=frag>a saved fragment</p>' in page and "<html><body><p" not in page
    assert "GPUs" in page and 'href="figures/demo/data.json"' in page


def test_report_summarises_each_paper_and_orders_figures_as_its_manifest(tmp_path):
    from moelab.papers.kit.report import coverage, figure_order, paper_vs_moelab_counts

    out = tmp_path / "out"
    figs = out / "figures" / "toy"
    for stem in ("fig_late", "fig_early", "extra"):  # written in the reverse of the manifest's order
        fig = go.Figure(layout={"meta": {"label": "SIMULATED: toy"}, "title": stem})
        record_figure(fig, figs / stem, formats=("html",))
        time.sleep(0.02)
    record_table(pd.DataFrame({"key": ["a", "b", "c"], "status": ["ratio", "trend check", "ratio"]}),
                 figs / "table_paper_vs_moelab", title="Paper vs moelab", label="PAPER vs moelab: toy")
    made = {"status": "made", "reason": ""}
    items = [{"id": "fig1", "title": "schematic", "not_reproduced": "a drawing", "products": []},
             {"id": "fig2", "title": "early", "products": [{"id": "p1", "cls": "SIMULATED", **made, "files": [
                 {"stem": "fig_early", "kind": "figure", "file": "fig_early.html"}]}]},
             {"id": "fig3", "title": "late", "products": [{"id": "p2", "cls": "SIMULATED", **made, "files": [
                 {"stem": "fig_late", "kind": "figure", "file": "fig_late.html"}]},
                 {"id": "p3", "cls": "REAL", "status": "skipped", "reason": "run_real=False", "files": []}]},
             {"id": "tab1", "title": "never", "products": [
                 {"id": "p4", "cls": "REAL", "status": "not run", "reason": "", "files": []}]},
             {"id": "gpu", "title": "on a GPU", "products": [
                 {"id": "p5", "cls": "REAL", "status": "skipped", "reason": "no CUDA device (a GPU item)",
                  "files": []}]}]
    (figs / "manifest.json").write_text(json.dumps({"kind": "manifest", "title": "Toy", "spec": "s", "items": items}))
    assert coverage(figs) == {"title": "Toy", "items": 5, "made": 2, "not_reproduced": 1, "missing": 1,
                              "needs_gpu": 1, "products": 5, "products_made": 2}
    assert figure_order(figs) == ["fig_early", "fig_late"]
    assert paper_vs_moelab_counts(figs) == {"ratio": 2, "trend check": 1}
    assert coverage(tmp_path) is None and paper_vs_moelab_counts(tmp_path) is None
    (out / "notebooks").mkdir()
    (out / "notebooks" / "toy.run.json").write_text(json.dumps(
        {"name": "toy", "status": "ok", "scale": "smoke", "wall_s": 2, "figures_dir": "figures/toy"}))
    page = build_index(out).read_text()
    summary = page[page.index("<h2>Notebooks</h2>"):page.index('<section id="nb-toy">')]
    assert "2 of 5 reproduced, 1 not reproducible here" in summary and "1 not made" in summary
    assert "1 skipped: needs a GPU" in summary
    assert "2 ratio, 1 trend check" in summary
    section = page[page.index('<section id="nb-toy">'):]
    cards = [section.index(f"figures/toy/{s}.html") for s in ("fig_early", "fig_late", "extra")]
    assert cards == sorted(cards)  # the manifest's order, then what the manifest does not list
    assert section.index("Paper vs moelab") < section.index("<h3>Figures")


def test_unknown_notebook_exits_2():
    r = moelab("reproduce", "nonesuch", "--scale", "smoke", "--out", "/nonexistent/never", timeout=60)
    assert r.returncode == 2 and "unknown notebook(s) nonesuch" in r.stderr and "quickstart" in r.stderr
    assert not Path("/nonexistent/never").exists()


# ---- end to end ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(290)
def test_reproduce_quickstart_smoke(tmp_path, tmp_path_factory):
    out = tmp_path / "out"
    runs = tmp_path_factory.getbasetemp() / "quickstart_runs"  # shared with test_quickstart: re-plots its run
    args = ("reproduce", "quickstart", "--scale", "smoke", "--out", out, "-p", f"runs_root={runs}")
    r = moelab(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 ran, 0 up to date, 0 failed" in r.stdout

    page = (out / "index.html").read_text()
    figs = out / "figures" / "quickstart"
    sidecars = sorted(figs.glob("*.json"))
    stems = {p.stem for p in sidecars if json.loads(p.read_text())["kind"] == "figure"}
    assert stems == {"loss_curve", "expert_load", "timeline", "bytes_by_link"}
    for stem in stems:
        assert f'href="figures/quickstart/{stem}.html"' in page, stem
        if (figs / f"{stem}.png").is_file():
            assert f'src="figures/quickstart/{stem}.png"' in page, stem
        assert json.loads((figs / f"{stem}.json").read_text())["label"] == LABEL
    assert page.count(LABEL) >= len(stems) and "Run summary" in page
    assert "experiments/quickstart/smoke.yaml" in page and 'href="notebooks/00_quickstart.ipynb"' in page
    manifest = json.loads((out / "notebooks" / "00_quickstart.run.json").read_text())
    assert manifest["status"] == "ok" and manifest["parameters"]["iters"] == 8
    from moelab.viz.export import find_chromium, plotlyjs_name

    assert manifest["parameters"]["png"] is False  # the images are written beside the run, not by the notebook
    if find_chromium() is not None:  # a PNG and an SVG of every figure, by default
        assert all((figs / f"{s}.png").is_file() and (figs / f"{s}.svg").is_file() for s in stems), stems
        assert manifest["images"]["files"] == 2 * len(stems) and "image(s) (PNG/SVG)" in r.stdout
        assert manifest["images"]["cpu_s"] > 0 and "of the browser's CPU" in r.stdout
    assert [p.name for p in out.rglob("plotly-*.js")] == [plotlyjs_name()]  # one plotly.js in the report
    assert len(page) < 2_000_000 and all((figs / f"{s}.html").stat().st_size < 1_000_000 for s in stems)
    assert manifest["parameters"]["out_dir"] == str(figs.resolve()) and manifest["cwd"] == str(REPO)

    executed = out / "notebooks" / "00_quickstart.ipynb"
    for _ in range(3):  # a second call re-uses the executed notebook
        stamp = executed.stat().st_mtime_ns
        again = moelab(*args)
        assert again.returncode == 0, again.stdout + again.stderr
        if not _reran_for_a_source_edit(again.stdout):
            break
    assert "quickstart: skipped (up to date" in again.stdout and "0 ran, 1 up to date" in again.stdout
    assert executed.stat().st_mtime_ns == stamp
    assert "up to date, re-used" in (out / "index.html").read_text()
    assert json.loads((out / "notebooks" / "00_quickstart.run.json").read_text())["outcome"] == "reused"


@pytest.mark.timeout(200)
def test_failing_notebook_is_listed_and_the_others_run(tmp_path):
    nbs, ex, out = tmp_path / "notebooks", tmp_path / "experiments", tmp_path / "out"
    notebook(nbs / "01_broken.ipynb", "raise ValueError('deliberate failure in a notebook')")
    notebook(nbs / "02_slow.ipynb", "import time\ntime.sleep(600)")
    notebook(nbs / "03_fine.ipynb", FINE, params='out_dir: str = "x"  # figures\nmessage: str = "default"  # text')
    (ex / "tiny").mkdir(parents=True)
    (ex / "tiny" / "smoke.yaml").write_text("fine:\n  message: from the shared file\nbroken: {}\nslow: {}\n")
    args = ("reproduce", "all", "--scale", "smoke", "--out", out, "--notebooks", nbs, "--experiments", ex,
            "--timeout", 8)

    t0 = time.monotonic()
    r = moelab(*args)
    assert time.monotonic() - t0 < 150
    assert r.returncode == 1, r.stdout + r.stderr
    assert "broken: FAILED" in r.stdout and "slow: TIMEOUT" in r.stdout and "fine: ok" in r.stdout
    assert "FAILED broken (failed" in r.stderr and "ValueError: deliberate failure in a notebook" in r.stderr
    assert "FAILED slow (timeout" in r.stderr and "timed out after 8 s" in r.stderr
    fine = out / "figures" / "fine"
    assert json.loads((fine / "tiny.json").read_text())["label"] == "SUBSTITUTE: from the shared file"
    page = (out / "index.html").read_text()
    assert "1 ok, 2 failed" in page and "deliberate failure in a notebook" in page
    assert 'href="figures/fine/tiny.html"' in page and "SUBSTITUTE: from the shared file" in page
    assert (out / "notebooks" / "01_broken.ipynb").is_file()  # the executed copy shows where it failed

    for _ in range(3):  # failed notebooks run again; the one that succeeded is re-used
        again = moelab(*args)
        if not _reran_for_a_source_edit(again.stdout):
            break
    assert again.returncode == 1 and "fine: skipped (up to date" in again.stdout
    assert "broken: running (the earlier run failed)" in again.stdout
    assert "slow: running (the earlier run timed out)" in again.stdout
