"""HTML blocks of a report that the report page (:mod:`moelab.papers.kit.page`, ``DIR/index.html``) and a
paper's section as one file (:mod:`moelab.papers.kit.publish`) both show: the style sheet and the page script,
escaping and badges, the paper's manifest, the parameters, and tables, ``table_paper_vs_moelab`` one line per
number with a coloured verdict (:func:`pvm_html`), sortable."""
from __future__ import annotations

import html
import json
import re
from pathlib import Path
from urllib.parse import quote

from moelab.papers.kit.report import KINDS, MAX_TABLE_ROWS, _paper_manifest, label_kind

# ---- style, escaping, badges ----------------------------------------------------------------------
CSS = """/* # not a paper number: the decimals below are sizes */
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


def esc(x) -> str:
    return html.escape("" if x is None else str(x))


def url(path: str) -> str:
    """A relative link, URL-quoted and HTML-escaped."""
    return html.escape(quote(path))


def badge(text: str, cls: str) -> str:
    return f'<span class="badge {esc(cls)}">{esc(text)}</span>'


def kinds_legend() -> str:
    """The five labels as badges, each with what it means."""
    return (" ".join(badge(k, k) for k in KINDS) + " — REAL: measured on real processes; EMULATED: real processes "
            "with emulated links; SIMULATED: the simulator at a cluster profile; SUBSTITUTE: a stand-in for what the "
            "paper used; PAPER: the paper's own numbers.")


def fmt_s(s) -> str:
    if s is None:
        return "?"
    s = float(s)
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"



def params_table(m: dict) -> str:
    used = m.get("parameters") or {}
    declared = m.get("declared") or {}
    rows = []
    for k in dict.fromkeys([*declared, *used]):
        d = declared.get(k, {})
        value = json.dumps(used[k]) if k in used else f"{d.get('default')} (default)"
        rows.append(f"<tr><td><code>{esc(k)}</code></td><td><code>{esc(value)}</code></td>"
                    f"<td>{esc(d.get('type') or '')}</td><td>{esc(d.get('help') or '')}</td></tr>")
    if not rows:
        return "<p class=muted>no parameters</p>"
    return ("<table><tr><th>parameter</th><th>value</th><th>type</th><th>meaning</th></tr>"
            + "".join(rows) + "</table>")



def table_section(t: dict, base: str | None, anchor: str = "") -> str:
    """A table with its title and label; ``base=None``: no file links (the single-file section)."""
    lab = f' {badge(label_kind(t["label"]), label_kind(t["label"]))}{esc(t["label"])}' if t["label"] else ""
    links = "" if base is None else " · ".join(
        f'<a href="{url(base + r)}">{e[1:].upper()}</a>' for e, r in t["files"].items() if e in (".csv", ".html"))
    body = (pvm_html(t) if t["name"].endswith("table_paper_vs_moelab") else None) or table_html(t)
    ident = f' id="{esc(anchor)}"' if anchor else ""
    return f"<h3{ident}>{esc(t['title'])}{lab}</h3>{body}" + (f"<p class=muted>{links}</p>" if links else "")


# ---- the paper-vs-moelab table, one line per number -----------------------------------------------------
# verdict -> (badge class, what it means); the order is the sort order (moelab.papers.kit.compare.VERDICTS)
VERDICT_STYLE = {
    "agrees": ("v-ok", "a SIMULATED ratio within ±25 % of the paper's number"),
    "explained": ("v-expl", "off by more, but a gap ladder of sourced rungs closes at least 75 % of the log-gap "
                            "or ends within ±25 %"),
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


def num(x, digits: int = 3) -> str:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return ""
    return "" if x != x else f"{x:.{digits}g}"


def verdict_badge(verdict: str, status: str = "", explain: bool = True) -> str:
    """A verdict's coloured badge; ``explain``: what it means on hover (the legend's, not every row's)."""
    cls, means = VERDICT_STYLE.get(verdict, ("v-none", ""))
    text = f"not evidence: {status}" if verdict == "not evidence" and status else verdict
    tip = f' title="{esc(means)}"' if explain else ""
    return f'<span class="badge {cls}"{tip}>{esc(text)}</span>'


