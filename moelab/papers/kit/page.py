"""The static report page ``DIR/index.html`` that ``moelab reproduce`` writes: a summary per paper notebook (run
time, manifest coverage, paper-vs-moelab verdicts), then each paper's section with its manifest, the paper-vs-moelab
table, the gap ladders and its figures in manifest order.

The page is one static HTML file with its CSS and a little plain JS inline and relative links (the output
folder can be moved or served as is). It holds no figure data and no plotly.js: PNGs are thumbnails linking to
the interactive pages (which load ``DIR/assets/plotly-*.min.js``), a figure without a PNG is drawn on a click.
``table_paper_vs_moelab`` reads one line per number with a coloured verdict, sortable; the blocks this page shares
with a paper's section as one file are in :mod:`moelab.papers.kit.html`.
"""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from moelab import __version__
from moelab.papers.kit.html import (
    CSS,
    PAGE_JS,
    VERDICT_STYLE,
    badge,
    esc,
    fmt_s,
    kinds_legend,
    manifest_html,
    params_table,
    table_section,
    url,
    verdict_badge,
)
from moelab.papers.kit.report import (
    FIGURE_EXTS,
    collect,
    coverage,
    figure_order,
    headline_verdicts,
    label_kind,
    load_manifests,
    paper_vs_moelab_counts,
    read_paper_vs_moelab,
)
from moelab.runtime.results import atomic_write_text


# ---- the page ------------------------------------------------------------------------------------
def _status_badges(m: dict) -> str:
    out = badge(m.get("status", "?"), m.get("status", "failed"))
    if m.get("outcome") == "reused":
        out += badge("up to date, re-used", "reused")
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
    cell = ", ".join(f"{n} {esc(status)}" for status, n in counts.items())
    if verdicts:
        rank = list(VERDICT_STYLE)
        cell += "<br>" + " ".join(f"{verdict_badge(v)}{n}" for v, n in sorted(
            verdicts.items(), key=lambda kv: rank.index(kv[0]) if kv[0] in rank else len(rank)))
    if headlines:
        cell += "<br><span class=muted>headline claims: " + ", ".join(
            f"{n} {esc(v)}" for v, n in headlines.items()) + "</span>"
    return cell


def _figure_card(f: dict, base: str) -> str:
    files = f["files"]
    main = files.get(".html") or files.get(".png") or files.get(".svg") or files.get(".pdf")
    if ".png" in files:
        img = (f'<a href="{url(base + main)}"><img src="{url(base + files[".png"])}" alt="{esc(f["title"])}" '
               f'loading="lazy"></a>')
    elif ".html" in files:  # no image: the interactive page itself, loaded on a click (the index stays light)
        img = (f'<div class=noimg>no image · <button class=show data-src="{url(base + files[".html"])}">'
               f'draw it here</button></div>')
    else:
        img = '<div class=noimg>no PNG</div>'

    links = " · ".join(f'<a href="{url(base + files[e])}">{e[1:].upper()}</a>'
                       for e in FIGURE_EXTS if e in files)
    return (f'<div class=card><p class=t>{esc(f["title"])}</p>{img}'
            f'<p class=l>{badge(f["kind"], f["kind"])}{esc(f["label"] or "no label: say what this shows")}</p>'
            f'<p class=l>{links} <span class=muted>({esc(f["name"])})</span></p></div>')


def figures_rel(m: dict) -> str:
    """A notebook's exported-files folder, relative to the report."""
    return m.get("figures_dir") or f"figures/{m.get('name', '?')}"


