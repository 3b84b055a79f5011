"""A paper's manifest: every table and figure the paper has, and what moelab makes of each.

``experiments/<paper>/manifest.yaml``::

    paper: fastermoe
    title: "FasterMoE (PPoPP'22)"
    spec: shared/papers/fastermoe.md
    products: moelab.papers.fastermoe.products   # module that registers the products
    items:
      - id: fig1
        title: MoE structure for large models
        not_reproduced: "schematic: ..."          # the reason, when moelab makes nothing of it
      - id: fig11
        title: Dynamic shadowing over 62 iterations
        products: {fig11: SIMULATED, fig11a: EMULATED}   # product id -> its class

A *product* is one registered figure/table function (:mod:`moelab.papers.kit.registry`); its class is
checked against the labels of what it writes. The notebook and the report are driven by the manifest:
the report lists every item with links to its products' files or the reason it is missing, and a test
fails when a promised product was not produced.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moelab.runtime.project import project_root

CLASSES = ("REAL", "EMULATED", "SIMULATED", "SUBSTITUTE")
NOT_REPRODUCED = "NOT REPRODUCED"
NO_CUDA = "no CUDA device"  # how a GPU product skipped on a machine without one begins its reason


class ManifestError(ValueError):
    """A manifest that cannot be right (unknown class, an item with neither products nor a reason)."""


@dataclass(frozen=True)
class Item:
    """One table or figure of the paper."""

    id: str
    title: str
    products: dict = field(default_factory=dict)  # product id -> class (one of CLASSES)
    not_reproduced: str = ""  # why moelab makes nothing of it (schematic, notation, needs hardware)

    @property
    def classes(self) -> tuple:
        return tuple(dict.fromkeys(self.products.values())) or (NOT_REPRODUCED,)


@dataclass(frozen=True)
class Manifest:
    paper: str
    title: str
    spec: str
    products_module: str
    items: tuple

    def item(self, item_id: str) -> Item:
        for it in self.items:
            if it.id == item_id:
                return it
        raise KeyError(f"{self.paper}: no manifest item {item_id!r}")

    def product_classes(self) -> dict:
        """product id -> class, over all items (in manifest order)."""
        return {p: c for it in self.items for p, c in it.products.items()}

    def item_of(self, product_id: str) -> Item:
        for it in self.items:
            if product_id in it.products:
                return it
        raise KeyError(f"{self.paper}: product {product_id!r} is in no manifest item")


def parse_manifest(data: dict, where: str = "manifest") -> Manifest:
    """Validate and build a :class:`Manifest` from its YAML mapping."""
    for key in ("paper", "title", "products", "items"):
        if key not in data:
            raise ManifestError(f"{where}: missing key {key!r}")
    items, seen_items, seen_products = [], set(), set()
    for raw in data["items"]:
        iid = str(raw.get("id", ""))
        if not iid or iid in seen_items:
            raise ManifestError(f"{where}: item ids must be unique and non-empty, got {iid!r}")
        seen_items.add(iid)
        products = {str(k): str(v) for k, v in (raw.get("products") or {}).items()}
        reason = str(raw.get("not_reproduced") or "").strip()
        if bool(products) == bool(reason):
            raise ManifestError(f"{where}: item {iid} needs either products or a not_reproduced reason (not both)")
        for pid, cls in products.items():
            if cls not in CLASSES:
                raise ManifestError(f"{where}: item {iid}, product {pid}: class must be one of {CLASSES}, got {cls!r}")
            if pid in seen_products:
                raise ManifestError(f"{where}: product {pid} listed under two items")
            seen_products.add(pid)
        items.append(Item(iid, str(raw.get("title") or iid), products, reason))
    return Manifest(str(data["paper"]), str(data["title"]), str(data.get("spec", "")), str(data["products"]),
                    tuple(items))


def manifest_path(paper: str) -> Path:
    return project_root() / "experiments" / paper / "manifest.yaml"


def load_manifest(paper_or_path) -> Manifest:
    """The manifest of a paper (``experiments/<paper>/manifest.yaml``) or of a given file."""
    import yaml

    p = Path(paper_or_path)
    path = p if p.suffix in (".yaml", ".yml") else manifest_path(str(paper_or_path))
    if not path.is_file():
        raise ManifestError(f"no manifest at {path}")
    return parse_manifest(yaml.safe_load(path.read_text()) or {}, str(path))
