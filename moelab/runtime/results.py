"""The results store: one folder per completed run, loaded back as pandas frames.

A run folder ``runs/<run_id>/`` holds ``config.json`` (the resolved config), ``summary.json``
(written last: its presence marks the run complete), ``metrics.csv``, ``loads.csv``,
``plans.jsonl``, ``comm_rank{r}.csv``, ``trace_rank{r}.json``, ``logs/`` and, with
``train.checkpoint_every``, ``checkpoints/step_<k>/``. Folders whose name starts with ``.``
are work in progress (the launcher's temp dirs) and are never listed.

Every writer in moelab goes through :func:`atomic_write_text` and friends (temp file in the same
folder + ``os.replace``), so a reader never sees half a file, even after a crash.
This module imports pandas lazily: each rank imports it through the launcher's per-rank entry.
"""
from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Any

from moelab import __version__
from moelab.config import RunConfig


# ---- atomic writes -----------------------------------------------------------------------------
def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` so readers see either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def atomic_write_csv(path: str | Path, frame) -> Path:
    """Write a pandas DataFrame as CSV (no index) atomically."""
    return atomic_write_text(path, frame.to_csv(index=False))


# ---- reading runs ------------------------------------------------------------------------------
class RunResult:
    """A completed run folder. Frames are read lazily and cached."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "summary.json").is_file():
            raise FileNotFoundError(f"{self.path} is not a completed run (no summary.json)")

    def __repr__(self) -> str:
        return f"RunResult({str(self.path)!r})"

    @cached_property
    def summary(self) -> dict:
        return json.loads((self.path / "summary.json").read_text())

    @property
    def run_id(self) -> str:
        return self.summary.get("run_id", self.path.name)

    @property
    def label(self) -> str:
        """What the numbers are, for figure titles: e.g. ``REAL: 2 ranks, gloo``."""
        return self.summary["label"]

    @cached_property
    def config(self) -> RunConfig:
        return RunConfig.from_dict(json.loads((self.path / "config.json").read_text()))

    @cached_property
    def metrics(self):
        return _read_csv(self.path / "metrics.csv")

    @cached_property
    def loads(self):
        return _read_csv(self.path / "loads.csv")

    @cached_property
    def plans(self):
        """``plans.jsonl``: one row per (iteration, MoE layer) with that layer's plan (``counts`` [N, E],
        ``holders``, ``shadowed``, or the layer's own ``plan_record``); empty for older runs."""
        import pandas as pd

        path = self.path / "plans.jsonl"
        if not path.is_file():
            return pd.DataFrame()
        return pd.DataFrame([json.loads(line) for line in path.read_text().splitlines() if line.strip()])

    @cached_property
    def requests(self):
        """A served run's ``requests.csv``: one row per request (``status`` served or rejected, arrival,
        start, end, latency, batch, answer); empty for training runs."""
        return _read_csv(self.path / "requests.csv")

    @cached_property
    def batches(self):
        """A served run's ``batches.csv``: one row per batch (requests, tokens, start, end, batch time)."""
        return _read_csv(self.path / "batches.csv")

    @cached_property
    def layer_metrics(self):
        """Every rank's per-(iteration, MoE layer) metrics (``layer.last_metrics``), with a ``rank``
        column; empty when the run's layers report none."""
        return _concat_ranks(self.path, "layer_metrics_rank*.csv", _read_csv)

    def checkpoint(self):
        """The run's latest checkpoint folder (``train.checkpoint_every``), or None."""
        from moelab.runtime.checkpoint import latest_checkpoint  # here: reading a run needs no torch, it does

        return latest_checkpoint(self.path)

    @cached_property
    def comm(self):
        """Every rank's communication records, with a ``rank`` column."""
        return _concat_ranks(self.path, "comm_rank*.csv", _read_csv)

    def trace(self, rank: int | None = None):
        """Trace events (Chrome format) as a frame with a ``rank`` column; all ranks by default."""
        pattern = "trace_rank*.json" if rank is None else f"trace_rank{rank}.json"
        return _concat_ranks(self.path, pattern, _read_trace)


def _read_csv(path: Path):
    import pandas as pd

    return pd.read_csv(path) if path.is_file() else pd.DataFrame()


def _read_trace(path: Path):
    """Accept both Chrome trace layouts: a bare list of events or ``{"traceEvents": [...]}``."""
    import pandas as pd

    data = json.loads(path.read_text())
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    frame = pd.DataFrame([e for e in events if e.get("ph") == "X"])
    if "args" in frame and "iter" not in frame:
        frame["iter"] = [a.get("iter") if isinstance(a, dict) else None for a in frame["args"]]
    return frame


def _concat_ranks(folder: Path, pattern: str, reader):
    import pandas as pd

    frames = []
    for p in sorted(folder.glob(pattern), key=_rank_of):
        f = reader(p)
        f.insert(0, "rank", _rank_of(p))
        frames.append(f)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _rank_of(path: Path) -> int:
    return int(path.stem.rsplit("rank", 1)[1])


# ---- the summary, written last by the ranks (moelab.runtime.runfolder) --------------------
def backend_of(cfg: RunConfig) -> str:
    """The backend a run uses: the configured one, or what ``auto`` picks on this machine."""
    from moelab.runtime.preflight import resolve_backend  # here: reading a run needs no torch, it does

    return resolve_backend(cfg.parallel.backend)


def run_label(cfg: RunConfig) -> str:
    """What a run's numbers are, for every figure: ``REAL: 4 ranks, gloo`` or ``EMULATED links: ...``."""
    p = cfg.parallel
    nodes = p.topology.nodes
    kind = "EMULATED links" if cfg.emulation.enabled else "REAL"
    where = f", {nodes} nodes x {p.nproc // nodes}" if nodes > 1 else ""
    return f"{kind}: {p.nproc} ranks{where}, {backend_of(cfg)}"


def summarize(run_dir: str | Path, cfg: RunConfig, wall_time_s: float, worker: str = "moelab.runtime.worker") -> dict:
    """The summary of a finished run folder. Bytes are summed over every rank's comm records; the
    mean step time leaves out the first iteration (warm-up). ``first_iter`` > 0 marks a resumed run."""
    run_dir = Path(run_dir)
    metrics = _read_csv(run_dir / "metrics.csv")
    comm = _concat_ranks(run_dir, "comm_rank*.csv", _read_csv)
    steps = metrics.get("step_time_s")
    steps = steps.iloc[1:] if steps is not None and len(steps) > 1 else steps
    bytes_from = comm if len(comm) else metrics
    return {
        "run_id": cfg.run_id(),
        "paper": cfg.paper,
        "name": cfg.name,
        "strategy": cfg.parallel.strategy,
        "config_hash": cfg.short_hash(),
        "nproc": cfg.parallel.nproc,
        "kind": "EMULATED" if cfg.emulation.enabled else "REAL",
        "backend": backend_of(cfg),
        "label": run_label(cfg),
        "worker": worker,
        "iters": len(metrics),
        "wall_time_s": round(wall_time_s, 3),
        "final_loss": float(metrics["loss"].iloc[-1]) if "loss" in metrics and len(metrics) else None,
        "final_eval_loss": _last_value(metrics, "eval_loss"),
        "first_iter": int(metrics["iter"].iloc[0]) if "iter" in metrics and len(metrics) else None,
        "mean_step_time_s": float(steps.mean()) if steps is not None and len(steps) else None,
        **{f"bytes_{c}": int(bytes_from[f"bytes_{c}"].sum()) if f"bytes_{c}" in bytes_from else 0
           for c in ("local", "intra", "inter")},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "moelab_version": _version(),
    }


def _version() -> str:
    return __version__


def stale_version(made_by: str | None) -> str | None:
    """Why results made by moelab ``made_by`` are stale now, or None when this is the same version."""
    if made_by == _version():
        return None
    return f"made by moelab {made_by or 'of an older version (none recorded)'}, this is moelab {_version()}"


def _last_value(frame, column: str):
    """The column's last non-empty value (evaluation runs every n-th iteration only), or None."""
    if column not in frame:
        return None
    values = frame[column].dropna()
    return float(values.iloc[-1]) if len(values) else None


def load_run(path_or_id: str | Path, root: str | Path = "runs") -> RunResult:
    """Load a completed run by folder path or by run id under ``root``."""
    p = Path(path_or_id)
    return RunResult(p if p.is_dir() else Path(root) / str(path_or_id))


def list_runs(root: str | Path = "runs"):
    """One row per completed run under ``root`` (summary fields plus ``path``), oldest first."""
    import pandas as pd

    rows = []
    root = Path(root)
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        summary = d / "summary.json"
        if d.name.startswith(".") or not summary.is_file():
            continue
        rows.append({**json.loads(summary.read_text()), "path": str(d)})
    frame = pd.DataFrame(rows)
    return frame.sort_values("created", ignore_index=True) if rows else frame
