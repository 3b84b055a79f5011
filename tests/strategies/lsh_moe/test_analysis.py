"""LSH-MoE's analytic side (spec §5.13): Eq. 9's closed form equals Eq. 7 / Eq. 8 (without the intra-node
term), is free of l and n and scales with (w−1)/(w·h); the §2.9 worked example; Amdahl identities; the step
model; Table 1's exact MoE counts and its flagged mismatches."""
from __future__ import annotations

import pandas as pd
import pytest

from moelab.strategies.lsh_moe import analysis as A


def test_eq9_is_eq7_over_eq8_free_of_l_and_n():
    F, B = 312e12, 12.5e9
    for k, h, w in ((1, 768, 2), (2, 1024, 4), (2, 4096, 16)):
        closed = A.a2a_compute_ratio(k, h, w, F, B)
        for n, l in ((512, 12), (8192, 24)):
            no_intra = A.t_a2a(n, k, h, l, w, float("inf"), B)
            assert no_intra / A.t_compute(n, k, h, l, F) == pytest.approx(closed, rel=1e-12)
    r = lambda w, h: A.a2a_compute_ratio(2, h, w, F, B)  # noqa: E731
    assert r(4, 768) / r(2, 768) == pytest.approx((3 / 4) / (1 / 2))
    assert r(4, 1536) == pytest.approx(r(4, 768) / 2)
    assert r(1, 768) == 0.0  # one server: nothing crosses the network


def test_worked_example_of_section_2_9():
    assert A.a2a_compute_ratio(2, 768, 4, 312e12, 12.5e9) == pytest.approx(1.625, abs=0.005)
    assert A.act_params(2, 768, 1) == 20 * 768 ** 2


def test_amdahl_and_step_model():
    assert A.amdahl_speedup(0.7, 1.0) == 1.0 and A.amdahl_speedup(0.0, 0.1) == 1.0
    assert A.amdahl_speedup(0.5, 0.2) == pytest.approx(1 / 0.6)
    assert A.implied_share(1.28, 0.117) == pytest.approx(0.248, abs=1e-3)  # spec §2.9: Swin implies p ~ 0.25
    assert A.implied_share(A.amdahl_speedup(0.42, 0.2), 0.2) == pytest.approx(0.42)
    with pytest.raises(ValueError):
        A.amdahl_speedup(1.2, 0.5)
    parts = [(1e-5, 1e6, 1e9)] * 4
    assert A.speedup(0.01, 0.004, parts, 1.0) == pytest.approx(1.0)
    s_all = A.speedup(0.01, 0.004, parts, 0.2)
    s_comm = A.speedup(0.01, 0.004, parts, 0.2, experts_on_centroids=False)
    assert s_all > s_comm > 1.0  # computing experts on centroids saves time the paper does not count
    assert A.speedup(0.01, 0.004, parts, 0.2, t_lsh=0.01) < s_all
    assert (A.t_a2a_ext(512, 2, 768, 12, 4, 1e11, 1e9, elem_bytes=2, rho=0.5)
            == pytest.approx(A.t_a2a(512, 2, 768, 12, 4, 1e11, 1e9)))


def test_table1_counts_and_flags():
    t = A.table1().set_index("model")
    for m in ("GPT-MoE-15B", "GPT-MoE-52B", "T5-MoE"):
        assert t.loc[m, "moe_matches"] == True, t.loc[m]  # noqa: E712 - numpy bool
    assert t.loc["GPT-MoE-15B", "moe_params_M"] == 14507 and t.loc["GPT-MoE-52B", "moe_params_M"] == 51539
    assert t.loc["RoBERTa-MoE", "moe_matches"] == False and t.loc["RoBERTa-MoE", "moe_params_M"] == 453  # noqa: E712
    assert "mismatch" in t.loc["RoBERTa-MoE", "note"] and t.loc["Swin-MoE-L", "moe_params_M"] is pd.NA


def test_ratio_curves_frame():
    df = A.ratio_curves(ws=(1, 2, 4), hs=(768, 1536), ks=(2,), rhos=(1.0, 0.2))
    assert set(df.axis) == {"w", "h"} and df.attrs["label"].startswith("SIMULATED")
    w = df[(df.axis == "w") & (df.rho == 1.0)].set_index("x").ratio
    assert w[1] == 0 and w[4] > w[2]
    assert df[(df.axis == "w") & (df.rho == 0.2) & (df.x == 4)].ratio.iloc[0] == pytest.approx(0.2 * w[4])


def test_ratio_curves_default_rates_are_no_papers():
    """The core's default rates are neutral (uncompressed, half, a quarter); a paper passes its own."""
    df = A.ratio_curves(ws=(2,), hs=(768,), ks=(2,))
    assert sorted(set(df.rho)) == [0.25, 0.5, 1.0]
