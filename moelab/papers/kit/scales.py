"""Scale specs as data: ``experiments/<paper>/scales.yaml`` maps each scale (smoke, default, full) to the
sizes of every experiment of the paper; a paper's frozen dataclass names and documents the fields::

    smoke:   {nproc: 4, d: 64, tokens: 256, ...}
    default: {nproc: 8, d: 128, ...}

``load_scale(paper, Spec, "smoke")`` builds ``Spec(name="smoke", **fields)``; lists become tuples where
the field is a tuple; an unknown, missing or mistyped field is an error naming the file and the scale.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from pathlib import Path

from moelab.runtime.project import project_root

SCALES = ("smoke", "default", "full")


def scales_path(paper: str) -> Path:
    return project_root() / "experiments" / paper / "scales.yaml"


@functools.lru_cache(maxsize=32)
def _read(path: str, mtime: float) -> dict:
    import yaml

    return yaml.safe_load(Path(path).read_text()) or {}


def _build(cls, name: str, raw: dict, where: str):
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "name"}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = sorted(set(required) - set(raw))
    if unknown or missing:
        raise ValueError(f"{where}, scale {name}: unknown fields {unknown}, missing fields {missing}")
    vals = {}
    for k, v in raw.items():
        hint = hints.get(k)
        origin = typing.get_origin(hint)
        if hint is tuple or origin is tuple:
            if not isinstance(v, (list, tuple)):
                raise ValueError(f"{where}, scale {name}: {k} must be a list, got {v!r}")
            v = tuple(v)
        elif hint in (int, float, bool) and not isinstance(v, hint) and not (hint is float and isinstance(v, int)):
            raise ValueError(f"{where}, scale {name}: {k} must be {hint.__name__}, got {v!r}")
        vals[k] = v
    return cls(name=name, **vals)


def load_scale(paper: str, cls, scale):
    """The ``cls`` spec of ``scale`` (a name, or an instance of ``cls`` passed through)."""
    if isinstance(scale, cls):
        return scale
    path = scales_path(paper)
    data = _read(str(path), path.stat().st_mtime)
    if scale not in data:
        raise ValueError(f"scale must be one of {tuple(data) or SCALES}, got {scale!r} ({path})")
    return _build(cls, scale, data[scale], str(path))
