"""Checkpoints: atomic writes, bit-for-bit resume, resume at another EP size, validation (fp64, gloo)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from moelab.config import ConfigError, MoEConfig, RunConfig
from moelab.runtime.ranks import run_ranks
from moelab.testing import TINY_TRAIN


def _state(tr) -> dict:
    experts = {}
    for li, layer in enumerate(tr.model.moe_layers()):
        ex = layer.experts
        for s, e in enumerate(ex.experts):
            experts[(li, e)] = torch.cat([p[s].detach().reshape(-1) for p in (ex.w1, ex.b1, ex.w2, ex.b2)])
    return dict(losses=[r["loss"] for r in tr.metrics], iters=[r["iter"] for r in tr.metrics], experts=experts,
                dense=torch.cat([p.detach().reshape(-1) for p in tr.model.dense_parameters()]),
                start=tr.start_iter, holders=[layer.placement.holders for layer in tr.model.moe_layers()])


def _train(rank, world, overrides, out=None, fail_at=None):
    """Train TINY_TRAIN + overrides; with ``fail_at=(rank, step)`` that rank's checkpoint write fails."""
    from moelab.runtime import checkpoint
    from moelab.runtime.train import Trainer

    cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": world, **overrides}).validate()
    tr = Trainer.build(cfg)
    tr.out_dir = out
    if fail_at is not None:
        real = checkpoint.torch.save

        def flaky(obj, path, *a, **k):
            if rank == fail_at[0] and f"step_{fail_at[1]:06d}" in str(path):
                with open(path, "wb") as f:
                    f.write(b"half a file")  # a write that dies half-way
                raise OSError("disk full (injected)")
            return real(obj, path, *a, **k)

        checkpoint.torch.save = flaky
        try:
            tr.run()
        except checkpoint.CheckpointError as e:
            return dict(error=str(e), **_state(tr))
        finally:
            checkpoint.torch.save = real
    tr.run()
    return _state(tr)


