"""The gap ladder: why a SIMULATED headline differs from the paper's, one sourced step at a time.

A headline row that is off by more than ±25 % is a finding only with its cause. A ladder walks from moelab's
setting to the paper's stated setting, one named assumption or mechanism per rung, and recomputes the headline
after each (SIMULATED, cumulative: rung *i* keeps rungs 1..i-1). Each rung says how much of the log-gap
``log(moelab) - log(paper)`` it closes; a ladder that ends within 25 % of the log-gap either side of the paper
(closes 75-125 %), or where a direct row would agree (within ±25 %), explains the row it starts from
(:func:`moelab.papers.kit.compare.verdict`).

Rungs are data, in ``experiments/<paper>/ladders.yaml``::

    ladders:
      zero3_speedup_trevor:                     # the paper.yaml key of the headline
        evaluate: moelab.papers.fastermoe.sensitivity:trevor_headline   # fn(scale, overrides) -> float
        profile: fastermoe_trevor               # the cluster profile the values are SIMULATED on
        rungs:
          - set: model.BERT-Wide.h_ff           # an assumption of experiments/<paper>/assumptions.yaml
            to: 4096                            # its paper-side value
            kind: setting                       # setting (a size, a rate, a link) | mechanism (a switch)
            source: "paper §5.1: ..."           # where the paper-side value comes from; never empty
            why: ...
            chosen_from: [fig11_key]            # only if the value was read off a paper RESULT: the ladder is
                                                # then shown, but explains nothing (a fit by another name)

Each rung moves one assumption through :meth:`~moelab.papers.kit.assumptions.Assumptions.with_values`, so a
value outside the assumption's stated range is refused, and a rung cannot name a constant the code does not read.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from pathlib import Path

from moelab.papers.kit.compare import load_numbers, paper_value
from moelab.runtime.project import project_root

RUNG_KINDS = ("setting", "mechanism")


class LadderError(ValueError):
    """A ladders.yaml entry that cannot be walked (the message names the file and the entry)."""


@dataclass(frozen=True)
class Rung:
    set: str
    to: float
    kind: str
    source: str
    why: str = ""
    chosen_from: tuple = ()  # paper keys the paper-side value was read off (a result, not a stated setting)


@dataclass(frozen=True)
class Ladder:
    key: str  # the paper.yaml number it explains
    evaluate: str  # "module:function", fn(scale, overrides: tuple[(name, value), ...]) -> float
    profile: str
    rungs: tuple
    note: str = ""


def ladders_path(paper: str) -> Path:
    return project_root() / "experiments" / paper / "ladders.yaml"


def load_ladders(paper: str, path: Path | None = None) -> dict:
    """paper key -> :class:`Ladder`, checked against the paper's numbers and assumptions ({} without a file)."""
    import yaml

    from moelab.papers.kit.assumptions import load_assumptions  # here: it imports pandas, the kit loads without
    path = path or ladders_path(paper)
    if not path.is_file():
        return {}
    raw = yaml.safe_load(path.read_text()) or {}
    numbers, assumptions = load_numbers(paper), load_assumptions(paper)
    out = {}
    for key, e in (raw.get("ladders") or {}).items():
        at = f"{path}: {key}"
        if key not in numbers:
            raise LadderError(f"{at}: no such paper number in paper.yaml")
        for field in ("evaluate", "profile", "rungs"):
            if not e.get(field):
                raise LadderError(f"{at}: {field} is missing")
        if ":" not in e["evaluate"]:
            raise LadderError(f"{at}: evaluate must be 'module:function'")
        rungs = []
        for i, r in enumerate(e["rungs"], 1):
            missing = [f for f in ("set", "to", "kind", "source") if r.get(f) in (None, "")]
            if missing:
                raise LadderError(f"{at}: rung {i} lacks {missing}")
            if r["kind"] not in RUNG_KINDS:
                raise LadderError(f"{at}: rung {i}: kind must be one of {RUNG_KINDS}")
            if r["set"] not in assumptions:
                raise LadderError(f"{at}: rung {i} sets {r['set']!r}, which is not in assumptions.yaml")
            assumptions.with_values({r["set"]: r["to"]})  # the paper-side value must lie in the stated range
            chosen = tuple(r.get("chosen_from") or ())
            unknown = sorted(set(chosen) - set(numbers))
            if unknown:
                raise LadderError(f"{at}: rung {i}: chosen_from names no paper number: {unknown}")
            rungs.append(Rung(r["set"], float(r["to"]), r["kind"], str(r["source"]), str(r.get("why", "")), chosen))
        out[key] = Ladder(key, e["evaluate"], str(e["profile"]), tuple(rungs), str(e.get("note", "")))
    return out


