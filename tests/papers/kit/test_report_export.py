"""The report travels: figures load one plotly.js, the index links them (no figure data, no plotly.js inside),
the paper-vs-moelab table reads one line per number with a coloured verdict, a section is one self-contained file
or a zip, images are written beside a run (or one line says why not). Browser checks: tests/e2e."""
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest

from moelab.papers.kit import page as P
from moelab.papers.kit import publish as R
from moelab.papers.kit.images import Images
from moelab.papers.kit.page import build_index
from moelab.papers.kit.report import collect, record_figure, record_table
from moelab.viz import export as X

REPO = Path(__file__).resolve().parents[3]
LONG = ("SIMULATED: parm_A / parm_B (2, 4, 8 nodes), one MoE layer fwd+bwd per kept Table III configuration (every "
        "29th), k=1, E=P/N_ESP, einsum and index dispatchers, fp32, compute at 0.5 of peak (assumed)")


def _pvm() -> pd.DataFrame:
    """A table as moelab.papers.kit.compare.compare writes it."""
    base = dict(source_id="p.c[]:only", quantity="speedup over the baseline", unit="x", paper_at="testbed A",
                moelab_label=LONG, product="p", trend="", note="", paper_source="spec §4 Table IV", why="")
    rows = [dict(key="a_agrees", figure="Table IV", paper=2.0, moelab=2.2, status="ratio", ratio=1.1,
                 headline=True, verdict="agrees"),
            dict(key="b_off", figure="Fig. 7", paper=2.0, moelab=5.0, status="ratio", ratio=2.5, headline=False,
                 verdict="off, no stated cause"),
            dict(key="c_fit", figure="Fig. 3", paper=0.5, moelab=0.5, status="fit", ratio=1.0, headline=False,
                 verdict="not evidence", note="fit: moelab's eta was fitted to this paper number (not evidence)"),
            dict(key="d_trend", figure="Table V", paper=3.0, moelab=1.1, status="trend check", ratio=float("nan"),
                 headline=False, verdict="trend: same side", trend="same side of 1 as the paper"),
            dict(key="e_none", figure="Fig. 1", paper=324, moelab=float("nan"), status="not run",
                 ratio=float("nan"), headline=True, verdict="no value"),
            dict(key="f_expl", figure="Fig. 10", paper=17.9, moelab=3.0, status="ratio", ratio=0.17,
                 headline=False, verdict="explained", why="gap ladder closes 80% of the log-gap")]
    df = pd.DataFrame([{**base, **r} for r in rows])
    return df[["key", "source_id", "figure", "quantity", "unit", "paper", "paper_at", "moelab", "moelab_label",
               "product", "status", "ratio", "trend", "note", "paper_source", "headline", "verdict", "why"]]


def _section(out: Path, name: str = "toy") -> Path:
    """A report folder with one notebook's section: two figures, the comparison table, a plain table, a table and
    a figure under one stem (as Parm's table5_real), a manifest."""
    figs = out / "figures" / name
    X.write_plotlyjs(out / "assets")
    for stem in ("fig_a", "fig_b"):
        fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4], name="EP"), layout={"meta": {"label": LONG}, "title": stem})
        record_figure(fig, figs / stem, formats=("html",))
    record_table(_pvm(), figs / "table_paper_vs_moelab", title="Paper vs moelab", label="PAPER vs moelab: toy")
    record_table(pd.DataFrame({"x": [1, 2]}), figs / "table_plain", title="A plain table", label="SIMULATED: toy")
    X.export_figure(go.Figure(layout={"meta": {"label": "REAL: 8 gloo ranks"}}), figs / "shared_stem", ("html",))
    record_table(pd.DataFrame({"y": [5]}), figs / "shared_stem", title="Table V analog", label="REAL: 8 gloo ranks")
    made = {"status": "made", "reason": "", "notes": []}
    items = [{"id": "fig1", "title": "one", "products": [{"id": "p1", "cls": "SIMULATED", **made, "files": [
        {"stem": "fig_a", "kind": "figure", "file": "fig_a.html"}, {"stem": "table_plain", "kind": "table",
                                                                     "file": "table_plain.csv"}]}]},
             {"id": "fig2", "title": "a schematic", "not_reproduced": "a drawing", "products": []}]
    (figs / "manifest.json").write_text(json.dumps({"kind": "manifest", "title": "Toy paper", "spec": "s",
                                                    "items": items}))
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    (out / "notebooks" / f"{name}.run.json").write_text(json.dumps(
        {"name": name, "status": "ok", "scale": "smoke", "wall_s": 2, "figures_dir": f"figures/{name}",
         "parameters": {"seed": 0}, "declared": {"seed": {"default": "0", "type": "int", "help": "the seed"}}}))
    return figs


