"""Strategy registry: a strategy is a name -> a factory of the MoE layer's overridable stages.

Papers' systems register here (``register``); the config validator and the launcher ask
``known_strategies()`` so an unknown name fails before any process starts.
"""
from __future__ import annotations

_REGISTRY: dict = {}


def register(name: str, factory=None):
    def deco(f):
        _REGISTRY[name] = f
        return f

    return deco(factory) if factory is not None else deco


def known_strategies() -> set:
    return {"ep", *_REGISTRY}


def get_strategy(name: str):
    if name == "ep":
        return None
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; known: {sorted(known_strategies())}") from None
