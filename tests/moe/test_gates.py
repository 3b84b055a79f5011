"""Any top-k (issue #8 item 12): the topk gate routes each token to any 1 <= k <= E experts
(DeepSeek-V3: 8 of 256); capacity ``ceil(k*cf*T/E)``; choice j's capacity slots come after those of
every choice < j; both dispatchers (and FasterMoE's shadowing and smart schedule) equal the fp64
reference on 2 and 4 ranks, with and without capacity drops."""
from __future__ import annotations

import pytest
import torch

from moelab.config import ConfigError, MoEConfig, RunConfig
from moelab.moe.gates import Gate, capacity_for, capacity_locations
from moelab.runtime.ranks import run_ranks
from tests.moe.test_layer import _run_cases, check, moe
from tests.strategies.fastermoe.test_smart_schedule import check as fastermoe_check
from tests.strategies.fastermoe.test_smart_schedule import reference as fastermoe_reference

KS = (1, 2, 3, 4, 8)


def cases_for(k):
    return {
        f"k{k}-sparse-dropless": dict(moe=moe(num_experts=8, top_k=k), tokens=[9, 4, 0, 7]),
        f"k{k}-sparse-drops": dict(moe=moe(num_experts=8, top_k=k, capacity_factor=0.5), tokens=[12, 12, 5, 12]),
        f"k{k}-dense-drops": dict(moe=moe(num_experts=8, top_k=k, capacity_factor=0.5, dispatcher="dense"),
                                  tokens=[12, 12, 5, 12]),
        f"k{k}-dense-roomy": dict(moe=moe(num_experts=8, top_k=k, capacity_factor=8.0, dispatcher="dense",
                                          expert_bias=False), tokens=[6, 10, 3, 8]),
    }


CASES = {name: c for k in KS for name, c in cases_for(k).items()}


@pytest.mark.parametrize("world", [2, 4])
def test_any_k_matches_reference(world):
    cases = [dict(c, tokens=c["tokens"][:world]) for c in CASES.values()]
    results = run_ranks(_run_cases, world, cases, timeout=120)
    for i, (name, case) in enumerate(zip(CASES, cases)):
        try:
            ref = check(case, [r[i] for r in results])
            idx = torch.cat([r.idx for r in ref["routes"]])
            assert idx.shape[1] == case["moe"]["top_k"]
            assert bool((idx < 0).any()) == name.endswith("-drops")  # the drop cases really drop, the others not
        except AssertionError as e:
            raise AssertionError(f"case {name} (world {world}): {e}") from None


def _fastermoe_rank(rank, world, cases):
    from tests.strategies.fastermoe.test_smart_schedule import _run_cases as fastermoe_cases

    return fastermoe_cases(rank, world, cases)


@pytest.mark.parametrize("world", [2, 4])
def test_any_k_fastermoe_shadowing_and_smart_schedule(world):
    variants = [{}, dict(shadow_force=[0, 5]), dict(smart=True, group_size=1, shadow_force=[2])]
    cases = [dict(moe=moe(num_experts=8, top_k=k, capacity_factor=cf), tokens=[9, 6, 11, 4][:world], variants=variants)
             for k, cf in ((3, None), (4, 0.75), (8, None))]
    results = run_ranks(_fastermoe_rank, world, cases, timeout=120)
    for i, case in enumerate(cases):
        ref = fastermoe_reference(case)
        for vi, opts in enumerate(variants):
            try:
                fastermoe_check(case, [r[i][vi] for r in results], ref)
                assert all(r[i][vi]["S"] == tuple(opts.get("shadow_force", ())) for r in results)
            except AssertionError as e:
                raise AssertionError(f"k={case['moe']['top_k']}, options {opts} (world {world}): {e}") from None


def test_capacity_positions_any_k():
    """Choice j's slots follow all choices < j (token order within a choice)."""
    idx = torch.tensor([[0, 1, 2], [1, 0, 2], [0, 2, 1], [2, -1, 0]])
    loc = capacity_locations(idx, 3)
    # expert 0: choice 0 of t0, t2 (0, 1), then choice 1 of t1 (2), then choice 2 of t3 (3)
    # expert 1: choice 0 of t1 (0), choice 1 of t0 (1), choice 2 of t2 (2)
    # expert 2: choice 0 of t3 (0), choice 1 of t2 (1), choice 2 of t0, t1 (2, 3)
    want = torch.tensor([[0, 1, 2], [0, 2, 3], [1, 1, 2], [0, 0, 3]])
    assert torch.equal(loc[idx >= 0], want[idx >= 0])


