"""The global balance loss's all-reduce (:func:`moelab.moe.layer.global_aux_losses`: one SUM of every MoE
layer's first-choice counts over ``dp`` per step) is training traffic: recorded and link-emulated by the
runtime, and priced by the simulator's iteration graph with the same record, for every registered strategy
whose layer is built on :class:`~moelab.moe.layer.MoELayer` (Parm's is not: neither side has it), and only
when the runtime issues it (a gate with balance statistics, a coefficient > 0, more than one rank).

On 2 gloo ranks, every registered strategy with a balance loss (its first conformance option set) plus two
runs that issue none (the ``base`` gate, a coefficient of 0): the real run records exactly one such call per
(rank, iteration) exactly when its graph has the op, and the simulated bytes equal the measured bytes.
Before the call was recorded the first check failed for every strategy; a graph without the op fails the
second (the identity held only because the call was hidden)."""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from moelab.config import MoEConfig, RunConfig
from moelab.moe.gates import GATES
from moelab.moe.layer import GATES_WITHOUT_BALANCE_STATS, MoELayer, balance_allreduce_bytes
from moelab.registry import all_strategies, get
from moelab.testing import TINY_TRAIN

CAL = {"nproc": 2, "gemm_flops": 1e9, "collectives": {op: {"alpha": 1e-4, "beta": 1e-9}
                                                      for op in ("all_to_all", "all_reduce", "all_gather")}}
BAL = {"model.moe.balance_loss_coef": 0.01}
NONE = {  # runs that issue no balance all-reduce
    "ep-base-gate": ("ep", {"model.moe.gate": "base", "model.moe.top_k": 1}),
    "ep-coef-0": ("ep", {"model.moe.balance_loss_coef": 0.0}),
}
EXTRA = {"zero-stage3": ("zero", {"stage": 3})}  # the regather after the op (runtime and graph)
NEEDS = {"parm": {"model.moe.gate": "switch", "model.moe.top_k": 1, "model.moe.capacity_factor": 1.0,
                  "model.moe.dispatcher": "dense"}}  # DeepSpeed-style gates and capacity buffers
CASES = ([(s.name, (s.conformance or ({},))[0], {**BAL, **NEEDS.get(s.name, {})}) for s in all_strategies()]
         + [(n, o, BAL) for n, o in EXTRA.values()] + [(n, {}, {**BAL, **o}) for n, o in NONE.values()])
IDS = [s.name for s in all_strategies()] + list(EXTRA) + list(NONE)


def _cfg(name, opts, over) -> RunConfig:
    base = {k: v for k, v in TINY_TRAIN.items() if k != "train.dtype"}
    return RunConfig().with_overrides({**base, "parallel.nproc": 2, "parallel.strategy": name,
                                       "parallel.strategy_options": opts, **over}).validate()


def _on_moelayer(cfg) -> bool:
    cls = get(cfg.parallel.strategy).layer_class(cfg) or MoELayer
    cls = getattr(cls, "func", cls)  # a functools.partial of the class (Parm's)
    return isinstance(cls, type) and issubclass(cls, MoELayer)


@pytest.fixture(scope="module")
def real_runs():
    from moelab.measure.realruns import run_real_many

    return run_real_many([_cfg(*c) for c in CASES], 2, timeout=240)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_the_balance_allreduce_is_recorded_and_simulated_exactly_when_issued(real_runs, case):
    from moelab.measure.validate import BytesMismatchWarning, compare, machine_profile, simulate_real

    real = real_runs[case]
    cfg, moe = real.cfg, real.cfg.model.moe
    n_moe = real.loads.shape[1]
    nbytes = balance_allreduce_bytes(moe, n_moe, 2) if _on_moelayer(cfg) else 0
    assert (nbytes > 0) == (IDS[case] not in NONE and IDS[case] != "parm"), (IDS[case], nbytes)
    c = real.comm
    calls = c[(c.op == "all_reduce") & (c.phase == "fwd") & (c.layer < 0)].groupby(["rank", "iter"]).size()
    assert calls.reindex(range(2), level=0).sum() == (2 * cfg.train.iters if nbytes else 0), calls
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BytesMismatchWarning)
        sim = simulate_real(cfg, real.loads, machine_profile(cfg, CAL, compute="gemm"), plans=real.graph_plans())
        cmp = compare(real, sim, warmup=0, names=[IDS[case]])
    for res in sim.results:
        ops = [o for o in res.graph.ops if o.category == "balance"]
        assert len(ops) == (1 if nbytes else 0), IDS[case]
        assert all(o.comm == {"op": "all_reduce", "group": [0, 1], "nbytes": nbytes} for o in ops)
    assert cmp.metrics["bytes_exact"], cmp.mismatches


@pytest.mark.parametrize("gate", sorted(GATES))
def test_the_gates_without_balance_statistics_are_the_ones_the_rule_names(gate):
    """:func:`balance_allreduce_bytes`'s gate rule against what every registered gate really returns."""
    top_k = 1 if gate in ("switch", "base") else 2
    cfg = MoEConfig(num_experts=4, top_k=top_k, gate=gate, balance_loss_coef=0.01)
    layer = MoELayer(8, 16, cfg, layer_id=0, seed=0, dtype=torch.float64)
    layer(torch.randn(16, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    keeps = layer.last_routing.balance_stats is not None
    assert keeps == (gate not in GATES_WITHOUT_BALANCE_STATS)
    assert (balance_allreduce_bytes(cfg, 3, 4) > 0) == keeps
    assert balance_allreduce_bytes(cfg, 3, 1) == 0  # one rank: its tokens are the batch
    assert balance_allreduce_bytes(replace(cfg, balance_loss_coef=0.0), 3, 4) == 0
    if keeps:
        assert balance_allreduce_bytes(cfg, 3, 4) == 3 * 4 * 8
