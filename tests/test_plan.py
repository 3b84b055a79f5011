"""``moelab plan`` (moelab.sim.plan): ranking, EP baseline, memory refusal, only compatible combinations,
bad input refused before any pricing."""
import dataclasses
import json

import pytest

from moelab.config import ConfigError
from moelab.sim import plan as P
from moelab.sim.profiles import get_profile
from moelab.techniques import SEP, compatibility

SMALL = dict(layers=2, tokens_per_gpu=256)  # qwen3's widths and 128 experts on one node of 8: a second or two


@pytest.fixture(scope="module")
def small():
    return P.plan("qwen3_30b_a3b", "hecate_A", 1, **SMALL)


def test_ranked_by_step_time_with_ep_as_one(small):
    ranked = small.ranked()
    assert len(ranked) >= 3
    steps = [r["step_ms"] for r in ranked]
    assert steps == sorted(steps)
    ep = next(r for r in small.rows if r["combination"] == P.EP)
    assert ep["speedup_vs_ep"] == 1.0
    for r in ranked:
        assert r["speedup_vs_ep"] == pytest.approx(ep["step_ms"] / r["step_ms"])
        assert 0 < r["peak_mem_GB"] <= get_profile("hecate_A").mem_GB
        assert r["inter_GB"] == 0  # one node: nothing crosses nodes
    assert small.label.startswith("SIMULATED: hecate_A x1 nodes")


def test_a_combination_that_does_not_fit_is_refused_with_the_reason(small):
    peaks = sorted({round(r["peak_mem_GB"], 6) for r in small.ranked()})
    assert len(peaks) >= 2, "the candidates' peaks should differ (ZeRO/FSDP vs EP) for this test to bite"
    limit = (peaks[0] + peaks[-1]) / 2
    tight = dataclasses.replace(get_profile("hecate_A"), mem_GB=limit)
    p = P.plan("qwen3_30b_a3b", tight, 1, **SMALL)
    over = [r for r in p.rows if r["refused"].startswith("does not fit")]
    assert over and p.ranked()
    for r in over:
        assert r["peak_mem_GB"] > limit and f"{limit:g} GB" in r["refused"]
    assert all(r["peak_mem_GB"] <= limit for r in p.ranked())
    assert "refused " + over[0]["combination"] + ": does not fit" in P.format_table(p)


def test_only_compatible_combinations_are_candidates(small):
    names = {n for n, _ in P.candidates()}
    seen = {r["combination"] for r in small.rows}
    for a, b, why in compatibility():
        pair = {f"{a}{SEP}{b}", f"{b}{SEP}{a}"}
        if why is None:
            assert pair & names and pair & seen, (a, b)
        else:
            assert not pair & names and not pair & seen, (a, b, why)
    with pytest.raises(ConfigError, match="not candidates"):
        P.plan("qwen3_30b_a3b", "hecate_A", 1, names=["zero+fastermoe"], **SMALL)


@pytest.mark.parametrize("args, match", [
    (("no_such_model", "hecate_A", 1), "unknown preset"),
    (("qwen3_30b_a3b", "no_such_profile", 1), "unknown cluster profile"),
    (("qwen3_30b_a3b", "hecate_A", 0), "--nodes must be an integer >= 1"),
    (("qwen3_30b_a3b", "hecate_A", -2), "--nodes must be an integer >= 1"),
])
def test_bad_input_is_refused_before_pricing(monkeypatch, args, match):
    def no_pricing(*a, **k):
        raise AssertionError("priced before the input was checked")

    monkeypatch.setattr(P, "price", no_pricing)
    with pytest.raises(ConfigError, match=match):
        P.plan(*args, **SMALL)


def test_experts_that_do_not_divide_over_the_gpus_grow_and_say_so():
    shape, prof = P.check_inputs("mixtral_8x7b", "hecate_A", 2, 1.0, None, 4096)
    cfg, note = P.base_config(shape, prof)
    assert cfg.model.moe.num_experts == 16 and "the preset has 8" in note
    cfg, note = P.base_config(*P.check_inputs("mixtral_8x7b", "hecate_A", 1, 1.0, None, 4096))
    assert cfg.model.moe.num_experts == 8 and note == "8 experts (the preset's)"


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    from moelab.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "qwen3_30b_a3b", "--profile", "hecate_A", "--nodes", "1", "--layers", "2",
                 "--tokens-per-gpu", "256", "--top", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("SIMULATED: hecate_A x1 nodes") and "speedup_vs_ep" in text
    data = json.loads(out.read_text())
    assert data["gpus"] == 8 and {r["combination"] for r in data["rows"]} >= {"ep", "lina+lsh_moe"}
    assert main(["plan", "--model", "qwen3_30b_a3b", "--profile", "hecate_A", "--nodes", "0"]) == 2
    assert "--nodes must be" in capsys.readouterr().err
