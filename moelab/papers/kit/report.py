"""Figure records and the static report that ``moelab reproduce`` writes (``DIR/index.html``): a summary
per paper notebook (run time, manifest coverage, paper-vs-moelab rows), then each paper's section with its
manifest, the paper-vs-moelab table and its figures in manifest order.

In a notebook, export figures and tables through these, so the report can say what each one is::

    from moelab.papers.kit.report import record_figure, record_table
    fig = loss_curve(run.metrics, label=run.label)
    record_figure(fig, f"{out_dir}/loss_curve")        # loss_curve.html, .png, .json
    record_table(frame, f"{out_dir}/table_paper_vs_moelab", title="Table 3: paper vs moelab",
                 label="SIMULATED: trevor")          # table_....csv, .json

``record_figure`` calls :func:`moelab.viz.export.export_figure` and writes a sidecar
``<stem>.json`` = ``{"kind": "figure", "label": ..., "title": ..., "files": [...]}``; the label is
the one the figure builder put in ``layout.meta`` unless given. The report reads, for every file
under ``DIR/figures/<name>/`` (grouped by stem):

- figures: stems with an ``.html``/``.png``/``.svg``/``.pdf`` — label and title from the sidecar,
  else the label is read from the plotly HTML's ``layout.meta`` (a figure exported with plain
  ``export_figure``), else it is shown as UNLABELLED;
- tables: stems named ``table_*`` (``.html`` fragment inlined, else the ``.csv`` rendered) and any
  other ``.csv``; at most :data:`MAX_TABLE_ROWS` rows inline, the file is linked. A table and a figure
  written under one stem are both shown (the figure page is never inlined as the table);
- anything else is linked under "other files".

The page is one static HTML file with its CSS and a little plain JS inline and relative links (the output
folder can be moved or served as is). It holds no figure data and no plotly.js: PNGs are thumbnails linking to
the interactive pages (which load ``DIR/assets/plotly-*.min.js``), a figure without a PNG is drawn on a click.
``table_paper_vs_moelab`` reads one line per number with a coloured verdict (:func:`_pvm_html`), sortable.
:class:`Images` writes the PNG/SVG of recorded figures (beside a run: ``moelab reproduce``);
:func:`single_file` writes one paper's section as one self-contained file, :func:`zip_section` its images
and CSVs as a zip (``moelab report``).
"""
from __future__ import annotations

import html
import json
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

from moelab.papers.kit.manifest import NO_CUDA

KINDS = ("REAL", "EMULATED", "SIMULATED", "SUBSTITUTE", "PAPER")
FIGURE_EXTS = (".html", ".png", ".svg", ".pdf")
MAX_TABLE_ROWS = 200
_META_LABEL = re.compile(r'"meta"\s*:\s*\{[^{}]*?"label"\s*:\s*"((?:[^"\\]|\\.)*)"')


# ---- what notebooks call -----------------------------------------------------------------------
def _title_of(fig) -> str:
    text = getattr(getattr(fig.layout, "title", None), "text", None) or ""
    return re.sub(r"<[^>]+>", " ", text.split("<br>")[0]).strip()


def record_figure(fig, stem: str | Path, label: str | None = None, *, title: str | None = None,
                  formats=("html", "png")) -> list[Path]:
    """Export ``fig`` (``export_figure``) and write the sidecar ``<stem>.json`` the report reads.

    ``label`` defaults to the figure's own (``layout.meta.label``, set by every moelab figure
    builder); a figure with neither raises ValueError, as a figure must say what it shows.
    """
    from moelab.runtime.results import atomic_write_json
    from moelab.viz.export import export_figure
    from moelab.viz.figures import check_label

    meta = fig.layout.meta if isinstance(fig.layout.meta, dict) else {}
    label = check_label(label if label is not None else meta.get("label"))
    stem = Path(stem)
    written = export_figure(fig, stem, formats=formats)
    atomic_write_json(f"{stem}.json", {"kind": "figure", "label": label, "title": title or _title_of(fig) or stem.name,
                                       "files": [p.name for p in written]})
    return written


def record_table(frame, stem: str | Path, *, title: str | None = None, label: str | None = None) -> list[Path]:
    """Save a pandas table as ``<stem>.csv`` with a sidecar ``<stem>.json`` (title, label); the
    report renders it inline. Name it ``table_*`` by convention (e.g. ``table_paper_vs_moelab``)."""
    from moelab.runtime.results import atomic_write_csv, atomic_write_json
    from moelab.viz.figures import check_label

    stem = Path(stem)
    side = {"kind": "table", "title": title or stem.name, "label": check_label(label) if label else None}
    return [atomic_write_csv(f"{stem}.csv", frame), atomic_write_json(f"{stem}.json", side)]


# ---- reading an output folder --------------------------------------------------------------------
def label_kind(label: str | None) -> str:
    """``"REAL: 4 ranks, gloo"`` -> ``REAL``; UNLABELLED when it is none of :data:`KINDS`."""
    word = (label or "").strip().split(":")[0].split()[0:1]
    return word[0].upper() if word and word[0].upper() in KINDS else "UNLABELLED"


