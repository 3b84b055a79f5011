"""Where the project is: the folder holding ``notebooks/`` and ``experiments/``, so that a notebook's relative
paths (a config, a runs root, an output folder) mean the same from any working directory."""
from __future__ import annotations

import os
from pathlib import Path

import moelab


def _is_root(d: Path) -> bool:
    return (d / "notebooks").is_dir() and (d / "experiments").is_dir()


def project_root(start: str | Path | None = None) -> Path:
    """The project folder (holding ``notebooks/`` and ``experiments/``): searched upwards from
    ``start`` (default: the working directory), then the folder above the ``moelab`` package (an
    editable install), else the working directory."""
    here = Path(start or os.getcwd()).resolve()
    for d in (here, *here.parents):
        if _is_root(d):
            return d
    pkg_parent = Path(moelab.__file__).resolve().parent.parent
    return pkg_parent if _is_root(pkg_parent) else here


def project_path(path: str | Path) -> Path:
    """``path`` if absolute, else relative to :func:`project_root` — for notebook parameters such as
    ``config``, ``runs_root`` and ``out_dir``, which then mean the same from any working directory."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else project_root() / p
