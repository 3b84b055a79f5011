"""Paper vs moelab, driven by ``experiments/<paper>/paper.yaml``: the paper's numbers as data, each
naming the moelab product, rows, column and reducer that give moelab's counterpart::

    numbers:
      zero3_speedup_trevor:
        value: 17.87
        quantity: MoE-layer time speedup of FasterMoE over ZeRO-3
        unit: x
        at: trevor, 64 V100-SXM2 (paper scale)
        figure: Fig. 10
        source: spec §1; §4 Fig. 10
        neutral: 1.0                     # optional: the value meaning "no effect" (trend checks)
        moelab:
          - {product: fig10, where: {system: FasterMoE, cluster: trevor}, column: speedup_vs_zero3, reduce: max}

Rules, so that a row never sets two different things side by side:

- the product must declare the column's :class:`~moelab.papers.kit.registry.Quantity`; a column of another
  quantity or unit is **refused** (the row says why, no ratio);
- a SIMULATED moelab value (the paper's cluster, priced) gets the ratio moelab / paper;
- a REAL, EMULATED or SUBSTITUTE value (a CPU box, not the paper's scale) is a **trend check**: no
  ratio, only whether it lies on the same side of ``neutral`` as the paper's; so is a SIMULATED value whose
  source says ``trend: <why>`` (moelab prices a coarser quantity, e.g. one value per model where the paper's
  number is one task's cell);
- a product that was not made gives a "not run" row; one that was made without a number there (no row
  matches, or only NaN: e.g. a system that never reached the target) a "no value" row.

Circular rows are named, never counted as agreement (the value and ratio stay visible):

- **fit**: an assumption of kind ``fitted`` lists the paper key in ``fitted_to`` (and the product in
  ``affects``): moelab's number was fitted to this paper number;
- **chosen from**: a guess lists the key in ``chosen_from``: it was reasoned from this very number;
- **input**: the moelab source lists paper keys in ``inputs``: its value used the paper's numbers as input.

Each row then gets a ``verdict`` (:data:`VERDICTS`): a SIMULATED ratio within ±25 % *agrees*; one further
off is *explained* when its gap ladder (:mod:`moelab.papers.kit.ladder`), walking from this row's value, closes
at least 75 % of the log-gap and overshoots by no more than 25 %, or ends where a direct row would agree,
*contradicted* when the paper.yaml entry states moelab's evidence against the claim (``contradicted:``), and
otherwise *off, no stated cause*. ``headline: true`` marks the claims of a paper's abstract and introduction.
"""
from __future__ import annotations

import copy
import functools
import math
from pathlib import Path

from moelab.papers.kit.report import label_kind
from moelab.runtime.project import project_root
from moelab.viz.figures import finish

REDUCERS = {"max": lambda s: s.max(), "min": lambda s: s.min(), "mean": lambda s: s.mean(),
            "median": lambda s: s.median(), "only": None}
STATUSES = ("ratio", "trend check", "fit", "chosen from", "input", "refused", "no value", "not run")
AGREE = 1.25  # a SIMULATED ratio within [1/AGREE, AGREE] agrees
EXPLAINED = 0.75  # the share of the log-gap a ladder must close to explain a row
VERDICTS = ("agrees", "explained", "contradicted", "off, no stated cause", "trend: same side", "trend: other side",
            "trend: no neutral", "not evidence", "no value")


class PaperNumbersError(ValueError):
    """paper.yaml cannot be read as the comparison needs it."""


def paper_numbers_path(paper: str) -> Path:
    return project_root() / "experiments" / paper / "paper.yaml"


def load_numbers(paper_or_path) -> dict:
    """key -> the paper number's entry, checked (value, quantity, unit, figure, source, moelab list)."""
    return copy.deepcopy(_numbers(_numbers_file(paper_or_path)))


def _numbers_file(paper_or_path) -> tuple:
    p = Path(paper_or_path)
    path = p if p.suffix in (".yaml", ".yml") else paper_numbers_path(str(paper_or_path))
    st = path.stat()
    return path.resolve(), st.st_mtime_ns, st.st_size  # an edited file is read again


