"""Hecate's overlap degree t at paper scale comes from the paper's rule t = floor(T_nonMoE * bw / s_e) at the
run's setting; the guess reasoned from Fig. 13 (``t_paper``) only drives its labelled variant, never a headline row."""
from __future__ import annotations

import math

import numpy as np
import pytest

from moelab.sim.engine import simulate
from moelab.sim.graphs import iteration_graph


def _spag_s(cfg, prof, loads, owners, hold, backend) -> float:
    """The forward spAG's span (first start to last end) of one simulated iteration with ``hold`` prefetched."""
    res = simulate(iteration_graph(cfg, prof, loads, None, elem_bytes=prof.elem_bytes, owners=owners,
                                   holders=hold, prefetch=hold, backend=backend))
    o = res.ops_frame()
    o = o[(o.category == "spag") & (o.phase == "fwd")]
    return float(o.end.max() - o.start.min())


def _setting(cluster="hecate_A", gpus=16, model="GPT-MoE-S", batch=1):
    from moelab.papers.hecate.paper_scale import paper_config, paper_profile

    prof = paper_profile(cluster, gpus)
    return paper_config(model, prof, layers=2, batch=batch), prof


@pytest.mark.parametrize("cluster,gpus,model", [("hecate_A", 16, "GPT-MoE-S"), ("hecate_A", 16, "BERT-MoE"),
                                                ("hecate_B", 32, "GPT-MoE-L")])
def test_t_derivation_is_the_papers_formula_on_its_own_terms(cluster, gpus, model):
    from moelab.papers.hecate import end_to_end as EE

    cfg, prof = _setting(cluster, gpus, model)
    d = EE.t_derivation(cfg, prof)
    assert d["t"] == min(cfg.model.moe.num_experts,
                         math.floor(d["T_nonMoE_ms"] * 1e-3 * d["bw_GBps"] * 1e9 / (d["s_e_MB"] * 1e6)))
    assert d["bw_GBps"] == pytest.approx(prof.inter_bw_GBps)  # the node's NIC (hierarchical spAG)
    assert d["s_e_MB"] * 1e6 == pytest.approx(2 * 2 * cfg.model.d_model * cfg.model.d_ff)  # fp16, no biases
    assert EE.overlap_degree(cfg, prof) == d["t"] and f"= {d['t']}" in d["text"]


def test_t_grows_with_the_batch_the_attention_it_hides_behind():
    from moelab.papers.hecate import end_to_end as EE

    ts = [EE.t_derivation(*_setting(batch=b)) for b in (1, 2, 4, 8)]
    assert [d["t"] for d in ts] == sorted(d["t"] for d in ts)
    assert ts[-1]["T_nonMoE_ms"] == pytest.approx(8 * ts[0]["T_nonMoE_ms"])


def test_headline_hecate_takes_the_formula_and_the_variant_takes_t_paper():
    from moelab.papers.hecate import end_to_end as EE

    cfg, prof = _setting("hecate_B", 32, "GPT-MoE-S")
    N, E = prof.world_size, cfg.model.moe.num_experts
    rng = np.random.default_rng(0)
    loads = rng.integers(0, 64, size=(2, 2, N, E))
    t_paper = int(EE.assumptions().value("t_paper"))
    _, _, note = EE.system_plans("Hecate", cfg, prof, loads, calibration=False)
    assert note.startswith(f"t={EE.overlap_degree(cfg, prof)},")
    _, _, note = EE.system_plans(EE.T_CHOSEN, cfg, prof, loads, calibration=False)
    assert note.startswith(f"t={t_paper},") and f"t = {t_paper}" in EE.T_CHOSEN and "chosen from" in EE.T_CHOSEN
    # a ladder's override reaches the variant (the assumption is read per run)
    _, _, note = EE.system_plans(EE.T_CHOSEN, cfg, prof, loads, (("t_paper", 2),), calibration=False)
    assert note.startswith("t=2,")


def test_no_headline_row_reads_the_guess_chosen_from_fig13():
    """t_paper affects only the products that draw its variant, and every headline row there reads plain "Hecate"."""
    from moelab.papers.hecate.end_to_end import SYSTEMS, T_CHOSEN
    from moelab.papers.kit.assumptions import load_assumptions
    from moelab.papers.kit.compare import load_numbers

    a = load_assumptions("hecate")["t_paper"]
    assert set(a.affects) == {"fig9", "fig10"} and a.chosen_from == ("hecate_params_over_ep",)
    assert T_CHOSEN in SYSTEMS
    for key, e in load_numbers("hecate").items():
        for src in e.get("moelab") or ():
            if e.get("headline") and src["product"] in a.affects:
                assert (src.get("where") or {}).get("system") == "Hecate", (key, src)


def test_ladders_name_only_sourced_settings_and_never_t():
    from moelab.papers.kit.ladder import load_ladders

    lad = load_ladders("hecate")
    assert {"a16_vs_ep_min", "a16_vs_ep_max", "b_vs_ep_min", "b_vs_ep_max", "speedup_up_to"} <= set(lad)
    for L in lad.values():
        assert L.rungs and all(r.source and r.set != "t_paper" for r in L.rungs), L.key
        mod, fn = L.evaluate.split(":")
        assert callable(getattr(__import__(mod, fromlist=[fn]), fn))


