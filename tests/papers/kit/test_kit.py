"""The reproduction kit (moelab.papers.kit): manifests, the product registry, the session a notebook drives,
the paper-vs-moelab comparison; and, for every paper, that manifest, registry, paper.yaml and notebook
agree (a notebook that forgets a promised product fails here, before any run)."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd
import pytest

from moelab.papers.kit import Made, Quantity, Session, product
from moelab.papers.kit.compare import compare, load_numbers
from moelab.papers.kit.manifest import ManifestError, load_manifest, parse_manifest
from moelab.papers.kit.registry import check_against_manifest, products
from moelab.papers.kit.session import ProductError

REPO = Path(__file__).resolve().parents[3]
PAPERS = ("fastermoe", "hecate", "lsh_moe", "parm", "lina")


def notebook_calls(paper: str) -> list:
    """Product ids the paper's notebook passes to ``S.show`` (in order)."""
    nb = json.loads((REPO / "notebooks" / f"{paper}.ipynb").read_text())
    src = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    return re.findall(r"""\.show\(\s*["']([\w-]+)["']""", src)


# ---- every paper: one registry, one manifest, one notebook ------------------------------------------------
@pytest.mark.parametrize("paper", PAPERS)
def test_manifest_registry_notebook_and_paper_numbers_agree(paper):
    m = load_manifest(paper)
    assert check_against_manifest(m) == []
    promised = list(m.product_classes())
    calls = notebook_calls(paper)
    assert sorted(calls) == sorted(promised), set(promised) ^ set(calls)  # each product shown exactly once
    reg = products(paper, m.products_module)
    for key, e in load_numbers(paper).items():
        for src in e.get("moelab") or []:
            q = reg[src["product"]].quantities.get(src["column"])
            if isinstance(q, tuple):
                q = q[1].get((src.get("where") or {}).get(q[0]))
            assert q is not None and (q.name, q.unit) == (e["quantity"], e["unit"]), (key, src)
        assert e.get("moelab") or e.get("no_counterpart"), f"{key}: say why moelab has no counterpart"
    for it in m.items:  # every item either has products or a reason
        assert it.products or it.not_reproduced


def test_the_notebook_check_catches_a_missing_call():
    calls = notebook_calls("fastermoe")
    promised = load_manifest("fastermoe").product_classes()
    assert sorted(calls[1:]) != sorted(promised)


def test_paper_numbers_are_read_once_and_again_after_an_edit(tmp_path):
    """Parsed paper.yaml files are cached (figures ask for hundreds of values); an edited file is read again,
    and a caller that changes what it got does not change what the next caller gets."""
    entry = "{value: %s, quantity: q, unit: x, figure: Fig. 1, source: text}"
    f = tmp_path / "paper.yaml"
    f.write_text("numbers:\n  a: " + entry % "1.5" + "\n")
    got = load_numbers(f)
    assert got["a"]["value"] == 1.5
    got["a"]["value"] = 99.0
    assert load_numbers(f)["a"]["value"] == 1.5
    f.write_text("numbers:\n  a: " + entry % "2.25" + "\n  b: " + entry % "3" + "\n")
    assert load_numbers(f)["a"]["value"] == 2.25 and set(load_numbers(f)) == {"a", "b"}
    f.write_text("numbers:\n  a: {value: 1}\n")
    with pytest.raises(ValueError, match="lacks"):
        load_numbers(f)


# ---- manifest validation -----------------------------------------------------------------------------------
def _m(items):
    return {"paper": "toy", "title": "Toy", "products": "tests.nothing", "items": items}


@pytest.mark.parametrize("items,match", [
    ([{"id": "fig1", "products": {"f1": "MEASURED"}}], "class must be one of"),
    ([{"id": "fig1"}], "either products or a not_reproduced"),
    ([{"id": "fig1", "products": {"f1": "REAL"}, "not_reproduced": "x"}], "not both"),
    ([{"id": "fig1", "not_reproduced": "x"}, {"id": "fig1", "not_reproduced": "y"}], "unique"),
    ([{"id": "fig1", "products": {"f1": "REAL"}}, {"id": "fig2", "products": {"f1": "REAL"}}], "two items"),
])
def test_manifest_rejects(items, match):
    with pytest.raises(ManifestError, match=match):
        parse_manifest(_m(items))


def test_manifest_classes():
    m = parse_manifest(_m([{"id": "fig1", "not_reproduced": "schematic"},
                           {"id": "fig2", "products": {"a": "REAL", "b": "SIMULATED"}}]))
    assert m.item("fig1").classes == ("NOT REPRODUCED",) and m.item("fig2").classes == ("REAL", "SIMULATED")
    assert m.item_of("b").id == "fig2"


