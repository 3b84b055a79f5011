"""Cluster-scale what-ifs: sweep rows, sensitivity, clear errors, the notebook at smoke scale."""
from pathlib import Path

import pytest

from moelab.config import ConfigError
from moelab.models.presets import preset
from moelab.sim import get_profile
from moelab.sim.whatif import check_sweep, strategies_with_graphs, sweep

REPO = Path(__file__).resolve().parents[2]
BASE = preset("mixtral_8x7b").config().with_overrides({"model.n_layers": 1, "model.seq_len": 512,
                                                       "train.batch_size": 1})


@pytest.mark.parametrize("args, word", [
    (([], 8, 1, [1.0], [1.0]), "ranks is empty"),
    (([16], 8, 1, [], [1.0]), "inter_bw_scales is empty"),
    (([16], 8, 1, [1.0], []), "skews is empty"),
    (([12], 8, 1, [1.0], [1.0]), "do not fill nodes of 8"),
    (([16], 8, 0, [1.0], [1.0]), "experts_per_rank"),
    (([16], 8, 1.5, [1.0], [1.0]), "experts_per_rank"),
    (([16], 8, 1, [0.0], [1.0]), "inter_bw_scales must be > 0")])
def test_bad_sweeps_fail_before_any_work(args, word):
    with pytest.raises(ConfigError, match=word):
        check_sweep(*args)


def test_a_sweep_prices_every_point_and_says_what_it_could_not():
    prof = get_profile("fastermoe_trevor")
    f = sweep(BASE, prof, [16], strategies=["ep", "fastermoe", "no_such_strategy"], inter_bw_scales=[0.5, 2.0],
              progress=False)
    assert len(f) == 6 and set(f.strategy) == {"ep", "fastermoe", "no_such_strategy"}
    priced = f[f.note == ""]
    assert set(priced.strategy) == {"ep", "fastermoe"} and (priced.step_ms > 0).all()
    nodes = 16 // prof.gpus_per_node
    assert (priced.bytes_inter_GB > 0).all() and (priced.experts == 16).all() and (priced.nodes == nodes).all()
    assert f[f.strategy == "no_such_strategy"].note.str.startswith("not priced").all()
    assert f.label.str.startswith(f"SIMULATED: fastermoe_trevor x{nodes} nodes").all()
    for name in ("ep", "fastermoe"):  # more inter-node bandwidth cannot make an iteration slower
        g = priced[priced.strategy == name].set_index("inter_bw_scale")
        assert g.step_ms[2.0] <= g.step_ms[0.5]
        assert g.bytes_inter_GB[2.0] == g.bytes_inter_GB[0.5]  # the same plan moves the same bytes


def test_the_registry_decides_which_strategies_appear():
    names = strategies_with_graphs()
    assert "ep" in names and "fastermoe" in names and len(names) == len(set(names))


@pytest.mark.timeout(600)
def test_the_notebook_runs_at_smoke_scale(tmp_path):
    pm = pytest.importorskip("papermill")
    import yaml

    params = yaml.safe_load((REPO / "experiments" / "cluster_scale" / "smoke.yaml").read_text())
    pm.execute_notebook(str(REPO / "notebooks" / "cluster_scale.ipynb"), str(tmp_path / "out.ipynb"),
                        parameters={**params, "out_dir": str(tmp_path / "figs")}, cwd=str(REPO),
                        kernel_name="python3", progress_bar=False)
    figs = tmp_path / "figs"
    for stem in ("scaling_step_ms", "scaling_bytes_inter_GB", "sensitivity_bandwidth", "table_scaling"):
        assert (figs / f"{stem}.json").is_file(), stem


def test_a_strategy_s_own_needs_are_applied_to_it_alone_and_recorded():
    prof = get_profile("fastermoe_trevor")
    need = {"parm": {"model.moe.capacity_factor": 1.25, "model.moe.dispatcher": "dense", "model.moe.gate": "gshard"}}
    f = sweep(BASE, prof, [16], strategies=["ep", "parm"], per_strategy=need, progress=False).set_index("strategy")
    assert f.loc["parm", "note"] == "" and f.loc["parm", "step_ms"] > 0
    assert f.loc["parm", "overrides"] == ("model.moe.capacity_factor=1.25, model.moe.dispatcher=dense, "
                                          "model.moe.gate=gshard")
    assert f.loc["ep", "overrides"] == ""
    bare = sweep(BASE, prof, [16], strategies=["parm"], progress=False)
    assert bare.note[0].startswith("not priced: ConfigError") and "capacity_factor" in bare.note[0]