def _section(m: dict, out: Path, found: dict) -> str:
    """One notebook's section; ``found`` is :func:`collect` of its folder, figures in manifest order."""
    name = m.get("name", "?")
    fig_rel = figures_rel(m)
    base = fig_rel.rstrip("/") + "/"
    kinds = sorted({f["kind"] for f in found["figures"]} | {label_kind(t["label"]) for t in found["tables"]
                                                            if t["label"]})
    head = (f'<section id="nb-{esc(name)}"><h2>{esc(name)} {_status_badges(m)}</h2>'
            f'<p>{" ".join(badge(k, k) for k in kinds)}'
            f'<a href="{url(m.get("executed", ""))}">executed notebook</a> · source '
            f'<code>{esc(m.get("notebook"))}</code>'
            f' · scale <b>{esc(m.get("scale"))}</b> · parameters from '
            f'<code>{esc(m.get("parameters_file") or "notebook defaults")}</code></p>'
            f'<p class=muted>run time {fmt_s(m.get("wall_s"))}, started {esc(m.get("started"))}; '
            f'last checked {esc(m.get("checked"))}: {esc(m.get("outcome"))} — {esc(m.get("reason"))}</p>')
    body = [head]
    body += [f"<p class=warn>warning: {esc(w)}</p>" for w in m.get("warnings") or []]
    if m.get("error"):
        body.append(f"<h3>Error</h3><pre>{esc(m['error'])}</pre>")
    body.append(manifest_html(out / fig_rel, base))
    pvm = [t for t in found["tables"] if t["name"].endswith(("table_paper_vs_moelab", "table_gap_ladders"))]
    body += [table_section(t, base) for t in pvm]  # the paper's numbers beside moelab's and the ladders first
    if found["figures"]:
        body.append(f"<h3>Figures ({len(found['figures'])})</h3><div class=grid>"
                    + "".join(_figure_card(f, base) for f in found["figures"]) + "</div>")
    elif m.get("status") == "ok":
        body.append("<p class=muted>no figures exported</p>")
    body += [table_section(t, base) for t in found["tables"] if t not in pvm]
    if found["others"]:
        body.append("<h3>Other files</h3><p>" + " · ".join(
            f'<a href="{url(base + r)}">{esc(r)}</a>' for r in found["others"]) + "</p>")
    body.append(f"<h3>Parameters</h3>{params_table(m)}</section>")
    return "\n".join(body)


def build_index(out: str | Path, session: dict | None = None) -> Path:
    """Write ``out/index.html`` from every notebook manifest and exported file under ``out``."""
    out = Path(out)
    manifests = load_manifests(out)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    sub = f"moelab {__version__} · written {now}"
    if session:
        sub += (f" · last call: {', '.join(session.get('names', []))} at scale {session.get('scale')}, "
                f"{fmt_s(session.get('wall_s'))}")
    rows, found = [], []
    for m in manifests:
        folder = out / figures_rel(m)
        found.append(collect(folder))
        order = {stem: i for i, stem in enumerate(figure_order(folder))}
        found[-1]["figures"].sort(key=lambda f: order.get(f["name"], len(order)))  # stable: the rest as written
        n = len(found[-1]["figures"])
        table = read_paper_vs_moelab(folder)  # read once for the three counts
        pvm = _pvm_cell(paper_vs_moelab_counts(folder, table=table), headline_verdicts(folder, table),
                        paper_vs_moelab_counts(folder, "verdict", table=table))
        rows.append(f'<tr><td><a href="#nb-{esc(m.get("name"))}">{esc(m.get("name"))}</a></td>'
                    f"<td>{_status_badges(m)}</td><td>{esc(m.get('scale'))}</td><td>{fmt_s(m.get('wall_s'))}</td>"
                    f"<td>{_coverage_cell(coverage(folder))}</td>"
                    f"<td>{pvm}</td>"
                    f"<td>{n}</td><td>{esc(m.get('reason'))}</td></tr>")
    bad = [m for m in manifests if m.get("status") != "ok"]
    summary = (f"<section><h2>Notebooks</h2><p>{len(manifests) - len(bad)} ok, {len(bad)} failed. Labels: "
               + kinds_legend() + "</p>"
               "<table><tr><th>notebook</th><th>status</th><th>scale</th><th>run time</th><th>paper items</th>"
               "<th>paper vs moelab</th><th>figures</th><th>why it ran / was re-used</th></tr>" + "".join(rows)
               + "</table></section>"
               if manifests else "<section><p>No notebooks have been run into this folder.</p></section>")
    page = (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>moelab report</title>"
            f"<meta name=viewport content='width=device-width,initial-scale=1'><style>{CSS}</style></head>"
            f"<body><header><h1>moelab report</h1><p>{esc(sub)}</p></header><main>{summary}"
            + "\n".join(_section(m, out, f) for m, f in zip(manifests, found))
            + f"</main><script>{PAGE_JS}</script></body></html>\n")
    return atomic_write_text(out / "index.html", page)