def _sniff_label(html_path: Path) -> str | None:
    """The label a moelab figure builder put in ``layout.meta``, read from an exported HTML."""
    try:
        text = html_path.read_text(errors="replace")
    except OSError:
        return None
    data = text.find('id="fig-data"')  # moelab's page: the figure's JSON, plotly.js loaded from assets/
    m = _META_LABEL.search(text, data if data >= 0 else max(text.rfind("Plotly.newPlot("), 0))  # after plotly.js
    if not m:
        return None
    try:
        return json.loads(f'"{m[1]}"')
    except ValueError:
        return m[1]


def _sidecar(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("kind") in ("figure", "table") else None


def collect(folder: str | Path) -> dict:
    """Figures, tables and other files under ``folder``, paths relative to it (see the module doc);
    figures and tables in the order they were written."""
    folder = Path(folder)
    groups: dict[Path, dict[str, Path]] = {}
    for p in sorted(folder.rglob("*")) if folder.is_dir() else []:
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts):
            groups.setdefault(p.with_suffix(""), {})[p.suffix.lower()] = p
    figures, tables, others = [], [], []
    for stem, files in groups.items():
        side = _sidecar(files[".json"]) if ".json" in files else None
        rel = {ext: p.relative_to(folder).as_posix() for ext, p in files.items()}
        if side is None and ".json" in files and stem.name != "manifest":  # manifest.json: _manifest_html
            others.append(rel[".json"])
        name = stem.relative_to(folder).as_posix()
        is_table = (side or {}).get("kind") == "table" or (side is None and (
            stem.name.startswith("table_") or (".csv" in files and not any(e in files for e in FIGURE_EXTS))))
        plot = ".html" in files and _is_plotly_page(files[".html"])
        if is_table:
            tables.append({"name": name, "title": (side or {}).get("title") or name,
                           "label": (side or {}).get("label"), "files": {e: r for e, r in rel.items() if not (
                               plot and e == ".html")}, "paths": {e: f for e, f in files.items() if not (
                               plot and e == ".html")}})
            others += [r for e, r in rel.items() if e not in (".csv", ".html", ".json", *FIGURE_EXTS)]
            if plot or any(e in files for e in FIGURE_EXTS[1:]):  # a figure written under the table's stem
                label = _sniff_label(files[".html"]) if plot else None
                figures.append({"name": name, "title": name.replace("_", " "), "label": label,
                                "kind": label_kind(label), "files": {e: r for e, r in rel.items() if e in FIGURE_EXTS}})
        elif any(e in files for e in FIGURE_EXTS):
            label = (side or {}).get("label") or (_sniff_label(files[".html"]) if ".html" in files else None)
            figures.append({"name": name, "title": (side or {}).get("title") or name.replace("_", " "),
                            "label": label, "kind": label_kind(label), "files": rel})
            others += [r for e, r in rel.items() if e not in (*FIGURE_EXTS, ".json")]
        else:
            others += [r for e, r in rel.items() if e != ".json" or side is not None]
    def written(item):  # export order: the notebook's order, not the alphabet's
        return min((p.stat().st_mtime for p in groups[folder / item["name"]].values()), default=0), item["name"]

    figures.sort(key=written)
    tables.sort(key=written)
    return {"figures": figures, "tables": tables, "others": sorted(set(others))}


