"""Assumptions as data (moelab.papers.kit.assumptions) and their use by the FasterMoE reproduction: the loader
refuses malformed entries, every FasterMoE constant has a kind and a source, the experiments read the
file's values, Table 2 never calls a guess the paper's, and the Fig. 10 sensitivity table moves exactly
when an assumption moves."""
from __future__ import annotations

import pytest
import yaml

from moelab.papers import fastermoe as E
from moelab.papers.kit.assumptions import KINDS, AssumptionError, load_assumptions, parse_assumptions
from moelab.runtime.project import project_root
from moelab.strategies.fastermoe import perf_model as pm

SMOKE = "smoke"


def _one(**entry):
    base = dict(value=0.5, kind="assumption", source="spec §1", affects=["fig10"], range=[0.0, 1.0])
    base.update(entry)
    return {"assumptions": {"x": {k: v for k, v in base.items() if v is not ...}}}


# ---- loader ---------------------------------------------------------------------------------------------------
def test_loader_reads_a_valid_entry():
    A = parse_assumptions(_one(unit="fraction", note="n"))
    a = A["x"]
    assert (a.value, a.kind, a.affects, a.range, a.unit) == (0.5, "assumption", ("fig10",), (0.0, 1.0), "fraction")
    assert A.value("x") == 0.5 and [b.name for b in A.for_figure("fig10")] == ["x"] and A.for_figure("fig12") == []
    assert list(A.frame().name) == ["x"]


@pytest.mark.parametrize("entry, msg", [
    (dict(kind="guess"), "kind must be one of"),
    (dict(source=""), "source is missing"),
    (dict(source=...), "source is missing"),
    (dict(kind=...), "kind is missing"),
    (dict(value=2.0), "outside its range"),
    (dict(value="1e12", range=None), "finite number"),
    (dict(range=[1.0, 0.0], value=0.5), "low > high"),
    (dict(range=["0", "1"]), "range must hold numbers"),
    (dict(colour="red"), "unknown fields"),
])
def test_loader_refuses_malformed_entries(entry, msg):
    with pytest.raises(AssumptionError, match=msg):
        parse_assumptions(_one(**entry), "test.yaml")


def test_overrides_are_validated_and_leave_the_base_alone():
    A = parse_assumptions(_one())
    B = A.with_values({"x": 0.9})
    assert B.value("x") == 0.9 and A.value("x") == 0.5
    with pytest.raises(AssumptionError, match="outside its range"):
        A.with_values({"x": 1.5})
    with pytest.raises(KeyError):
        A.with_values({"y": 0.1})


def test_load_by_path_and_by_paper_name(tmp_path):
    p = tmp_path / "a.yaml"
    p.write_text(yaml.safe_dump(_one()))
    assert load_assumptions(p).value("x") == 0.5
    A = load_assumptions("fastermoe")
    assert A.path == project_root() / "experiments" / "fastermoe" / "assumptions.yaml"
    with pytest.raises(FileNotFoundError):
        load_assumptions("no-such-paper")


# ---- FasterMoE's file -----------------------------------------------------------------------------------------
def test_every_fastermoe_constant_has_kind_source_and_guesses_have_a_range():
    A = E.assumptions()
    assert len(A) >= 30
    for a in A.values():
        assert a.kind in KINDS and a.source.strip() and a.affects, a.name
        if a.kind == "paper":
            assert "§" in a.source, a.name  # the paper's own numbers cite the spec section
        else:
            assert a.range is not None, a.name  # a guess without a plausible range cannot be assessed
    assert A["zero_overlap"].kind == "assumption" and "§6.16" in A["zero_overlap"].source
    assert {A[f"model.BERT-Wide.{f}"].kind for f in ("tokens", "h", "h_ff")} == {"assumption"}


def test_experiments_read_the_file_and_duplicated_literals_agree_with_it():
    A = E.assumptions()
    for m in E.PAPER_LAYER_MODELS.values():
        for f in E.MODEL_FIELDS:
            assert getattr(m, f) == A.value(f"model.{m.name}.{f}")
    assert E.ZERO_OVERLAP == A.value("zero_overlap")
    assert E.sim_profile("trevor").achieved_flops == A.value("trevor_P")
    assert E.sim_profile("trevor").inter_bw_GBps == A.value("trevor_nic_Gbps") / 8
    assert E.sim_profile("johnny").achieved_flops == A.value("johnny_P")
    c = E.policy_constants("trevor")
    assert (c["P"], c["W_net"], c["c"], c["group_size"]) == (
        A.value("trevor_P"), A.value("trevor_policy_W_net_Gbps") * pm.GBPS, 2, 4)
    # the literals other modules keep as defaults must not drift from the file
    from moelab.sim import get_profile

    assert get_profile("fastermoe_trevor").achieved_flops == pytest.approx(A.value("trevor_P"))
    assert get_profile("fastermoe_trevor").inter_bw_GBps == pytest.approx(A.value("trevor_nic_Gbps") / 8)
    assert get_profile("fastermoe_johnny").achieved_flops == pytest.approx(A.value("johnny_P"))
    assert pm.P_V100_SXM2 == pytest.approx(A.value("trevor_P"))
    assert pm.P_V100_PCIE == A.value("johnny_P") and pm.W_NET_DEFAULT == A.value("johnny_policy_W_net_Gbps") * pm.GBPS
    assert E.TOPO_FRACTION == A.value("topo_fraction")
    # an override reaches the simulation inputs
    ov = (("trevor_P", 1.0e13), ("model.BERT-Wide.h_ff", 8192.0))
    assert E.sim_profile("trevor", ov).achieved_flops == 1.0e13
    assert E.paper_layer_models(ov)["BERT-Wide"].h_ff == 8192
    assert E.paper_variant_options("trevor", ov)["shadow"]["shadow_gpu_flops"] == 1.0e13


