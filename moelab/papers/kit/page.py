"""The static report page ``DIR/index.html`` that ``moelab reproduce`` writes: a summary per paper notebook (run
time, manifest coverage, paper-vs-moelab verdicts), then each paper's section with its manifest, the paper-vs-moelab
table, the gap ladders and its figures in manifest order.

The page is one static HTML file with its CSS and a little plain JS inline and relative links (the output
folder can be moved or served as is). It holds no figure data and no plotly.js: PNGs are thumbnails linking to
the interactive pages (which load ``DIR/assets/plotly-*.min.js``), a figure without a PNG is drawn on a click.
``table_paper_vs_moelab`` reads one line per number with a coloured verdict (:func:`_pvm_html`), sortable.
"""
from __future__ import annotations

import html
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

from moelab.papers.kit.report import (
    FIGURE_EXTS,
    KINDS,
    MAX_TABLE_ROWS,
    _paper_manifest,
    collect,
    coverage,
    figure_order,
    headline_verdicts,
    label_kind,
    load_manifests,
    paper_vs_moelab_counts,
    read_paper_vs_moelab,
)

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
        table = read_paper_vs_moelab(folder)  # read once for the three counts
        pvm = _pvm_cell(paper_vs_moelab_counts(folder, table=table), headline_verdicts(folder, table),
                        paper_vs_moelab_counts(folder, "verdict", table=table))
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


# ---- tables and the manifest, as HTML ------------------------------------------------------------
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
