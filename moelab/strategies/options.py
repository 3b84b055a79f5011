"""One ``from_dict`` for every strategy's options (``parallel.strategy_options``).

A strategy's options are a frozen dataclass deriving from :class:`StrategyOptions`; the field's
default says its type (``bool``, ``int``, ``float``, ``str``; ``None`` defaults name their type in
``field(metadata={"type": int})``), and ``metadata={"choices": (...)}`` restricts a value. The
shared :meth:`StrategyOptions.from_dict` rejects unknown keys, coerces numbers given as strings
(CLI, YAML 1.1), collects every error into one message naming each option, then asks the subclass
for value checks (:meth:`value_errors`). Checks that need the run's shape (experts, ranks, gate)
go in :meth:`run_errors`, called by :meth:`moelab.strategies.Strategy.bind` before launch.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

from moelab.config import ConfigError


class StrategyOptions:
    """Base of a strategy's options dataclass (see module doc)."""

    strategy: ClassVar[str] = "strategy"  # the name used in messages
    error: ClassVar[type] = ConfigError  # the strategy's own ConfigError subclass

    @classmethod
    def from_dict(cls, d: Optional[dict]):
        d = dict(d or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise cls.error(f"unknown {cls.strategy} option(s) {unknown}; known: {sorted(fields)}")
        errs, kw = [], {}
        for name, v in d.items():
            try:
                kw[name] = cls.coerce(fields[name], v)
            except (TypeError, ValueError) as e:
                errs.append(str(e))
        cls.raise_if(errs)
        opts = cls(**kw)
        cls.raise_if(opts.value_errors())
        return opts

    @classmethod
    def raise_if(cls, errs) -> None:
        if errs:
            raise cls.error(f"invalid {cls.strategy} option(s):\n  - " + "\n  - ".join(errs))

    @classmethod
    def coerce(cls, f: dataclasses.Field, v):
        """``v`` as the field's type, or a TypeError/ValueError naming the option."""
        name, default = f.name, f.default
        kind = f.metadata.get("type", type(default))
        if v is None and default is None:
            return None
        if kind is bool:
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be true or false, got {v!r}")
        elif kind is int:
            if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                raise TypeError(f"{name} must be an integer, got {v!r}")
            try:
                x = float(v)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {v!r}") from None
            if x != int(x):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            v = int(x)
        elif kind is float:
            if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                raise TypeError(f"{name} must be a number, got {v!r}")
            try:
                v = float(v)
            except ValueError:
                raise ValueError(f"{name} must be a number, got {v!r}") from None
        elif kind is tuple:  # a list of integers (expert ids, ranks), kept sorted
            if isinstance(v, int) and not isinstance(v, bool):
                v = [v]
            if not isinstance(v, (list, tuple)) or not all(isinstance(e, int) and not isinstance(e, bool) for e in v):
                raise TypeError(f"{name} must be a list of integers or null, got {v!r}")
            v = tuple(sorted(int(e) for e in v))
        choices = f.metadata.get("choices")
        if choices is not None and v not in choices:
            why = f.metadata.get("why", "")
            raise ValueError(f"{name} must be one of {list(choices)}{' (' + why + ')' if why else ''}, got {v!r}")
        return v

    def value_errors(self) -> list:
        """Messages for values that are wrong whatever the run (ranges, combinations)."""
        return []

    def run_errors(self, run_cfg) -> list:
        """Messages for values that do not fit this run (expert count, ranks, gate, dispatcher)."""
        return []
