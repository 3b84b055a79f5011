"""Parm's layout (spec §2.3, §5 I1), pure: partitions, the (ep, esp) bijection, shards per ESP group,
node locality, the spec's worked examples, and bad layouts named before anything starts."""
from __future__ import annotations

import itertools

import pytest

from moelab.comm.groups import validate_groups
from moelab.strategies.parm.layout import DENSE_DP, EP, EPESP, ESP, MP, SAA, ParmLayout


@pytest.mark.parametrize("P, g", [(4, 4), (8, 4), (8, 8), (16, 4), (32, 4)])
def test_groups_partition_and_bijection(P, g):
    for n_mp, n_esp in itertools.product((1, 2, 4), repeat=2):
        if P % n_mp or P % n_esp:
            continue
        lay = ParmLayout(P, n_mp, n_esp, P // n_esp, g).check()
        groups = validate_groups(lay.groups(), P)  # every group partitions the ranks
        sizes = {MP: n_mp, ESP: n_esp, EP: P // n_esp, EPESP: P, SAA: P, DENSE_DP: P // n_mp}
        for name, n in sizes.items():
            assert all(len(inst) == n for inst in groups[name]), name
        assert sorted(lay.rank_of(**{k: v for k, v in lay.coords(r).items() if k in ("ep", "esp")})
                      for r in range(P)) == list(range(P))
        for inst in groups[ESP]:  # one ESP group holds all N_ESP shards of the same E_l experts
            assert sorted(lay.coords(r)["esp"] for r in inst) == list(range(n_esp))
            assert len({tuple(lay.experts_of(r)) for r in inst}) == 1
        for inst in groups[MP] + groups[ESP]:  # intra-node when the size divides g
            assert len({r // g for r in inst}) == 1
        for inst in groups[MP]:  # an MP group shares one micro-batch
            assert len({lay.coords(r)["dp"] for r in inst}) == 1


def test_worked_examples_of_the_spec():
    lay = ParmLayout(4, 2, 2, 2, 2)  # Fig. 2: 2 nodes x 2
    g = lay.groups()
    assert g[MP] == [[0, 1], [2, 3]] and g[ESP] == [[0, 1], [2, 3]] and g[EP] == [[0, 2], [1, 3]]
    assert lay.experts_of(0) == lay.experts_of(1) == [0] and lay.experts_of(2) == [1]
    g = ParmLayout(8, 2, 4, 2, 4).groups()
    assert g[ESP] == [[0, 1, 2, 3], [4, 5, 6, 7]] and g[EP] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    g = ParmLayout(8, 4, 2, 4, 4).groups()
    assert g[MP] == [[0, 1, 2, 3], [4, 5, 6, 7]] and g[EP] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g[DENSE_DP] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    g = ParmLayout(32, 4, 2, 16, 4).groups()
    assert g[EP] == [list(range(0, 32, 2)), list(range(1, 32, 2))]


@pytest.mark.parametrize("kw, message", [
    (dict(world=8, n_mp=3, n_esp=1, num_experts=8, ranks_per_node=4), "mp=3 does not divide parallel.nproc=8"),
    (dict(world=8, n_mp=1, n_esp=8, num_experts=1, ranks_per_node=4), "esp=8: ESP groups would cross nodes of 4 ranks"),
    (dict(world=8, n_mp=1, n_esp=2, num_experts=6, ranks_per_node=4), "N_EP = nproc/esp = 4 does not divide"),
    (dict(world=8, n_mp=0, n_esp=2, num_experts=4, ranks_per_node=4), "mp must be a positive integer"),
    (dict(world=6, n_mp=2, n_esp=2, num_experts=3, ranks_per_node=4), "does not split into nodes of 4"),
])
def test_bad_layouts_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        ParmLayout(**kw).check()


def test_cross_node_groups_only_when_allowed():
    assert ParmLayout(8, 8, 1, 8, 4, allow_cross_node=True).check().groups()[MP] == [list(range(8))]
    assert ParmLayout(8, 2, 8, 1, 4, allow_cross_node=True).errors() == []
    # E = 2 on 8 ranks is valid (Table V on testbed A): N_EP = 2 divides it
    assert ParmLayout(8, 4, 4, 2, 8).errors() == []


# ---- bad input through the run config: a ConfigError naming option and values, before any process ----
GOOD = {"parallel.nproc": 8, "parallel.strategy": "parm", "model.moe.dispatcher": "dense",
        "model.moe.capacity_factor": 1.2, "model.moe.gate": "switch", "model.moe.top_k": 1, "model.moe.num_experts": 2,
        "model.d_model": 64, "model.d_ff": 128, "model.n_heads": 4, "parallel.topology.nodes": 2}


@pytest.mark.parametrize("over, message", [
    ({"parallel.strategy_options": {"mp": 3}}, "mp=3 does not divide parallel.nproc=8"),
    ({"parallel.strategy_options": {"esp": 8}}, "esp=8: ESP groups would cross nodes of 4 ranks"),
    ({"parallel.strategy_options": {"esp": 2}, "model.moe.num_experts": 3}, "does not divide model.moe.num_experts=3"),
    ({"parallel.strategy_options": {"esp": 4}, "model.d_ff": 130},
     "model.d_ff=130 (the expert hidden size) is not divisible by esp=4"),
    ({"parallel.strategy_options": {"mp": 4}, "model.n_heads": 2}, "model.n_heads=2 is not divisible by mp=4"),
    ({"parallel.strategy_options": {"mp": 4, "schedule": "s1"}, "train.batch_size": 1, "model.seq_len": 6},
     "train.batch_size * model.seq_len = 6 is not divisible by it"),
    ({"model.moe.capacity_factor": None}, "parm needs model.moe.capacity_factor"),
    ({"model.moe.dispatcher": "sparse"}, "set model.moe.dispatcher='dense'"),
    ({"parallel.placement": {0: [0], 1: [1]}}, "parallel.placement must be unset"),
    ({"model.moe.gate": "topk"}, "gate='topk' with top_k=1 has a constant weight of 1: use gate='switch'"),
    ({"parallel.strategy_options": {"schedule": "s3"}}, "schedule must be one of"),
    ({"parallel.strategy_options": {"baseline_variant": "ds090"}}, "baseline_variant must be one of"),
    ({"parallel.strategy_options": {"saa_mode": "summed"}}, "saa_mode must be one of ['raw', 'combined']"),
])
def test_bad_parm_configs_fail_before_launch(over, message):
    from moelab.config import ConfigError, RunConfig

    with pytest.raises(ConfigError) as e:
        RunConfig().with_overrides({**GOOD, **over}).validate()
    assert message in str(e.value)


def test_a_good_parm_config_validates_with_two_experts_on_eight_ranks():
    from moelab.config import RunConfig

    RunConfig().with_overrides({**GOOD, "parallel.strategy_options": {"mp": 4, "esp": 4}}).validate()