def test_table2_marks_each_value_with_its_kind():
    t = E.table2_models().set_index("model")
    A = E.assumptions()
    for model, r in t.iterrows():
        for f in E.MODEL_FIELDS:
            assert r[f"{f}_kind"] == A[f"model.{model}.{f}"].kind
    assert t.loc["BERT-Wide", "h_ff_kind"] == "assumption" and t.loc["BERT-Wide", "assumed"] == "tokens, h, h_ff"
    assert t.loc["GPT-S", "assumed"] == ""
    assert not t.attrs["label"].startswith("PAPER:") and "model.BERT-Wide.h_ff" in t.attrs["assumptions"]


def test_fig10_and_fig13_name_their_assumptions():
    f10 = E.fig10_end_to_end(SMOKE)
    assert "zero_overlap" in f10.attrs["assumptions"] and "assumes: zero_overlap=0.5" in f10.attrs["label"]
    f13 = E.fig13_breakdown(SMOKE)
    assert "zero_overlap" not in f13.attrs["assumptions"] and "trevor_P" in f13.attrs["assumptions"]
    # johnny: paper constants + T2
    assert set(E.fig12_smart(SMOKE).attrs["assumptions"]) == {"t2_noise", "t2_step0", "t2_step_decay"}


# ---- sensitivity ----------------------------------------------------------------------------------------------
def test_fig10_sensitivity_moves_only_with_its_assumption():
    A = E.assumptions()
    s = E.fig10_sensitivity(SMOKE)
    assert s.attrs["label"].startswith("SIMULATED")
    swept = {a.name for a in A.values() if "fig10" in a.affects and a.range is not None}
    assert set(s.assumption) == swept
    base = E.fig10_speedups(SMOKE)
    for cl in ("trevor", "johnny"):
        r = s[s.cluster == cl]
        assert (r.speedup_base == base[cl][1]).all()
        paper = yaml.safe_load((project_root() / "experiments/fastermoe/paper.yaml").read_text())
        assert (r.paper_speedup == paper["numbers"][f"zero3_speedup_{cl}"]["value"]).all()
    # a trevor-only assumption has no johnny row; the shared ones have both
    assert set(s[s.assumption == "trevor_P"].cluster) == {"trevor"}
    assert set(s[s.assumption == "zero_overlap"].cluster) == {"trevor", "johnny"}
    # exactly base at the base value; an end equal to the base value changes nothing
    z = A.value("zero_overlap")
    assert E.fig10_speedups(SMOKE, 0, (("zero_overlap", z),)) == base
    nic = s[(s.assumption == "trevor_nic_Gbps")].iloc[0]
    assert nic.value_low == nic.value_base and nic.change_low == 0.0
    # the mechanism: more ZeRO overlap makes ZeRO-3 faster, so FasterMoE's speedup over it falls
    zr = s[(s.assumption == "zero_overlap") & (s.cluster == "trevor")].iloc[0]
    assert zr.speedup_low > zr.speedup_base > zr.speedup_high
    assert zr.change_low == pytest.approx(zr.speedup_low - zr.speedup_base)
    # a slower trevor GPU (low P) moves the number; the swing column is max - min of the three
    p = s[(s.assumption == "trevor_P")].iloc[0]
    assert p.speedup_low != p.speedup_base
    assert p.swing == pytest.approx(max(p.speedup_low, p.speedup_base, p.speedup_high)
                                    - min(p.speedup_low, p.speedup_base, p.speedup_high))


@pytest.mark.parametrize("paper", sorted(p.parent.name
                                         for p in (project_root() / "experiments").glob("*/assumptions.yaml")))
def test_every_papers_assumptions_file_loads(paper):
    """Each paper's assumptions are valid data (numeric values, a kind, a source): a product may read any of them."""
    a = load_assumptions(paper)
    assert len(a) > 0 and all(a[n].kind in KINDS for n in a)
