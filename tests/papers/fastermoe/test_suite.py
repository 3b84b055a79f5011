"""Honest EMULATED shadowing (issue 9): the layer suite's shadow policy really fires, its decision per
iteration is recorded (identical on every rank, with the modelled times it compared), the shadowed
expert's tokens stay off the all-to-all, and a run where the policy does not fire says so."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from moelab.papers import fastermoe as E
from moelab.papers.fastermoe import suite as SU
from moelab.strategies.fastermoe.shadow import shadow_decision


def _decisions(n_shadowed, gain=1.0):
    return pd.DataFrame(dict(iter=range(len(n_shadowed)), n_shadowed=n_shadowed, modelled_gain_ms=gain,
                             modelled_imbl_ms=10.0))


def test_the_note_says_when_the_policy_never_fired():
    assert SU.shadowing_note(_decisions([0, 0, 0])).startswith("shadow policy never fired in 3 iterations")
    assert SU.shadowing_note(_decisions([0, 1, 2])).startswith("shadow policy fired in 2/3 iterations (mean 1.5")


def test_decisions_must_agree_across_ranks():
    rows = [dict(iter=1, variant="shadow", rank=r, shadowed=s, modelled_imbl_s=0.1, modelled_shadow_s=0.05)
            for r, s in ((0, (3,)), (1, (3,)), (2, ()))]
    with pytest.raises(AssertionError, match="different shadow sets"):
        SU.shadow_decisions({"times": pd.DataFrame(rows), "warmup": 1, "label": "x"})


def test_why_the_suite_replays_the_hot_trace():
    """On T2 (seed 0) the most loaded worker owns two mid-popular experts: shadowing the single most
    popular one cannot lower the maximum and Algorithm 1 stops; uniform loads never shadow; the hot
    trace fires every iteration (the suite's constants: P ~ 6e10, W_net = 0.02 GB/s, c = 5, h = 128)."""
    sp = E.scale_spec("default")
    kw = dict(h=sp.d, h_ff=2 * sp.d, P=6e10, W_net=sp.inter_GBps * 1e9, c=sp.nproc // 2 + 1)
    t2 = E.suite_trace("default", "t2")
    assert all(shadow_decision(C, **kw).chosen == () for C in t2[:8])
    uniform = np.full((sp.nproc, 16), 2 * sp.tokens // 16)
    assert shadow_decision(uniform, **kw).chosen == ()
    hot = E.suite_trace("default", "hot")
    assert all(shadow_decision(C, **kw).chosen == (3,) for C in hot[:8])
    assert sp.suite_trace == "hot" and E.scale_spec("smoke").suite_trace == "hot"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_suite_shadows_and_keeps_the_shadowed_tokens_off_the_wire():
    s = SU.layer_suite("smoke")
    dec = SU.shadow_decisions(s)
    fired = dec[dec.n_shadowed > 0]
    assert len(fired) >= 1 and (fired.modelled_gain_ms > 0).all()
    t = s["times"]
    per = t[t.iter.isin(fired.iter)].groupby(["iter", "variant"]).a2a_bytes.sum().unstack()
    assert (per["shadow"] < per["fastmoe"]).all()  # the shadowed expert's tokens are computed at their source
    lat, smap, summ = E.fig11_shadowing_real("smoke")
    assert summ.attrs["fired"] and summ.iterations_with_shadow.iloc[0] >= 1 and smap.shadowed.sum() >= 1
    assert "fired in" in lat.attrs["label"]
    f13 = E.fig13_breakdown_real("smoke")
    assert f13.attrs["fired"] and "never" not in f13.attrs["label"]
