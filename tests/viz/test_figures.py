"""Figure builders carry their label and wrap it; export writes HTML loading one shared plotly.js always, PNG when
it can."""
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


def test_html_export_loads_one_shared_plotlyjs(tmp_path, metrics):
    fig = loss_curve(metrics, label=LABEL)
    paths = export_figure(fig, tmp_path / "figs" / "loss", formats=("html",))
    assert paths == [tmp_path / "figs" / "loss.html"]
    html = paths[0].read_text()
    js = export.plotlyjs_name()
    assert f'<script src="assets/{js}"' in html and "https://" not in html and LABEL in html
    assert len(html) < 50_000 and (tmp_path / "figs" / "assets" / js).stat().st_size > 1_000_000
    export_figure(fig, tmp_path / "figs" / "deeper" / "loss", formats=("html",))  # finds the copy above it
    assert f'src="../assets/{js}"' in (tmp_path / "figs" / "deeper" / "loss.html").read_text()
    export_figure(fig, tmp_path / "r" / "figures" / "paper" / "loss", formats=("html",))  # figures/<name>/
    assert (tmp_path / "r" / "figures" / "assets" / js).is_file()
    assert sorted(p.name for p in tmp_path.rglob("plotly-*.js")) == [js, js]
    assert export.read_figure(paths[0])["layout"]["meta"] == {"label": LABEL}
    inline = export_figure(fig, tmp_path / "alone", formats=("html",), plotlyjs="inline")[0].read_text()
    assert len(inline) > 1_000_000 and "<script src=" not in inline and export.read_figure(tmp_path / "alone.html")


def test_without_chromium_html_is_kept_and_the_warning_comes_once(tmp_path, metrics, monkeypatch):
    monkeypatch.setattr(export, "find_chromium", lambda: None)
    monkeypatch.setattr(export, "_warned", False)
    fig = loss_curve(metrics, label=LABEL)
    with pytest.warns(RuntimeWarning, match=r"PNG export skipped: no Chromium found \(apt install chromium"):
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


def test_long_titles_and_labels_wrap_inside_the_width(metrics):
    from moelab.viz.figures import WIDTH, finish, wrap
    from tests.viz.figure_checks import title_lines, too_wide

    long = ("SIMULATED: parm_A / parm_B (2, 4, 8 nodes), one MoE layer fwd+bwd per kept Table III configuration "
            "(every 29th), k=1, E=P/N_ESP, einsum and index dispatchers, fp32, compute at 0.5 of peak (assumed); "
            "Parm = Alg. 1 on alpha-beta lines fitted to the simulator's own collective curves")
    fig = loss_curve(metrics, label=long, title="Fig. 7: distribution of Parm's speedup over the baseline, " * 3)
    lines = title_lines(fig)
    assert sum(sup for _, sup in lines) >= 2 and sum(not sup for _, sup in lines) >= 2
    assert " ".join(ln for ln, sup in lines if sup) == long  # wrapped at spaces, nothing lost
    assert fig.layout.meta["label"] == long and not too_wide(fig)
    assert fig.layout.margin.t >= 22 * len(lines) and fig.layout.title.yanchor == "top"
    narrow = finish(loss_curve(metrics, label=LABEL), "t", long, width=600)
    assert not too_wide(narrow) and len(title_lines(narrow)) > len(lines) - 2
    short = loss_curve(metrics, label=LABEL)  # one title line and one label line: plotly's own layout
    assert short.layout.title.text == f"Training loss<br><sup>{LABEL}</sup>" and short.layout.margin.t is None
    assert finish(loss_curve(metrics, label=LABEL), "t", long, margin={"t": 170}).layout.margin.t == 170
    assert wrap("a " * 10 + "x" * 50, 200, 10) == ["a " * 9 + "a", "x" * 50]  # a long word stays whole
    assert WIDTH == 1200


def test_smaller_png_is_the_same_image(tmp_path):
    import struct
    import zlib

    raw = b"".join(b"\x00" + bytes([x % 256, 0, 0]) * 64 for x in range(64))  # 64x64 RGB, filter 0
    def chunk(t, b):
        return struct.pack(">I", len(b)) + t + b + struct.pack(">I", zlib.crc32(t + b))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 0)[:100]) + chunk(b"IDAT", zlib.compress(raw, 0)[100:])
           + chunk(b"IEND", b""))
    small = export.smaller_png(png)
    assert len(small) < len(png) / 4 and small.count(b"IDAT") == 1
    idat = small[small.index(b"IDAT") + 4:small.index(b"IEND") - 8]
    assert zlib.decompress(idat) == raw and small.endswith(chunk(b"IEND", b""))
    assert export.smaller_png(b"not a png") == b"not a png"
