"""Techniques on axes (moelab.techniques) and their composition (moelab.strategies.compose): the declarations
match the layer classes, the pair table follows from them and docs/compose.md shows it, bad choices are refused
before launch with the reason, and a composed layer's methods each see their own technique's options."""
from __future__ import annotations

import functools
import pathlib

import pytest

from moelab import techniques as tq
from moelab.config import ConfigError, RunConfig
from moelab.registry import all_strategies, get
from moelab.techniques import Technique, all_techniques, compatibility, conflict, parse, table_markdown

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "compose.md"
MOE = {"model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.gate": "topk"}


def cfg(strategy, opts=None, **over):
    return RunConfig().with_overrides({**MOE, "parallel.nproc": 2, "parallel.strategy": strategy,
                                       "parallel.strategy_options": opts or {}}, **over)


# ---- declarations ------------------------------------------------------------------------------------
def test_every_strategy_but_ep_declares_its_techniques_and_each_technique_is_its_strategys():
    for s in all_strategies():
        if s.name == "ep":
            assert s.techniques == ()  # every axis its default
            continue
        assert s.techniques, f"{s.name} declares no technique"
        if tq.SEP in s.name:  # a composition registered earlier in this process: named by its techniques
            assert sorted(t.name for t in s.techniques) == sorted(s.name.split(tq.SEP)) and len(s.techniques) > 1
            continue
        assert [t.name for t in s.techniques] == [s.name]


def _overridden(cls) -> set:
    """MoELayer stages ``cls`` or a base between it and MoELayer defines."""
    from moelab.moe.layer import MoELayer

    out = set()
    for c in cls.__mro__:
        if c is MoELayer:
            break
        out |= {k for k in vars(c) if k in tq.LAYER_STAGES + tq.WRAP_ONLY}
    return out


@pytest.mark.parametrize("name", sorted(set(all_techniques()) - {"parm"}))
def test_a_techniques_declaration_covers_every_stage_its_layer_class_overrides(name):
    s, t = get(name), all_techniques()[name]
    opts = s.conformance[0] if s.conformance else {}
    made = s.layer(cfg(name, opts), s.options.from_dict(opts))
    cls = made.func if isinstance(made, functools.partial) else made
    undeclared = _overridden(cls) - set(t.owns) - set(t.wraps) - {"forward", "plan_record"}
    assert not undeclared, f"{name}'s layer overrides {sorted(undeclared)} without declaring them"
    if s.update is not None:
        assert "update" in t.owns, f"{name} has its own update but does not declare owning it"
    if s.groups is not None:
        assert "groups" in t.owns
    if s.own_expert_layout:
        assert "expert_layout" in t.owns


def test_parm_owns_every_layer_stage_its_own_layer_replaces():
    assert set(tq.LAYER_STAGES) | {"own_layer", "update"} <= set(all_techniques()["parm"].owns)


# ---- the conflict rule ---------------------------------------------------------------------------------
def test_conflicts_follow_from_the_declarations_only():
    a = Technique("a", "placement", owns=("place",))
    b = Technique("b", "wire", owns=("plan", "dispatch_compute_combine"), calls=("token_dispatch",))
    c = Technique("c", "schedule", owns=("update",), wraps=("dispatch_compute_combine",))
    assert conflict(a, c) is None and conflict(b, c) is None
    assert "both on axis placement" in conflict(a, Technique("a2", "placement"))
    assert "both own update" in conflict(c, Technique("d", "placement", owns=("update",)))
    assert "skips e's materialize" in conflict(b, Technique("e", "placement", owns=("materialize",)))
    assert conflict(b, Technique("f", "placement", wraps=("token_dispatch",))) is None  # b still calls it
    assert "g excludes a: why" in conflict(a, Technique("g", "wire", excludes=(("a", "why"),)))
    with pytest.raises(ValueError, match="unknown hooks"):
        Technique("h", "wire", owns=("teleport",))
    with pytest.raises(ValueError, match="axis"):
        Technique("i", "gravity")