def _exactly_equal(a: dict, b: dict) -> None:
    assert set(a["experts"]) == set(b["experts"])
    for k in a["experts"]:
        assert torch.equal(a["experts"][k], b["experts"][k]), k
    assert torch.equal(a["dense"], b["dense"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_resume_continues_bit_for_bit(tmp_path, world):
    base = {"train.batch_size": 4 // world, "model.moe.random_routing": True, "model.moe.gate": "gshard",
            "model.moe.capacity_factor": 1.0}  # capacity drops and random routing: the RNG counters matter
    full = run_ranks(_train, world, {**base, "train.iters": 6}, timeout=120)
    first = run_ranks(_train, world, {**base, "train.iters": 3, "train.checkpoint_every": 3}, str(tmp_path),
                      timeout=120)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000003"]
    meta = json.loads((tmp_path / "checkpoints" / "step_000003" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["world"] == world and meta["global_batch"] == 4
    assert [layer["forward_calls"] for layer in meta["layers"]] == [3, 3]
    resumed = run_ranks(_train, world, {**base, "train.iters": 6, "train.resume_from": str(tmp_path)}, timeout=120)
    for r in range(world):
        assert first[r]["losses"] == full[r]["losses"][:3]
        assert resumed[r]["start"] == 3 and resumed[r]["iters"] == [3, 4, 5]
        assert resumed[r]["losses"] == full[r]["losses"][3:]  # bit for bit
        _exactly_equal(resumed[r], full[r])


_LINA_PACKING = {"policy": "lina_full", "pack_controller": True, "pack_start_step": 1, "pack_every": 1, "a2a_chunks": 2}
_SLOW_A2A = {"model.moe.dispatcher": "dense", "model.moe.capacity_factor": 2.0, "emulation.enabled": True,
             "emulation.intra_latency_us": 3000.0, "emulation.inter_latency_us": 3000.0}  # the FFN micro-op is faster


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy, opts, extra", [("smartmoe", {"interval": 2, "decision": "always"}, {}),
                                                   ("flexmoe", {"interval": 2, "window": 3, "threshold": 1.01,
                                                                "migration_cost_s": 0.0}, {}),
                                                   ("hecate", {"reshard_interval": 2, "t": 2, "m": 2}, {}),
                                                   ("lina", _LINA_PACKING, _SLOW_A2A)])
def test_resume_after_a_replacement_continues_on_the_saved_placement(tmp_path, strategy, opts, extra):
    """Experts move every 2 iterations (Lina: its packing controller halves the block at steps 1 and 2); a
    checkpoint taken after a move resumes on the moved placement (not the initial one) with the update's
    own state (iteration, load window, packing block), and the rounds after the resume decide as in the
    uninterrupted run: bit for bit."""
    base = {"parallel.strategy": strategy, "parallel.strategy_options": opts, "train.batch_size": 1,
            "model.moe.num_experts": 8, **extra}
    full = run_ranks(_train, 4, {**base, "train.iters": 7}, timeout=150)
    run_ranks(_train, 4, {**base, "train.iters": 3, "train.checkpoint_every": 3}, str(tmp_path), timeout=150)
    meta = json.loads((tmp_path / "checkpoints" / "step_000003" / "meta.json").read_text())
    initial = [[e // 2] for e in range(8)]  # 8 experts on 4 ranks
    assert any(layer["holders"] != initial for layer in meta["layers"]), meta["layers"]  # experts had moved
    resumed = run_ranks(_train, 4, {**base, "train.iters": 7, "train.resume_from": str(tmp_path)}, timeout=150)
    for r in range(4):
        assert resumed[r]["iters"] == [3, 4, 5, 6] and resumed[r]["losses"] == full[r]["losses"][3:]
        _exactly_equal(resumed[r], full[r])
        assert resumed[r]["holders"] == full[r]["holders"]  # the rounds after the resume chose the same


@pytest.mark.timeout(300)
def test_resume_at_another_ep_size(tmp_path):
    """Saved on 4 ranks, resumed on 2 (global batch kept): the same losses as the 4-rank run, with the
    balance loss at its default coefficient (computed over the global batch, so the split does not matter;
    from each rank's own tokens the losses differed by ~1e-6 .. 2e-4 relative from iteration 4 on)."""
    coef = {"model.moe.balance_loss_coef": MoEConfig().balance_loss_coef}  # TINY_TRAIN turns it off
    assert coef["model.moe.balance_loss_coef"] > 0
    full = run_ranks(_train, 4, {**coef, "train.batch_size": 1, "train.iters": 6}, timeout=120)
    run_ranks(_train, 4, {**coef, "train.batch_size": 1, "train.iters": 3, "train.checkpoint_every": 3},
              str(tmp_path), timeout=120)
    files = sorted(os.listdir(tmp_path / "checkpoints" / "step_000003"))
    assert files == ["dense.pt", "meta.json", "rank0.pt", "rank1.pt", "rank2.pt", "rank3.pt"]
    two = run_ranks(_train, 2, {**coef, "train.batch_size": 2, "train.iters": 6,
                                "train.resume_from": str(tmp_path)}, timeout=120)
    for r in range(2):
        assert two[r]["iters"] == [3, 4, 5] and two[r]["experts"].keys() == {(li, e) for li in (0, 1)
                                                                            for e in (2 * r, 2 * r + 1)}
        torch.testing.assert_close(torch.tensor(two[r]["losses"]), torch.tensor(full[0]["losses"][3:]),
                                   rtol=1e-12, atol=0)
        for key, v in two[r]["experts"].items():
            torch.testing.assert_close(v, full[key[1]]["experts"][key], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(two[r]["dense"], full[0]["dense"], rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_a_failed_checkpoint_leaves_the_previous_one_intact(tmp_path, world):
    over = {"train.batch_size": 4 // world, "train.iters": 6, "train.checkpoint_every": 2}
    res = run_ranks(_train, world, over, str(tmp_path), (world - 1, 4), timeout=120)
    for r in res:
        assert "checkpoint at step 4 failed" in r["error"] and r["iters"] == [0, 1, 2, 3]  # every rank stopped
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000002"]  # no temp folder, old one kept
    full = run_ranks(_train, world, {**over, "train.checkpoint_every": 0}, timeout=120)
    resumed = run_ranks(_train, world, {**over, "train.checkpoint_every": 0, "train.resume_from": str(tmp_path)},
                        timeout=120)
    assert resumed[0]["iters"] == [2, 3, 4, 5] and resumed[0]["losses"] == full[0]["losses"][2:]


def test_resuming_another_model_fails_before_launch(tmp_path):
    _train(0, 1, {"train.batch_size": 4, "train.iters": 2, "train.checkpoint_every": 2}, str(tmp_path))
    ok = {**TINY_TRAIN, "parallel.nproc": 1, "train.batch_size": 4, "train.iters": 4,
          "train.resume_from": str(tmp_path)}
    RunConfig().with_overrides(ok).validate()
    RunConfig().with_overrides({**ok, "parallel.nproc": 2, "train.batch_size": 2}).validate()
    for over, message in [
        ({"model.d_model": 32}, "is of another model: model.d_model=32 (checkpoint: 16)"),
        ({"model.moe.num_experts": 8}, "model.moe.num_experts=8 (checkpoint: 4)"),
        ({"train.batch_size": 2}, "global batch parallel.nproc x train.batch_size = 1 x 2 = 2 must equal the "
                                  "checkpoint's 4"),
        ({"train.iters": 2}, "train.iters=2 must exceed the checkpoint's step 2"),
        ({"train.seed": 3}, "train.seed=3 differs"),
    ]:
        with pytest.raises(ConfigError) as info:
            RunConfig().with_overrides({**ok, **over}).validate()
        assert message in str(info.value)
