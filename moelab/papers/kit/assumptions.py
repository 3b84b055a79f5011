"""Assumptions as data: every constant a reproduction guesses or fits, with its kind and source.

``experiments/<paper>/assumptions.yaml`` holds one entry per constant under ``assumptions:``::

    zero_overlap:
      value: 0.5
      kind: assumption          # assumption (a guess) | fitted (from a measurement) | paper (the paper's own)
      source: spec §3, §6.16    # where it comes from; never empty
      affects: [fig10]          # figure / table ids whose numbers move with it
      range: [0.0, 0.9]         # optional: the plausible interval a sensitivity table sweeps
      unit: fraction
      note: ...
      fitted_to: [key, ...]     # fitted: the paper.yaml numbers it was fitted to (their rows become "fit")
      chosen_from: [key, ...]   # an assumption reasoned from these paper numbers (their rows: "chosen from")

Experiments read values with ``A.value(name)``; figures list the names they depend on
(``A.for_figure("fig10")``) so a reader sees which numbers are guesses. Loading validates every
entry, so a guess cannot slip in without a kind and a source.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional, Tuple, Union

import pandas as pd

from moelab.runtime.project import project_root

KINDS = ("assumption", "fitted", "paper")
_FIELDS = ("value", "kind", "source", "affects", "range", "unit", "note", "fitted_to", "chosen_from")


class AssumptionError(ValueError):
    """An entry of an assumptions file that is malformed (the message names the file and the entry)."""


@dataclass(frozen=True)
class Assumption:
    name: str
    value: float
    kind: str  # assumption | fitted | paper
    source: str
    affects: Tuple[str, ...] = ()
    range: Optional[Tuple[float, float]] = None
    unit: str = ""
    note: str = ""
    fitted_to: Tuple[str, ...] = ()  # paper.yaml keys this constant was fitted to
    chosen_from: Tuple[str, ...] = ()  # paper.yaml keys this guess was reasoned from

    def check(self, where: str = "") -> "Assumption":
        """Raise :class:`AssumptionError` unless kind, source, value and range are well formed."""
        at = f"{where}{': ' if where else ''}{self.name}"
        if self.kind not in KINDS:
            raise AssumptionError(f"{at}: kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source.strip():
            raise AssumptionError(f"{at}: source is missing (say where the number comes from)")
        v = self.value
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise AssumptionError(f"{at}: value must be a finite number, got {self.value!r}"
                                  + (" (YAML reads 1e12 as text: write 1.0e+12)"
                                     if isinstance(self.value, str) else ""))
        if self.fitted_to and self.kind != "fitted":
            raise AssumptionError(f"{at}: fitted_to is for kind 'fitted' (use chosen_from for a guess)")
        if self.range is not None:
            lo, hi = self.range
            if not lo <= hi:
                raise AssumptionError(f"{at}: range {self.range} has low > high")
            if not lo <= self.value <= hi:
                raise AssumptionError(f"{at}: value {self.value} lies outside its range [{lo}, {hi}]")
        return self


class Assumptions(Mapping):
    """name -> :class:`Assumption` of one paper (read-only; :meth:`with_values` makes a varied copy)."""

    def __init__(self, entries: Mapping[str, Assumption], path: Optional[Path] = None):
        self._d = dict(entries)
        self.path = path

    def __getitem__(self, name: str) -> Assumption:
        try:
            return self._d[name]
        except KeyError:
            raise KeyError(f"no assumption {name!r} in {self.path or 'this set'}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def value(self, name: str) -> float:
        return self[name].value

    def for_figure(self, fig_id: str, kinds: Tuple[str, ...] = ("assumption", "fitted")) -> list:
        """Entries of ``kinds`` (default: the non-paper ones) whose ``affects`` names ``fig_id``."""
        return [a for a in self._d.values() if fig_id in a.affects and a.kind in kinds]

    def names_for(self, fig_id: str) -> list:
        return [a.name for a in self.for_figure(fig_id)]

    def with_values(self, values: Mapping[str, float]) -> "Assumptions":
        """A copy with some values replaced (validated: a value outside its range is an error)."""
        d = dict(self._d)
        for k, v in dict(values).items():
            d[k] = dataclasses.replace(self[k], value=v).check("override")
        return Assumptions(d, self.path)

    def frame(self) -> pd.DataFrame:
        rows = [dict(name=a.name, value=a.value, kind=a.kind, unit=a.unit,
                     low=a.range[0] if a.range else None, high=a.range[1] if a.range else None,
                     affects=", ".join(a.affects), source=a.source, note=a.note,
                     from_paper=", ".join(a.fitted_to + a.chosen_from)) for a in self._d.values()]
        df = pd.DataFrame(rows, columns=["name", "value", "kind", "unit", "low", "high", "affects", "source", "note",
                                         "from_paper"])
        df.attrs["label"] = f"assumptions as data: {self.path}"
        return df


def assumptions_path(paper: str, root: Union[str, Path, None] = None) -> Path:
    return project_root(root) / "experiments" / paper / "assumptions.yaml"


def parse_assumptions(raw: Mapping, where: str = "") -> Assumptions:
    """Build and validate :class:`Assumptions` from the parsed YAML (``{"assumptions": {name: {...}}}``)."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("assumptions"), Mapping):
        raise AssumptionError(f"{where}: needs a mapping under 'assumptions:'")
    out = {}
    for name, e in raw["assumptions"].items():
        if not isinstance(e, Mapping):
            raise AssumptionError(f"{where}: {name}: entry must be a mapping, got {e!r}")
        unknown = sorted(set(e) - set(_FIELDS))
        if unknown:
            raise AssumptionError(f"{where}: {name}: unknown fields {unknown}")
        for req in ("value", "kind", "source"):
            if req not in e:
                raise AssumptionError(f"{where}: {name}: {req} is missing")
        rng = e.get("range")
        if rng is not None:
            if not isinstance(rng, (list, tuple)) or len(rng) != 2:
                raise AssumptionError(f"{where}: {name}: range must be [low, high], got {rng!r}")
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in rng):
                raise AssumptionError(f"{where}: {name}: range must hold numbers, got {rng!r} "
                                      "(YAML reads 1e12 as text: write 1.0e+12)")
            rng = (float(rng[0]), float(rng[1]))
        aff = e.get("affects", ())
        aff = (aff,) if isinstance(aff, str) else tuple(aff)
        a = Assumption(name=str(name), value=e["value"], kind=e["kind"], source=e["source"] or "",
                       affects=aff, range=rng, unit=str(e.get("unit", "")), note=str(e.get("note", "")),
                       fitted_to=_keys(e, "fitted_to", where, name), chosen_from=_keys(e, "chosen_from", where, name))
        out[str(name)] = a.check(where)
    return Assumptions(out)


