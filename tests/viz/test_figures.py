"""Figure builders carry their label; export writes self-contained HTML always, PNG when it can."""
import warnings

import pandas as pd
import pytest

from moelab.viz import bytes_by_link, expert_load_heatmap, export, export_figure, loss_curve, timeline

LABEL = "REAL: 2 ranks, gloo"


@pytest.fixture
def metrics():
    return pd.DataFrame({"iter": [0, 1, 2], "loss": [3.0, 2.0, 1.5], "bytes_local": [1, 1, 1],
                         "bytes_intra": [10, 20, 30], "bytes_inter": [0, 5, 0]})


@pytest.fixture
def loads():
    rows = [(it, layer, e, (e + 1) * (it + 1) + layer) for it in range(3) for layer in (0, 1) for e in range(4)]
    return pd.DataFrame(rows, columns=["iter", "layer", "expert", "tokens"])


@pytest.fixture
def trace():
    ev = []
    for rank in (0, 1):
        for it in (0, 1):
            t0 = 1000.0 * it + 100 * rank
            ev += [dict(rank=rank, name=f"iter {it}", cat="iteration", ts=t0, dur=900.0, tid=0, iter=it),
                   dict(rank=rank, name="forward", cat="compute", ts=t0 + 10, dur=300.0, tid=0, iter=it),
                   dict(rank=rank, name="all_to_all", cat="comm", ts=t0 + 50, dur=100.0, tid=0, iter=it)]
    return pd.DataFrame(ev)


def _title(fig):
    return fig.layout.title.text


def test_every_builder_shows_its_label(metrics, loads, trace):
    figs = [loss_curve(metrics, label=LABEL), expert_load_heatmap(loads, label=LABEL),
            timeline(trace, label=LABEL), bytes_by_link(metrics, label=LABEL)]
    for fig in figs:
        assert LABEL in _title(fig) and fig.layout.meta["label"] == LABEL


@pytest.mark.parametrize("builder", [loss_curve, expert_load_heatmap, timeline, bytes_by_link])
def test_a_figure_without_a_proper_label_cannot_be_built(builder, metrics):
    with pytest.raises(TypeError):
        builder(metrics)
    for bad in ("", "  ", "my run", "real: lowercase", None):
        with pytest.raises(ValueError, match="must start with one of"):
            builder(metrics, label=bad)


def test_labels_of_every_kind(metrics):
    for label in ("EMULATED links: 4 ranks", "SIMULATED: trevor", "SUBSTITUTE: CPU for V100", "PAPER: Fig. 9"):
        assert label in _title(loss_curve(metrics, label=label))


def test_loss_curve_one_line_per_group(metrics):
    both = pd.concat([metrics.assign(run="ep"), metrics.assign(run="hecate", loss=metrics["loss"] / 2)])
    fig = loss_curve(both, label=LABEL, by="run")
    assert [t.name for t in fig.data] == ["ep", "hecate"] and list(fig.data[1].y) == [1.5, 1.0, 0.75]


def test_heatmap_selects_a_layer_and_shows_shares(loads):
    fig = expert_load_heatmap(loads, label=LABEL, layer=1)
    z = pd.DataFrame(fig.data[0].z)
    assert z.shape == (4, 3) and z.sum(axis=0).round(12).tolist() == [1.0, 1.0, 1.0]
    raw = expert_load_heatmap(loads, label=LABEL, layer=1, share=False)
    assert raw.data[0].z[3][0] == 5  # expert 3, iteration 0, layer 1: 4*1 + 1 tokens
    assert "layer 1" in _title(fig)
    with pytest.raises(ValueError, match="layer 7 not in the loads"):
        expert_load_heatmap(loads, label=LABEL, layer=7)


def test_timeline_draws_one_iteration_per_rank_with_nesting(trace):
    fig = timeline(trace, label=LABEL)  # the last iteration by default
    assert "iteration 1" in _title(fig)
    bars = {t.name: t for t in fig.data}
    assert set(bars) == {"iteration", "compute", "comm"} and [t.name for t in fig.data][0] == "iteration"
    assert list(bars["iteration"].y) == ["rank 0", "rank 1"] and list(bars["iteration"].base) == [0.0, 0.1]
    widths = [bars[c].width[0] for c in ("iteration", "compute", "comm")]
    assert widths[0] > widths[1] > widths[2]  # nested events are drawn thinner, on top
    assert list(timeline(trace, label=LABEL, iteration=0).data[0].x) == [0.9, 0.9]
    with pytest.raises(ValueError, match="no trace events for iteration 5"):
        timeline(trace, label=LABEL, iteration=5)


def test_bytes_by_link_stacks_link_classes(metrics):
    fig = bytes_by_link(metrics, label=LABEL)
    assert fig.layout.barmode == "stack" and [t.name for t in fig.data] == ["local", "intra", "inter"]
    assert list(fig.data[1].y) == [10, 20, 30]
    comm = pd.DataFrame({"op": ["all_to_all", "all_to_all", "all_reduce"], "bytes_local": [1, 2, 3],
                         "bytes_intra": [4, 5, 6], "bytes_inter": [0, 0, 9]})
    per_op = bytes_by_link(comm, label=LABEL, by="op")
    assert list(per_op.data[0].x) == ["all_reduce", "all_to_all"] and list(per_op.data[2].y) == [9, 0]


def test_html_export_is_self_contained(tmp_path, metrics):
    paths = export_figure(loss_curve(metrics, label=LABEL), tmp_path / "figs" / "loss", formats=("html",))
    assert paths == [tmp_path / "figs" / "loss.html"]
    html = paths[0].read_text()
    assert 'src="https://cdn' not in html and len(html) > 1_000_000 and LABEL in html


def test_without_chromium_html_is_kept_and_the_warning_comes_once(tmp_path, metrics, monkeypatch):
    monkeypatch.setattr(export, "find_chromium", lambda: None)
    monkeypatch.setattr(export, "_warned", False)
    fig = loss_curve(metrics, label=LABEL)
    with pytest.warns(RuntimeWarning, match="PNG export skipped: no Chromium found; HTML written"):
        assert export_figure(fig, tmp_path / "a") == [tmp_path / "a.html"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert export_figure(fig, tmp_path / "b") == [tmp_path / "b.html"]
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.timeout(120)
@pytest.mark.skipif(export.find_chromium() is None, reason="no Chromium for kaleido")
def test_png_and_svg_export_with_chromium(tmp_path, loads):
    fig = expert_load_heatmap(loads, label=LABEL)
    paths = export_figure(fig, tmp_path / "heat", formats=("html", "png", "svg"))
    assert [p.name for p in paths] == ["heat.html", "heat.png", "heat.svg"]
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[1].stat().st_size > 5000
    assert "<svg" in paths[2].read_text()[:1000] and "REAL: 2 ranks, gloo" in paths[2].read_text()
