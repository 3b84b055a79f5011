"""``moelab reproduce``: execute the notebooks headless with papermill at a scale, then build a report.

::

    moelab reproduce [NAMES... | all] --scale smoke|default|full --out DIR [--force] [--timeout S]
                     [-p NAME=VALUE ...] [--notebooks DIR] [--experiments DIR]

**Notebooks.** Every ``notebooks/*.ipynb``; a notebook's *name* is its file stem without a leading
``NN_`` (``00_quickstart.ipynb`` -> ``quickstart``). ``all`` runs them in file-name order.

**Parameters** (see ``experiments/README.md``), lowest precedence first:

1. the notebook's own ``parameters`` cell (its defaults);
2. the scale file: ``experiments/<name>/<scale>.yaml`` — the whole file is the parameter dict, unless
   it holds a mapping under the key ``<name>``, which then is; otherwise the one
   ``experiments/<group>/<scale>.yaml`` holding a mapping under the key ``<name>`` (several notebooks
   sharing one file, keyed by notebook name). Two such files for one notebook is an error. No file:
   the notebook's defaults, and the report says so;
3. ``-p NAME=VALUE`` on the command line (values read as YAML scalars: ``-p reuse=false``);
4. ``out_dir``, always set to ``DIR/figures/<name>`` (absolute), so that what a notebook exports is
   collected; and ``png``, where the notebook declares it, set to false unless given with ``-p``: the images are
   written beside the run (below), not by the notebook itself.

**Execution.** Kernel ``python3``, working directory = the project root (the folder holding
``notebooks/`` and ``experiments/``), so ``runs/`` and ``figures/`` mean the same for every notebook.
Executed copies go to ``DIR/notebooks/<stem>.ipynb`` with a manifest ``<stem>.run.json`` (status,
reason, parameters, times, error tail). A failing notebook is recorded and the next one runs; the
command exits 1 if any failed. ``--timeout S`` is a wall-clock limit per notebook: at the deadline
the kernel is interrupted (SIGINT, so ``moelab.launch`` stops its ranks), and killed 30 s later if it
has not stopped.

**Files.** Every figure page loads one plotly.js, ``DIR/assets/plotly-<version>.min.js`` (written before the
first notebook runs, from the installed plotly package: offline). By default a thread beside each notebook's
run writes a PNG and an SVG of every figure the notebook records (kaleido, one Chromium for the whole call, its
page kept loaded between images and its processes at the lowest CPU priority: :mod:`moelab.viz.chromium`), so the
export takes the cycles the notebook leaves; a re-used notebook gets the images it lacks. Without a Chromium one line
says so and how to get one; ``--no-images`` skips them (and the line).

**Re-use.** A notebook is skipped when its last run into DIR succeeded with the same parameters and
*started* after the last change to every input: the notebook, its scale file, the ``moelab``
sources and every file a string parameter names (e.g. the run config). Comparing with the start
rather than with the executed copy's time also catches an input edited during the run. ``--force``
re-executes anyway. The reason — why it ran or why it was skipped — is in the manifest and the report.
Note that re-executing a notebook is not regenerating its data: the quickstart re-plots a stored run
when ``reuse`` is true; ``-p reuse=false`` regenerates it.

Notebooks find the project root themselves (:func:`moelab.runtime.project.project_path`), so they also work opened in
JupyterLab from ``notebooks/`` or run by papermill from any folder.
"""
from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import moelab
from moelab import __version__
from moelab.papers.kit.execute import declared_parameters, execute
from moelab.papers.kit.images import Images
from moelab.papers.kit.page import build_index
from moelab.runtime.project import project_root
from moelab.runtime.results import atomic_write_json, stale_version
from moelab.viz.export import ASSETS, NO_CHROMIUM, find_chromium, image_session, write_plotlyjs

SCALES = ("smoke", "default", "full")
_NUMBERED = re.compile(r"^\d+_")


class ReproduceError(ValueError):
    """A bad request (unknown notebook, ambiguous parameters): nothing was executed."""


