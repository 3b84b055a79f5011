"""Strategy registry: a strategy name -> a factory ``f(run_cfg) -> MoE layer class``.

The returned class takes :class:`moelab.moe.layer.MoELayer`'s constructor arguments (usually a
subclass overriding only the stage it changes, bound to its options from
``cfg.parallel.strategy_options`` with ``functools.partial``). ``ep`` is the baseline itself.
Built-in strategies live in submodules imported on first use, so the validator and the launcher
can ask ``known_strategies()`` before any process starts without importing everything.
"""
from __future__ import annotations

import importlib
import importlib.util

_REGISTRY: dict = {}
_BUILTIN = {"fastermoe": "moelab.strategies.fastermoe", "zero": "moelab.strategies.zero"}  # name -> module that registers it


def register(name: str, factory=None):
    def deco(f):
        _REGISTRY[name] = f
        return f

    return deco(factory) if factory is not None else deco


_UPDATES: dict = {}


def register_update(name: str, update_cls) -> None:
    """A strategy that changes gradient sync / optimizer state registers a
    :class:`moelab.runtime.update.Update` subclass here."""
    _UPDATES[name] = update_cls


def get_update(name: str):
    """The Update class of ``name`` (None: the data-parallel default)."""
    if name != "ep":
        get_strategy(name)  # imports a built-in strategy, which registers its update
    return _UPDATES.get(name)


_GROUPS: dict = {}


def register_groups(name: str, declare) -> None:
    """A strategy whose layout needs more process groups declares them as data:
    ``declare(run_cfg) -> {group: [[ranks of one instance], [ranks of another], ...]}``, each group a
    partition of the ranks (:func:`moelab.comm.groups.validate_groups`, checked before launch). The
    trainer's communicator creates them once, at build."""
    _GROUPS[name] = declare


def get_groups(cfg) -> dict:
    """The process groups ``cfg``'s strategy declares (``{}`` for none)."""
    name = cfg.parallel.strategy
    if name != "ep":
        get_strategy(name)  # imports a built-in strategy, which registers its groups
    declare = _GROUPS.get(name)
    return dict(declare(cfg)) if declare is not None else {}


def known_strategies() -> set:
    found = {"ep", *_REGISTRY}
    for name, mod in _BUILTIN.items():
        if importlib.util.find_spec(mod) is not None:
            found.add(name)
    return found


def get_strategy(name: str):
    """The layer-class factory of ``name`` (None for the plain EP baseline)."""
    if name == "ep":
        return None
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; known: {sorted(known_strategies())}") from None