def test_the_index_links_figures_and_never_embeds_them(tmp_path):
    figs = _section(tmp_path)
    found = collect(figs)
    assert [f["name"] for f in found["figures"]] == ["fig_a", "fig_b", "shared_stem"]
    shared = next(f for f in found["figures"] if f["name"] == "shared_stem")
    assert shared["label"] == "REAL: 8 gloo ranks" and shared["files"] == {".html": "shared_stem.html"}
    table = next(t for t in found["tables"] if t["name"] == "shared_stem")
    assert ".html" not in table["files"] and ".csv" in table["files"]  # the figure page is not the table
    page = build_index(tmp_path).read_text()
    assert 'id="fig-data"' not in page and "Plotly.newPlot" not in page and "bdata" not in page
    assert len(page) < 100_000 and 'href="figures/toy/shared_stem.html"' in page
    assert 'data-src="figures/toy/fig_a.html"' in page  # no PNG: the page is drawn on a click, not embedded
    assert "Table V analog" in page and "<td>5</td>" in page


def test_the_comparison_table_reads_one_line_per_number(tmp_path):
    _section(tmp_path)
    page = build_index(tmp_path).read_text()
    pvm = page[page.index("<table class=pvm>"):]
    pvm = pvm[:pvm.index("</table>")]
    rows = pvm.split("<tr data-i=")[1:]
    assert len(rows) == 6 and all(r.count("<details>") == 1 for r in rows)
    assert [r.split("<code>")[1].split("</code>")[0] for r in rows] == list(_pvm().key)  # the CSV's order
    assert rows[0].count("★") == 1 and rows[4].count("★") == 1 and not any("★" in r for r in rows[1:4])
    assert 'class="badge v-ok"' in rows[0] and "×1.10" in rows[0] and "2.2<" in rows[0]
    assert 'class="badge v-off"' in rows[1] and "off, no stated cause" in rows[1]
    assert "not evidence: fit" in rows[2] and "fitted to this paper number" in rows[2]
    assert "trend: same side" in rows[3] and "×" not in rows[3].split("<details>")[0]
    assert "no value" in rows[4] and ">—<" in rows[4] and "explained" in rows[5]
    before = [r.split("<details>")[0] for r in rows]
    assert not any(LONG in b or "spec §4" in b for b in before)  # the long label and source only in the detail
    assert all(LONG in r and "spec §4 Table IV" in r for r in rows[:4])
    assert 'data-col="6"' in pvm and "table.pvm" in page  # sortable, by plain JS in the page
    ranks = [int(re.findall(r'data-k="([^"]*)"', r)[6]) for r in rows]
    assert ranks == [list(P.VERDICT_STYLE).index(v) for v in _pvm().verdict]
    summary = page[page.index("<h2>Notebooks</h2>"):page.index('<section id="nb-toy">')]
    assert "v-ok" in summary and "v-off" in summary  # verdict counts in the summary
    assert (tmp_path / "figures" / "toy" / "table_paper_vs_moelab.csv").read_text() == _pvm().to_csv(index=False)


def test_every_verdict_of_the_comparison_has_a_style():
    from moelab.papers.kit.compare import VERDICTS

    assert list(P.VERDICT_STYLE) == list(VERDICTS)


