"""The golden file: every SIMULATED moelab value of a paper's comparison at smoke scale, checked in.

The paper-scale simulations are deterministic, so a change that moves a paper result should be a deliberate,
reviewed edit of ``experiments/<paper>/golden_smoke.json`` (with the reason in the commit), never a surprise. The
file holds each SIMULATED row of the paper-vs-moelab table (named by paper key and moelab source) and each rung of
the paper's gap ladders. REAL and EMULATED rows are not in it: they are measured, and keep their trend checks.

    python -m moelab.papers.kit.golden fastermoe lsh_moe          # check; exit 1 and print what moved
    python -m moelab.papers.kit.golden --write fastermoe          # record the values of this commit
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import tempfile
from pathlib import Path

from moelab.papers.kit.report import label_kind
from moelab.papers.kit.session import Session
from moelab.runtime.project import project_root
from moelab.runtime.results import atomic_write_text

SCALE = "smoke"
RTOL = 1e-9


def golden_path(paper: str) -> Path:
    return project_root() / "experiments" / paper / f"golden_{SCALE}.json"


def simulated_values(paper: str) -> dict:
    """row name -> value: the SIMULATED comparison rows and ladder rungs of ``paper`` at smoke scale, made
    without spawning ranks (products that need them are skipped, and so are rows that read them)."""
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):  # no "skipped" lines
        S = Session(paper, SCALE, out, run_real=False, show=False)
        for pid in S.manifest.product_classes():
            S.show(pid)
        pvm = S.finish()
        ladders = S.ladders
    values = {}
    for r in pvm.itertuples():
        if label_kind(r.moelab_label) == "SIMULATED" and math.isfinite(r.moelab):
            values[f"{r.key} <- {r.source_id}"] = float(r.moelab)
    for r in ladders.itertuples() if ladders is not None and len(ladders) else ():
        values[f"ladder {r.key} rung {r.rung} ({r.set})"] = float(r.headline)
    return values


def differences(old: dict, new: dict, rtol: float = RTOL) -> list:
    """Lines naming each row that moved (old and new value), appeared or vanished."""
    out = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            out.append(f"gone:  {name} (was {old[name]!r})")
        elif name not in old:
            out.append(f"new:   {name} = {new[name]!r}")
        elif not math.isclose(old[name], new[name], rel_tol=rtol, abs_tol=0.0):
            out.append(f"moved: {name}: {old[name]!r} -> {new[name]!r} ({new[name] / old[name] - 1:+.3g} relative)"
                       if old[name] else f"moved: {name}: {old[name]!r} -> {new[name]!r}")
    return out


def load_golden(paper: str) -> dict:
    return json.loads(golden_path(paper).read_text())["values"]


def write_golden(paper: str, values: dict | None = None) -> Path:
    values = simulated_values(paper) if values is None else values
    doc = {"paper": paper, "scale": SCALE, "what": "SIMULATED moelab values of the paper-vs-moelab rows and gap "
           "ladder rungs (moelab.papers.kit.golden); edit only by --write, with the reason in the commit",
           "values": dict(sorted(values.items()))}
    path = golden_path(paper)
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moelab.papers.kit.golden", description=__doc__.split("\n")[0])
    p.add_argument("papers", nargs="+")
    p.add_argument("--write", action="store_true", help="record the values of this commit")
    args = p.parse_args(argv)
    rc = 0
    for paper in args.papers:
        new = simulated_values(paper)
        if args.write:
            print(f"{paper}: {len(new)} values -> {write_golden(paper, new)}")
            continue
        diff = differences(load_golden(paper), new)
        print(f"{paper}: {len(new)} values, {len(diff)} differ")
        for line in diff:
            print("  " + line)
        rc |= bool(diff)
    return rc


if __name__ == "__main__":
    sys.exit(main())
