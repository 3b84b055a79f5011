"""Every reproduction notebook built on the kit (Hecate, LSH-MoE), executed headless with papermill at smoke
scale through ``moelab reproduce``: its parameters cell matches the scale files; every product the manifest
promises is made and exported with a label of its declared class; the paper-vs-moelab table refuses no row.
(What a manifest promises grows with its issue; manifest/registry/notebook agreement: tests/papers/kit/test_kit.py.
FasterMoE's notebook has its own, stricter file.)"""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

pm = pytest.importorskip("papermill")
# one worker under pytest-xdist: the browser test reads the report the notebook tests wrote into its basetemp
pytestmark = pytest.mark.xdist_group("paper_reports")

REPO = Path(__file__).resolve().parents[2]
KINDS = ("REAL", "EMULATED", "SIMULATED", "SUBSTITUTE", "PAPER")
# paper -> one table it must write
PAPERS = {"hecate": "table1_models", "lsh_moe": "table_fig06l_summary", "parm": "table4", "lina": "table_fig14e"}


def _reports(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "paper_reports"


@pytest.mark.parametrize("paper", PAPERS)
def test_parameters_cell_and_scale_files_match(paper):
    declared = pm.inspect_notebook(str(REPO / "notebooks" / f"{paper}.ipynb"))
    for name in ("scale", "out_dir", "png", "seed", "run_real"):
        assert name in declared and declared[name]["help"], name
    spec = importlib.import_module(f"moelab.papers.{paper}").scale_spec
    for scale in ("smoke", "default", "full"):
        params = yaml.safe_load((REPO / "experiments" / paper / f"{scale}.yaml").read_text())
        assert params["scale"] == scale and set(params) <= set(declared), scale
        assert spec(scale).name == scale


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("paper", PAPERS)
def test_notebook_smoke_exports_every_product_with_its_class(paper, tmp_path_factory):
    from moelab.papers.kit.manifest import NO_CUDA, load_manifest
    from moelab.papers.kit.reproduce import reproduce

    out = _reports(tmp_path_factory)  # one report for every paper: the browser test below reads it
    batch = reproduce([paper], "smoke", out, log=lambda s: None)
    assert not batch.failed, batch.outcomes[0].error
    figs = out / "figures" / paper
    sides = [json.loads(p.read_text()) for p in figs.glob("*.json")]
    labels = [s["label"] for s in sides if s.get("kind") == "figure"]
    assert labels and all(l.startswith(KINDS) for l in labels), labels
    assert (figs / f"{PAPERS[paper]}.csv").is_file() and (figs / "table_manifest.csv").is_file()
    promised = load_manifest(paper).product_classes()
    table = pd.read_csv(figs / "table_manifest.csv", dtype=str).fillna("")
    made = table[table["product"] != ""].set_index("product")
    assert sorted(made.index) == sorted(promised)
    gpu_skip = (made.status == "skipped") & made.reason.str.startswith(NO_CUDA)  # a GPU item on a CPU machine
    assert ((made.status == "made") | gpu_skip).all(), made[made.status != "made"]
    manifest = json.loads((figs / "manifest.json").read_text())
    for p in (p for it in manifest["items"] for p in it["products"]):
        for f in p["files"]:
            assert f["label"].startswith((p["cls"], "PAPER")), (p["id"], f["stem"])
    pvm = pd.read_csv(figs / "table_paper_vs_moelab.csv")
    assert not (pvm.status == "refused").any(), pvm[pvm.status == "refused"]


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_report_reads_right_in_a_browser(tmp_path_factory):
    """The report of the smoke runs above, opened in Chromium: the per-paper summary (manifest coverage,
    paper-vs-moelab rows, run time), every figure drawing, no broken image or link; a screenshot."""
    from moelab.papers.kit.reproduce import reproduce

    browser_kit = pytest.importorskip("tests.browser_kit")
    pytest.importorskip("playwright")
    if browser_kit.chromium_path() is None:
        pytest.skip("no chromium executable (README: browser tests)")
    out = _reports(tmp_path_factory)
    if not (out / "index.html").is_file():  # run on its own: make one paper's report first
        assert not reproduce(["parm"], "smoke", out, log=lambda s: None).failed
    with browser_kit.chromium() as page:
        checked = browser_kit.check_report(page, out / "index.html")
        page.goto((out / "index.html").resolve().as_uri())
        rows = page.locator("section").first.locator("tr").all_inner_texts()[1:]
    made = sorted(p.stem.removesuffix(".run") for p in (out / "notebooks").glob("*.run.json"))
    assert len(rows) == len(made) and made
    for row in rows:
        assert "ok" in row and " reproduced, " in row and "not reproducible here" in row, row
        assert "ratio" in row or "trend check" in row or "not run" in row, row  # the paper-vs-moelab column
    assert checked["figures"] >= 2 * len(made), checked


def _one_paper_report(tmp_path_factory, paper: str = "parm") -> Path:
    """A report folder holding ``paper``'s smoke section only: copied from the notebook tests' report when it has
    one, else made here."""
    import shutil

    from moelab.papers.kit.page import build_index
    from moelab.papers.kit.reproduce import reproduce

    one = tmp_path_factory.getbasetemp() / f"report_{paper}"
    if (one / "index.html").is_file():
        return one
    shared = _reports(tmp_path_factory)
    if (shared / "notebooks" / f"{paper}.run.json").is_file():
        shutil.copytree(shared / "assets", one / "assets")
        shutil.copytree(shared / "figures" / paper, one / "figures" / paper)
        (one / "notebooks").mkdir()
        for p in (shared / "notebooks").glob(f"{paper}.*"):
            shutil.copy2(p, one / "notebooks" / p.name)
        build_index(one)
    else:
        batch = reproduce([paper], "smoke", one, log=lambda s: None)
        assert not batch.failed, batch.outcomes[0].error
    return one


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_one_paper_report_opens_fast_draws_every_figure_and_travels(tmp_path_factory, tmp_path):
    """Parm's smoke report: index.html loads in Chromium within 5 s, is small (figures linked, one plotly.js
    beside them), every figure page draws without a script error; every figure has a PNG and an SVG; the
    single-file export of the section opens with the network blocked and no request attempted, every figure in it
    drawn; the comparison table reads one line per number (a screenshot goes to the artifacts)."""
    import zipfile

    from moelab.papers.kit.page import VERDICT_STYLE
    from moelab.papers.kit.publish import single_file, zip_section
    from moelab.viz.export import plotlyjs_name

    browser_kit = pytest.importorskip("tests.browser_kit")
    pytest.importorskip("playwright")
    if browser_kit.chromium_path() is None:
        pytest.skip("no chromium executable (README: browser tests)")
    out = _one_paper_report(tmp_path_factory)
    index = out / "index.html"
    figs = out / "figures" / "parm"
    assert index.stat().st_size < 2_000_000
    assert [p.name for p in out.rglob("plotly-*.js")] == [plotlyjs_name()]  # one plotly.js in the whole report
    pages = sorted(figs.glob("*.html"))
    assert pages and all(p.stat().st_size < 1_000_000 for p in pages)
    assert all(p.with_suffix(".png").is_file() and p.with_suffix(".svg").is_file() for p in pages), \
        [p.name for p in pages if not p.with_suffix(".png").is_file()]
    with browser_kit.chromium(width=1280, height=900) as page:
        errors: list = []
        page.on("pageerror", lambda e: errors.append(f"{page.url}: {e}"))
        page.goto(index.resolve().as_uri(), wait_until="load")
        load_ms = page.evaluate("() => { const t = performance.getEntriesByType('navigation')[0];"
                                " return t.loadEventEnd - t.startTime; }")
        assert load_ms < 5000, f"index.html took {load_ms:.0f} ms to load"
        table = page.locator("table.pvm").first
        rows = table.locator("tbody tr")
        assert rows.count() > 10 and table.locator(".badge").count() == rows.count()
        heights = rows.evaluate_all("rs => rs.map(r => r.getBoundingClientRect().height)")
        assert max(heights) < 40, f"a comparison row is {max(heights):.0f} px tall: not one line"  # details closed
        table.locator("th[data-col='6']").click()  # sort by verdict
        verdicts = table.locator("tbody tr td:nth-child(7)").all_inner_texts()
        order = list(VERDICT_STYLE)
        ranks = [next(i for i, v in enumerate(order) if t == v or t.startswith("not evidence") and v == "not evidence")
                 for t in verdicts]
        assert ranks == sorted(ranks), verdicts
        shot = browser_kit.screenshot_element(table, "report_paper_vs_moelab")
        assert shot.stat().st_size > 10_000
        checked = browser_kit.check_report(page, index, drawn=None)  # every figure page draws
        assert checked["figures"] == len(pages) and checked["images"] >= len(pages)

        one = single_file(out, "parm", tmp_path / "parm.html")
        with browser_kit.offline(page) as attempted:
            page.goto(one.as_uri(), wait_until="load")
            n = page.locator("div.plot").count()
            page.evaluate("() => window.moelabDrawAll()")
            page.wait_for_function(f"() => document.querySelectorAll('div.plot .main-svg').length >= {n}",
                                   timeout=60_000)
            assert attempted == []
        assert n == len(pages) and page.locator("table.pvm").count() == 1
        assert not errors, errors
    bundle = zip_section(out, "parm", tmp_path / "parm.zip")
    names = zipfile.ZipFile(bundle).namelist()
    assert "parm/README.txt" in names and sum(n.endswith(".png") for n in names) == len(pages)
    assert sum(n.endswith(".csv") for n in names) >= 5
