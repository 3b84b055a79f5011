"""Update hooks, the DDP-overlap baseline and one optimizer semantics, on real gloo ranks (fp64)."""
from __future__ import annotations

import collections

import pytest
import torch

from moelab.runtime.ranks import run_ranks
from moelab.testing import train_snapshot
from tests.runtime.test_train import gather_experts

SMALL_BUCKETS = {"parallel.grad_sync": "ddp_overlap", "parallel.bucket_mb": 0.004}  # 4 KiB: ~10 buckets


def assert_same_training(got: list, want: dict, rtol=1e-10, atol=1e-12) -> None:
    """Every rank of ``got`` matches the single-process ``want``: losses, each expert, dense params."""
    for res in got:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want["losses"]), rtol=rtol, atol=0)
        torch.testing.assert_close(res["dense"], want["dense"], rtol=1e-8, atol=1e-10)
    e_got, e_want = gather_experts(got), gather_experts([want])
    assert set(e_got) == set(e_want)
    for key in e_want:
        torch.testing.assert_close(e_got[key], e_want[key], rtol=1e-8, atol=1e-10)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_overlap_equals_after_backward_and_the_reference(world):
    base = {"train.iters": 4}
    one = run_ranks(train_snapshot, 1, {**base, "train.batch_size": 4}, timeout=120)[0]
    after = run_ranks(train_snapshot, world, {**base, "train.batch_size": 4 // world}, timeout=120)
    ddp = run_ranks(train_snapshot, world, {**base, **SMALL_BUCKETS, "train.batch_size": 4 // world}, timeout=120)
    assert_same_training(after, one)
    assert_same_training(ddp, one)
    assert ddp[0]["ops"]["all_reduce"] > after[0]["ops"]["all_reduce"] == 4  # buckets vs one flat all-reduce


def _bucket_timing(rank, world):
    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer
    from moelab.testing import TINY_TRAIN

    out = {}
    for mode in ("after_backward", "ddp_overlap"):
        cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": world, "train.batch_size": 1,
                                          "train.iters": 2, **SMALL_BUCKETS, "parallel.grad_sync": mode}).validate()
        tr = Trainer.build(cfg)
        tr.run()
        rec = tr.comm.rec
        bwd = {tags["iter"]: (t0, t1) for name, cat, t0, t1, tags in rec.spans if name == "backward"}
        order = [(r.op, r.tags.get("phase"), r.tags.get("iter"), r.t_start, r.t_end, r.bytes) for r in rec.comm]
        buckets = [sum(p.numel() for p in b) * 8 for b in getattr(tr.update, "buckets", [])]
        last = [n for n, _ in tr.model.named_parameters() if not n.startswith("blocks.1.ffn.experts")][-1]
        first_bucket = [n for n, p in tr.model.named_parameters() if any(p is q for q in tr.update.buckets[0])] \
            if mode == "ddp_overlap" else []
        out[mode] = dict(bwd=bwd, order=order, buckets=buckets, last=last, first_bucket=first_bucket)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_buckets_are_all_reduced_during_backward(world):
    for rank, res in enumerate(run_ranks(_bucket_timing, world, timeout=120)):
        ddp, after = res["ddp_overlap"], res["after_backward"]
        assert len(ddp["buckets"]) >= 3
        assert ddp["first_bucket"][-1] == ddp["last"]  # buckets fill in reverse parameter order
        for it in (0, 1):
            t0, t1 = ddp["bwd"][it]
            syncs = [o for o in ddp["order"] if o[2] == it and o[1] == "grad_sync"]
            assert len(syncs) == len(ddp["buckets"])
            # every bucket's all-reduce was issued (async) inside the backward span, and completed
            # at its wait in sync(), after backward ...
            assert all(t0 <= ts <= t1 for _, _, _, ts, _, _ in syncs)
            assert all(te >= t1 for _, _, _, _, te, _ in syncs)
            # ... the first one before the first MoE layer's backward all-to-all started (mid-backward)
            bwd_a2a = [ts for op, ph, i, ts, _, _ in ddp["order"] if i == it and op == "all_to_all" and ph == "bwd"]
            assert min(ts for _, _, _, ts, _, _ in syncs) < max(bwd_a2a)
            per_bucket = [sum(o[5].values()) for o in syncs]  # in launch order
            assert per_bucket == [world * 2 * (nb // world) for nb in ddp["buckets"]]  # pairwise rule: 2 S/N per member
            # today's update: one all-reduce, after backward ended
            a0, a1 = after["bwd"][it]
            plain = [o for o in after["order"] if o[2] == it and o[1] == "grad_sync"]
            assert len(plain) == 1 and plain[0][3] >= a1


# ---- one optimizer semantics ---------------------------------------------------------------------
# seed 7, top-1 of 8 experts, 16 tokens per iteration: in some iterations all experts of a rank get no token
STARVED = {"train.seed": 7, "train.iters": 5, "model.moe.num_experts": 8, "model.moe.top_k": 1,
           "model.seq_len": 4}


def starved(loads: list, world: int, E: int = 8) -> list:
    """(iter, layer, rank) whose experts received no token in that iteration (EP placement)."""
    per = collections.Counter()
    for r in loads:
        per[(r["iter"], r["layer"], r["expert"] // (E // world))] += r["tokens"]
    return sorted(k for k, n in per.items() if n == 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_every_expert_takes_an_adam_step_like_the_reference(world):
    one = run_ranks(train_snapshot, 1, {**STARVED, "train.batch_size": 4}, timeout=120)[0]
    for grad_sync in ({}, SMALL_BUCKETS):  # DDP's buckets too: a starved rank's backward graph is smaller
        ep = run_ranks(train_snapshot, world, {**STARVED, **grad_sync, "train.batch_size": 4 // world}, timeout=120)
        hit = starved(ep[0]["loads"], world)
        assert hit and hit[0][0] < 4  # a rank's experts got nothing, and Adam steps followed
        assert ep[0]["loads"] == one["loads"]
        assert_same_training(ep, one)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_overlap_under_fastermoe_smart_schedule(world):
    """FasterMoE's smart schedule runs its own communication (p2p, shadow broadcasts) in forward and
    backward; the buckets issued from the gradient hooks must interleave with it identically on
    every rank."""
    one = run_ranks(train_snapshot, 1, {"train.batch_size": 4}, timeout=120)[0]
    opts = {"smart": True, "group_size": 1, "shadow_force": [1]}
    res = run_ranks(train_snapshot, world, {"parallel.strategy": "fastermoe", "parallel.strategy_options": opts,
                                            **SMALL_BUCKETS, "train.batch_size": 4 // world}, timeout=120)
    assert res[0]["cls"] == "FasterMoELayer" and res[0]["ops"]["p2p"] > 0 and res[0]["ops"]["all_reduce"] == 3 * 3
    assert_same_training(res, one, rtol=1e-9)


def test_refresh_params_follows_parameters_swapped_by_set_placement():
    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer

    cfg = RunConfig().with_overrides({"parallel.nproc": 1, "model.n_layers": 1, "model.moe.num_experts": 2,
                                      "train.iters": 1, "train.trace": False}).validate()
    tr = Trainer.build(cfg)
    layer = tr.model.moe_layers()[0]
    old = layer.experts.w1
    layer.set_placement(layer.placement, [None if p is None else p.detach().clone() for p in layer.experts.stacked()])
    assert layer.experts.w1 is not old and torch.equal(layer.experts.w1, old)
    seen = []
    tr.update.on_grad_ready = seen.append
    tr.update.refresh_params()
    assert any(p is layer.experts.w1 for p in tr.update._params) and not any(p is old for p in tr.update._params)
    layer(torch.randn(3, cfg.model.d_model)).sum().backward()
    assert any(p is layer.experts.w1 for p in seen)  # the new stack's gradient-ready hook fires
    with pytest.raises(ValueError, match="stacks 1 experts"):
        layer.set_placement(layer.placement, [p[:1] if p is not None else None for p in layer.experts.stacked()])


def test_ddp_bucket_rule_first_bucket_is_one_mib():
    """PyTorch DDP's default caps: the first bucket closes at 1 MiB, the others at the cap; an item
    larger than its cap gets a bucket of its own; a cap below 1 MiB applies to the first bucket too."""
    from moelab.runtime.update import DDP_FIRST_BUCKET_BYTES as F
    from moelab.runtime.update import bucket_groups

    mib = 2**20
    assert bucket_groups([F // 2, F // 2, 10 * mib, 10 * mib, 5 * mib, 1], 25 * mib) == [[0, 1], [2, 3, 4], [5]]
    assert bucket_groups([3 * mib, mib, mib], 25 * mib) == [[0], [1, 2]]
    assert bucket_groups([100, 100, 100], 150) == [[0, 1], [2]]