def _keys(e: Mapping, field: str, where: str, name) -> Tuple[str, ...]:
    v = e.get(field, ())
    v = (v,) if isinstance(v, str) else v
    if not isinstance(v, (list, tuple)) or not all(isinstance(k, str) for k in v):
        raise AssumptionError(f"{where}: {name}: {field} must list paper.yaml keys, got {v!r}")
    return tuple(v)


def load_assumptions(path_or_paper: Union[str, Path], root: Union[str, Path, None] = None) -> Assumptions:
    """The validated assumptions of a file, or of a paper name (``experiments/<paper>/assumptions.yaml``
    under :func:`moelab.runtime.project.project_root`, searched from ``root``)."""

    p = Path(path_or_paper)
    if p.suffix not in (".yaml", ".yml"):
        p = assumptions_path(str(path_or_paper), root)
    if not p.exists():
        raise FileNotFoundError(f"no assumptions file {p}")
    st = p.stat()
    return _load(p, st.st_mtime_ns, st.st_size)  # read again when the file is edited


@functools.lru_cache(maxsize=32)
def _load(p: Path, mtime_ns: int, size: int) -> Assumptions:
    """One version of a file, parsed once: products ask for assumptions hundreds of times per notebook.
    Safe to share: :class:`Assumptions` is read-only (``with_values`` makes a copy)."""
    import yaml

    a = parse_assumptions(yaml.safe_load(p.read_text()) or {}, str(p))
    a.path = p
    return a
