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
  other ``.csv``; at most :data:`MAX_TABLE_ROWS` rows inline, the file is linked;
- anything else is linked under "other files".

The page is one static HTML file with its CSS inline and relative links (the output folder can be
moved or served as is); PNGs are shown as thumbnails linking to the interactive HTML.
"""
from __future__ import annotations

import html
import json
import re
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
    m = _META_LABEL.search(text, max(text.rfind("Plotly.newPlot("), 0))  # the figure, after plotly.js
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
        if is_table:
            tables.append({"name": name, "title": (side or {}).get("title") or name,
                           "label": (side or {}).get("label"), "files": rel, "paths": files})
            others += [r for e, r in rel.items() if e not in (".csv", ".html", ".json")]
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


def _manifest_html(folder: Path, base: str) -> str:
    """The paper's manifest (``manifest.json`` written by :class:`moelab.papers.kit.session.Session`): every
    table and figure of the paper, with links to what moelab made of it or the reason it is missing."""
    m = _paper_manifest(folder)
    if m is None:
        return ""
    rows = []
    for it in m.get("items", []):
        if not it.get("products"):
            rows.append(f"<tr><td>{_e(it['id'])}</td><td>{_e(it['title'])}</td><td>{_badge('NOT REPRODUCED', 'NO')}"
                        f"</td><td class=muted>{_e(it.get('not_reproduced'))}</td></tr>")
        for p in it.get("products", []):
            links = " · ".join(f'<a href="{_u(base + f["file"])}">{_e(f["stem"])}</a>' for f in p.get("files", []))
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


# ---- the page ------------------------------------------------------------------------------------
_CSS = """
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


def _pvm_cell(counts: dict | None, headlines: dict | None = None) -> str:
    if not counts:
        return "<span class=muted>—</span>"
    cell = ", ".join(f"{n} {_e(status)}" for status, n in counts.items())
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
    img = (f'<a href="{_u(base + main)}"><img src="{_u(base + files[".png"])}" alt="{_e(f["title"])}" '
           f'loading="lazy"></a>' if ".png" in files else '<div class=noimg>no PNG (HTML only)</div>')
    links = " · ".join(f'<a href="{_u(base + files[e])}">{e[1:].upper()}</a>'
                       for e in FIGURE_EXTS if e in files)
    return (f'<div class=card><p class=t>{_e(f["title"])}</p>{img}'
            f'<p class=l>{_badge(f["kind"], f["kind"])}{_e(f["label"] or "no label: say what this shows")}</p>'
            f'<p class=l>{links} <span class=muted>({_e(f["name"])})</span></p></div>')


def _table_section(t: dict, base: str) -> str:
    lab = f' {_badge(label_kind(t["label"]), label_kind(t["label"]))}{_e(t["label"])}' if t["label"] else ""
    links = " · ".join(f'<a href="{_u(base + r)}">{e[1:].upper()}</a>' for e, r in t["files"].items()
                       if e in (".csv", ".html"))
    return f"<h3>{_e(t['title'])}{lab}</h3>{_table_html(t)}<p class=muted>{links}</p>"


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
        rows.append(f'<tr><td><a href="#nb-{_e(m.get("name"))}">{_e(m.get("name"))}</a></td>'
                    f"<td>{_status_badges(m)}</td><td>{_e(m.get('scale'))}</td><td>{_fmt_s(m.get('wall_s'))}</td>"
                    f"<td>{_coverage_cell(coverage(folder))}</td>"
                    f"<td>{_pvm_cell(paper_vs_moelab_counts(folder), headline_verdicts(folder))}</td>"
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
            + "\n".join(_section(m, out, f) for m, f in zip(manifests, found)) + "</main></body></html>\n")
    return atomic_write_text(out / "index.html", page)
