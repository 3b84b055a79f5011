"""The FasterMoE notebook, executed headless with papermill at smoke scale (the CI budget): every product
the manifest promises is made and exported with a label of its declared class, the tables (Table 2,
Table 3, paper vs moelab, the manifest) exist, and ``moelab reproduce`` files the same notebook, with its
manifest, into its report."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

pm = pytest.importorskip("papermill")

REPO = Path(__file__).resolve().parents[3]
NOTEBOOK = REPO / "notebooks" / "fastermoe.ipynb"
KINDS = ("REAL", "EMULATED", "SIMULATED", "SUBSTITUTE", "PAPER")
FIGURES = ("fig03_ep_example", "fig04_popularity", "fig05_roofline", "fig05a_roofline_measured", "fig06_shadow_bytes",
           "fig07_schedule", "fig08a_schedules_real", "fig08b_schedules_sim", "fig09_predictor", "fig10_end_to_end",
           "fig10a_end_to_end_real", "fig11_shadowing", "fig11a_shadowing_real", "fig12_smart", "fig12a_smart_real",
           "fig13_breakdown",
           "fig13a_breakdown_real", "fig14_convergence", "paper_vs_moelab")
TABLES = ("table2_models", "table3_time_to_loss", "table_paper_vs_moelab", "table_fig09_r2", "table_fig10_end_to_end",
          "table_manifest")


def test_parameters_cell_is_typed_and_commented_and_scale_files_match():
    declared = pm.inspect_notebook(str(NOTEBOOK))
    for name in ("scale", "out_dir", "png", "seed", "run_real"):
        assert name in declared, name
        assert declared[name]["inferred_type_name"] != "None" and declared[name]["help"], name
    for scale in ("smoke", "default", "full"):
        params = yaml.safe_load((REPO / "experiments" / "fastermoe" / f"{scale}.yaml").read_text())
        assert params["scale"] == scale and set(params) <= set(declared), scale
    paper = yaml.safe_load((REPO / "experiments" / "fastermoe" / "paper.yaml").read_text())
    assert all({"value", "quantity", "unit", "source", "figure"} <= set(v) for v in paper["numbers"].values())


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_notebook_smoke_exports_every_figure_with_a_label(tmp_path):
    """One papermill execution at smoke scale through ``moelab reproduce`` (parameters from
    experiments/fastermoe/smoke.yaml, out_dir set by reproduce), then every export and the report."""
    from moelab.papers.kit.report import collect
    from moelab.papers.kit.reproduce import reproduce

    out = tmp_path / "rep"
    batch = reproduce(["fastermoe"], "smoke", out, log=lambda s: None)
    assert not batch.failed, batch.outcomes[0].error
    figs = out / "figures" / "fastermoe"
    assert (out / "notebooks" / "fastermoe.ipynb").is_file()
    for stem in FIGURES:
        assert (figs / f"{stem}.html").stat().st_size > 1000, stem
        side = json.loads((figs / f"{stem}.json").read_text())
        assert side["kind"] == "figure" and side["label"].startswith(KINDS) and side["title"], stem
    for stem in TABLES:
        assert (figs / f"{stem}.csv").is_file(), stem
    labels = {json.loads(p.read_text())["label"].split(":")[0].split()[0] for p in figs.glob("fig*.json")}
    assert {"REAL", "EMULATED", "SIMULATED", "SUBSTITUTE"} <= labels

    # every product the manifest promises was made, with files, and each file carries its declared class
    manifest = json.loads((figs / "manifest.json").read_text())
    made = [p for it in manifest["items"] for p in it["products"]]
    assert made and all(p["status"] == "made" and p["files"] for p in made), [
        (p["id"], p["status"], p["reason"]) for p in made if p["status"] != "made" or not p["files"]]
    for p in made:
        for f in p["files"]:
            assert f["label"].startswith((p["cls"], "PAPER")), (p["id"], f["stem"])

    table = pd.read_csv(figs / "table_paper_vs_moelab.csv")
    paper = yaml.safe_load((REPO / "experiments" / "fastermoe" / "paper.yaml").read_text())["numbers"]
    assert set(paper) <= set(table.key) and not (table.status == "refused").any()
    ran = table.dropna(subset=["moelab"])
    assert ran.moelab_label.str.startswith(KINDS).all() and len(ran.key.unique()) >= len(paper) - 4
    ratio = ran[ran.status == "ratio"]
    assert ratio.moelab_label.str.startswith("SIMULATED").all() and len(ratio)
    assert (ratio.ratio - ratio.moelab / ratio.paper).abs().max() < 1e-9
    assert ran[ran.status == "trend check"].ratio.isna().all()  # runs on this machine: trend checks, no ratio
    circular = ran[ran.status.isin(["fit", "chosen from", "input"])]  # their ratio stays visible (kit.compare)
    assert (circular.verdict == "not evidence").all()
    seconds = pd.read_csv(figs / "table_manifest.csv").seconds.sum()
    assert seconds < 300  # CI budget: the whole notebook in a few minutes on 2 cores

    # the report lists every figure with its label, and the paper table
    found = collect(figs)
    assert {f["name"] for f in found["figures"]} >= set(FIGURES)
    assert all(f["kind"] != "UNLABELLED" for f in found["figures"])
    index = (out / "index.html").read_text()
    assert "fastermoe" in index and "Paper vs moelab" in index and "fig10_end_to_end" in index
    assert "Manifest: what the paper has" in index and "NOT REPRODUCED" in index