# ---- where things are: moelab.runtime.project ---------------------------------------------------
def notebook_name(path: str | Path) -> str:
    """``notebooks/00_quickstart.ipynb`` -> ``quickstart``."""
    return _NUMBERED.sub("", Path(path).stem)


def discover(notebooks_dir: str | Path) -> dict[str, Path]:
    """Name -> notebook path for every ``*.ipynb`` in ``notebooks_dir``, in file-name order."""
    found: dict[str, Path] = {}
    for p in sorted(Path(notebooks_dir).glob("*.ipynb")):
        if p.name.startswith("."):
            continue
        name = notebook_name(p)
        if name in found:
            raise ReproduceError(f"two notebooks are named {name!r}: {found[name].name} and {p.name}")
        found[name] = p
    return found


def _load_yaml(path: Path) -> dict:
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ReproduceError(f"{path}: expected a mapping of parameters, got {type(data).__name__}")
    return data


def find_parameters(name: str, scale: str, experiments_dir: str | Path,
                    stem: str | None = None) -> tuple[dict, Path | None]:
    """The parameters of notebook ``name`` at ``scale`` and the file they came from (see the module
    docstring). A shared file may key a notebook by its name or by its full file stem."""
    experiments_dir = Path(experiments_dir)
    keys = [name] + ([stem] if stem and stem != name else [])

    def keyed(data: dict):
        for k in keys:
            if isinstance(data.get(k), dict):
                return data[k]
        return None

    own = experiments_dir / name / f"{scale}.yaml"
    if own.is_file():
        data = _load_yaml(own)
        sub = keyed(data)
        return (dict(sub) if sub is not None else data), own
    hits = []
    for f in sorted(experiments_dir.glob(f"*/{scale}.yaml")):
        sub = keyed(_load_yaml(f))
        if sub is not None:
            hits.append((dict(sub), f))
    if len(hits) > 1:
        raise ReproduceError(f"parameters for {name!r} at scale {scale!r} are in several files: "
                             + ", ".join(str(f) for _, f in hits))
    return hits[0] if hits else ({}, None)


def parse_param(item: str) -> tuple[str, object]:
    """``NAME=VALUE`` -> (name, value); the value is read as a YAML scalar (``false``, ``3``, ``x``)."""
    import yaml

    key, eq, value = item.partition("=")
    if not eq or not key.strip():
        raise ReproduceError(f"-p expects NAME=VALUE, got {item!r}")
    return key.strip(), yaml.safe_load(value) if value.strip() else ""


# ---- the up-to-date check ----------------------------------------------------------------------
def _package_sources() -> list[Path]:
    pkg = Path(moelab.__file__).resolve().parent
    return sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)


def _inputs(nb: Path, params_file: Path | None, values: list, root: Path) -> list[Path]:
    """Files whose change makes an executed notebook stale: the notebook, its parameters, the package, its
    paper's data (``experiments/<name>/*.yaml``: scales, manifest, paper numbers, assumptions) and files
    that parameters name."""
    data = sorted((root / "experiments" / notebook_name(nb)).glob("*.yaml"))
    files = [nb, *([params_file] if params_file else []), *_package_sources(), *data]
    for v in values:
        if isinstance(v, str) and v and len(v) < 4096 and "\n" not in v:
            p = Path(v) if Path(v).is_absolute() else root / v
            try:
                if p.is_file():
                    files.append(p)
            except OSError:
                pass
    return files


def _rel(p: Path, root: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(root))
    except ValueError:
        return str(p)


