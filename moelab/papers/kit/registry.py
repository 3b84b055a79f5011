"""The figure registry: one function per product (a figure or table moelab makes of a paper's item).

A paper's products module registers its functions::

    @product("fastermoe", "fig11a", needs_real=True,
             quantities={"mean_fraction_shadowed": Quantity("fraction of experts shadowed per iteration")})
    def fig11a(ctx):
        lat, smap, summary = shadowing.fig11_shadowing_real(ctx.scale)
        return Made(value=summary, tables={"table_fig11a_summary": (summary, "Fig. 11 (a): summary")},
                    figures={"fig11a_shadowing_real": F.fig11_shadowing(lat, smap, label=lat.attrs["label"])},
                    notes=[summary.attrs["shadowing"]])

``ctx`` (:class:`Context`) carries the scale, the seed and the values of products made before.
``quantities`` declares what a column of ``value`` measures: the paper-vs-moelab comparison
(:mod:`moelab.papers.kit.compare`) refuses to set a column against a paper number of another quantity.
The notebook, the report and the tests all read this one registry and the paper's manifest.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

_REGISTRY: dict = {}  # (paper, product id) -> Product


@dataclass(frozen=True)
class Quantity:
    """What a number measures, in words both sides of a comparison must share, and its unit."""

    name: str
    unit: str = ""


@dataclass
class Made:
    """What a product function returns: figures (stem -> plotly figure), tables (stem -> (frame, title)),
    the value later products and the comparison read, and notes printed under it (e.g. a mechanism that
    did not fire)."""

    value: Any = None
    figures: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


@dataclass
class Context:
    paper: str
    scale: Any  # the paper's scale spec object
    seed: int = 0
    run_real: bool = True
    values: dict = field(default_factory=dict)  # product id -> Made.value of products already made


@dataclass(frozen=True)
class Product:
    paper: str
    id: str
    make: Callable[[Context], Made]
    needs_real: bool = False  # spawns ranks: skipped (and reported) when run_real is False
    needs_gpu: bool = False  # times a CUDA device: skipped (and reported) where none is present
    # column of value -> Quantity, or (column c, {value of c: Quantity}) when rows differ in meaning
    quantities: dict = field(default_factory=dict)
    doc: str = ""


def product(paper: str, pid: str, *, needs_real: bool = False, needs_gpu: bool = False,
            quantities: Optional[dict] = None):
    """Register ``fn(ctx) -> Made`` as product ``pid`` of ``paper`` (ids as in the paper's manifest)."""
    def deco(fn):
        key = (paper, pid)
        if key in _REGISTRY and _REGISTRY[key].make.__qualname__ != fn.__qualname__:
            raise ValueError(f"product {pid!r} of {paper!r} registered twice")
        _REGISTRY[key] = Product(paper, pid, fn, needs_real, needs_gpu, dict(quantities or {}),
                                 (fn.__doc__ or "").strip())
        return fn
    return deco


def products(paper: str, module: Optional[str] = None) -> dict:
    """product id -> :class:`Product` of ``paper``, importing its products ``module`` first."""
    if module:
        importlib.import_module(module)
    return {pid: p for (pp, pid), p in _REGISTRY.items() if pp == paper}


def check_against_manifest(manifest) -> list:
    """Problems between a manifest and the registry (empty when they agree): products the manifest
    promises that no function makes, and registered functions the manifest does not list."""
    reg = products(manifest.paper, manifest.products_module)
    promised = manifest.product_classes()
    errors = [f"{manifest.paper}: manifest promises {pid!r}, no function registers it"
              for pid in promised if pid not in reg]
    errors += [f"{manifest.paper}: {pid!r} is registered but in no manifest item" for pid in reg if pid not in promised]
    return errors
