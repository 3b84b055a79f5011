"""Memory by category from live storages (moelab.runtime.memory), and the per-iteration plans log."""
from __future__ import annotations

import json

import pytest
import torch

from moelab.config import RunConfig
from moelab.runtime.memory import available_memory, free_memory_bytes, storage_bytes
from moelab.runtime.ranks import run_ranks
from moelab.testing import TINY_TRAIN


def _train(overrides: dict, world: int = 1):
    from moelab.runtime.train import Trainer

    cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": world, **overrides}).validate()
    tr = Trainer.build(cfg)
    tr.run()
    return tr


def test_storage_bytes_counts_each_storage_once():
    a = torch.zeros(10, dtype=torch.float64)
    assert storage_bytes([a, a[2:5], a.view(2, 5).t(), None]) == 80
    assert storage_bytes([a, torch.zeros(3)]) == 92


def test_free_memory_is_the_hosts_available_memory_shared_by_its_ranks(monkeypatch):
    """Hecate's m is profiled from it (spec §2.3): /proc/meminfo's MemAvailable split over the ranks on the host."""
    import moelab.runtime.memory as mem

    have = available_memory()
    assert 0 < have <= mem.physical_memory()
    monkeypatch.setattr(mem, "available_memory", lambda: 8 * 2**30)
    assert free_memory_bytes("cpu") == 8 * 2**30
    assert free_memory_bytes(torch.device("cpu"), sharers=8) == 2**30
    with pytest.raises(ValueError, match="sharers"):
        free_memory_bytes("cpu", sharers=0)


def test_activations_grow_with_the_batch_and_are_freed_by_backward():
    small, large = _train({"train.batch_size": 1}), _train({"train.batch_size": 4})
    s, l = small.metrics[-1], large.metrics[-1]
    assert l["mem_activations_bytes"] > 3 * s["mem_activations_bytes"] > 0
    assert l["mem_activations_peak_bytes"] == l["mem_activations_bytes"]  # saved tensors peak at the forward's end
    for tr in (small, large):
        assert tr.update.memory.live_activations == 0  # backward freed every saved tensor
        assert tr.update.grad_bytes() == 0  # zero_grad(set_to_none) frees the grads between iterations
        row = tr.metrics[-1]
        # every parameter gets a gradient of its own size (1 rank: no bucket, no flat buffer kept)
        assert row["mem_grads_peak_bytes"] == row["mem_grads_bytes"] == row["mem_params_bytes"]
        # + fp32 step
        assert row["mem_optim_bytes"] == 2 * row["mem_params_bytes"] + 4 * len(list(tr.model.parameters()))
        assert row["mem_total_peak_bytes"] >= row["mem_params_bytes"] + row["mem_optim_bytes"] + row["mem_grads_bytes"]


def _zero_memory(rank, world, stage):
    tr = _train({"parallel.strategy": "zero", "parallel.strategy_options": {"stage": stage},
                 "train.batch_size": 1, "train.iters": 2}, world)
    return dict(rows=tr.metrics, S=tr.update.full_bytes, between=tr.update.param_bytes(),
                grads_between=tr.update.grad_bytes())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_zero_peaks_see_gathered_parameters_and_full_gradients(world):
    for res in run_ranks(_zero_memory, world, 3, timeout=120):
        S = res["S"]
        assert res["between"] == S // world and res["grads_between"] == 0
        for row in res["rows"]:
            assert row["mem_params_bytes"] == S // world  # the shard between iterations
            assert row["mem_params_peak_bytes"] == S + S // world  # gathered buffer beside the shard
            assert row["mem_grads_bytes"] == S // world  # the reduced shard after sync
            assert row["mem_grads_peak_bytes"] >= S  # backward wrote full-size grads first
    for res in run_ranks(_zero_memory, world, 1, timeout=120):
        for row in res["rows"]:
            assert row["mem_params_peak_bytes"] == row["mem_params_bytes"] == res["S"]  # nothing gathered


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_plans_jsonl_records_every_iteration_and_layer(tmp_path, world):
    from moelab.runtime.results import RunResult

    placement = {0: [0, 1], 1: [0], 2: [1], 3: [1]}
    if world == 4:
        placement = {0: [0, 3], 1: [1], 2: [2], 3: [3, 0]}
    last = run_ranks(_plans_for, world, str(tmp_path), placement, timeout=120)[0]
    (tmp_path / "summary.json").write_text("{}")
    plans = RunResult(tmp_path).plans
    assert list(zip(plans["iter"], plans["layer"])) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    want_holders = {str(e): list(placement[e]) for e in range(4)}
    assert all(p["holders"] == want_holders for p in plans["placement"])
    assert [c for c in plans["counts"][2:]] == last  # global [N, E] counts of the last iteration
    assert all(len(c) == world and sum(map(sum, c)) == 32 * world for c in plans["counts"])  # T*k = 16*2 per rank
    assert "shadowed" not in plans and "materialized" not in plans  # recorded only when something is
    with open(tmp_path / "plans.jsonl") as f:
        assert len([json.loads(line) for line in f]) == 4


def _plans_for(rank, world, out, placement):
    tr = _train({"train.batch_size": 1, "train.iters": 2, "parallel.placement": placement}, world)
    tr.write_outputs(out)
    return [layer.last_global_counts.tolist() for layer in tr.model.moe_layers()]
