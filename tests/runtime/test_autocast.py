"""train.autocast=bf16: the forward runs in bfloat16 on real ranks, close to the fp32 run; refused where it cannot
run."""
import pytest

from moelab.config import ConfigError, RunConfig
from moelab.runtime.preflight import cpu_has_bf16


@pytest.mark.timeout(300)
def test_bf16_autocast_on_two_gloo_ranks_tracks_the_fp32_run():
    from moelab.runtime.ranks import run_ranks
    from moelab.testing import train_snapshot

    if not cpu_has_bf16():
        pytest.skip("this CPU has no native bf16")
    bf16 = run_ranks(train_snapshot, 2, {"train.dtype": "float32", "train.autocast": "bf16"}, timeout=240)
    fp32 = run_ranks(train_snapshot, 2, {"train.dtype": "float32"}, timeout=240)
    assert bf16[0]["losses"] == pytest.approx(fp32[0]["losses"], rel=1e-2)
    assert bf16[0]["losses"] != fp32[0]["losses"]  # bf16 really ran: not the fp32 numbers


def test_autocast_is_refused_where_it_cannot_work(monkeypatch):
    cfg = RunConfig().with_overrides({"parallel.backend": "gloo"})
    assert cfg.short_hash() == cfg.with_overrides({"train.autocast": "none"}).short_hash()  # old run ids kept
    with pytest.raises(ConfigError, match="train.autocast must be none or bf16"):
        cfg.with_overrides({"train.autocast": "fp16"}).validate()
    with pytest.raises(ConfigError, match="set train.dtype=float32"):
        cfg.with_overrides({"train.autocast": "bf16", "train.dtype": "float64"}).validate()
    monkeypatch.setattr("moelab.runtime.preflight.cpu_has_bf16", lambda: False)
    with pytest.raises(ConfigError, match="this CPU has no native bf16"):
        cfg.with_overrides({"train.autocast": "bf16"}).validate()