@functools.lru_cache(maxsize=32)
def _numbers(file: tuple) -> dict:
    """The checked numbers of one version of a paper.yaml: figures ask for paper values hundreds of times per
    notebook, and parsing the YAML each time cost seconds."""
    import yaml

    path = file[0]
    data = yaml.safe_load(path.read_text()) or {}
    out = {}
    for key, e in (data.get("numbers") or {}).items():
        missing = [k for k in ("value", "quantity", "unit", "figure", "source") if k not in e]
        if missing:
            raise PaperNumbersError(f"{path}: {key} lacks {missing}")
        for src in e.get("moelab") or []:
            if not {"product", "column"} <= set(src):
                raise PaperNumbersError(f"{path}: {key}: each moelab source names a product and a column")
            if "trend" in src and not str(src["trend"]).strip():
                raise PaperNumbersError(f"{path}: {key}: a trend-only source says why (trend: <reason>)")
            if src.get("reduce", "only") not in REDUCERS:
                raise PaperNumbersError(f"{path}: {key}: reduce must be one of {sorted(REDUCERS)}")
            unknown = sorted(set(src.get("inputs") or ()) - set(data["numbers"]))
            if unknown:
                raise PaperNumbersError(f"{path}: {key}: inputs names no paper number: {unknown}")
        out[key] = e
    return out


def paper_entry(paper: str, key: str) -> dict:
    """One paper number's entry (a copy of that entry alone: :func:`load_numbers` copies the whole file)."""
    return copy.deepcopy(_numbers(_numbers_file(paper))[key])


def paper_value(paper: str, key: str) -> float:
    """The paper's own number ``key`` from paper.yaml: where moelab calibrates to a paper number (and says
    so), it reads it from here rather than retyping it."""
    return float(_numbers(_numbers_file(paper))[key]["value"])


def _select(frame, where: dict):
    for col, want in (where or {}).items():
        if col not in frame:
            return frame.iloc[0:0]
        frame = frame[frame[col].isin(want if isinstance(want, list) else [want])]
    return frame


def _reduce(frame, column: str, how: str):
    s = frame[column].dropna()
    if not len(s):
        return None
    if how == "only":
        if len(s) != 1:
            raise PaperNumbersError(f"reduce 'only' needs one row, got {len(s)} for column {column}")
        return float(s.iloc[0])
    return float(REDUCERS[how](s))


def circularity(paper: str) -> dict:
    """paper key -> [(status, assumption name, products it affects)] from the paper's assumptions file:
    the constants fitted to (``fitted_to``) or reasoned from (``chosen_from``) a paper number."""
    from moelab.papers.kit.assumptions import (  # here: it imports pandas, the kit loads without
        assumptions_path,
        load_assumptions,
    )

    out: dict = {}
    if not assumptions_path(paper).is_file():
        return out
    for a in load_assumptions(paper).values():
        for status, keys in (("fit", a.fitted_to), ("chosen from", a.chosen_from)):
            for k in keys:
                out.setdefault(k, []).append((status, a.name, a.affects))
    return out


def _circular(key: str, pid: str, src: dict, circ: dict):
    """(status, why) when this row's moelab value came from the paper number it is compared with."""
    for status, name, affects in circ.get(key, ()):
        if not affects or pid in affects:
            verb = "fitted to" if status == "fit" else "chosen from"
            return status, f"{status}: moelab's {name} was {verb} this paper number (not evidence)"
    if src.get("inputs"):
        return "input", f"input: moelab's value uses the paper's {', '.join(src['inputs'])} (not evidence)"
    return None


def source_id(src: dict) -> str:
    """A moelab source in one line (product.column[where]:reducer), to name a row in the golden file."""
    where = ",".join(f"{k}={v}" for k, v in sorted((src.get("where") or {}).items()))
    return f"{src['product']}.{src['column']}[{where}]:{src.get('reduce', 'only')}"


def _not_run(key: str, entry: dict, sid: str, pid: str, note: str) -> dict:
    """A row with the paper's side filled in and no moelab value (yet)."""
    return dict(key=key, source_id=sid, figure=entry["figure"], quantity=entry["quantity"], unit=entry["unit"],
                paper=float(entry["value"]), paper_at=entry.get("at", ""), moelab=math.nan, moelab_label="",
                product=pid, status="not run", ratio=math.nan, trend="", note=note, paper_source=entry["source"])