def test_topk_gate_k8_of_8_capacity_and_weights():
    cfg = MoEConfig(num_experts=8, top_k=8, gate="topk", capacity_factor=0.5)
    g = Gate(4, cfg, dtype=torch.float64)
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    r = g(x)
    assert r.capacity == capacity_for(10, 8, 8, 0.5) == 5  # ceil(8 * 0.5 * 10 / 8)
    kept = r.idx >= 0
    assert int(kept.sum()) == 8 * 5  # every expert is chosen by all 10 tokens and keeps 5 of them
    for e in range(8):
        assert sorted(r.loc[r.idx == e].tolist()) == list(range(5))
    assert torch.all(r.weights[~kept] == 0) and torch.all(r.weights[kept] > 0)
    # without capacity: all 8 experts, weights a softmax over them
    r2 = Gate(4, MoEConfig(num_experts=8, top_k=8, gate="topk"), dtype=torch.float64)(x)
    assert torch.equal(r2.idx.sort(1).values, torch.arange(8).expand(10, 8))
    torch.testing.assert_close(r2.weights.sum(1), torch.ones(10, dtype=torch.float64))


@pytest.mark.parametrize("overrides, message", [
    ({"model.moe.top_k": 9}, "model.moe.top_k must be an integer in 1..model.moe.num_experts=8, got 9"),
    ({"model.moe.top_k": 0}, "model.moe.top_k must be an integer in 1..model.moe.num_experts=8, got 0"),
    ({"model.moe.top_k": 3, "model.moe.gate": "gshard"}, "gshard' is a top-2 gate"),
    ({"model.moe.top_k": 2, "model.moe.gate": "switch"}, "switch' is a top-1 gate"),
])
def test_top_k_validation(overrides, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig().with_overrides(overrides).validate()


def test_large_k_configs_validate():
    for k, E in ((8, 8), (3, 8), (8, 16)):
        RunConfig().with_overrides({"model.moe.top_k": k, "model.moe.num_experts": E}).validate()
    with pytest.raises(ValueError, match="model.moe.top_k"):
        Gate(4, MoEConfig(num_experts=4, top_k=5))


# ---- the byte rules and the simulator at any k ---------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_simulated_bytes_equal_measured_bytes_at_large_k(world):
    """Real training runs with top-4 and top-8 of 8 (sparse dropless, dense with drops): the
    simulator's graphs, built from the measured loads, carry exactly the bytes the door recorded."""
    import warnings

    from moelab.measure.validate import BASE_MODEL, BytesMismatchWarning, compare, run_real_many, simulate_real
    from tests.sim.test_sim import flat_profile

    base = {**BASE_MODEL, "train.iters": 2, "model.moe.num_experts": 8, "train.batch_size": 1,
            "parallel.nproc": world, "parallel.topology.nodes": world // 2}
    cfgs = {"k4-sparse": {"model.moe.top_k": 4},
            "k8-dense": {"model.moe.top_k": 8, "model.moe.dispatcher": "dense", "model.moe.capacity_factor": 0.5}}
    cfgs = {n: RunConfig().with_overrides({**base, **ov}).validate() for n, ov in cfgs.items()}
    reals = dict(zip(cfgs, run_real_many(list(cfgs.values()), world, timeout=120)))
    for name, real in reals.items():
        T, k = real.cfg.train.batch_size * real.cfg.model.seq_len, real.cfg.model.moe.top_k
        assert (real.loads.sum(-1) == T * k).all() if name.endswith("sparse") else (real.loads.sum(-1) < T * k).all()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BytesMismatchWarning)
            prof = flat_profile(nodes=world // 2, gpn=2)
            c = compare(real, simulate_real(real.cfg, real.loads, prof), warmup=0, names=[name])
        assert c.metrics["bytes_exact"], (name, c.mismatches)


def test_a_registered_gate_declares_what_it_needs_and_validate_checks_it():
    """The gate registry entry says what a gate asks of the run (register_gate(..., needs=)); the pre-flight
    runs it for the gate the config names, and only for that one."""
    from moelab.moe.gates import GATE_NEEDS, GATES, register_gate, topk_rule

    register_gate("three", topk_rule, needs=lambda cfg: [] if cfg.model.moe.top_k == 3 else ["needs top_k=3"])
    try:
        with pytest.raises(ConfigError, match="needs top_k=3"):
            RunConfig().with_overrides({"model.moe.gate": "three", "model.moe.top_k": 2}).validate()
        RunConfig().with_overrides({"model.moe.gate": "three", "model.moe.top_k": 3}).validate()
        RunConfig().with_overrides({"model.moe.top_k": 2}).validate()  # topk: not asked
    finally:
        GATES.pop("three"), GATE_NEEDS.pop("three")
    with pytest.raises(ConfigError, match=r"model.moe.gate must be one of \(.*'topk'.*\), got 'three'"):
        RunConfig().with_overrides({"model.moe.gate": "three"}).validate()