def _is_plotly_page(path: Path) -> bool:
    """A figure page (moelab's or plotly's own ``to_html``), not a table's HTML fragment."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(4096)
        return 'id="fig-data"' in head or "Plotly.newPlot" in path.read_text(errors="replace")
    except OSError:
        return False


def _table_html(table: dict) -> str:
    paths = table["paths"]
    if ".html" not in paths and ".csv" not in paths:
        return "<p class=muted>(no CSV or HTML file)</p>"
    if ".html" in paths:
        text = paths[".html"].read_text(errors="replace")
        m = re.search(r"<body[^>]*>(.*)</body>", text, re.S | re.I)
        return m[1] if m else text
    import pandas as pd

    try:
        frame = pd.read_csv(paths[".csv"])
    except Exception as e:  # noqa: BLE001 - a broken table is reported, not fatal to the report
        return f"<p class=err>cannot read {html.escape(table['files']['.csv'])}: {html.escape(str(e))}</p>"
    note = f"<p class=note>first {MAX_TABLE_ROWS} of {len(frame)} rows</p>" if len(frame) > MAX_TABLE_ROWS else ""
    return frame.head(MAX_TABLE_ROWS).to_html(index=False, border=0, classes="data", na_rep="") + note


def _manifest_html(folder: Path, base: str, link=None) -> str:
    """The paper's manifest (``manifest.json`` written by :class:`moelab.papers.kit.session.Session`): every
    table and figure of the paper, with links to what moelab made of it or the reason it is missing.
    ``link(file entry) -> href`` replaces the relative file links (the single-file section's anchors)."""
    link = link or (lambda f: _u(base + f["file"]))
    m = _paper_manifest(folder)
    if m is None:
        return ""
    rows = []
    for it in m.get("items", []):
        if not it.get("products"):
            rows.append(f"<tr><td>{_e(it['id'])}</td><td>{_e(it['title'])}</td><td>{_badge('NOT REPRODUCED', 'NO')}"
                        f"</td><td class=muted>{_e(it.get('not_reproduced'))}</td></tr>")
        for p in it.get("products", []):
            links = " · ".join(f'<a href="{link(f)}">{_e(f["stem"])}</a>' for f in p.get("files", []))
            what = (links if p.get("status") == "made"
                    else f"<span class=warn>{_e(p.get('status'))}: {_e(p.get('reason'))}</span>")
            notes = "".join(f"<br><span class=muted>{_e(n)}</span>" for n in p.get("notes", []) if len(n) < 300)
            rows.append(f"<tr><td>{_e(it['id'])}</td><td>{_e(it['title'])}</td><td>{_badge(p['cls'], p['cls'])}"
                        f"{_e(p['id'])}</td><td>{what}{notes}</td></tr>")
    return (f"<h3>Manifest: what the paper has, what moelab made of it</h3><p class=muted>{_e(m.get('title'))} · "
            f"spec <code>{_e(m.get('spec'))}</code></p><table><tr><th>paper item</th><th>title</th>"
            f"<th>moelab product</th><th>files, or why not</th></tr>{''.join(rows)}</table>")


def _paper_manifest(folder: Path) -> dict | None:
    try:
        m = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("kind") == "manifest" else None


def coverage(folder: str | Path) -> dict | None:
    """What a paper notebook made of its manifest (``folder/manifest.json``): items ``made`` (at least one
    product made), ``not_reproduced`` (the manifest says why not), ``missing`` (products promised but
    none made: skipped or not run), ``needs_gpu`` (of those, items whose every product was skipped for want
    of a CUDA device: not a failure on a CPU machine), and products made of all promised. None without a
    manifest."""
    m = _paper_manifest(Path(folder))
    if m is None:
        return None
    items = m.get("items", [])
    made = [it for it in items if any(p.get("status") == "made" for p in it.get("products", []))]
    products = [p for it in items for p in it.get("products", [])]
    unmade = [it for it in items if it.get("products") and it not in made]
    gpu = [it for it in unmade if all(str(p.get("reason", "")).startswith(NO_CUDA) for p in it["products"])]
    return {"title": m.get("title"), "items": len(items), "made": len(made),
            "not_reproduced": sum(1 for it in items if not it.get("products")),
            "missing": len(unmade) - len(gpu), "needs_gpu": len(gpu),
            "products": len(products), "products_made": sum(1 for p in products if p.get("status") == "made")}


def figure_order(folder: str | Path) -> list[str]:
    """Figure stems in the paper's manifest order (item by item, product by product), for the report."""
    m = _paper_manifest(Path(folder)) or {}
    return [f["stem"] for it in m.get("items", []) for p in it.get("products", []) for f in p.get("files", [])
            if f.get("kind") == "figure"]


def paper_vs_moelab_counts(folder: str | Path, column: str = "status") -> dict | None:
    """Rows of ``table_paper_vs_moelab.csv`` by ``column``: status (ratio, trend check, fit, chosen from, input,
    refused, no value, not run) or verdict (agrees, explained, contradicted, off, ...)."""
    path = Path(folder) / "table_paper_vs_moelab.csv"
    if not path.is_file():
        return None
    import pandas as pd

    try:
        return pd.read_csv(path)[column].value_counts().to_dict()
    except (ValueError, KeyError):
        return None


def headline_verdicts(folder: str | Path) -> dict | None:
    """The headline claims' rows (``headline: true`` in paper.yaml) by verdict."""
    path = Path(folder) / "table_paper_vs_moelab.csv"
    if not path.is_file():
        return None
    import pandas as pd

    try:
        df = pd.read_csv(path)
        return df[df.headline.astype(bool)]["verdict"].value_counts().to_dict()
    except (ValueError, KeyError, AttributeError):
        return None


def load_manifests(out: str | Path) -> list[dict]:
    """Every notebook's manifest in ``out/notebooks/`` (written by ``moelab reproduce``)."""
    found = []
    for p in sorted(Path(out, "notebooks").glob("*.run.json")):
        try:
            found.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return found


# ---- images beside a run ------------------------------------------------------------------------
class Images:
    """PNG and SVG of every figure recorded into ``folder`` (its ``<stem>.json`` sidecar, written after the
    page): :meth:`start` exports on a thread while the notebook runs, :meth:`finish` waits for it and exports
    the rest. ``seconds`` is the time spent exporting, ``after_s`` the part after the notebook ended."""

    def __init__(self, folder: Path, formats=None, poll_s: float = 2.0):
        from moelab.viz.export import IMAGE_FORMATS

        self.folder, self.formats, self.poll_s = Path(folder), tuple(formats or IMAGE_FORMATS), poll_s
        self.written: list[Path] = []
        self.seconds = self.after_s = 0.0
        self._tried: set = set()
        self._stop = None
        self._thread = None

    def pending(self) -> list[tuple[tuple, Path]]:
        """``(missing formats, stem)`` of every recorded figure that lacks an image and was not tried yet."""
        out = []
        for side in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []:
            stem = side.with_suffix("")
            if stem in self._tried or not stem.with_suffix(".html").is_file():
                continue
            try:
                kind = json.loads(side.read_text()).get("kind")
            except (OSError, ValueError):
                continue
            if kind != "figure" and not (kind == "table" and _is_plotly_page(stem.with_suffix(".html"))):
                continue
            missing = tuple(f for f in self.formats if not stem.with_suffix(f".{f}").is_file())
            if missing:
                out.append((missing, stem))
        return out

    def export(self) -> int:
        """One pass: every pending figure, in one Chromium call per set of missing formats."""
        from moelab.viz.export import export_images, read_figure

        jobs = self.pending()
        if not jobs:
            return 0
        t0 = time.monotonic()
        by_formats: dict = {}
        for missing, stem in jobs:
            self._tried.add(stem)
            spec = read_figure(stem.with_suffix(".html"))
            if spec is not None:
                by_formats.setdefault(missing, []).append((spec, stem))
        n = 0
        for missing, batch in by_formats.items():
            made = export_images(batch, missing)
            self.written += made
            n += len(made)
        self.seconds += time.monotonic() - t0
        return n

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.export()
            except Exception:  # noqa: BLE001 - finish() tries again and reports
                pass
            self._stop.wait(self.poll_s)

    def start(self) -> "Images":
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moelab-images", daemon=True)
        self._thread.start()
        return self

    def finish(self) -> "Images":
        t0 = time.monotonic()
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self.export()
        self.after_s = time.monotonic() - t0
        return self


# ---- the page ------------------------------------------------------------------------------------
_CSS = """/* # not a paper number: the decimals below are sizes */
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1f2933;background:#f7f8fa}
header{background:#1f2933;color:#fff;padding:18px 32px}header h1{margin:0 0 4px;font-size:22px}
header p{margin:0;color:#cbd2d9}main{padding:16px 32px;max-width:1400px}
section{background:#fff;border:1px solid #e4e7eb;border-radius:8px;padding:16px 20px;margin:18px 0}
h2{margin:0 0 8px;font-size:19px}h3{font-size:15px;margin:16px 0 6px}
table{border-collapse:collapse;font-size:13px}td,th{border-bottom:1px solid #e4e7eb;padding:4px 10px;
text-align:left;vertical-align:top}th{background:#f0f2f5}code,pre{font:12.5px/1.4 ui-monospace,Menlo,Consolas,monospace}
pre{background:#fff4f4;border:1px solid #f5c2c2;padding:10px;overflow-x:auto;white-space:pre-wrap}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;color:#fff;
margin-right:4px}.ok{background:#2f9e44}.failed,.timeout{background:#d9480f}.reused{background:#5c7cfa}
.REAL{background:#2f9e44}.EMULATED{background:#e67700}.SIMULATED{background:#1c7ed6}
.SUBSTITUTE{background:#7048e8}.PAPER{background:#868e96}.UNLABELLED{background:#e03131}.NO{background:#adb5bd}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(320px,1fr));gap:14px}
.card{border:1px solid #e4e7eb;border-radius:6px;padding:10px;background:#fcfcfd}
.card img{width:100%;border:1px solid #eef0f3;border-radius:4px}.card .t{font-weight:600;margin:0 0 4px}
.card .l{font-size:12.5px;color:#52606d;margin:4px 0}.noimg{padding:40px 0;text-align:center;color:#9aa5b1;
border:1px dashed #d9dde3;border-radius:4px}.note,.muted{color:#7b8794;font-size:13px}
.warn{color:#b35c00;font-size:13px}.err{color:#c92a2a}a{color:#1c64c4}
.card iframe{width:100%;height:300px;border:1px solid #eef0f3;border-radius:4px}
table.pvm td{white-space:nowrap}table.pvm td.n{text-align:right;font-variant-numeric:tabular-nums}
table.pvm td.d{white-space:normal;max-width:560px}table.pvm th{cursor:pointer;user-select:none}
table.pvm details summary{cursor:pointer;color:#52606d;font-size:12px}
table.pvm dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 10px;margin:6px 0;font-size:12.5px}
table.pvm dt{color:#7b8794}table.pvm dd{margin:0}.star{color:#e67700}.legend .badge{margin-left:8px}
.v-ok{background:#2f9e44}.v-expl{background:#1c7ed6}.v-bad{background:#c92a2a}.v-off{background:#e8590c}
.v-same{background:#69db7c;color:#1f2933}.v-other{background:#ffa8a8;color:#1f2933}
.v-none{background:#ced4da;color:#1f2933}
"""


def _e(x) -> str:
    return html.escape("" if x is None else str(x))


def _u(path: str) -> str:
    """A relative link, URL-quoted and HTML-escaped."""
    return html.escape(quote(path))


def _badge(text: str, cls: str) -> str:
    return f'<span class="badge {_e(cls)}">{_e(text)}</span>'


def _fmt_s(s) -> str:
    if s is None:
        return "?"
    s = float(s)
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def _status_badges(m: dict) -> str:
    out = _badge(m.get("status", "?"), m.get("status", "failed"))
    if m.get("outcome") == "reused":
        out += _badge("up to date, re-used", "reused")
    return out


def _coverage_cell(c: dict | None) -> str:
    if c is None:
        return "<span class=muted>no manifest</span>"
    missing = f", <span class=warn>{c['missing']} not made</span>" if c["missing"] else ""
    missing += f", <span class=muted>{c['needs_gpu']} skipped: needs a GPU</span>" if c.get("needs_gpu") else ""
    return (f"{c['made']} of {c['items']} reproduced, {c['not_reproduced']} not reproducible here{missing}"
            f"<br><span class=muted>{c['products_made']}/{c['products']} products made</span>")


def _pvm_cell(counts: dict | None, headlines: dict | None = None, verdicts: dict | None = None) -> str:
    if not counts:
        return "<span class=muted>—</span>"
    cell = ", ".join(f"{n} {_e(status)}" for status, n in counts.items())
    if verdicts:
        rank = list(VERDICT_STYLE)
        cell += "<br>" + " ".join(f"{_verdict_badge(v)}{n}" for v, n in sorted(
            verdicts.items(), key=lambda kv: rank.index(kv[0]) if kv[0] in rank else len(rank)))
    if headlines:
        cell += "<br><span class=muted>headline claims: " + ", ".join(
            f"{n} {_e(v)}" for v, n in headlines.items()) + "</span>"
    return cell


def _params_table(m: dict) -> str:
    used = m.get("parameters") or {}
    declared = m.get("declared") or {}
    rows = []
    for k in dict.fromkeys([*declared, *used]):
        d = declared.get(k, {})
        value = json.dumps(used[k]) if k in used else f"{d.get('default')} (default)"
        rows.append(f"<tr><td><code>{_e(k)}</code></td><td><code>{_e(value)}</code></td>"
                    f"<td>{_e(d.get('type') or '')}</td><td>{_e(d.get('help') or '')}</td></tr>")
    if not rows:
        return "<p class=muted>no parameters</p>"
    return ("<table><tr><th>parameter</th><th>value</th><th>type</th><th>meaning</th></tr>"
            + "".join(rows) + "</table>")


def _figure_card(f: dict, base: str) -> str:
    files = f["files"]
    main = files.get(".html") or files.get(".png") or files.get(".svg") or files.get(".pdf")
    if ".png" in files:
        img = (f'<a href="{_u(base + main)}"><img src="{_u(base + files[".png"])}" alt="{_e(f["title"])}" '
               f'loading="lazy"></a>')
    elif ".html" in files:  # no image: the interactive page itself, loaded on a click (the index stays light)
        img = (f'<div class=noimg>no image · <button class=show data-src="{_u(base + files[".html"])}">'
               f'draw it here</button></div>')
    else:
        img = '<div class=noimg>no PNG</div>'

    links = " · ".join(f'<a href="{_u(base + files[e])}">{e[1:].upper()}</a>'
                       for e in FIGURE_EXTS if e in files)
    return (f'<div class=card><p class=t>{_e(f["title"])}</p>{img}'
            f'<p class=l>{_badge(f["kind"], f["kind"])}{_e(f["label"] or "no label: say what this shows")}</p>'
            f'<p class=l>{links} <span class=muted>({_e(f["name"])})</span></p></div>')


def _table_section(t: dict, base: str | None, anchor: str = "") -> str:
    """A table with its title and label; ``base=None``: no file links (the single-file section)."""
    lab = f' {_badge(label_kind(t["label"]), label_kind(t["label"]))}{_e(t["label"])}' if t["label"] else ""
    links = "" if base is None else " · ".join(
        f'<a href="{_u(base + r)}">{e[1:].upper()}</a>' for e, r in t["files"].items() if e in (".csv", ".html"))
    body = (_pvm_html(t) if t["name"].endswith("table_paper_vs_moelab") else None) or _table_html(t)
    ident = f' id="{_e(anchor)}"' if anchor else ""
    return f"<h3{ident}>{_e(t['title'])}{lab}</h3>{body}" + (f"<p class=muted>{links}</p>" if links else "")


# ---- the paper-vs-moelab table, one line per number -----------------------------------------------------
# verdict -> (badge class, what it means); the order is the sort order (moelab.papers.kit.compare.VERDICTS)
VERDICT_STYLE = {
    "agrees": ("v-ok", "a SIMULATED ratio within ±25 % of the paper's number"),
    "explained": ("v-expl", "off by more, but a gap ladder closes at least 75 % of the log-gap"),
    "contradicted": ("v-bad", "moelab's evidence goes against the claim (stated in paper.yaml)"),
    "off, no stated cause": ("v-off", "off by more than ±25 %, with no ladder or stated cause"),
    "trend: same side": ("v-same", "a run on this machine on the paper's side of 'no effect'"),
    "trend: other side": ("v-other", "a run on this machine on the other side of 'no effect'"),
    "trend: no neutral": ("v-none", "a run on this machine; paper.yaml states no 'no effect' value"),
    "not evidence": ("v-none", "moelab's value was fitted to, chosen from or built on this paper number"),
    "no value": ("v-none", "moelab made no number here (not run, refused or no rows)"),
}
_PVM_COLUMNS = {"key", "paper", "moelab", "verdict"}
_STAR = "<span class=star title='a headline claim of the paper'>★</span>"


def _num(x, digits: int = 3) -> str:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return ""
    return "" if x != x else f"{x:.{digits}g}"


def _verdict_badge(verdict: str, status: str = "", explain: bool = True) -> str:
    """A verdict's coloured badge; ``explain``: what it means on hover (the legend's, not every row's)."""
    cls, means = VERDICT_STYLE.get(verdict, ("v-none", ""))
    text = f"not evidence: {status}" if verdict == "not evidence" and status else verdict
    tip = f' title="{_e(means)}"' if explain else ""
    return f'<span class="badge {cls}"{tip}>{_e(text)}</span>'


def _pvm_html(t: dict) -> str | None:
    """``table_paper_vs_moelab`` (:func:`moelab.papers.kit.compare.compare`) at a glance: one line per number
    (headline mark, key, figure, paper, moelab, ratio, a coloured verdict), the long label, note, source
    and status in an expandable detail; sortable by a click on a column's head. None for another table."""
    if ".csv" not in t["paths"]:
        return None
    import pandas as pd

    try:
        df = pd.read_csv(t["paths"][".csv"], dtype={"key": str}, keep_default_na=True)
    except Exception:  # noqa: BLE001 - the plain rendering reports it
        return None
    if not _PVM_COLUMNS <= set(df.columns):
        return None
    order = {v: i for i, v in enumerate(VERDICT_STYLE)}
    get = lambda r, c: "" if c not in r or r[c] != r[c] else r[c]  # noqa: E731 - NaN as empty
    rows = []
    for i, r in enumerate(df.to_dict("records")):
        verdict, status = str(get(r, "verdict")), str(get(r, "status"))
        head = str(get(r, "headline")).lower() in ("true", "1")
        unit = _e(get(r, "unit"))
        ratio = f"{float(get(r, 'ratio')):.2f}" if _num(get(r, "ratio")) else ""
        facts = [("quantity", get(r, "quantity")), ("paper at", get(r, "paper_at")), ("status", status),
                 ("why", get(r, "why")), ("trend", get(r, "trend")), ("note", get(r, "note")),
                 ("moelab label", get(r, "moelab_label")), ("paper source", get(r, "paper_source")),
                 ("moelab source", get(r, "source_id"))]
        detail = "".join(f"<dt>{k}</dt><dd>{_e(v)}</dd>" for k, v in facts if str(v).strip())
        rows.append(
            f'<tr data-i="{i}"><td data-k="{0 if head else 1}">{_STAR if head else ""}</td>'
            f'<td data-k="{_e(get(r, "key"))}"><code>{_e(get(r, "key"))}</code></td>'
            f'<td data-k="{_e(get(r, "figure"))}">{_e(get(r, "figure"))}</td>'
            f'<td class=n data-k="{_e(get(r, "paper"))}">{_num(get(r, "paper"))} <span class=muted>{unit}</span></td>'
            f'<td class=n data-k="{_e(get(r, "moelab"))}">{_num(get(r, "moelab")) or "—"}</td>'
            f'<td class=n data-k="{_e(get(r, "ratio"))}">{"×" + ratio if ratio else ""}</td>'
            f'<td data-k="{order.get(verdict, len(order))}">{_verdict_badge(verdict, status, False)}</td>'
            f'<td class=d><details><summary>details</summary><dl>{detail}</dl></details></td></tr>')
    counts = df["verdict"].value_counts()
    legend = " ".join(f"{_verdict_badge(v)} {int(counts[v])}" for v in VERDICT_STYLE if v in counts)
    heads = "".join(f'<th data-col="{c}" title="sort">{h}</th>' for c, h in enumerate(
        ["★", "key", "figure", "paper", "moelab", "moelab / paper", "verdict ▾", "label, note, source"]))
    return (f"<p class=legend>{legend}</p><table class=pvm><thead><tr>{heads}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>"
            "<p class=muted>one line per number: click a column's head to sort (verdict first: agrees, "
            "explained, contradicted, off ...); ★ marks the paper's headline claims; hover a verdict above the "
            "table for what it means, open details for the quantity, label, note and source</p>")


_SORT_JS = """
document.querySelectorAll("button.show").forEach(function (b) {
  b.addEventListener("click", function () {
    var f = document.createElement("iframe"); f.src = b.dataset.src; f.title = "figure";
    b.parentNode.replaceWith(f); });
});
document.querySelectorAll("table.pvm").forEach(function (t) {
  t.querySelectorAll("th[data-col]").forEach(function (th) {
    th.addEventListener("click", function () {
      var c = +th.dataset.col, body = t.tBodies[0], up = th.dataset.dir !== "up";
      th.dataset.dir = up ? "up" : "down";
      var rows = Array.prototype.slice.call(body.rows), key = function (r) {
        var v = r.cells[c].dataset.k, n = parseFloat(v);
        return v !== "" && !isNaN(n) && isFinite(v) ? n : v; };
      rows.sort(function (a, b) {
        var x = key(a), y = key(b), d = typeof x === typeof y ? (x < y ? -1 : x > y ? 1 : 0)
          : (typeof x === "number" ? -1 : 1);
        return (up ? d : -d) || (+a.dataset.i - +b.dataset.i); });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
});
"""


def _figures_rel(m: dict) -> str:
    """A notebook's exported-files folder, relative to the report."""
    return m.get("figures_dir") or f"figures/{m.get('name', '?')}"


def _section(m: dict, out: Path, found: dict) -> str:
    """One notebook's section; ``found`` is :func:`collect` of its folder, figures in manifest order."""
    name = m.get("name", "?")
    fig_rel = _figures_rel(m)
    base = fig_rel.rstrip("/") + "/"
    kinds = sorted({f["kind"] for f in found["figures"]} | {label_kind(t["label"]) for t in found["tables"]
                                                            if t["label"]})
    head = (f'<section id="nb-{_e(name)}"><h2>{_e(name)} {_status_badges(m)}</h2>'
            f'<p>{" ".join(_badge(k, k) for k in kinds)}'
            f'<a href="{_u(m.get("executed", ""))}">executed notebook</a> · source <code>{_e(m.get("notebook"))}</code>'
            f' · scale <b>{_e(m.get("scale"))}</b> · parameters from '
            f'<code>{_e(m.get("parameters_file") or "notebook defaults")}</code></p>'
            f'<p class=muted>run time {_fmt_s(m.get("wall_s"))}, started {_e(m.get("started"))}; '
            f'last checked {_e(m.get("checked"))}: {_e(m.get("outcome"))} — {_e(m.get("reason"))}</p>')
    body = [head]
    body += [f"<p class=warn>warning: {_e(w)}</p>" for w in m.get("warnings") or []]
    if m.get("error"):
        body.append(f"<h3>Error</h3><pre>{_e(m['error'])}</pre>")
    body.append(_manifest_html(out / fig_rel, base))
    pvm = [t for t in found["tables"] if t["name"].endswith(("table_paper_vs_moelab", "table_gap_ladders"))]
    body += [_table_section(t, base) for t in pvm]  # the paper's numbers beside moelab's and the ladders first
    if found["figures"]:
        body.append(f"<h3>Figures ({len(found['figures'])})</h3><div class=grid>"
                    + "".join(_figure_card(f, base) for f in found["figures"]) + "</div>")
    elif m.get("status") == "ok":
        body.append("<p class=muted>no figures exported</p>")
    body += [_table_section(t, base) for t in found["tables"] if t not in pvm]
    if found["others"]:
        body.append("<h3>Other files</h3><p>" + " · ".join(
            f'<a href="{_u(base + r)}">{_e(r)}</a>' for r in found["others"]) + "</p>")
    body.append(f"<h3>Parameters</h3>{_params_table(m)}</section>")
    return "\n".join(body)


def build_index(out: str | Path, session: dict | None = None) -> Path:
    """Write ``out/index.html`` from every notebook manifest and exported file under ``out``."""
    from moelab import __version__
    from moelab.runtime.results import atomic_write_text

    out = Path(out)
    manifests = load_manifests(out)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    sub = f"moelab {__version__} · written {now}"
    if session:
        sub += (f" · last call: {', '.join(session.get('names', []))} at scale {session.get('scale')}, "
                f"{_fmt_s(session.get('wall_s'))}")
    rows, found = [], []
    for m in manifests:
        folder = out / _figures_rel(m)
        found.append(collect(folder))
        order = {stem: i for i, stem in enumerate(figure_order(folder))}
        found[-1]["figures"].sort(key=lambda f: order.get(f["name"], len(order)))  # stable: the rest as written
        n = len(found[-1]["figures"])
        pvm = _pvm_cell(paper_vs_moelab_counts(folder), headline_verdicts(folder),
                        paper_vs_moelab_counts(folder, "verdict"))
        rows.append(f'<tr><td><a href="#nb-{_e(m.get("name"))}">{_e(m.get("name"))}</a></td>'
                    f"<td>{_status_badges(m)}</td><td>{_e(m.get('scale'))}</td><td>{_fmt_s(m.get('wall_s'))}</td>"
                    f"<td>{_coverage_cell(coverage(folder))}</td>"
                    f"<td>{pvm}</td>"
                    f"<td>{n}</td><td>{_e(m.get('reason'))}</td></tr>")
    bad = [m for m in manifests if m.get("status") != "ok"]
    summary = (f"<section><h2>Notebooks</h2><p>{len(manifests) - len(bad)} ok, {len(bad)} failed. Labels: "
               + " ".join(_badge(k, k) for k in KINDS) + " — REAL: measured on real processes; EMULATED: "
               "real processes with emulated links; SIMULATED: the simulator at a cluster profile; "
               "SUBSTITUTE: a stand-in for what the paper used; PAPER: the paper's own numbers.</p>"
               "<table><tr><th>notebook</th><th>status</th><th>scale</th><th>run time</th><th>paper items</th>"
               "<th>paper vs moelab</th><th>figures</th><th>why it ran / was re-used</th></tr>" + "".join(rows)
               + "</table></section>"
               if manifests else "<section><p>No notebooks have been run into this folder.</p></section>")
    page = (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>moelab report</title>"
            f"<meta name=viewport content='width=device-width,initial-scale=1'><style>{_CSS}</style></head>"
            f"<body><header><h1>moelab report</h1><p>{_e(sub)}</p></header><main>{summary}"
            + "\n".join(_section(m, out, f) for m, f in zip(manifests, found))
            + f"</main><script>{_SORT_JS}</script></body></html>\n")
    return atomic_write_text(out / "index.html", page)


# ---- a paper's section as one file, and its files as one zip --------------------------------------------
class SectionError(ValueError):
    """No such section in the report folder."""


def find_section(out: str | Path, name: str) -> tuple[dict, Path]:
    """The notebook manifest (``notebooks/*.run.json``; a bare one when there is none) and the exported-files
    folder of section ``name`` (a notebook name: ``parm``, ``quickstart``) in report folder ``out``."""
    out = Path(out)
    for m in load_manifests(out):
        if m.get("name") == name:
            return m, out / _figures_rel(m)
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

    from moelab.viz.export import figure_json, read_figure

    head = (f'<div class=fig><p class=t>{_e(f["title"])}</p><p class=l>{_badge(f["kind"], f["kind"])}'
            f'{_e(f["label"] or "no label: say what this shows")}</p>')
    spec = read_figure(folder / f["files"][".html"]) if ".html" in f["files"] else None
    if spec is not None:
        lay = spec.get("layout") or {}
        size = f"height:{int(lay.get('height') or 500)}px"
        size += f";max-width:{int(lay['width'])}px" if lay.get("width") else ""
        return (f'{head}<div class=plot id="{ident}" style="{size}"></div>'
                f'<script type="application/json" id="d-{ident}">{figure_json(spec)}</script></div>')
    if ".png" in f["files"]:
        data = base64.b64encode((folder / f["files"][".png"]).read_bytes()).decode()
        return f'{head}<img id="{ident}" alt="{_e(f["title"])}" src="data:image/png;base64,{data}"></div>'
    return f'{head}<p class=warn id="{ident}">no figure data in {_e(f["name"])} (re-run the notebook)</p></div>'


def single_file(out: str | Path, name: str, path: str | Path) -> Path:
    """Write section ``name`` of report folder ``out`` as one self-contained HTML file ``path``: the paper's
    manifest (its links jump within the page), the paper-vs-moelab table, the gap ladders, every other table
    and every figure (interactive: one plotly.js inside, each figure drawn when scrolled to). Opens offline."""
    from moelab import __version__
    from moelab.runtime.results import atomic_write_text
    from moelab.viz.export import plotlyjs_source

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
           f"run time {_fmt_s(m.get('wall_s'))} · written {now}")
    body = [f"<section><p>{' '.join(_badge(k, k) for k in KINDS)} REAL: measured on real processes; EMULATED: "
            "real processes with emulated links; SIMULATED: the simulator at a cluster profile; SUBSTITUTE: a "
            "stand-in for what the paper used; PAPER: the paper's own numbers.</p>",
            _manifest_html(folder, "", link=link)]
    body += [_table_section(t, None, tids[t["name"]]) for t in pvm]
    body.append(f"<h3>Figures ({len(found['figures'])})</h3>"
                + "".join(_figure_block(f, folder, ids[f["name"]]) for f in found["figures"]))
    body += [_table_section(t, None, tids[t["name"]]) for t in rest]
    if m.get("declared") or m.get("parameters"):
        body.append(f"<h3>Parameters</h3>{_params_table(m)}")
    body.append("</section>")
    js = plotlyjs_source().read_text(encoding="utf-8")
    page = (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{_e(title)}: moelab</title>"
            f"<meta name=viewport content='width=device-width,initial-scale=1'><style>{_CSS}"
            ".fig{margin:18px 0;border-top:1px solid #e4e7eb;padding-top:10px}.fig .t{font-weight:600;margin:0}"
            ".fig .l{font-size:12.5px;color:#52606d;margin:4px 0}.fig img{max-width:100%}</style>"
            f"<script>{js}</script></head><body><header><h1>{_e(title)}</h1><p>{_e(sub)}</p></header><main>"
            + "\n".join(body) + f"</main><script>{_SORT_JS}{_DRAW_JS}</script></body></html>\n")
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
            (m, out / _figures_rel(m)) for m in load_manifests(out)]
    except SectionError as e:
        print(f"moelab: {e}", file=sys.stderr)
        return 2
    if args.images:
        from moelab.viz.export import NO_CHROMIUM, find_chromium, image_session

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
