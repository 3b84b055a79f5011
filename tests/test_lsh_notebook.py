"""The LSH-MoE notebook, executed headless with papermill at smoke scale through ``moelab reproduce``: every
product the manifest promises is made and exported with a label of its declared class, and its tables exist.
(What the manifest promises grows with issue #11; the manifest/registry/notebook agreement is checked in
tests/test_repro_kit.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pm = pytest.importorskip("papermill")

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "lsh_moe.ipynb"
KINDS = ("REAL", "EMULATED", "SIMULATED", "SUBSTITUTE", "PAPER")


def test_parameters_cell_and_scale_files_match():
    declared = pm.inspect_notebook(str(NOTEBOOK))
    for name in ("scale", "out_dir", "png", "seed", "run_real"):
        assert name in declared and declared[name]["help"], name
    for scale in ("smoke", "default", "full"):
        params = yaml.safe_load((REPO / "experiments" / "lsh_moe" / f"{scale}.yaml").read_text())
        assert params["scale"] == scale and set(params) <= set(declared), scale
        from moelab.strategies.lsh_moe.experiments import scale_spec

        assert scale_spec(scale).name == scale


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_notebook_smoke_exports_every_product_with_its_class(tmp_path):
    from moelab.repro.manifest import load_manifest
    from moelab.reproduce import reproduce

    out = tmp_path / "rep"
    batch = reproduce(["lsh_moe"], "smoke", out, log=lambda s: None)
    assert not batch.failed, batch.outcomes[0].error
    figs = out / "figures" / "lsh_moe"
    sides = [json.loads(p.read_text()) for p in figs.glob("*.json")]
    labels = [s["label"] for s in sides if s.get("kind") == "figure"]
    assert labels and all(l.startswith(KINDS) for l in labels), labels
    assert (figs / "table_fig06l_summary.csv").is_file() and (figs / "table_manifest.csv").is_file()
    import pandas as pd

    promised = load_manifest("lsh_moe").product_classes()
    table = pd.read_csv(figs / "table_manifest.csv", dtype=str).fillna("")
    made = table[table["product"] != ""].set_index("product")
    assert sorted(made.index) == sorted(promised)
    assert (made.status == "made").all(), made[made.status != "made"]
