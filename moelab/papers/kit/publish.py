"""One paper's section of a report as one self-contained HTML file (one plotly.js inside, opens offline) or its
images and CSVs as one zip, and the ``moelab report`` command that writes them."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from moelab import __version__
from moelab.papers.kit.html import (
    CSS,
    PAGE_JS,
    badge,
    esc,
    fmt_s,
    kinds_legend,
    manifest_html,
    params_table,
    table_section,
)
from moelab.papers.kit.images import Images
from moelab.papers.kit.page import build_index, figures_rel
from moelab.papers.kit.report import FIGURE_EXTS, _paper_manifest, collect, figure_order, load_manifests
from moelab.runtime.results import atomic_write_text
from moelab.viz.export import NO_CHROMIUM, figure_json, find_chromium, image_session, plotlyjs_source, read_figure


# ---- a paper's section as one file, and its files as one zip --------------------------------------------
class SectionError(ValueError):
    """No such section in the report folder."""


def find_section(out: str | Path, name: str) -> tuple[dict, Path]:
    """The notebook manifest (``notebooks/*.run.json``; a bare one when there is none) and the exported-files
    folder of section ``name`` (a notebook name: ``parm``, ``quickstart``) in report folder ``out``."""
    out = Path(out)
    for m in load_manifests(out):
        if m.get("name") == name:
            return m, out / figures_rel(m)
    folder = out / "figures" / name
    if folder.is_dir():
        return {"name": name, "figures_dir": f"figures/{name}"}, folder
    known = sorted({m.get("name") for m in load_manifests(out)} | {
        p.name for p in (out / "figures").glob("*") if p.is_dir() and p.name != "assets"})
    raise SectionError(f"no section {name!r} in {out}; sections: {', '.join(known) or 'none (run moelab reproduce)'}")


def _ordered(folder: Path) -> dict:
    found = collect(folder)
    order = {stem: i for i, stem in enumerate(figure_order(folder))}
    found["figures"].sort(key=lambda f: order.get(f["name"], len(order)))
    return found


_DRAW_JS = """
(function () {
  function draw(el) {
    if (el.dataset.drawn) return;
    el.dataset.drawn = "1";
    var f = JSON.parse(document.getElementById("d-" + el.id).textContent);
    Plotly.newPlot(el, f.data, f.layout || {}, Object.assign({responsive: true}, f.config || {}));
  }
  var plots = document.querySelectorAll("div.plot");
  window.moelabDrawAll = function () { plots.forEach(draw); };
  if (!("IntersectionObserver" in window)) return window.moelabDrawAll();
  var io = new IntersectionObserver(function (es) {
    es.forEach(function (e) { if (e.isIntersecting) { io.unobserve(e.target); draw(e.target); } });
  }, {rootMargin: "600px"});
  plots.forEach(function (el) { io.observe(el); });
})();
"""


def _figure_block(f: dict, folder: Path, ident: str) -> str:
    """A figure of the single-file section: its JSON (drawn when scrolled to), else its PNG inlined."""
    import base64

    head = (f'<div class=fig><p class=t>{esc(f["title"])}</p><p class=l>{badge(f["kind"], f["kind"])}'
            f'{esc(f["label"] or "no label: say what this shows")}</p>')
    spec = read_figure(folder / f["files"][".html"]) if ".html" in f["files"] else None
    if spec is not None:
        lay = spec.get("layout") or {}
        size = f"height:{int(lay.get('height') or 500)}px"
        size += f";max-width:{int(lay['width'])}px" if lay.get("width") else ""
        return (f'{head}<div class=plot id="{ident}" style="{size}"></div>'
                f'<script type="application/json" id="d-{ident}">{figure_json(spec)}</script></div>')
    if ".png" in f["files"]:
        data = base64.b64encode((folder / f["files"][".png"]).read_bytes()).decode()
        return f'{head}<img id="{ident}" alt="{esc(f["title"])}" src="data:image/png;base64,{data}"></div>'
    return f'{head}<p class=warn id="{ident}">no figure data in {esc(f["name"])} (re-run the notebook)</p></div>'


def single_file(out: str | Path, name: str, path: str | Path) -> Path:
    """Write section ``name`` of report folder ``out`` as one self-contained HTML file ``path``: the paper's
    manifest (its links jump within the page), the paper-vs-moelab table, the gap ladders, every other table
    and every figure (interactive: one plotly.js inside, each figure drawn when scrolled to). Opens offline."""
    m, folder = find_section(out, name)
    found = _ordered(folder)
    ids = {f["name"]: f"f{i}" for i, f in enumerate(found["figures"])}
    tids = {t["name"]: f"t{i}" for i, t in enumerate(found["tables"])}

    def link(entry: dict) -> str:
        return "#" + (ids.get(entry.get("stem")) or tids.get(entry.get("stem")) or "")

    pvm = [t for t in found["tables"] if t["name"].endswith(("table_paper_vs_moelab", "table_gap_ladders"))]
    rest = [t for t in found["tables"] if t not in pvm]
    mf = _paper_manifest(folder) or {}
    title = mf.get("title") or name
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    sub = (f"moelab {__version__} · section {name} of {Path(out).resolve()} · scale {m.get('scale', '?')} · "
           f"run time {fmt_s(m.get('wall_s'))} · written {now}")
    body = [f"<section><p>{kinds_legend()}</p>",
            manifest_html(folder, "", link=link)]
    body += [table_section(t, None, tids[t["name"]]) for t in pvm]
    body.append(f"<h3>Figures ({len(found['figures'])})</h3>"
                + "".join(_figure_block(f, folder, ids[f["name"]]) for f in found["figures"]))
    body += [table_section(t, None, tids[t["name"]]) for t in rest]
    if m.get("declared") or m.get("parameters"):
        body.append(f"<h3>Parameters</h3>{params_table(m)}")
    body.append("</section>")
    js = plotlyjs_source().read_text(encoding="utf-8")
    page = (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{esc(title)}: moelab</title>"
            f"<meta name=viewport content='width=device-width,initial-scale=1'><style>{CSS}"
            ".fig{margin:18px 0;border-top:1px solid #e4e7eb;padding-top:10px}.fig .t{font-weight:600;margin:0}"
            ".fig .l{font-size:12.5px;color:#52606d;margin:4px 0}.fig img{max-width:100%}</style>"
            f"<script>{js}</script></head><body><header><h1>{esc(title)}</h1><p>{esc(sub)}</p></header><main>"
            + "\n".join(body) + f"</main><script>{PAGE_JS}{_DRAW_JS}</script></body></html>\n")
    return atomic_write_text(path, page)


def zip_section(out: str | Path, name: str, path: str | Path) -> Path:
    """Bundle section ``name``'s images (PNG, SVG, PDF) and tables (CSV) into zip ``path``, with a README
    listing each figure's title and label (for a slide deck)."""
    import zipfile

    _, folder = find_section(out, name)
    found = _ordered(folder)
    lines = [f"moelab report section {name}: images and tables", ""]
    files: list[str] = []
    for f in found["figures"]:
        imgs = [f["files"][e] for e in FIGURE_EXTS[1:] if e in f["files"]]
        files += imgs
        lines.append(f"{f['name']}: {f['title']}\n    {f['label'] or 'UNLABELLED'}\n    "
                     + (", ".join(imgs) if imgs else "no image (moelab report --images writes them, with a Chromium)"))
    for t in found["tables"]:
        if ".csv" in t["files"]:
            files.append(t["files"][".csv"])
            lines.append(f"{t['files']['.csv']}: {t['title']}" + (f"\n    {t['label']}" if t["label"] else ""))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{name}/README.txt", "\n".join(lines) + "\n")
        for rel in files:
            z.write(folder / rel, f"{name}/{rel}")
    tmp.replace(path)
    return path


# ---- the command line (``moelab report``; wired in moelab/cli.py) --------------------------------------------
DESCRIPTION = """\
Rebuild DIR/index.html from what `moelab reproduce` wrote into DIR, or write one paper's section as one file.

examples:
  moelab report                                   # rebuild reports/index.html
  moelab report --images                          # ... after writing the PNG/SVG images it lacks
  moelab report parm --single-file parm.html      # manifest, tables and every figure in one offline file
  moelab report parm --zip parm.zip               # the section's images and CSVs, for a slide deck
"""


def add_arguments(p) -> None:
    import argparse

    p.description, p.formatter_class = DESCRIPTION, argparse.RawDescriptionHelpFormatter
    p.add_argument("name", nargs="?", metavar="PAPER",
                   help="a section: a notebook name (parm, fastermoe, quickstart, ...); needs --single-file or --zip")
    p.add_argument("--out", default="reports", help="the report folder moelab reproduce wrote (default: reports)")
    p.add_argument("--single-file", metavar="FILE", help="write PAPER's section as one self-contained HTML file")
    p.add_argument("--zip", metavar="FILE", help="bundle PAPER's images and CSVs into a zip")
    p.add_argument("--images", action="store_true",
                   help="first write the PNG/SVG images the figures lack (needs a Chromium)")


def main(args) -> int:
    """``moelab report``: 0 done, 2 a bad request (no such folder or section)."""
    import sys

    out = Path(args.out)
    if not out.is_dir():
        print(f"moelab: no report folder {out} (moelab reproduce writes one)", file=sys.stderr)
        return 2
    if args.name is None and (args.single_file or args.zip):
        print("moelab: --single-file and --zip need a PAPER (a section name)", file=sys.stderr)
        return 2
    if args.name is not None and not (args.single_file or args.zip):
        print("moelab: with a PAPER, say what to write: --single-file FILE and/or --zip FILE", file=sys.stderr)
        return 2
    try:
        sections = [find_section(out, args.name)] if args.name else [
            (m, out / figures_rel(m)) for m in load_manifests(out)]
    except SectionError as e:
        print(f"moelab: {e}", file=sys.stderr)
        return 2
    if args.images:
        if find_chromium() is None:
            print(f"images: skipped, {NO_CHROMIUM}")
        else:
            with image_session():
                for m, folder in sections:
                    img = Images(folder).finish()
                    print(f"{m.get('name')}: {len(img.written)} image(s) written in {img.seconds:.1f} s")
    if args.single_file:
        path = single_file(out, args.name, args.single_file)
        print(f"{path} ({path.stat().st_size / 1e6:.1f} MB, opens offline)")
    if args.zip:
        path = zip_section(out, args.name, args.zip)
        print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")
    if args.name is None:
        print(build_index(out))
    return 0