def test_a_section_as_one_file_and_as_a_zip(tmp_path):
    figs = _section(tmp_path)
    (figs / "fig_a.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (figs / "fig_a.svg").write_text("<svg/>")
    one = R.single_file(tmp_path, "toy", tmp_path / "out" / "toy.html")
    text = one.read_text()
    js = X.plotlyjs_source().read_text(encoding="utf-8")
    assert text.count(js) == 1  # one plotly.js, inside
    text = text.replace(js, "")
    assert "<script src=" not in text and 'href="figures/' not in text and "https://cdn" not in text
    assert text.count('<div class=plot id="f') == 3 and text.count('id="d-f') == 3
    assert "Toy paper" in text and "a drawing" in text and "<table class=pvm>" in text and "the seed" in text
    assert 'href="#f0">fig_a</a>' in text and 'href="#t' in text  # the manifest links within the page
    assert "moelabDrawAll" in text and LONG in text
    z = zipfile.ZipFile(R.zip_section(tmp_path, "toy", tmp_path / "toy.zip"))
    names = set(z.namelist())
    assert {"toy/README.txt", "toy/fig_a.png", "toy/fig_a.svg", "toy/table_paper_vs_moelab.csv",
            "toy/table_plain.csv", "toy/shared_stem.csv"} <= names
    readme = z.read("toy/README.txt").decode()
    assert LONG in readme and "fig_b: fig_b" in readme and "no image" in readme
    with pytest.raises(R.SectionError, match="no section 'nope'.*sections: toy"):
        R.single_file(tmp_path, "nope", tmp_path / "x.html")


def test_moelab_report_command(tmp_path):
    _section(tmp_path)

    def moelab(*args):
        return subprocess.run([sys.executable, "-m", "moelab.cli", "report", *map(str, args)], capture_output=True,
                              text=True, timeout=120, cwd=REPO)

    r = moelab("toy", "--out", tmp_path, "--single-file", tmp_path / "s.html", "--zip", tmp_path / "s.zip")
    assert r.returncode == 0, r.stderr
    assert "opens offline" in r.stdout and (tmp_path / "s.html").is_file() and (tmp_path / "s.zip").is_file()
    (tmp_path / "index.html").unlink(missing_ok=True)
    r = moelab("--out", tmp_path)
    assert r.returncode == 0 and (tmp_path / "index.html").is_file()
    assert moelab("toy", "--out", tmp_path).returncode == 2
    r = moelab("nope", "--out", tmp_path, "--zip", tmp_path / "n.zip")
    assert r.returncode == 2 and "no section 'nope'" in r.stderr
    assert moelab("--out", tmp_path / "missing").returncode == 2


def test_images_beside_a_run_fill_in_what_is_missing(tmp_path, monkeypatch):
    figs = _section(tmp_path)
    calls = []

    def fake(jobs, formats):
        jobs = list(jobs)
        calls.append(([Path(s).name for _, s in jobs], tuple(formats)))
        out = []
        for spec, stem in jobs:
            assert spec["layout"]["meta"]
            for f in formats:
                out.append(Path(f"{stem}.{f}"))
                out[-1].write_text("image")
        return out

    from moelab.papers.kit import images as image_mod

    monkeypatch.setattr(image_mod, "export_images", fake)  # where Images calls it
    (figs / "fig_b.png").write_text("made in the notebook")
    img = Images(figs).finish()
    assert sorted(calls) == [(["fig_a", "shared_stem"], ("png", "svg")), (["fig_b"], ("svg",))]
    assert len(img.written) == 5 and img.after_s >= 0
    assert Images(figs).finish().written == []  # nothing left to do
    assert {".html", ".png", ".svg"} <= set(next(f for f in collect(figs)["figures"] if f["name"] == "fig_a")["files"])


def test_without_chromium_one_line_says_what_was_skipped(tmp_path, monkeypatch):
    import nbformat

    from moelab.papers.kit import reproduce as rp

    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    first = nbformat.v4.new_code_cell('out_dir: str = "x"  # figures')
    first.metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(cells=[first, nbformat.v4.new_code_cell(
        "import plotly.graph_objects as go\nfrom moelab.papers.kit.report import record_figure\n"
        "record_figure(go.Figure(layout={'meta': {'label': 'SIMULATED: x'}}), f'{out_dir}/f', formats=('html',))")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, nbs / "tiny.ipynb")
    monkeypatch.setattr(rp, "find_chromium", lambda: None)  # where reproduce looks for it
    lines: list = []
    batch = rp.reproduce(["tiny"], "smoke", tmp_path / "out", notebooks_dir=nbs, experiments_dir=tmp_path,
                         root=REPO, log=lines.append)
    assert not batch.failed, batch.outcomes[0].error
    skipped = [ln for ln in lines if "skipped" in ln and "Chromium" in ln]
    assert len(skipped) == 1 and "apt install chromium" in skipped[0] and "--no-images" in skipped[0]
    out = tmp_path / "out"
    assert (out / "figures" / "tiny" / "f.html").is_file() and not list(out.rglob("*.png"))
    assert [p.name for p in out.rglob("plotly-*.js")] == [X.plotlyjs_name()]
    assert f'src="../../assets/{X.plotlyjs_name()}"' in (out / "figures" / "tiny" / "f.html").read_text()
    lines.clear()
    rp.reproduce(["tiny"], "smoke", out, notebooks_dir=nbs, experiments_dir=tmp_path, root=REPO, log=lines.append,
                 images=False)
    assert not any("Chromium" in ln for ln in lines)  # --no-images: no images, no message