def test_the_table_has_every_cross_axis_pair_and_the_docs_page_is_current():
    ts = all_techniques()
    rows = compatibility()
    cross = sum(1 for i, x in enumerate(sorted(ts)) for y in sorted(ts)[i + 1:] if ts[x].axis != ts[y].axis)
    assert len(rows) == cross
    assert {(a, b) for a, b, why in rows if why is None} >= {("lina", "lsh_moe"), ("lsh_moe", "smartmoe")}
    text = DOC.read_text()
    assert text.split(tq.BEGIN, 1)[1].split(tq.END, 1)[0].strip() == table_markdown().strip(), \
        "docs/compose.md is stale: python -m moelab.techniques --write docs/compose.md"


# ---- a run naming techniques: refused before launch with the reason --------------------------------------
@pytest.mark.parametrize("over, says", [
    ({"parallel.strategy": "hecate+smartmoe"}, "axis named twice: placement: hecate and smartmoe"),
    ({"parallel.strategy": "hecate+lsh_moe"}, "lsh_moe's dispatch_compute_combine skips hecate's materialize"),
    ({"parallel.strategy": "lina+smartmoe"}, "lina + smartmoe: both own update"),
    ({"parallel.strategy": "flexmoe+lsh_moe"}, "lsh_moe excludes flexmoe: LSH-MoE runs on placements without replicas"),
    ({"parallel.strategy": "lina+warp"}, "unknown technique(s) ['warp']"),
    ({"parallel.strategy": "lina+lsh_moe", "parallel.strategy_options": {"hecate": {"t": 1}}},
     "names technique(s) ['hecate'] not chosen"),
    ({"parallel.strategy": "lina+lsh_moe", "parallel.strategy_options": {"lina": {"policy": "lina_pipe"}}},
     "runs alone only: policy lina_pipe replaces the dispatch chain"),
    ({"parallel.strategy": "lina+lsh_moe", "parallel.strategy_options": {"lsh_moe": {"bogus": 1}}},
     "unknown lsh_moe option(s) ['bogus']"),
    ({"parallel.techniques": {"wire": "lina"}}, "'lina' is a schedule technique, named for wire"),
    ({"parallel.techniques": {"gravity": "lina"}}, "'gravity' is not an axis"),
])
def test_a_bad_choice_is_refused_before_launch_naming_it(over, says):
    with pytest.raises(ConfigError) as e:
        RunConfig().with_overrides({**MOE, "parallel.nproc": 2, **over}).validate()
    assert says in str(e.value)


def test_techniques_and_another_strategy_both_given_are_refused():
    with pytest.raises(ConfigError, match="both name the run's system"):
        cfg("hecate", **{"parallel.techniques": {"wire": "lsh_moe", "schedule": "lina"}})


def test_the_axis_map_and_the_joined_name_are_one_run():
    by_axes = RunConfig().with_overrides({**MOE, "parallel.nproc": 2, "parallel.techniques":
                                          {"schedule": "lina", "wire": "lsh_moe"}}).validate()
    assert by_axes.parallel.strategy == "lina+lsh_moe"
    assert [t.name for t in get("lina+lsh_moe").techniques] == ["lina", "lsh_moe"]
    by_name = RunConfig().with_overrides({**MOE, "parallel.nproc": 2, "parallel.strategy": "lina+lsh_moe"})
    assert by_axes.run_id() == by_name.run_id()  # one run, two spellings: one id (and the presets' ids unchanged)


def test_parse_orders_a_composition_schedule_first():
    assert [t.name for t in parse("lsh_moe+lina")] == ["lina", "lsh_moe"]


def test_a_composition_is_simulated_when_each_technique_contributes_else_refused_with_the_reason():
    import dataclasses

    from moelab.registry import Strategy

    assert get("lina+lsh_moe").sim_refused == "" and callable(get("lina+lsh_moe").graph())
    lina, lsh = parse("lina+lsh_moe")
    why = tq.sim_refusal((lina, dataclasses.replace(lsh, sim=None)))
    assert why.startswith("lsh_moe declares no simulator contribution")
    with pytest.raises(ConfigError, match="cannot be SIMULATED: lsh_moe declares no simulator contribution"):
        Strategy("x", sim_refused=why).graph()