def staleness(manifest: dict | None, executed: Path, params: dict, scale: str, inputs: list[Path],
              root: Path, figures: Path | None = None, force: bool = False) -> str | None:
    """Why the notebook must run, or None when its last run in this output folder is up to date."""
    if force:
        return "--force"
    if manifest is None or not executed.is_file():
        return "no earlier run in this output folder"
    if manifest.get("status") != "ok":
        return "the earlier run " + {"timeout": "timed out"}.get(manifest.get("status"), "failed")
    version = stale_version(manifest.get("moelab_version"))
    if version is not None:
        return version
    if manifest.get("scale") != scale:
        return f"scale changed ({manifest.get('scale')} -> {scale})"
    old = manifest.get("parameters", {})
    if old != params:
        changed = sorted(k for k in set(old) | set(params) if old.get(k) != params.get(k))
        return "parameters changed: " + ", ".join(changed)
    if figures is not None and not figures.is_dir():
        return "its exported files are gone"
    started = float(manifest.get("started_ts", 0))
    newer = [p for p in inputs if p.is_file() and p.stat().st_mtime > started]
    if newer:
        more = f" (and {len(newer) - 1} more)" if len(newer) > 1 else ""
        return f"{_rel(newer[0], root)} changed since the last run{more}"
    return None


# ---- the batch -----------------------------------------------------------------------------------
@dataclass
class Outcome:
    name: str
    status: str  # ok | failed | timeout
    ran: bool  # False: up to date, re-used
    reason: str
    wall_s: float
    error: str = ""
    manifest: Path | None = None
    warnings: list = field(default_factory=list)


@dataclass
class Batch:
    out: Path
    scale: str
    outcomes: list
    wall_s: float
    index: Path | None = None

    @property
    def failed(self) -> list:
        return [o for o in self.outcomes if o.status != "ok"]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _clear(folder: Path) -> None:
    import shutil

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def reproduce(names=("all",), scale: str = "default", out: str | Path = "reports", *, force: bool = False,
              timeout: float | None = None, params: dict | None = None, notebooks_dir=None,
              experiments_dir=None, root=None, log=print, images: bool = True) -> Batch:
    """Execute the named notebooks (or ``all``) at ``scale`` into ``out`` and write ``out/index.html``;
    ``images``: a PNG and an SVG of every figure where a Chromium is found (see the module doc).

    Raises :class:`ReproduceError` for a bad request before anything runs; failures inside
    notebooks are recorded in the returned :class:`Batch` instead.
    """
    if scale not in SCALES:
        raise ReproduceError(f"unknown scale {scale!r}; scales: {', '.join(SCALES)}")
    root = Path(root).resolve() if root else project_root()
    nb_dir = Path(notebooks_dir).resolve() if notebooks_dir else root / "notebooks"
    ex_dir = Path(experiments_dir).resolve() if experiments_dir else root / "experiments"
    if not nb_dir.is_dir():
        raise ReproduceError(f"no notebooks folder {nb_dir}")
    found = discover(nb_dir)
    names = list(names) or ["all"]
    if "all" in names:
        chosen = list(found)
    else:
        unknown = [n for n in names if n not in found]
        if unknown:
            raise ReproduceError(f"unknown notebook(s) {', '.join(unknown)}; known: {', '.join(found) or 'none'}")
        chosen = list(dict.fromkeys(names))
    out = Path(out).resolve()
    plans = []
    for name in chosen:  # resolve every notebook's parameters first: a bad file fails before any run
        nb = found[name]
        file_params, params_file = find_parameters(name, scale, ex_dir, nb.stem)
        plans.append((name, nb, file_params, params_file))

    write_plotlyjs(out / ASSETS)  # the one plotly.js every figure page of the report loads
    if images and find_chromium() is None:
        log(f"images: PNG/SVG skipped, {NO_CHROMIUM}; the HTML figures are written (--no-images: no images, "
            "no message)")
        images = False
    start = time.monotonic()
    outcomes = []
    with image_session():
        for i, plan in enumerate(plans, 1):
            outcomes.append(_run_one(i, plan, len(plans), out, scale, params, root, ex_dir, force, timeout, log,
                                     images))
    batch = Batch(out, scale, outcomes, time.monotonic() - start)
    batch.index = build_index(out, session={"scale": scale, "wall_s": batch.wall_s, "names": chosen,
                                            "finished": _now()})
    return batch


