"""From drawing to run: the exported YAML is a config `moelab run` takes with the drawn placement, an invalid or
over-memory placement is refused, and a REAL run of it on 4 EMULATED ranks is read back beside the simulator
(bytes exactly equal; the layer times reported)."""
from __future__ import annotations

import pytest

from moelab.config import RunConfig
from moelab.runtime.launch import resolve_config
from moelab.viz import explorer as X
from moelab.viz.explorer_run import export_config, launch_config, real_vs_simulated, run_config

# lina's testbed shaped as 2 nodes x 2 GPUs: the 4 ranks of this machine, 8 experts, a replica of the hot one
LOCAL = X.ExplorerState(profile="lina", nodes=2, gpus_per_node=2, num_experts=8, tokens_per_rank=256,
                        d_model=64, d_ff=128, trace_iters=1, trace_layers=1)


def test_export_writes_a_config_moelab_run_takes(tmp_path):
    s = X.toggle_replica(LOCAL, X.hottest_expert(LOCAL), 3)
    p = export_config(s, tmp_path / "drawn.yaml")
    cfg = resolve_config(str(p))  # what `moelab run drawn.yaml` does first
    assert cfg.parallel.nproc == 4 and (cfg.parallel.topology.nodes, cfg.parallel.topology.ranks_per_node) == (2, 2)
    assert {int(e): list(h) for e, h in cfg.parallel.placement.items()} == X.mapping(s)
    assert cfg.model.moe.num_experts == 8 and cfg.emulation.enabled
    assert RunConfig.load(p).to_dict() == run_config(s).to_dict()


def test_export_refuses_a_placement_that_does_not_fit_memory(tmp_path):
    big = X.ExplorerState(profile="fastermoe_johnny", num_experts=16, tokens_per_rank=64, d_model=8192,
                          d_ff=32768, trace_iters=1, trace_layers=1)
    over = X.toggle_replica(big, 0, 1)
    with pytest.raises(ValueError, match="does not fit memory"):
        export_config(over, tmp_path / "no.yaml")
    assert not (tmp_path / "no.yaml").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_of_the_export_is_read_back_beside_the_simulator(tmp_path):
    s = X.toggle_replica(LOCAL, X.hottest_expert(LOCAL), 3)
    p = export_config(s, tmp_path / "drawn.yaml", iters=4)
    run = launch_config(p, tmp_path / "runs", progress=False)
    assert run.config.parallel.placement is not None and run.summary["iters"] == 4
    r = real_vs_simulated(run, warmup=2)
    assert r["real_label"].startswith("REAL: 4 ranks") and "EMULATED" in r["real_label"]
    assert r["sim_label"].startswith("SIMULATED") and r["real_s"] > 0 and r["sim_s"] > 0
    assert r["bytes_exact"]  # the run moved exactly the bytes the simulator's graph of its plan says
    assert set(r["layers"].layer) == {0, 1} and len(r["layers"]) == 4  # 2 timed iterations x 2 MoE layers
    print(f"MoE layer time: REAL {r['real_s'] * 1e3:.1f} ms, SIMULATED {r['sim_s'] * 1e3:.1f} ms "
          f"({r['rel_err'] * 100:+.1f} %)")
