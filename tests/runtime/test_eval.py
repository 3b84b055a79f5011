"""Evaluation on held-out windows: never trained on, global over ranks, invisible to training."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moelab.config import RunConfig
from moelab.models.data import ByteCorpus
from moelab.models.tasks import make_batch, make_eval_batch
from moelab.runtime.ranks import run_ranks
from moelab.testing import TINY_TRAIN

torch.set_num_threads(1)


@pytest.mark.parametrize("seq_len", [16, 63])
def test_eval_windows_are_disjoint_from_training_windows(seq_len):
    c = ByteCorpus("gpt")
    L = seq_len + 1
    W_train, H = c.split_windows(L)
    assert H == (W_train + H) // 32 and W_train + H == len(c) // L
    train = c._window_index(np.arange(3 * W_train), L, seed=5)  # every sample training can ever draw
    assert set(train.tolist()) == set(range(W_train))
    tokens = c._tokens
    seqs = c.sequences(np.arange(2 * H), L, seed=5, split="eval")
    for i, row in enumerate(seqs[:H]):
        w = W_train + i  # held-out window i, in a fixed order, cycling after H
        assert np.array_equal(row, tokens[w * L:(w + 1) * L])
    assert np.array_equal(seqs[:H], seqs[H:])
    cfg = RunConfig().with_overrides({"model.seq_len": seq_len, "train.batch_size": 3})
    ev = make_eval_batch(cfg, 1, 2, 0)
    tr = make_batch(cfg, 1, 2, 0)
    assert ev["inputs"].shape == tr["inputs"].shape == (3, seq_len)
    assert torch.equal(ev["targets"][:, :-1], ev["inputs"][:, 1:])


def test_random_dataset_eval_rows_differ_from_training_rows():
    c = ByteCorpus("gpt", dataset="random")
    tr = c.batch(0, 1, 0, 4, 16, seed=0)
    ev = c.batch(0, 1, 0, 4, 16, seed=0, split="eval")
    assert not torch.equal(tr["inputs"], ev["inputs"])


def _eval_run(rank, world, overrides):
    from moelab.runtime.train import Trainer

    cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": world, **overrides}).validate()
    tr = Trainer.build(cfg)
    rows = tr.run()
    return dict(losses=[r["loss"] for r in rows], eval=[(r.get("eval_loss"), r.get("eval_ppl")) for r in rows],
                bytes=[(r["bytes_local"], r["bytes_intra"], r["bytes_inter"]) for r in rows],
                ops=len(tr.comm.rec.comm))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_eval_loss_is_global_over_ranks(world):
    over = {"train.iters": 4, "train.eval_every": 2, "train.eval_batches": 2}
    one = run_ranks(_eval_run, 1, {**over, "train.batch_size": 4}, timeout=120)[0]
    many = run_ranks(_eval_run, world, {**over, "train.batch_size": 4 // world}, timeout=120)
    assert [e is None for e, _ in one["eval"]] == [True, False, True, False]
    for res in many:
        for (got, ppl), (want, _) in zip(res["eval"], one["eval"]):
            if want is None:
                assert got is None
            else:
                assert abs(got - want) < 1e-10 and ppl == pytest.approx(math.exp(got), rel=1e-12)
                assert got < math.log(256)  # a trained model beats the uniform guess on held-out text


def test_evaluating_does_not_change_training_or_its_traffic():
    """Random routing draws from each layer's forward counter: evaluation forwards must not advance it."""
    over = {"train.iters": 4, "model.moe.gate": "gshard", "model.moe.random_routing": True,
            "model.moe.capacity_factor": 1.0}
    plain = _eval_run(0, 1, over)
    evald = _eval_run(0, 1, {**over, "train.eval_every": 1})
    assert all(e is not None for e, _ in evald["eval"])
    assert evald["losses"] == plain["losses"]
    assert evald["bytes"] == plain["bytes"] and evald["ops"] == plain["ops"]  # no eval traffic recorded


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_eval_under_zero3_gathers_the_sharded_model(world):
    """ZeRO-3 releases its parameters between iterations: evaluation gathers them (unrecorded) and
    scores the same model as the EP run, without changing the recorded training traffic."""
    over = {"train.iters": 2, "train.batch_size": 4 // world}
    z3 = {"parallel.strategy": "zero", "parallel.strategy_options": {"stage": 3}}
    ep = run_ranks(_eval_run, world, {**over, "train.eval_every": 1}, timeout=120)
    zero = run_ranks(_eval_run, world, {**over, **z3, "train.eval_every": 1}, timeout=120)
    zero_plain = run_ranks(_eval_run, world, {**over, **z3}, timeout=120)
    for r in range(world):
        for (got, _), (want, _) in zip(zero[r]["eval"], ep[0]["eval"]):
            assert got is not None and abs(got - want) < 1e-10
        assert zero[r]["bytes"] == zero_plain[r]["bytes"] and zero[r]["ops"] == zero_plain[r]["ops"]