def _images_line(img, ran: bool) -> str:
    kinds = "/".join(f.upper() for f in img.formats)
    if not ran:
        return f"{len(img.written)} missing image(s) ({kinds}) written in {img.seconds:.1f} s ({img.cpu_s:.1f} s CPU)"
    return (f"{len(img.written)} image(s) ({kinds}) in {img.seconds:.1f} s beside the run "
            f"({img.cpu_s:.1f} s of the browser's CPU), {img.after_s:.1f} s after it")


def _run_one(i, plan, total, out, scale, params, root, ex_dir, force, timeout, log, images) -> Outcome:
    """Run (or re-use) one notebook of the batch; its images beside it."""
    name, nb, file_params, params_file = plan
    declared = declared_parameters(nb)
    fig_dir = out / "figures" / name
    run_params = {**file_params, **(params or {}), "out_dir": str(fig_dir)}
    if "png" in declared and "png" not in (params or {}):
        run_params["png"] = False  # the images are written beside the run (or not: --no-images); -p png=true: by it
    executed = out / "notebooks" / f"{nb.stem}.ipynb"
    manifest_path = out / "notebooks" / f"{nb.stem}.run.json"
    old = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    values = [*run_params.values(), *(d["default"] for d in declared.values())]
    inputs = _inputs(nb, params_file, _literal_values(values), root)
    reason = staleness(old, executed, run_params, scale, inputs, root, fig_dir, force=force)
    warnings = []
    if declared and "out_dir" not in declared:
        warnings.append("the notebook declares no out_dir parameter: what it exports is not collected")
    unknown = sorted(k for k in run_params if declared and k not in declared and k != "out_dir")
    if unknown:
        warnings.append("parameters the notebook does not declare: " + ", ".join(unknown))
    if params_file is None:
        warnings.append(f"no parameters for scale {scale!r} in {_rel(ex_dir, root)}/: notebook defaults")
    if reason is None:
        ran_at = old.get("started", "?")
        old.update(outcome="reused", checked=_now(),
                   reason=f"up to date: ran at {ran_at}, after the last change to the notebook, "
                          f"its parameters and the moelab sources")
        log(f"[{i}/{total}] {name}: skipped ({old['reason']})")
        if images:
            img = Images(fig_dir).finish()
            if img.written:
                log(f"    {_images_line(img, False)}")
        atomic_write_json(manifest_path, old)
        return Outcome(name, "ok", False, old["reason"], 0.0, manifest=manifest_path, warnings=warnings)
    log(f"[{i}/{total}] {name}: running ({reason}) ...")
    _clear(fig_dir)
    executed.parent.mkdir(parents=True, exist_ok=True)
    started_ts, t0 = time.time(), time.monotonic()
    img = Images(fig_dir).start() if images else None
    status, error = execute(nb, executed, run_params, root, timeout)
    wall = time.monotonic() - t0
    if img is not None:
        img.finish()
    manifest = {
        "name": name, "notebook": _rel(nb, root), "stem": nb.stem, "scale": scale, "status": status,
        "outcome": "ran", "reason": reason, "started": datetime.fromtimestamp(started_ts, timezone.utc)
        .isoformat(timespec="seconds"), "started_ts": started_ts, "checked": _now(),
        "wall_s": round(wall, 2), "parameters": run_params, "parameters_file": _rel(params_file, root)
        if params_file else None, "declared": declared, "error": error, "warnings": warnings,
        "executed": _rel(executed, out), "figures_dir": _rel(fig_dir, out), "cwd": str(root),
        "moelab_version": __version__,
        "images": None if img is None else {"files": len(img.written), "seconds": round(img.seconds, 2),
                                            "after_s": round(img.after_s, 2), "cpu_s": round(img.cpu_s, 2)},
    }
    atomic_write_json(manifest_path, manifest)
    word = "ok" if status == "ok" else status.upper()
    log(f"[{i}/{total}] {name}: {word} in {wall:.1f} s")
    if img is not None:
        log(f"    {_images_line(img, True)}")
    for w in warnings:
        log(f"    warning: {w}")
    return Outcome(name, status, True, reason, wall, error, manifest_path, warnings)