# ---- a toy paper through the session and the comparison ----------------------------------------------------
TOY = "toy_repro_paper"
SPEED = Quantity("speedup of the toy system", "x")


def _frame(label, **cols):
    df = pd.DataFrame(cols)
    df.attrs["label"] = label
    return df


@product(TOY, "sim", quantities={"speedup": SPEED, "other": Quantity("something else", "x")})
def _sim(ctx):
    f = _frame("SIMULATED: toy cluster", system=["a", "b"], speedup=[2.0, 3.0], other=[9.0, 9.0])
    return Made(f, tables={"table_sim": (f, "toy table")}, notes=["a note"])


@product(TOY, "emu", needs_real=True, quantities={"speedup": SPEED})
def _emu(ctx):
    return Made(_frame("EMULATED: 2 ranks", speedup=[0.8]))


@product(TOY, "gpu", needs_gpu=True)
def _gpu(ctx):
    f = _frame("REAL: 1 GPU", ms=[1.0])
    return Made(f, tables={"table_gpu": (f, "toy GPU timings")})


@product(TOY, "liar")
def _liar(ctx):
    import plotly.graph_objects as go

    fig = go.Figure(layout={"meta": {"label": "REAL: 2 ranks gloo"}})
    return Made(None, figures={"fig_liar": fig})


def _toy_manifest(with_liar=False):
    items = [{"id": "fig1", "not_reproduced": "schematic"},
             {"id": "fig2", "products": {"sim": "SIMULATED", "emu": "EMULATED", "gpu": "REAL"}}]
    if with_liar:
        items.append({"id": "fig3", "products": {"liar": "SIMULATED"}})
    return parse_manifest({"paper": TOY, "title": "Toy", "products": __name__, "items": items})


def test_registry_check_names_both_directions():
    errs = check_against_manifest(_toy_manifest())
    assert errs == [f"{TOY}: 'liar' is registered but in no manifest item"]
    m = parse_manifest({"paper": TOY, "title": "Toy", "products": __name__,
                        "items": [{"id": "x", "products": {"sim": "SIMULATED", "emu": "EMULATED", "liar": "SIMULATED",
                                                           "gpu": "REAL", "ghost": "REAL"}}]})
    assert check_against_manifest(m) == [f"{TOY}: manifest promises 'ghost', no function registers it"]


def test_session_records_skips_and_rejects_a_mislabelled_product(tmp_path):
    m = _toy_manifest(with_liar=True)
    S = Session(TOY, "smoke", tmp_path, run_real=False, show=False, manifest=m)
    assert S.show("sim")["speedup"].tolist() == [2.0, 3.0]
    assert S.show("emu") is None and S.status["emu"]["status"] == "skipped"
    with pytest.raises(ProductError, match="manifest says SIMULATED.*REAL"):
        S.show("liar")
    with pytest.raises(KeyError):
        S.show("nope")
    S.finish()
    side = json.loads((tmp_path / "manifest.json").read_text())
    prods = {p["id"]: p for it in side["items"] for p in it["products"]}
    assert prods["sim"]["status"] == "made" and prods["sim"]["files"][0]["file"] == "table_sim.csv"
    assert prods["emu"]["status"] == "skipped" and "run_real" in prods["emu"]["reason"]
    mf = pd.read_csv(tmp_path / "table_manifest.csv")
    assert mf.set_index("item").loc["fig1", "status"] == "not reproduced"
    # the report shows the manifest with a link to each product's file and the reason for the rest
    from moelab.papers.kit.html import manifest_html

    html = manifest_html(tmp_path, "figures/toy/")
    assert 'href="figures/toy/table_sim.csv"' in html and "schematic" in html and "run_real=False" in html


def test_a_gpu_product_is_skipped_and_reported_without_cuda_and_made_with_it(tmp_path, monkeypatch):
    import moelab.papers.kit.session as session

    monkeypatch.setattr(session, "_has_cuda", lambda: False)
    S = Session(TOY, "smoke", tmp_path, show=False, manifest=_toy_manifest(with_liar=True))
    assert S.show("gpu") is None and S.status["gpu"]["status"] == "skipped"
    assert "no CUDA device" in S.status["gpu"]["reason"] and not (tmp_path / "table_gpu.csv").exists()
    monkeypatch.setattr(session, "_has_cuda", lambda: True)
    assert S.show("gpu").ms.tolist() == [1.0] and S.status["gpu"]["status"] == "made"