def pvm_html(t: dict) -> str | None:
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
        unit = esc(get(r, "unit"))
        ratio = f"{float(get(r, 'ratio')):.2f}" if num(get(r, "ratio")) else ""
        facts = [("quantity", get(r, "quantity")), ("paper at", get(r, "paper_at")), ("status", status),
                 ("why", get(r, "why")), ("trend", get(r, "trend")), ("note", get(r, "note")),
                 ("moelab label", get(r, "moelab_label")), ("paper source", get(r, "paper_source")),
                 ("moelab source", get(r, "source_id"))]
        detail = "".join(f"<dt>{k}</dt><dd>{esc(v)}</dd>" for k, v in facts if str(v).strip())
        rows.append(
            f'<tr data-i="{i}"><td data-k="{0 if head else 1}">{_STAR if head else ""}</td>'
            f'<td data-k="{esc(get(r, "key"))}"><code>{esc(get(r, "key"))}</code></td>'
            f'<td data-k="{esc(get(r, "figure"))}">{esc(get(r, "figure"))}</td>'
            f'<td class=n data-k="{esc(get(r, "paper"))}">{num(get(r, "paper"))} <span class=muted>{unit}</span></td>'
            f'<td class=n data-k="{esc(get(r, "moelab"))}">{num(get(r, "moelab")) or "—"}</td>'
            f'<td class=n data-k="{esc(get(r, "ratio"))}">{"×" + ratio if ratio else ""}</td>'
            f'<td data-k="{order.get(verdict, len(order))}">{verdict_badge(verdict, status, False)}</td>'
            f'<td class=d><details><summary>details</summary><dl>{detail}</dl></details></td></tr>')
    counts = df["verdict"].value_counts()
    legend = " ".join(f"{verdict_badge(v)} {int(counts[v])}" for v in VERDICT_STYLE if v in counts)
    heads = "".join(f'<th data-col="{c}" title="sort">{h}</th>' for c, h in enumerate(
        ["★", "key", "figure", "paper", "moelab", "moelab / paper", "verdict ▾", "label, note, source"]))
    return (f"<p class=legend>{legend}</p><table class=pvm><thead><tr>{heads}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>"
            "<p class=muted>one line per number: click a column's head to sort (verdict first: agrees, "
            "explained, contradicted, off ...); ★ marks the paper's headline claims; hover a verdict above the "
            "table for what it means, open details for the quantity, label, note and source</p>")


# the page script: a figure drawn on a click (button.show), paper-vs-moelab tables sorted by a click on a head
PAGE_JS = """
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


# ---- tables and the manifest ------------------------------------------------------------
def table_html(table: dict) -> str:
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


def manifest_html(folder: Path, base: str, link=None) -> str:
    """The paper's manifest (``manifest.json`` written by :class:`moelab.papers.kit.session.Session`): every
    table and figure of the paper, with links to what moelab made of it or the reason it is missing.
    ``link(file entry) -> href`` replaces the relative file links (the single-file section's anchors)."""
    link = link or (lambda f: url(base + f["file"]))
    m = _paper_manifest(folder)
    if m is None:
        return ""
    rows = []
    for it in m.get("items", []):
        if not it.get("products"):
            rows.append(f"<tr><td>{esc(it['id'])}</td><td>{esc(it['title'])}</td><td>{badge('NOT REPRODUCED', 'NO')}"
                        f"</td><td class=muted>{esc(it.get('not_reproduced'))}</td></tr>")
        for p in it.get("products", []):
            links = " · ".join(f'<a href="{link(f)}">{esc(f["stem"])}</a>' for f in p.get("files", []))
            what = (links if p.get("status") == "made"
                    else f"<span class=warn>{esc(p.get('status'))}: {esc(p.get('reason'))}</span>")
            notes = "".join(f"<br><span class=muted>{esc(n)}</span>" for n in p.get("notes", []) if len(n) < 300)
            rows.append(f"<tr><td>{esc(it['id'])}</td><td>{esc(it['title'])}</td><td>{badge(p['cls'], p['cls'])}"
                        f"{esc(p['id'])}</td><td>{what}{notes}</td></tr>")
    return (f"<h3>Manifest: what the paper has, what moelab made of it</h3><p class=muted>{esc(m.get('title'))} · "
            f"spec <code>{esc(m.get('spec'))}</code></p><table><tr><th>paper item</th><th>title</th>"
            f"<th>moelab product</th><th>files, or why not</th></tr>{''.join(rows)}</table>")
