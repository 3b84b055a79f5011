"""Every registered product's figures read at smoke scale: each series its own colour (two traces share one only when
they are the same system: one legend group or one name), and the title and the label under it fit a 1,200 px wide
figure (``moelab.viz.figures.finish`` wraps them). Products that spawn ranks are ``slow``; GPU products run where
CUDA is. Known offenders are strict xfails naming the builder and the fix, so a fix shows up as XPASS."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tests.viz.figure_checks import shared_colours, too_wide

REPO = Path(__file__).resolve().parents[2]

# (paper, product) -> why its figure fails the colour check, and the fix (in files this test does not own)
KNOWN: dict = {}


def _products() -> list:
    """(paper, product id, needs_real, needs_gpu) of every paper with a manifest, in manifest order."""
    from moelab.papers.kit.manifest import load_manifest
    from moelab.papers.kit.registry import products

    out = []
    for path in sorted((REPO / "experiments").glob("*/manifest.yaml")):
        paper = path.parent.name
        m = load_manifest(paper)
        reg = products(paper, m.products_module)
        out += [(paper, pid, reg[pid].needs_real, reg[pid].needs_gpu) for pid in m.product_classes() if pid in reg]
    return out


def _params():
    for paper, pid, real, gpu in _products():
        marks = [pytest.mark.slow] if real else []
        if (paper, pid) in KNOWN:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN[(paper, pid)]))
        yield pytest.param(paper, pid, gpu, marks=marks, id=f"{paper}-{pid}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("paper", "pid", "gpu"), list(_params()))
def test_every_series_its_own_colour_and_titles_that_fit(paper, pid, gpu):
    from moelab.papers.kit.manifest import load_manifest
    from moelab.papers.kit.registry import Context, products

    if gpu:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("a GPU product: no CUDA device here")
    m = load_manifest(paper)
    module = importlib.import_module(m.products_module)
    spec = module.scale_spec("smoke") if hasattr(module, "scale_spec") else "smoke"
    made = products(paper, m.products_module)[pid].make(Context(paper, spec, 0, True))
    problems = [f"{stem}: {p}" for stem, fig in made.figures.items() for p in shared_colours(fig) + too_wide(fig)]
    assert not problems, "\n".join(problems)


def test_the_checks_themselves():
    import plotly.graph_objects as go

    from moelab.viz.figures import finish

    fig = go.Figure()
    fig.add_bar(x=[1], y=[1], name="Hecate", marker_color="#e45756")
    fig.add_bar(x=[1], y=[2], name="Hecate (t formula)", marker_color="rgb(228, 87, 86)")
    assert shared_colours(fig) == ["#e45756 drawn for 'Hecate', 'Hecate (t formula)'"]
    same = go.Figure()  # one system in two panels (one legend group), an unnamed reference line
    same.add_bar(x=[1], y=[1], name="EP", legendgroup="EP", marker_color="#4c78a8")
    same.add_bar(x=[1], y=[1], name="EP", legendgroup="EP", marker_color="#4c78a8", showlegend=False)
    same.add_scatter(x=[0, 1], y=[0, 1], mode="lines", line_color="grey")
    same.add_scatter(x=[0, 1], y=[1, 0], mode="lines", line_color="grey")
    same.add_heatmap(z=[[1, 2]])
    assert shared_colours(same) == []
    cycled = go.Figure([go.Scatter(x=[0], y=[i], name=f"s{i}") for i in range(11)])  # the 10-colour default
    assert shared_colours(cycled) == ["#636efa drawn for 's0', 's10'"]
    long = "SIMULATED: " + "a long label " * 30
    raw = go.Figure(layout={"title": {"text": f"t<br><sup>{long}</sup>"}})
    assert too_wide(raw) and not too_wide(finish(go.Figure(), "t", long))
