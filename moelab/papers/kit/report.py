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

This module records and reads an output folder; the page is :mod:`moelab.papers.kit.page`, the images of
recorded figures :mod:`moelab.papers.kit.images`, one paper's section as one file or a zip (``moelab report``)
:mod:`moelab.papers.kit.publish`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from moelab.papers.kit.manifest import NO_CUDA
from moelab.runtime.results import atomic_write_csv, atomic_write_json
from moelab.viz.export import export_figure
from moelab.viz.figures import check_label

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


def read_paper_vs_moelab(folder: str | Path):
    """``table_paper_vs_moelab.csv`` of an output folder as a frame, or None where there is none."""
    path = Path(folder) / "table_paper_vs_moelab.csv"
    if not path.is_file():
        return None
    import pandas as pd

    try:
        return pd.read_csv(path)
    except ValueError:
        return None


def paper_vs_moelab_counts(folder: str | Path, column: str = "status", *, headline_only: bool = False,
                           table=None) -> dict | None:
    """Rows of ``table_paper_vs_moelab.csv`` by ``column``: status (ratio, trend check, fit, chosen from, input,
    refused, no value, not run) or verdict (agrees, explained, contradicted, off, ...); ``headline_only``: the
    headline claims' rows (``headline: true`` in paper.yaml); ``table``: the frame, if already read."""
    df = read_paper_vs_moelab(folder) if table is None else table
    if df is None:
        return None
    try:
        if headline_only:
            df = df[df.headline.astype(bool)]
        return df[column].value_counts().to_dict()
    except (ValueError, KeyError, AttributeError):
        return None


def headline_verdicts(folder: str | Path, table=None) -> dict | None:
    """The headline claims' rows by verdict."""
    return paper_vs_moelab_counts(folder, "verdict", headline_only=True, table=table)


def load_manifests(out: str | Path) -> list[dict]:
    """Every notebook's manifest in ``out/notebooks/`` (written by ``moelab reproduce``)."""
    found = []
    for p in sorted(Path(out, "notebooks").glob("*.run.json")):
        try:
            found.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return found