def compare_one(key: str, entry: dict, src: dict, values: dict, products: dict,
                circularity: dict | None = None) -> dict:
    """One row: the paper number ``entry`` against moelab source ``src``; ``circularity`` as returned by
    :func:`circularity`."""
    pid, col = src["product"], src["column"]
    row = _not_run(key, entry, source_id(src), pid, src.get("note", ""))
    prod = products.get(pid)
    q = prod.quantities.get(col) if prod is not None else None
    if isinstance(q, tuple):  # the column's quantity depends on another column: (that column, {value: Quantity})
        q = q[1].get((src.get("where") or {}).get(q[0]))
    if prod is not None and (q is None or q.name != entry["quantity"] or q.unit != entry["unit"]):
        got = f"{q.name!r} [{q.unit}]" if q else "an undeclared quantity"
        row.update(status="refused", note=f"moelab column {pid}.{col} measures {got}, the paper "
                                          f"{entry['quantity']!r} [{entry['unit']}]")
        return row
    frame = values.get(pid)
    if frame is None:
        return row
    sel = _select(frame, src.get("where"))
    try:
        v = _reduce(sel, col, src.get("reduce", "only")) if col in sel else None
    except PaperNumbersError as e:
        row.update(status="refused", note=str(e))
        return row
    if v is None:  # the product ran, but has no such number (e.g. a system never reached the target)
        row.update(status="no value", note=(row["note"] + "; " if row["note"] else "") + "no rows match")
        return row
    label = frame.attrs.get("label", "")
    kind = label_kind(label)
    row.update(moelab=v, moelab_label=label)
    circular = _circular(key, pid, src, circularity or {})
    if circular:
        status, why = circular
        row.update(status=status, ratio=v / row["paper"] if row["paper"] else math.nan,
                   note=(row["note"] + "; " if row["note"] else "") + why)
    elif kind == "SIMULATED" and not src.get("trend"):
        row.update(status="ratio", ratio=v / row["paper"] if row["paper"] else math.nan)
    else:
        neutral = entry.get("neutral")
        row["status"] = "trend check"
        if src.get("trend"):  # SIMULATED, but not the paper's quantity: the source says why
            row["note"] = (row["note"] + "; " if row["note"] else "") + f"trend check only: {src['trend']}"
        if neutral is not None:
            same = (v - neutral) * (row["paper"] - neutral) > 0
            row["trend"] = f"{'same' if same else 'other'} side of {neutral:g} as the paper"
        else:
            row["trend"] = "no ratio: not measured at the paper's scale"
    return row


def verdict(row: dict, entry: dict, closed: float | None = None) -> str:
    """What a row says about the paper's claim (:data:`VERDICTS`); ``closed``: the share of the row's log-gap
    its ladder closes, if it has one. A ratio near 1 on the other side of the entry's ``neutral`` (moelab finds
    a slowdown where the paper claims a gain) does not agree; a ladder that overshoots the paper by more than
    it leaves does not explain."""
    st = row["status"]
    if st in ("fit", "chosen from", "input"):
        return "not evidence"
    if st == "trend check":
        return ("trend: same side" if row["trend"].startswith("same") else
                "trend: other side" if row["trend"].startswith("other") else "trend: no neutral")
    if st != "ratio" or not row["ratio"] > 0:
        return "no value"
    neutral = entry.get("neutral")
    sides_differ = neutral is not None and (row["moelab"] - neutral) * (row["paper"] - neutral) <= 0
    if 1 / AGREE <= row["ratio"] <= AGREE and not sides_differ:
        return "agrees"
    if closed is not None and (abs(1 - closed) <= 1 - EXPLAINED or _ends_agreeing(row, entry, closed)):
        return "explained"
    if entry.get("contradicted"):
        return "contradicted"
    return "off, no stated cause"