def _numbers(**moelab):
    base = dict(value=2.5, quantity=SPEED.name, unit="x", figure="Fig. 2", source="spec §1", neutral=1.0)
    return {"n": {**base, "moelab": [moelab]}}


def test_compare_ratio_only_for_simulated_and_trend_check_otherwise():
    reg = products(TOY, __name__)
    values = {"sim": _sim(None).value, "emu": _emu(None).value}
    r = compare(TOY, values, reg, _numbers(product="sim", column="speedup", reduce="max")).iloc[0]
    assert r.status == "ratio" and r.moelab == 3.0 and r.ratio == pytest.approx(3.0 / 2.5)
    r = compare(TOY, values, reg, _numbers(product="sim", where={"system": "a"}, column="speedup")).iloc[0]
    assert r.moelab == 2.0
    r = compare(TOY, values, reg, _numbers(product="emu", column="speedup")).iloc[0]
    assert r.status == "trend check" and math.isnan(r.ratio) and r.trend.startswith("other side of 1")
    r = compare(TOY, {}, reg, _numbers(product="emu", column="speedup")).iloc[0]
    assert r.status == "not run" and math.isnan(r.moelab)
    r = compare(TOY, values, reg, _numbers(product="sim", where={"system": "z"}, column="speedup")).iloc[0]
    assert r.status == "no value" and "no rows match" in r.note


def test_compare_refuses_a_different_quantity():
    reg = products(TOY, __name__)
    values = {"sim": _sim(None).value}
    for col in ("other", "system"):  # declared as another quantity / not declared at all
        r = compare(TOY, values, reg, _numbers(product="sim", column=col, reduce="max")).iloc[0]
        assert r.status == "refused" and math.isnan(r.ratio) and "measures" in r.note
    r = compare(TOY, values, reg, _numbers(product="sim", column="speedup", reduce="only")).iloc[0]
    assert r.status == "refused" and "one row" in r.note  # two rows where one was promised


def test_fastermoe_paper_numbers_against_simulated_fig13():
    """The real table: a SIMULATED product's rows get ratios computed from its own frame; products not
    made are 'not run'; every paper number appears."""
    from moelab.papers import fastermoe as E

    m = load_manifest("fastermoe")
    reg = products("fastermoe", m.products_module)
    f13 = E.fig13_breakdown("smoke")
    table = compare("fastermoe", {"fig13": f13}, reg)
    assert set(load_numbers("fastermoe")) == set(table.key)
    row = table[(table.key == "breakdown_smart") & (table["product"] == "fig13")].iloc[0]
    assert row.status == "ratio" and row.moelab == pytest.approx(f13[f13.variant == "smart"].speedup.max())
    assert (row.paper == load_numbers("fastermoe")["breakdown_smart"]["value"]
            and row.ratio == pytest.approx(row.moelab / row.paper))
    assert (table[table["product"] != "fig13"].status == "not run").all()


# ---- scale specs as data -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    name: str
    nproc: int
    sizes: tuple
    layers: Optional[int]
    rate: float = 1.0


def test_scale_specs_from_yaml_are_checked():
    from moelab.papers.kit.scales import _build

    s = _build(Spec, "smoke", {"nproc": 4, "sizes": [1, 2], "layers": None, "rate": 2}, "f.yaml")
    assert s == Spec("smoke", 4, (1, 2), None, 2)
    with pytest.raises(ValueError, match=r"unknown fields \['nprocs'\], missing fields \['nproc'\]"):
        _build(Spec, "smoke", {"nprocs": 4, "sizes": [1], "layers": 1}, "f.yaml")
    with pytest.raises(ValueError, match="nproc must be int"):
        _build(Spec, "smoke", {"nproc": "4", "sizes": [1], "layers": 1}, "f.yaml")
    with pytest.raises(ValueError, match="sizes must be a list"):
        _build(Spec, "smoke", {"nproc": 4, "sizes": 3, "layers": 1}, "f.yaml")


def test_cache_runs_once_per_bound_arguments_and_returns_copies():
    from moelab.papers.kit.cache import cached

    calls = []

    @cached
    def suite(scale, trace=None, seed=0):
        calls.append((scale, trace, seed))
        return {"rows": [1, 2]}

    a = suite("smoke")
    a["rows"].append(3)  # a caller editing its copy
    assert suite("smoke", None) == {"rows": [1, 2]} and suite("smoke", trace=None, seed=0) == {"rows": [1, 2]}
    suite("smoke", "hot")
    assert calls == [("smoke", None, 0), ("smoke", "hot", 0)]