@pytest.mark.parametrize("cluster,gpus", [("hecate_A", 16), ("hecate_B", 32)])
def test_a_crossing_expert_moves_at_the_node_bandwidth_t_is_sized_on(cluster, gpus):
    """Hecate's paper-scale gather sends one expert to another node at the bandwidth its t is sized on (the node's
    NICs together, t_derivation's bw), not over one NIC of the owner: on hecate_B (4 NICs per node) ``hier`` takes
    4x as long, ``relay`` (the backend the runs take) the node's time."""
    from moelab.papers.hecate import end_to_end as EE

    cfg, prof = _setting(cluster, gpus, "GPT-MoE-S")
    cfg = cfg.with_overrides({"parallel.strategy": "hecate"})
    N, E, G = prof.world_size, cfg.model.moe.num_experts, prof.gpus_per_node
    loads = np.full((2, N, E), 64, dtype=np.int64)
    owners = [[e // (E // N) for e in range(E)]] * 2
    P = [tuple((o,) for o in row) for row in owners]
    hold = [P[0], P[1][:1] + ((P[1][1][0], G),) + P[1][2:]]  # layer 1: expert 1 (rank 0) to rank G, the next node
    d = EE.t_derivation(cfg, prof)
    want = d["s_e_MB"] * 1e6 / (d["bw_GBps"] * 1e9)

    assert EE.SPAG_BACKEND == "relay"
    got = _spag_s(cfg, prof, loads, owners, hold, EE.SPAG_BACKEND)
    assert want <= got < 1.25 * want + 3 * (prof.inter_latency_us + prof.intra_latency_us) * 1e-6
    if prof.nics_per_node > 1:  # one NIC of the owner: a quarter of the bandwidth t counts on
        assert _spag_s(cfg, prof, loads, owners, hold, "hier") > 0.9 * prof.nics_per_node * want


def test_memory_budget_is_the_specs_m_and_binds_only_where_the_batch_fills_the_gpu():
    from moelab.papers.hecate import end_to_end as EE

    for model in ("GPT-MoE-S", "GPT-MoE-L", "BERT-MoE", "BERT-MoE-Deep"):
        cfg, prof = _setting("hecate_A", 16, model)
        mb = EE.memory_budget(cfg, prof)
        assert mb["m"] == min(cfg.model.moe.num_experts, mb["m_uncapped"])
        assert mb["m"] == cfg.model.moe.num_experts  # batch 1: memory binds nothing
    ms = [EE.memory_budget(*_setting("hecate_B", 32, "GPT-MoE-L", batch=b))["m_uncapped"] for b in (1, 2, 5)]
    assert ms == sorted(ms, reverse=True) and ms[-1] < ms[0]
    cfg, prof = _setting("hecate_B", 32, "GPT-MoE-L", batch=5)
    assert EE.memory_budget(cfg, prof)["m"] < cfg.model.moe.num_experts  # the activations of 5 sequences bind it
    loads = np.random.default_rng(0).integers(0, 64, size=(2, 2, prof.world_size, cfg.model.moe.num_experts))
    _, _, note = EE.system_plans("Hecate", cfg, prof, loads, calibration=False)
    assert f"m={EE.memory_budget(cfg, prof)['m']};" in note


def test_skew_one_is_the_measured_trace_and_a_larger_one_sharpens_the_same_ranking():
    from moelab.papers.hecate.trace import upsample

    rng = np.random.default_rng(1)
    tr = rng.integers(1, 50, size=(3, 2, 4, 16))
    base = upsample(tr, 8, 512, seed=3)
    assert np.array_equal(upsample(tr, 8, 512, seed=3, skew=1.0), base)
    sharp = upsample(tr, 8, 512, seed=3, skew=3.0)
    assert sharp.sum() == base.sum()  # the same tokens, only their spread changes
    share = lambda x: x.sum(2).max(-1) / x.sum((2, 3))  # noqa: E731  the hottest expert's share per (iter, layer)
    assert (share(sharp) > share(base)).all()
    G = tr.sum(2)
    assert (G.argmax(-1) == sharp.sum(2).argmax(-1)).all()  # the measured hottest expert stays the hottest


def test_an_expert_for_every_node_leaves_its_owners_node_once():
    """On hecate_B (4 nodes) an expert newly held on every device: ``stripe`` sends it out of the owner's node 3
    times (one stage of 3 s_e over the node's NICs), ``relay`` once, then the destination nodes pass it on (two
    stages of about s_e each: the NIC-time of one crossing saved)."""
    from moelab.papers.hecate import end_to_end as EE

    cfg, prof = _setting("hecate_B", 32, "GPT-MoE-L")
    cfg = cfg.with_overrides({"parallel.strategy": "hecate"})
    N, E = prof.world_size, cfg.model.moe.num_experts
    loads = np.full((2, N, E), 64, dtype=np.int64)
    owners = [[e // (E // N) for e in range(E)]] * 2
    P = [tuple((o,) for o in row) for row in owners]
    hold = [P[0], ((0,) + tuple(range(1, N)),) + P[1][1:]]  # layer 1: expert 0 (rank 0) on every device
    d = EE.t_derivation(cfg, prof)
    one = d["s_e_MB"] * 1e6 / (d["bw_GBps"] * 1e9)

    stripe, relay = (_spag_s(cfg, prof, loads, owners, hold, b) for b in ("stripe", "relay"))
    assert stripe >= 3 * one
    assert 2 * one <= relay <= stripe - 0.9 * one
