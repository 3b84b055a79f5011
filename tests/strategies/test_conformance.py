"""Conformance suite: every registered strategy, with each option set it declares
(``Strategy.conformance``), must

1. compute the single-process fp64 reference's outputs and input gradients, and leave expert and
   gate gradients whose sum over the ranks holding them is the reference's, on 2 and 4 gloo ranks
   under edge loads (a rank with zero tokens, every token to one expert, uneven batches);
2. train exactly like the EP baseline (losses, every expert, dense parameters after 3 Adam steps,
   fp64), unless an option in ``changes_model`` is on (then only finite losses are checked);
3. have its simulator graph account exactly the bytes the real run recorded.

A new strategy registered with :func:`moelab.registry.register_strategy` is picked up here with
no edit. Each group of checks shares one spawn per world size (module fixtures).
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from moelab.config import MoEConfig, RunConfig
from moelab.registry import all_strategies
from moelab.runtime.ranks import run_ranks
from moelab.testing import TINY_TRAIN, expert_grads, rank_inputs, reference_grads, train_snapshot

D, F = 8, 16
TOL = dict(rtol=1e-9, atol=1e-10)
MOE = dict(num_experts=4, top_k=2, gate="topk", balance_loss_coef=0.01, z_loss_coef=0.001)
def _strategies() -> list:
    """Every registered strategy, then the composition of every compatible pair of techniques
    (:func:`moelab.strategies.compose.compatible_strategies`, generated from their declarations).
    ``MOELAB_CONFORMANCE=a,b+c`` keeps the named ones only (the shared spawns then build those alone)."""
    from moelab.strategies.compose import compatible_strategies

    every = all_strategies() + compatible_strategies()
    only = [n for n in os.environ.get("MOELAB_CONFORMANCE", "").split(",") if n]
    return [s for s in every if not only or s.name in only]


CASES = [(s.name, opts, s.changes_model_with(opts)) for s in _strategies() for opts in s.conformance]
def _flat(o: dict, pre: str = "") -> dict:  # a composition's options are keyed by technique: lsh_moe.hash_family
    return {kk: vv for k, v in o.items()
            for kk, vv in (_flat(v, f"{pre}{k}.") if isinstance(v, dict) else {f"{pre}{k}": v}).items()}


IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in _flat(o).items()) or 'default'}" for n, o, _ in CASES]
LOADS = {  # tokens per rank (2 ranks, 4 ranks) and whether every token goes to one expert
    "zero_token_rank": ([0, 9], [5, 0, 9, 3], False),
    "one_hot_expert": ([6, 6], [4, 4, 4, 4], True),
    "uneven": ([1, 13], [7, 1, 12, 2], False),
}
HOT = 2  # the expert every token picks first in "one_hot_expert"


def run_cfg(name, opts, world, **over) -> RunConfig:
    moe = {f"model.moe.{k}": v for k, v in MOE.items()}
    return RunConfig().with_overrides({**moe, "parallel.nproc": world, "parallel.strategy": name,
                                       "parallel.strategy_options": opts, **over}).validate()


def make_inputs(tokens, hot):
    return rank_inputs(tokens, D, seed=1, shift=4.0 if hot else 0.0)


def bias_gate(gate, hot):
    if hot:
        with torch.no_grad():
            gate.wg.weight[HOT] += 1.0


# ---- 1. layer vs the fp64 reference under edge loads ----------------------------------------------
def _layer_cases(rank, world, cases):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.config import ConfigError
    from moelab.moe.layer import MoELayer
    from moelab.registry import get

    out = []
    for name, opts, _ in cases:
        try:
            cfg = run_cfg(name, opts, world)
        except ConfigError as e:  # the strategy rejects this shape before launch (e.g. SmartMoE with E/N = 1)
            out += [dict(skip=str(e).splitlines()[-1].strip(" -"))] * len(LOADS)
            continue
        cls = get(name).layer_class(cfg) or MoELayer
        for load, (t2, t4, hot) in LOADS.items():
            xs, gys = make_inputs(t2 if world == 2 else t4, hot)
            layer = cls(D, F, MoEConfig(**MOE), layer_id=3, seed=7, comm=Communicator(Topology(world, world)),
                        dtype=torch.float64)
            bias_gate(layer.gate, hot)
            x = xs[rank].clone().requires_grad_()
            y = layer(x)
            ((y * gys[rank]).sum() + layer.aux_loss).backward()
            out.append(dict(y=y.detach(), gx=x.grad, gg=layer.gate.wg.weight.grad.clone(),
                            eg=expert_grads(layer.experts),
                            counts=layer.last_global_counts.clone()))
            layer.comm.close()  # 84 builds per rank: unclosed, their groups left ~950 threads per rank
    return out


@pytest.fixture(scope="module", params=[2, 4])
def layer_runs(request):
    world = request.param
    res = run_ranks(_layer_cases, world, CASES, timeout=120)
    return world, res


def _reference(tokens, hot):
    from moelab.moe.reference import ReferenceMoE

    xs, gys = make_inputs(tokens, hot)
    ref = ReferenceMoE(D, F, MoEConfig(**MOE), layer_id=3, seed=7)
    bias_gate(ref.gate, hot)
    return reference_grads(ref, xs, gys)


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_layer_matches_reference_under_edge_loads(layer_runs, case):
    world, res = layer_runs
    name, opts, changes_model = CASES[case]
    if changes_model:
        pytest.skip(f"{IDS[case]} routes differently on purpose (changes the model)")
    for j, (load, (t2, t4, hot)) in enumerate(LOADS.items()):
        tokens = t2 if world == 2 else t4
        ref = _reference(tokens, hot)
        got = [r[case * len(LOADS) + j] for r in res]
        if "skip" in got[0]:
            pytest.skip(f"{IDS[case]} on {world} ranks: the strategy rejects the shape ({got[0]['skip']})")
        counts = got[0]["counts"]
        if load == "one_hot_expert":  # the edge really happened: every first choice is the hot expert
            assert int(counts[:, HOT].sum()) == sum(tokens), counts
        if load == "zero_token_rank":
            assert min(tokens) == 0 and int(counts[tokens.index(0)].sum()) == 0, counts
        for rank, g in enumerate(got):
            torch.testing.assert_close(g["y"], ref["y"][rank], **TOL)
            torch.testing.assert_close(g["gx"], ref["gx"][rank], **TOL)
        torch.testing.assert_close(sum(g["gg"] for g in got), ref["gg"], **TOL)
        for e, want in ref["eg"].items():  # every holder's share of the expert's gradient
            shares = [g["eg"][e] for g in got if e in g["eg"]]
            assert shares, f"expert {e} is held by no rank"
            for i, w in enumerate(want):
                torch.testing.assert_close(sum(s[i] for s in shares), w, **TOL)


# ---- 2. training equivalence with EP, and 3. simulated bytes == measured bytes --------------------
def _train_all(rank, world, overrides):
    return [train_snapshot(rank, world, o) for o in overrides]


def train_overrides(name, opts):
    return {"parallel.strategy": name, "parallel.strategy_options": opts}


@pytest.fixture(scope="module")
def trained():
    runs = [train_overrides("ep", {})] + [train_overrides(n, o) for n, o, _ in CASES]
    res = run_ranks(_train_all, 2, runs, timeout=120)
    return [[r[i] for r in res] for i in range(len(runs))]


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_trains_like_ep(trained, case):
    ep, got = trained[0], trained[case + 1]
    losses = torch.tensor(got[0]["losses"])
    assert torch.isfinite(losses).all() and len(losses) == TINY_TRAIN["train.iters"]
    if CASES[case][2]:  # trains a different model on purpose: finite losses are all it owes
        return
    torch.testing.assert_close(losses, torch.tensor(ep[0]["losses"]), rtol=1e-10, atol=0)
    want = {key: v for a in ep for key, v in a["experts"].items()}  # every expert, on the rank EP keeps it
    held: dict = {}  # every copy of it, on whichever rank holds one (a migration moves it, a replica copies it)
    for b in got:
        for key, v in b["experts"].items():
            held.setdefault(key, []).append(v)
    assert set(want) <= set(held), f"experts held by no rank: {sorted(set(want) - set(held))}"
    for key, v in want.items():
        for copy in held[key]:
            torch.testing.assert_close(copy, v, rtol=1e-10, atol=1e-10)
    for a, b in zip(ep, got):
        torch.testing.assert_close(b["dense"], a["dense"], rtol=1e-10, atol=1e-10)


@pytest.fixture(scope="module")
def real_runs():
    from moelab.measure.validate import run_real_many

    base = {k: v for k, v in TINY_TRAIN.items() if k != "train.dtype"}
    cfgs = [RunConfig().with_overrides({**base, "parallel.nproc": 2, **train_overrides(n, o)}).validate()
            for n, o, _ in CASES]
    return run_real_many(cfgs, 2, timeout=150, probe=_probe)


def _probe(tr):
    """What a probe sees: the trainer after its iterations, in the rank's own process."""
    return tr.comm.rank, len(tr.metrics)


def test_a_probe_runs_on_each_rank_after_each_run_and_rank_0s_result_is_kept(real_runs):
    assert [r.probe for r in real_runs] == [(0, r.cfg.train.iters) for r in real_runs]


CAL = {"nproc": 2, "gemm_flops": 1e9, "collectives": {op: {"alpha": 1e-4, "beta": 1e-9}
                                                      for op in ("all_to_all", "all_reduce", "all_gather")}}


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_simulated_bytes_equal_measured(real_runs, case):
    from moelab.measure.validate import BytesMismatchWarning, compare, machine_profile, simulate_real
    from moelab.registry import get

    refused = get(CASES[case][0]).sim_refused
    if refused:  # never a faked simulation: the strategy says why it cannot be priced
        pytest.skip(f"{IDS[case]}: SIMULATED refused: {refused}")
    real = real_runs[case]
    assert len(real.comm), "the run recorded no training traffic"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BytesMismatchWarning)
        sim = simulate_real(real.cfg, real.loads, machine_profile(real.cfg, CAL, compute="gemm"),
                           plans=real.graph_plans())
        c = compare(real, sim, warmup=0, names=[IDS[case]])
    assert c.metrics["bytes_exact"], c.mismatches
