"""The local_gpu profile fit recovers the constants a sweep was made with, and prices the rows it was fitted on."""
import pytest

from moelab.sim.gpu_profile import fit_gpu, layer_terms, local_gpu_profile, predict_layer_s


def _rows(launch=6e-6, rate=600e12, hbm=2.5e12, noise=0.0):
    import random

    rnd = random.Random(0)
    rows = []
    for shape, d, f, E, k in (("mixtral", 4096, 14336, 8, 2), ("deepseek", 2048, 1408, 64, 6)):
        for T in (2048, 4096, 8192, 16384):
            row = dict(shape=shape, device="H100 SXM", d=d, f=f, E=E, k=k, T=T, dtype="torch.bfloat16",
                       peak_tflops=989.0, hbm_GBps=3350.0)
            kernels, flops, moved = layer_terms(row)
            t = kernels * launch + flops / rate + moved / hbm
            row.update(layer_triton=t * (1 + noise * rnd.uniform(-1, 1)), layer_torch=3 * t,
                       gemm_triton=2 * T * k * d * f / (0.7 * 989e12))
            rows.append(row)
    return rows


def test_fit_recovers_the_constants_and_predicts_the_sweep():
    fit = fit_gpu(_rows())
    assert fit["launch_s"] == pytest.approx(6e-6, rel=1e-6) and fit["flops_per_s"] == pytest.approx(600e12, rel=1e-6)
    assert fit["hbm_bytes_per_s"] == pytest.approx(2.5e12, rel=1e-6) and fit["r2"] == pytest.approx(1.0)
    assert all(v == pytest.approx(0.7) for v in fit["gemm_efficiency"].values())
    prof = local_gpu_profile(fit)
    for row in _rows():
        assert predict_layer_s(prof, row) == pytest.approx(row["layer_triton"], rel=1e-6)
    assert prof.sources["*"].startswith("fitted") and prof.extra["r2"] == fit["r2"]


def test_noisy_sweep_r2_says_how_well_it_fits():
    fit = fit_gpu(_rows(noise=0.05))
    assert 0.9 < fit["r2"] < 1.0 and fit["n"] == 8
    assert fit_gpu(_rows(noise=0.8))["r2"] < fit["r2"]  # worse data, worse fit: the number is not decoration


def test_assumed_efficiencies_are_listed_beside_the_measured_one():
    from moelab.sim.gpu_profile import assumed_vs_measured

    rows = assumed_vs_measured(fit_gpu(_rows()))
    names = {r["profile"] for r in rows}
    assert "hecate_A" in names and "fastermoe_johnny" not in names  # johnny's rate is the paper's own P
    assert all(r["measured"] == pytest.approx(600e12 / 989e12) and 0 < r["assumed"] < 1 for r in rows)
