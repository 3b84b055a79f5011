"""The quickstart notebook, executed headless with papermill at smoke scale: a real 4-rank run,
four labelled figures and a table; a second execution re-plots the stored run instead of training."""
import json
from pathlib import Path

import pytest
import yaml

pm = pytest.importorskip("papermill")

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "00_quickstart.ipynb"
FIGURES = ("loss_curve", "expert_load", "timeline", "bytes_by_link")
LABEL = "REAL: 4 ranks, 2 nodes x 2, gloo"


def shared_runs_root(tmp_path_factory) -> Path:
    """One results store for the session, so test_reproduce can re-plot this run instead of training."""
    return tmp_path_factory.getbasetemp() / "quickstart_runs"


def execute(out_nb: Path, cwd: Path, **params):
    return pm.execute_notebook(str(NOTEBOOK), str(out_nb), parameters=params, kernel_name="python3",
                               cwd=str(cwd), progress_bar=False)


def test_parameters_cell_is_typed_and_commented():
    declared = pm.inspect_notebook(str(NOTEBOOK))
    for name in ("nproc", "iters", "nodes", "emulate", "out_dir", "runs_root", "reuse"):
        assert name in declared, name
        assert declared[name]["inferred_type_name"] != "None" and declared[name]["help"], name
    smoke = yaml.safe_load((REPO / "experiments" / "quickstart" / "smoke.yaml").read_text())
    assert set(smoke) <= set(declared)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quickstart_smoke(tmp_path, tmp_path_factory):
    from moelab.viz.export import find_chromium

    smoke = yaml.safe_load((REPO / "experiments" / "quickstart" / "smoke.yaml").read_text())
    runs, figs = shared_runs_root(tmp_path_factory), tmp_path / "figures"
    # run from an unrelated folder: the notebook finds experiments/ itself (moelab.runtime.project.project_path)
    execute(tmp_path / "executed.ipynb", tmp_path, **smoke, out_dir=str(figs), runs_root=str(runs))

    (run_dir,) = [d for d in runs.iterdir() if not d.name.startswith(".")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iters"] == smoke["iters"] and summary["nproc"] == 4 and summary["label"] == LABEL
    png = find_chromium() is not None
    for stem in FIGURES:
        assert (figs / f"{stem}.html").stat().st_size > 1000, stem
        assert (figs / f"{stem}.png").is_file() == png, stem
        side = json.loads((figs / f"{stem}.json").read_text())
        assert side["kind"] == "figure" and side["label"] == LABEL and side["title"], stem
    assert "final_loss" in (figs / "table_run_summary.csv").read_text()

    # the re-plot tier: the stored run is found, nothing is trained again
    stamp = (run_dir / "summary.json").stat().st_mtime_ns
    execute(tmp_path / "replot.ipynb", REPO, **smoke, out_dir=str(tmp_path / "replot"), runs_root=str(runs),
            png=False)
    assert (run_dir / "summary.json").stat().st_mtime_ns == stamp
    assert [d.name for d in runs.iterdir() if not d.name.startswith(".")] == [run_dir.name]
    assert sorted(p.stem for p in (tmp_path / "replot").glob("*.html")) == sorted(FIGURES)
    assert not list((tmp_path / "replot").glob("*.png"))
    assert not (REPO / "notebooks" / "runs").exists()