def _ends_agreeing(row: dict, entry: dict, closed: float) -> bool:
    """Whether the ladder's last rung, ``ratio ** (1 - closed)`` of the paper, would itself agree (within ±25 %,
    on the paper's side of ``neutral``): the standard a direct row is held to. Without it a ladder from 3× that
    ends 20 % off would explain and one from 1.45× that ends 11 % off would not."""
    end_ratio = row["ratio"] ** (1 - closed)
    neutral = entry.get("neutral")
    end = row["paper"] * end_ratio
    same_side = neutral is None or (end - neutral) * (row["paper"] - neutral) > 0
    return 1 / AGREE <= end_ratio <= AGREE and same_side


def _ladder_share(row: dict, ladder) -> tuple:
    """(the share of this row's log-gap its ladder closes, the paper keys a rung was read off), if the ladder
    starts from this row's very value (a key with several moelab sources has one ladder, which explains only the
    row it walks from); (None, ()) otherwise."""
    if ladder is None:
        return None, ()
    start, share, chosen = (*ladder, ())[:3]
    return (share, tuple(chosen)) if math.isclose(start, row["moelab"], rel_tol=1e-9) else (None, ())


def compare(paper: str, values: dict, products: dict, numbers: dict | None = None, *, closed: dict | None = None):
    """The paper-vs-moelab frame: one row per (paper number, moelab source), see the module doc.
    ``closed``: paper key -> (headline at rung 0, share of the log-gap closed, keys a rung was read off), from
    :func:`moelab.papers.kit.ladder.walk_all`."""
    import pandas as pd

    numbers = load_numbers(paper) if numbers is None else numbers
    circ = circularity(paper)
    closed = closed or {}
    rows = []
    for key, e in numbers.items():
        for src in e.get("moelab") or [{}]:
            if not src:  # the paper has it, moelab has nothing to set against it
                row = _not_run(key, e, "", "", e.get("no_counterpart", "no moelab counterpart"))
            else:
                row = compare_one(key, e, src, values, products, circ)
            share, chosen = _ladder_share(row, closed.get(key))
            v = verdict(row, e, None if chosen else share)  # a rung read off a paper result explains nothing
            why = (e["contradicted"] if v == "contradicted" else
                   f"gap ladder closes {share:.0%} of the log-gap and ends at "
                   f"{row['ratio'] ** (1 - share):.2f}x the paper" if v == "explained" else "")
            if chosen and share is not None and v != "contradicted":
                why = (f"gap ladder closes {share:.0%} of the log-gap, but a rung's value was read off "
                       f"{', '.join(chosen)}: not an explanation")
            row.update(headline=bool(e.get("headline")), verdict=v, why=why)
            rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs["label"] = (f"PAPER vs moelab: the paper's numbers from experiments/{paper}/paper.yaml; ratios only "
                         "for SIMULATED values at the paper's scale, trend checks for runs on this machine")
    return df


def compare_figure(table, *, title: str = "Paper vs moelab: moelab / paper, SIMULATED values at the paper's scale"):
    """One marker per ratio row (log scale, 1 = equal); trend-check and refused rows are listed in the
    table only, since a CPU-box number over a paper-scale one is not a ratio worth drawing."""
    import plotly.graph_objects as go

    t = table[(table.status == "ratio") & (table.ratio > 0)]
    fig = go.Figure()
    fig.add_scatter(x=t.ratio, y=t.key, mode="markers", name="SIMULATED", marker={"size": 11, "color": "#1c7ed6"},
                    text=t.moelab_label, customdata=t[["paper", "moelab"]].to_numpy(),
                    hovertemplate="%{y}<br>paper %{customdata[0]:.3g}, moelab %{customdata[1]:.3g}"
                                  "<br>%{text}<extra></extra>")
    fig.add_vline(x=1.0, line_dash="dash", line_color="grey")
    n_trend = int((table.status == "trend check").sum())
    label = (f"SIMULATED over PAPER: {len(t)} ratios of SIMULATED values; {n_trend} trend checks of runs on this "
             "machine are in the table, not drawn")
    return finish(fig, title, label, xaxis={"type": "log", "title": "moelab / paper"},
                  height=max(400, 28 * t.key.nunique() + 150))