def _function(spec: str):
    mod, name = spec.split(":")
    return getattr(importlib.import_module(mod), name)


def walk(paper: str, ladder: Ladder, scale):
    """The ladder's frame: rung 0 is moelab's setting, then each rung applied on top of the ones before, with
    the headline, its ratio to the paper, the share of the initial log-gap this rung closes and the share closed
    so far (``closed`` of the last row is what :func:`~moelab.papers.kit.compare.verdict` reads)."""
    import pandas as pd

    from moelab.papers.kit.assumptions import load_assumptions  # here: it imports pandas, the kit loads without
    fn, base = _function(ladder.evaluate), load_assumptions(paper)
    paper_v = paper_value(paper, ladder.key)
    overrides: list = []
    rows = [dict(rung=0, set="moelab's setting", kind="", moelab_value=math.nan, paper_value=math.nan,
                 source="experiments/%s/assumptions.yaml" % paper, why="every assumption at its base value",
                 chosen_from="")]
    for i, r in enumerate(ladder.rungs, 1):
        overrides.append((r.set, r.to))
        rows.append(dict(rung=i, set=r.set, kind=r.kind, moelab_value=base.value(r.set), paper_value=r.to,
                         source=r.source, why=r.why, chosen_from=", ".join(r.chosen_from)))
    values = [float(fn(scale, tuple(overrides[:i]))) for i in range(len(rows))]
    gap = math.log(values[0]) - math.log(paper_v)
    df = pd.DataFrame(rows)
    df.insert(0, "key", ladder.key)
    df["headline"] = values
    df["paper"] = paper_v
    df["ratio"] = [v / paper_v for v in values]
    df["closes"] = [math.nan] + [(math.log(a) - math.log(b)) / gap if gap else math.nan
                                 for a, b in zip(values, values[1:])]
    df["closed"] = [(math.log(values[0]) - math.log(v)) / gap if gap else math.nan for v in values]
    name = getattr(scale, "name", scale)
    df.attrs["label"] = (f"SIMULATED: {ladder.profile} profile, scale {name}; gap ladder for {ladder.key}: each "
                         f"rung sets one assumption of experiments/{paper}/assumptions.yaml to its paper-side value "
                         "(ladders.yaml), keeping the rungs before it; the paper's number is a reference only")
    return df


def walk_all(paper: str, scale):
    """Every ladder of a paper, one frame (empty without a ladders.yaml), and key -> (the headline at rung 0,
    the share of the log-gap the ladder closes, the paper keys any rung's value was read off): a ladder explains
    only the row it starts from, and only when no rung was read off a paper result."""
    import pandas as pd

    ladders = load_ladders(paper)
    frames = [walk(paper, lad, scale) for lad in ladders.values()]
    if not frames:
        return pd.DataFrame(), {}
    df = pd.concat(frames, ignore_index=True)
    profiles = ", ".join(dict.fromkeys(lad.profile for lad in ladders.values()))
    df.attrs["label"] = (f"SIMULATED: {profiles} profiles, scale {getattr(scale, 'name', scale)}; gap ladders of "
                         f"experiments/{paper}/ladders.yaml: each rung sets one assumption to its paper-side value, "
                         "keeping the rungs before it; the paper's numbers are references only")
    closed = {lad.key: (float(f.headline.iloc[0]), float(f.closed.iloc[-1]),
                        tuple(sorted({k for r in lad.rungs for k in r.chosen_from})))
              for lad, f in zip(ladders.values(), frames)}
    return df, closed
