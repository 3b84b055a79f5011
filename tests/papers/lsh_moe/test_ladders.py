"""LSH-MoE's gap ladders: rung 0 is the very number each headline row compares, every rung moves the one thing it
names (overrides reach the simulator), and the evidence behind speedup_min's ``contradicted`` is computed columns."""
from __future__ import annotations

import re

import pytest

from moelab.papers.kit.compare import REDUCERS, load_numbers, paper_value
from moelab.papers.kit.ladder import load_ladders, walk

SMOKE = "smoke"
TABLE_OF = {"table2s": "table2_speed", "table3s": "table3_speed"}


@pytest.fixture
def substitute_rate(monkeypatch):
    """The substitute's measured rate without training it (the rate sweep trains a tiny model)."""
    from moelab.papers.lsh_moe import speed

    monkeypatch.setattr(speed, "measured_rho", lambda scale, overrides=(): 0.3)
    return 0.3


def _row_value(key: str):
    """The headline row's moelab value, read from the speed table as paper.yaml's measured-rate source says."""
    from moelab.papers.lsh_moe import speed

    src = next(s for s in load_numbers("lsh_moe")[key]["moelab"] if not s.get("inputs"))
    df = getattr(speed, TABLE_OF[src["product"]]).__wrapped__(SMOKE)
    for col, want in src["where"].items():
        df = df[df[col] == want]
    col = df[src["column"]]
    return float(col.iloc[0]) if src["reduce"] == "only" else float(REDUCERS[src["reduce"]](col))


def test_the_ladders_cover_the_off_headlines_and_each_rung_is_a_switch_the_code_reads():
    lads = load_ladders("lsh_moe")
    assert set(lads) == {"glue_speed_15b", "glue_speed_52b", "speedup_min"}
    for lad in lads.values():
        assert [r.set for r in lad.rungs] == ["rate_from_paper", "hash_full_rotation", "eta_n_per_model"]
        assert all(r.to == 1 and r.source for r in lad.rungs)


@pytest.mark.parametrize("key", ["glue_speed_15b", "glue_speed_52b", "speedup_min"])
def test_the_lsh_moe_ladders_start_from_the_compared_value(substitute_rate, key):
    """Rung 0 is moelab's setting: the very number the paper-vs-moelab row compares."""
    lad = load_ladders("lsh_moe")[key]
    df = walk("lsh_moe", lad, SMOKE)
    assert df.headline.iloc[0] == pytest.approx(_row_value(key), rel=1e-12)
    assert df.closes.iloc[1:].sum() == pytest.approx(df.closed.iloc[-1])


def test_each_rung_moves_what_it_names(substitute_rate):
    from moelab.papers.lsh_moe import share, speed

    paper = (("rate_from_paper", 1),)
    assert speed.experiment_rate(SMOKE, "swin_rate") == substitute_rate
    assert speed.experiment_rate(SMOKE, "swin_rate", paper) == paper_value("lsh_moe", "swin_rate")
    assert speed.experiment_rate(SMOKE, "rate_at_L6", paper) == paper_value("lsh_moe", "rate_at_L6")

    full = (("hash_full_rotation", 1),)
    assert speed.hashing("GPT-MoE-52B") == (6, 2)
    assert speed.hashing("GPT-MoE-52B", full) == (6, share.model_config("GPT-MoE-52B").d_model)
    base, eq3 = (speed.glue_step(SMOKE, "GPT-MoE-15B", 0.2, o) for o in ((), full))
    assert eq3["hash_s"] > 100 * base["hash_s"] and eq3["speedup"] < base["speedup"]
    assert eq3["ep_s"] == base["ep_s"]  # the uncompressed step hashes nothing

    per_model = (("eta_n_per_model", 1),)
    g = share.fit_model("GPT-MoE-15B")
    assert not g["at_edge"] and g["share"] == pytest.approx(paper_value("lsh_moe", "a2a_share_gpt15b"), abs=1e-4)
    assert share.constants(SMOKE, "GPT-MoE-52B", per_model)["eta"] == g["eta"]  # 52B: no bar of its own
    f = share.fit(SMOKE)
    assert share.constants(SMOKE, "GPT-MoE-52B")["eta"] == f["eta"]
    assert share.constants(SMOKE, "T5-MoE", per_model)["eta"] == f["eta"]  # no bar, no stand-in bar: the joint fit


def test_overrides_reach_the_simulated_step():
    from moelab.papers.lsh_moe import share

    cfg, _, loads = share.paper_step("Swin-MoE-L", 4, 0.4, 1.0, overrides=(("tokens_per_gpu_swin", 3136),
                                                                           ("swin_d_model", 512)))
    assert cfg.model.d_model == 512 and cfg.train.batch_size * cfg.model.seq_len == 3136
    base = share.paper_step("Swin-MoE-L", 4, 0.4, 1.0)[2]
    assert loads.sum() * 2 == base.sum()


def test_speedup_min_is_contradicted_by_columns_moelab_computes(substitute_rate):
    from moelab.papers.lsh_moe import speed

    text = load_numbers("lsh_moe")["speedup_min"]["contradicted"]
    df = speed.table3_speed.__wrapped__(SMOKE)
    named = set(re.findall(r"\b[a-z0-9]+(?:_[a-z0-9]+)+\b", text)) & set(df.columns)
    assert {"a2a_share_ep", "amdahl_speedup", "implied_a2a_share", "overhead_needed", "hash_share"} <= named
    s_paper = paper_value("lsh_moe", "speedup_min")
    for r in df.itertuples():
        assert r.amdahl_speedup == pytest.approx(speed.amdahl(r.a2a_share_ep, r.rho_effective))
        assert speed.amdahl(r.implied_a2a_share, r.rho_effective) == pytest.approx(s_paper)
        assert r.overhead_needed == pytest.approx(1 / s_paper - 1 / r.amdahl_speedup)
    # the evidence at the paper's rate: the bytes alone beat the claim by far, and moelab's hashing is nowhere near
    # the overhead the claim needs
    r = df[df.rho_source == "paper (swin_rate)"].iloc[0]
    assert r.amdahl_speedup > 1.5 * s_paper and r.a2a_share_ep > 2 * r.implied_a2a_share
    assert r.hash_share < 0.1 * r.overhead_needed
