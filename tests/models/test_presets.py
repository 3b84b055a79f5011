"""Real MoE models as presets: sourced shapes, simulated at their real size, run for real scaled down."""
import numpy as np
import pytest

from moelab.config import ConfigError, RunConfig
from moelab.models.presets import PRESETS, preset
from moelab.runtime.memory import fits_memory, run_bytes_per_rank


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_sourced_valid_and_says_what_it_leaves_out(name):
    p = preset(name)
    cfg = p.config().validate()
    assert all(src.strip() for src in p.sources().values())
    assert p.not_modelled and all(x in p.label for x in p.not_modelled)
    small = p.config(scale=1 / 64).validate()
    m, s = cfg.model, small.model
    assert (s.moe.num_experts, s.moe.top_k, s.seq_len, s.moe_every) == (m.moe.num_experts, m.moe.top_k, m.seq_len,
                                                                       m.moe_every)
    assert s.d_model < m.d_model and s.d_ff < m.d_ff and s.n_layers <= m.n_layers
    assert s.vocab_size == RunConfig().model.vocab_size  # the data's vocabulary at small scale
    assert run_bytes_per_rank(small) < run_bytes_per_rank(cfg)


def test_published_numbers_are_the_ones_in_the_presets():
    mixtral = preset("mixtral_8x7b").config().model
    assert (mixtral.d_model, mixtral.d_ff, mixtral.n_layers, mixtral.moe.num_experts, mixtral.moe.top_k) == \
        (4096, 14336, 32, 8, 2)
    ds = preset("deepseek_v3").config().model
    assert (ds.d_model, ds.d_ff, ds.n_layers, ds.moe.num_experts, ds.moe.top_k) == (7168, 2048, 61, 256, 8)


def test_unknown_preset_and_bad_scale_are_clear():
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'.*mixtral_8x7b"):
        preset("gpt5")
    for bad in (0, -1, 1.5):
        with pytest.raises(ConfigError, match="scale must be in"):
            preset("mixtral_8x7b").config(scale=bad)


def test_a_preset_too_big_for_this_machine_is_refused_before_any_process(tmp_path):
    from moelab.cli import main

    cfg = preset("mixtral_8x7b").config().with_overrides({"parallel.nproc": 2})
    with pytest.raises(ConfigError, match="--scale"):
        fits_memory(cfg, memory=64 * 2**30)
    fits_memory(preset("mixtral_8x7b").config(scale=1 / 64).with_overrides({"parallel.nproc": 2}),
                memory=64 * 2**30)
    assert main(["run", "--preset", "mixtral_8x7b", "--nproc", "2", "--out-root", str(tmp_path / "runs")]) == 2
    assert not (tmp_path / "runs").exists()


def test_the_simulator_prices_a_preset_at_its_real_size():
    from moelab.sim import config_for_profile, get_profile, simulate_iteration, synthetic_loads

    prof = get_profile("parm_A")  # 8 GPUs: one Mixtral expert each
    cfg = config_for_profile(preset("mixtral_8x7b").config(), prof, **{"train.batch_size": 1})
    res = simulate_iteration(cfg, prof, synthetic_loads(cfg, seed=0))
    assert res.makespan > 0 and np.isfinite(res.makespan)


@pytest.mark.timeout(300)
def test_a_scaled_down_preset_trains_for_real(tmp_path):
    import moelab

    cfg = preset("switch_base_128").config(scale=1 / 64)
    run = moelab.launch(cfg, nproc=2, out_root=tmp_path, progress=False,
                        overrides={"train.iters": 2, "train.batch_size": 1, "model.seq_len": 64})
    assert run.summary["iters"] == 2 and np.isfinite(run.summary["final_loss"])
    assert run.config.model.moe.num_experts == 128 and run.config.name.startswith("switch_base_128-x")
