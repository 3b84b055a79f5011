"""A reproduction session: what a paper's notebook holds on to while it makes the manifest's products.

::

    S = Session("fastermoe", scale, out_dir, png=png, seed=seed, run_real=run_real)
    S.show("fig3")        # one call per product: runs it, exports and labels its files, displays them
    ...
    S.finish()            # paper vs moelab, the manifest with what was made, run time per product

Every written figure and table must carry a label whose class is the one the manifest declares for the
product (a table may also be PAPER), so a figure cannot silently change what it claims to be.
``finish`` writes ``manifest.json`` (read by the report) and ``table_manifest.csv``.
"""
from __future__ import annotations

import time

from moelab.papers.kit.compare import compare, compare_figure, paper_numbers_path
from moelab.papers.kit.ladder import walk_all
from moelab.papers.kit.manifest import NO_CUDA, NOT_REPRODUCED, load_manifest
from moelab.papers.kit.registry import Context, check_against_manifest, products
from moelab.papers.kit.report import label_kind, record_figure, record_table
from moelab.runtime.project import project_path
from moelab.runtime.results import atomic_write_json
from moelab.viz.export import IMAGE_FORMATS


class ProductError(RuntimeError):
    """A product wrote something that contradicts the manifest (wrong class, no label)."""


def _display(obj) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover - IPython ships with jupyter
        return
    if get_ipython() is not None:
        display(obj)


class Session:
    def __init__(self, paper: str, scale="smoke", out_dir="figures", *, png: bool = False, seed: int = 0,
                 run_real: bool = True, show: bool = True, manifest=None):
        import importlib

        self.manifest = manifest or load_manifest(paper)
        problems = check_against_manifest(self.manifest)
        if problems:
            raise ProductError("; ".join(problems))
        self.products = products(paper, self.manifest.products_module)
        module = importlib.import_module(self.manifest.products_module)
        spec = module.scale_spec(scale) if hasattr(module, "scale_spec") else scale
        self.ctx = Context(paper, spec, seed, run_real)
        self.out = project_path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.formats = ("html", *IMAGE_FORMATS) if png else ("html",)  # png: every static image reproduce writes
        self.show_output = show
        self.status: dict = {}  # product id -> {status, reason, files, seconds, notes}
        self.ladders = None  # the gap ladders' frame, once finish() walked them

    @property
    def values(self) -> dict:
        return self.ctx.values

    def show(self, pid: str):
        """Make product ``pid``, export its figures and tables with their labels, display them; return
        its value. A product needing real ranks is skipped (and reported) when ``run_real`` is False, one needing
        a GPU where CUDA has no device."""
        cls = self.manifest.product_classes().get(pid)
        if cls is None:
            raise KeyError(f"{self.manifest.paper}: {pid!r} is not in the manifest")
        prod = self.products[pid]
        skip = ("run_real=False (needs spawned ranks)" if prod.needs_real and not self.ctx.run_real else
                f"{NO_CUDA} (a GPU item: REAL where a GPU is present)" if prod.needs_gpu and not _has_cuda() else None)
        if skip:
            self.status[pid] = dict(status="skipped", reason=skip, files=[], seconds=0.0, notes=[])
            print(f"{pid}: skipped ({skip})")
            return None
        t0 = time.time()
        made = prod.make(self.ctx)
        files = []
        for stem, fig in made.figures.items():
            label = (fig.layout.meta or {}).get("label") if isinstance(fig.layout.meta, dict) else None
            self._check(pid, cls, label, "figure " + stem, label_kind)
            record_figure(fig, self.out / stem, formats=self.formats)
            files.append(dict(stem=stem, kind="figure", file=f"{stem}.html", label=label))
        for stem, (frame, title) in made.tables.items():
            label = frame.attrs.get("label")
            self._check(pid, cls, label, "table " + stem, label_kind, allow_paper=True)
            record_table(frame, self.out / stem, title=title, label=label)
            files.append(dict(stem=stem, kind="table", file=f"{stem}.csv", label=label))
        self.ctx.values[pid] = made.value
        self.status[pid] = dict(status="made", reason="", files=files, seconds=round(time.time() - t0, 1),
                                notes=list(made.notes))
        if self.show_output:
            for note in made.notes:
                print(note)
            for frame, _ in made.tables.values():
                _display(frame)
            for fig in made.figures.values():
                _display(fig)
        return made.value

    @staticmethod
    def _check(pid, cls, label, what, label_kind, allow_paper=False):
        kind = label_kind(label)
        if kind == cls or (allow_paper and kind == "PAPER"):
            return
        raise ProductError(f"product {pid}: the manifest says {cls}, but its {what} is labelled "
                           f"{label!r} ({kind}); fix the label or the manifest")

    # ---- the closing tables -------------------------------------------------------------------
    def manifest_frame(self):
        """One row per product (and per item moelab does not reproduce): what was made, or why not."""
        import pandas as pd

        rows = []
        for it in self.manifest.items:
            if not it.products:
                rows.append(dict(item=it.id, title=it.title, product="", kind=NOT_REPRODUCED, status="not reproduced",
                                 reason=it.not_reproduced, files="", seconds=None))
            for pid, cls in it.products.items():
                st = self.status.get(pid, dict(status="not run", reason="the notebook did not call show()",
                                               files=[], seconds=None))
                rows.append(dict(item=it.id, title=it.title, product=pid, kind=cls, status=st["status"],
                                 reason=st["reason"], files=" ".join(f["file"] for f in st["files"]),
                                 seconds=st["seconds"]))
        df = pd.DataFrame(rows)
        df.attrs["label"] = (f"PAPER items of {self.manifest.title} and what moelab made of each "
                             f"(experiments/{self.manifest.paper}/manifest.yaml)")
        return df

    def finish(self):
        """Walk the paper's gap ladders, write the paper-vs-moelab table, the manifest (``manifest.json`` +
        ``table_manifest.csv``) and the run time per product; return the paper-vs-moelab frame."""
        pvm = None
        if paper_numbers_path(self.manifest.paper).is_file():
            ladders, closed = walk_all(self.manifest.paper, self.ctx.scale)
            self.ladders = ladders
            if len(ladders):
                record_table(ladders, self.out / "table_gap_ladders", title="Gap ladders", label=ladders.attrs["label"])
            pvm = compare(self.manifest.paper, self.values, self.products, closed=closed)
            record_table(pvm, self.out / "table_paper_vs_moelab", title="Paper vs moelab", label=pvm.attrs["label"])
            record_figure(compare_figure(pvm), self.out / "paper_vs_moelab", formats=self.formats)
        mf = self.manifest_frame()
        record_table(mf, self.out / "table_manifest", title=f"Manifest: {self.manifest.title}", label=mf.attrs["label"])
        atomic_write_json(self.out / "manifest.json", dict(
            kind="manifest", paper=self.manifest.paper, title=self.manifest.title, spec=self.manifest.spec,
            items=[dict(id=it.id, title=it.title, not_reproduced=it.not_reproduced,
                        products=[dict(id=pid, cls=cls, **self.status.get(
                            pid, dict(status="not run", reason="the notebook did not call show()", files=[],
                                      seconds=None, notes=[])))
                                  for pid, cls in it.products.items()])
                   for it in self.manifest.items]))
        if self.show_output:
            import pandas as pd

            with pd.option_context("display.max_colwidth", 90, "display.width", 250):
                _display(mf[["item", "product", "kind", "status", "reason", "seconds"]])
                if pvm is not None:
                    _display(pvm)
        return pvm


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