# ---- the composed layer: each technique's methods see its own options --------------------------------------
def test_a_composed_layer_scopes_each_techniques_options():
    import torch

    from moelab.config import MoEConfig

    c = cfg("lina+lsh_moe", {"lina": {"policy": "priority"}, "lsh_moe": {"hash_family": "identity"}}).validate()
    cls = get(c.parallel.strategy).layer_class(c)
    layer = cls(8, 16, MoEConfig(num_experts=4, top_k=2, gate="topk"), dtype=torch.float64)
    assert layer.technique_options["lina"].policy == "priority"
    assert layer.technique_options["lsh_moe"].hash_family == "identity"
    assert layer.options is layer.technique_options["lina"]  # lina owns the update: outside calls, its options
    assert layer.compresses  # LSH-MoE's property read its own options (a LinaOptions has no hash_family)
    y = layer(torch.randn(5, 8, dtype=torch.float64))
    assert y.shape == (5, 8) and layer.options is layer.technique_options["lina"]
    assert layer.last_metrics["rho"] == 1.0  # LSH-MoE's metrics of the call (identity: every row its own bucket)
    layer.last_metrics = {"sched_stalls": 0}  # a second technique's metrics merge, none overwritten
    assert set(layer.last_metrics) >= {"rho", "sched_stalls"}
    layer(torch.randn(3, 8, dtype=torch.float64))
    assert "sched_stalls" not in layer.last_metrics  # a new call starts empty


# ---- a wire technique on a placement technique's placement: the fp64 reference, 2 gloo ranks ---------------
PLACED = {  # (composition, options, holders of the 4 experts on 2 ranks): a SmartMoE permutation
    "permuted": ("lsh_moe+smartmoe", {"lsh_moe": {"hash_family": "identity"}}, ((1,), (0,), (1,), (0,))),
}


def _placed(rank, world, cases):
    import torch

    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.config import MoEConfig
    from moelab.placement import Placement
    from moelab.testing import expert_grads, rank_inputs

    out = []
    for name, opts, holders in cases:
        c = cfg(name, opts).validate()
        layer = get(name).layer_class(c)(8, 16, MoEConfig(num_experts=4, top_k=2, gate="topk"), layer_id=1, seed=3,
                                          comm=Communicator(Topology(world, world)),
                                          placement=Placement(4, world, holders), dtype=torch.float64)
        xs, gys = rank_inputs([5, 9], 8, seed=2)
        x = xs[rank].clone().requires_grad_()
        y = layer(x)
        ((y * gys[rank]).sum() + layer.aux_loss).backward()
        out.append(dict(y=y.detach(), gx=x.grad, eg=expert_grads(layer.experts), rec=layer.plan_record()))
        layer.comm.close()
    return out


@pytest.mark.timeout(240)
def test_a_wire_technique_on_a_placement_techniques_placement_matches_the_fp64_reference():
    import torch

    from moelab.config import MoEConfig
    from moelab.moe.reference import ReferenceMoE
    from moelab.runtime.ranks import run_ranks
    from moelab.testing import rank_inputs, reference_grads

    cases = list(PLACED.values())
    res = run_ranks(_placed, 2, cases, timeout=180)
    xs, gys = rank_inputs([5, 9], 8, seed=2)
    ref = reference_grads(ReferenceMoE(8, 16, MoEConfig(num_experts=4, top_k=2, gate="topk"), layer_id=1, seed=3),
                          xs, gys)
    for i, (name, _, holders) in enumerate(cases):
        got = [r[i] for r in res]
        assert got[0]["rec"]["placement"] and got[0]["rec"]["lsh"]["family"] == "identity", got[0]["rec"]
        assert sum(map(sum, got[0]["rec"]["lsh"]["centroids"])) == 2 * 14  # every (token, choice) a centroid
        for r, g in enumerate(got):
            torch.testing.assert_close(g["y"], ref["y"][r], rtol=1e-9, atol=1e-10)
            torch.testing.assert_close(g["gx"], ref["gx"][r], rtol=1e-9, atol=1e-10)
        for e, want in ref["eg"].items():  # the holders' shares sum to the reference's gradient
            shares = [g["eg"][e] for g in got if e in g["eg"]]
            assert len(shares) == len(holders[e]), (name, e)
            for j, w in enumerate(want):
                torch.testing.assert_close(sum(s[j] for s in shares), w, rtol=1e-9, atol=1e-10)