def _literal_values(values: list) -> list:
    """Notebook defaults come from papermill as source text (``'"runs"'``); unquote string literals."""
    import ast

    res = []
    for v in values:
        if isinstance(v, str):
            try:
                v = ast.literal_eval(v)
            except (ValueError, SyntaxError):
                pass
        res.append(v)
    return res


# ---- the command line (``moelab reproduce``; wired in moelab/cli.py) -----------------------------
DESCRIPTION = """\
Execute notebooks/*.ipynb headless with papermill at a scale and write DIR/index.html.

Parameters: experiments/<name>/<scale>.yaml, or a shared experiments/<group>/<scale>.yaml keyed
by notebook name (see experiments/README.md), then -p NAME=VALUE; out_dir is set to
DIR/figures/<name>. Notebooks run with the project root as working directory. Figures load one
DIR/assets/plotly-*.min.js; a PNG and an SVG of each are written beside the run unless --no-images. A notebook whose
last run into DIR is newer than the notebook, its parameters and the moelab sources is skipped
unless --force. Exit code: 0 all ok, 1 a notebook failed (the others still run), 2 a bad request.

examples:
  moelab reproduce quickstart --scale smoke --out reports
  moelab reproduce all --scale default --out reports --timeout 1800
  moelab reproduce quickstart --force -p reuse=false   # regenerate the run, not only the figures
  moelab reproduce parm --scale smoke --no-images      # HTML figures only (no Chromium needed)
"""


def add_arguments(p) -> None:
    import argparse

    p.description, p.formatter_class = DESCRIPTION, argparse.RawDescriptionHelpFormatter
    p.add_argument("names", nargs="*", default=["all"], metavar="NAME",
                   help="notebook names (file stem without NN_, e.g. quickstart) or all (default)")
    p.add_argument("--scale", choices=SCALES, default="default",
                   help="parameter set: smoke (CI), default (a laptop), full (a GPU cluster); default: default")
    p.add_argument("--out", default="reports", help="output folder: index.html, notebooks/, figures/ "
                                                    "(default: reports)")
    p.add_argument("--force", action="store_true", help="re-execute notebooks that are up to date")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="wall-clock seconds per notebook (default: none)")
    p.add_argument("-p", "--param", dest="params", action="append", default=[], metavar="NAME=VALUE",
                   help="set a notebook parameter for every notebook run, repeatable: -p reuse=false")
    p.add_argument("--no-images", dest="images", action="store_false",
                   help="no PNG/SVG of the figures (default: both, written beside each run where a Chromium is found)")
    p.add_argument("--notebooks", default=None, metavar="DIR", help="notebooks folder (default: notebooks/)")
    p.add_argument("--experiments", default=None, metavar="DIR",
                   help="parameters folder (default: experiments/)")


def main(args) -> int:
    """Run ``moelab reproduce`` from parsed arguments; 0 all ok, 1 a notebook failed, 2 a bad request."""
    try:
        params = dict(parse_param(p) for p in args.params)
        batch = reproduce(args.names, args.scale, args.out, force=args.force, timeout=args.timeout,
                          params=params, notebooks_dir=args.notebooks, experiments_dir=args.experiments,
                          log=lambda s: print(s, flush=True), images=getattr(args, "images", True))
    except ReproduceError as e:
        print(f"moelab: {e}", file=sys.stderr)
        return 2
    ran = sum(o.ran for o in batch.outcomes)
    print(f"{len(batch.outcomes)} notebook(s): {ran} ran, {len(batch.outcomes) - ran} up to date, "
          f"{len(batch.failed)} failed; {batch.wall_s:.1f} s; report: {batch.index}")
    for o in batch.failed:
        print(f"\nFAILED {o.name} ({o.status}, {o.wall_s:.1f} s):\n" + "\n".join(
            "    " + ln for ln in o.error.splitlines()), file=sys.stderr)
    return 1 if batch.failed else 0
