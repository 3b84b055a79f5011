"""Hecate's products: one registered function per figure or table moelab makes of the paper (ids as in
``experiments/hecate/manifest.yaml``); the notebook calls ``Session.show(id)`` once per product."""
from __future__ import annotations

from moelab.repro.registry import Made, Quantity, product

from . import figures as F
from . import trace
from .common import scale_spec, table1 as _table1  # noqa: F401 - scale_spec: the Session's scale lookup

P = "hecate"
X = "x"


TABLE1_PARAMS = ("model", {m: Quantity(f"parameters of {m} (experts + attention, L*(4E+4)*d^2)", "params")
                           for m in ("GPT-MoE-S", "GPT-MoE-L", "BERT-MoE", "BERT-MoE-Deep")})


@product(P, "table1", quantities={"params": TABLE1_PARAMS})
def table1(ctx):
    t = _table1()
    bad = t[~t.matches_paper]
    notes = [f"moelab's count differs from the paper's column for {list(bad.model)}"] if len(bad) else []
    return Made(t, tables={"table1_models": (t, "Table 1: models and parameters (L·(4E+4)·d²)")}, notes=notes)


@product(P, "fig3", needs_real=True)
def fig3(ctx):
    f = trace.fig3_heatmap(ctx.scale.name)
    s = trace.imbalance_summary(f)
    return Made(s, tables={"table_fig03_imbalance": (s, "Fig. 3: per layer, mean max/mean expert load and drift")},
                figures={"fig03_heatmap": F.fig3_heatmap(f, label=f.attrs["label"])})
