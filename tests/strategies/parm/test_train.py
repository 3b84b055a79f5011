"""Parm through the trainer (spec §5 I7): a tiny MoE-BERT with tensor-parallel attention trains to the
same parameters under every schedule and layout with the same N_DP, and as the N_MP = 1 run (fp64,
no drops, dedup on); the update's §2.9 rules are what make that true (without dedup the baseline
diverges)."""
from __future__ import annotations

import pytest
import torch

from moelab.runtime.ranks import run_ranks

BASE = {
    "model.arch": "bert", "model.d_model": 16, "model.d_ff": 32, "model.n_layers": 2, "model.n_heads": 4,
    "model.seq_len": 8, "model.vocab_size": 64, "model.moe_every": 2,
    "model.moe.num_experts": 4, "model.moe.top_k": 1, "model.moe.gate": "switch", "model.moe.capacity_factor": 4.0,
    "model.moe.dispatcher": "dense", "model.moe.balance_loss_coef": 0.0, "model.moe.z_loss_coef": 0.0,
    "model.moe.expert_bias": False,
    "train.iters": 20, "train.batch_size": 2, "train.dtype": "float64", "train.lr": 1e-2, "train.trace": False,
    "parallel.strategy": "parm",
}


def _full_params(tr):
    """Every parameter of the 1-degree model, reassembled from this MP group's shards (dense) and the
    world's expert shards (gathered), so runs with different layouts compare entry by entry."""
    from moelab.strategies.parm.layout import ESP, MP

    comm, model = tr.comm, tr.model
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if getattr(p, "moelab_tp", False):
            parts = comm.all_gather(t.contiguous(), group=MP)
            dim = 1 if name.endswith(("out_w", "fc2_w")) else 0
            if name.endswith(("qkv_w", "qkv_b")):  # heads: (3, H_local, dh, ...) per rank
                parts = parts.view(parts.shape[0], 3, -1, *t.shape[1:])
                t = torch.cat(list(parts.unbind(0)), dim=1).reshape(-1, *t.shape[1:])
            else:
                t = torch.cat(list(parts.unbind(0)), dim=dim)
        elif getattr(p, "moelab_expert", False) and name.endswith(("w1", "w2")):
            parts = comm.all_gather(t.contiguous(), group=ESP)  # the N_ESP shards of my experts
            t = torch.cat(list(parts.unbind(0)), dim=2 if name.endswith("w1") else 1)
            t = comm.all_gather(t.contiguous(), group="world")[:: len(comm.group_ranks(ESP))]  # every EP rank's
            t = t.reshape(-1, *t.shape[2:])
        out[name.replace("qkv_w", "qkv.weight").replace("qkv_b", "qkv.bias").replace("out_w", "out.weight")
            .replace("out_b", "out.bias").replace("fc1_w", "fc1.weight").replace("fc1_b", "fc1.bias")
            .replace("fc2_w", "fc2.weight").replace("fc2_b", "fc2.bias")] = t.clone()
    return out


def _train(rank, world, runs):
    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer

    out = {}
    for key, opts in runs.items():
        if world % (opts.get("mp", 1) * 1) or key[0] != world:
            continue
        cfg = RunConfig().with_overrides({**BASE, "parallel.nproc": world,
                                          "parallel.strategy_options": opts}).validate()
        tr = Trainer.build(cfg)
        losses = [row["loss"] for row in tr.run()]
        out[key] = dict(losses=losses, params=_full_params(tr))
        tr.close()  # one spawn runs every case: hand the groups on to the next
    return out


RUNS4 = {(4, "base-2-2"): {"mp": 2, "esp": 2, "schedule": "baseline"},
         (4, "s1-2-2"): {"mp": 2, "esp": 2, "schedule": "s1"},
         (4, "s2-2-2"): {"mp": 2, "esp": 2, "schedule": "s2"},
         (4, "s2comb-2-2"): {"mp": 2, "esp": 2, "schedule": "s2", "saa_mode": "combined"},
         (4, "aas-2-1"): {"mp": 2, "esp": 1, "schedule": "s2_aas"},
         (4, "s1-2-4"): {"mp": 2, "esp": 4, "schedule": "s1"},
         (4, "nodedup-2-2"): {"mp": 2, "esp": 2, "schedule": "baseline", "baseline_dedup_grad": False}}
RUNS2 = {(2, "mp1"): {"mp": 1, "esp": 1, "schedule": "s1"}}


def test_every_schedule_trains_the_same_model_as_n_mp_1():
    ref = run_ranks(_train, 2, RUNS2, timeout=240)[0][(2, "mp1")]  # N_DP = 2, as every 4-rank run below
    res = run_ranks(_train, 4, RUNS4, timeout=300)
    for key in RUNS4:
        got = res[0][key]
        same = key[1] != "nodedup-2-2"
        close = all(torch.allclose(got["params"][k], v, rtol=1e-8, atol=1e-10) for k, v in ref["params"].items())
        assert close == same, key
        if same:
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-8, atol=1e-10)
            for r in range(1, 4):  # every rank reassembles the same model
                for k, v in res[r][key]["params"].items():
                    torch.testing.assert_close(v, got["params"][k], rtol=1e-12, atol=1e-12)
    assert ref["losses"][-1] < ref["losses"][0]  # it learns


def _resumable(rank, world, opts, iters, out, resume):
    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer

    over = {**BASE, "parallel.nproc": world, "parallel.strategy_options": opts, "train.iters": iters}
    over.update({"train.resume_from": out} if resume else {"train.checkpoint_every": 3})
    tr = Trainer.build(RunConfig().with_overrides(over).validate())
    tr.out_dir = None if resume else out
    tr.run()
    state = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    adam = {n: tr.update.optimizer.state[p]["exp_avg_sq"].clone() for n, p in tr.model.named_parameters()}
    return dict(losses=[r["loss"] for r in tr.metrics], iters=[r["iter"] for r in tr.metrics], params=state, adam=adam,
                choices=[(layer.schedule, repr(layer.choice)) for layer in tr.model.moe_layers()])


def test_a_parm_run_resumes_bit_for_bit_on_its_layout(tmp_path):
    """Checkpoints of a parm run (each rank's TP and ESP shards with Adam's state) resume the same run
    exactly; an ``auto`` run resumes on the choice it made from timings (not measured again); another
    layout is refused before launch."""
    from moelab.config import ConfigError, RunConfig

    opts = {"mp": 2, "esp": 2, "schedule": "s2"}
    full = run_ranks(_resumable, 4, opts, 6, None, False, timeout=240)
    run_ranks(_resumable, 4, opts, 3, str(tmp_path / "s2"), False, timeout=240)
    assert sorted(p.name for p in (tmp_path / "s2" / "checkpoints" / "step_000003").iterdir()) == \
        ["meta.json", "rank0.pt", "rank1.pt", "rank2.pt", "rank3.pt"]  # no dense.pt: every rank's shards are its own
    resumed = run_ranks(_resumable, 4, opts, 6, str(tmp_path / "s2"), True, timeout=240)
    auto = {**opts, "schedule": "auto"}
    first = run_ranks(_resumable, 4, auto, 3, str(tmp_path / "auto"), False, timeout=240)
    later = run_ranks(_resumable, 4, auto, 4, str(tmp_path / "auto"), True, timeout=240)
    for r in range(4):
        assert later[r]["choices"] == first[r]["choices"] and "fits" in later[r]["choices"][0][1]
        assert resumed[r]["iters"] == [3, 4, 5] and resumed[r]["losses"] == full[r]["losses"][3:]
        for n, p in full[r]["params"].items():
            assert torch.equal(resumed[r]["params"][n], p), (r, n)
            assert torch.equal(resumed[r]["adam"][n], full[r]["adam"][n]), (r, n)
    with pytest.raises(ConfigError, match="holds each rank's own shards"):
        RunConfig().with_overrides({**BASE, "parallel.nproc": 4, "train.iters": 6,
                                    "train.resume_from": str(tmp_path / "s2"),
                                    "parallel.strategy_options": {**opts, "esp": 1}}).validate()


def _ep_checkpoint(rank, world, out):
    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer

    over = {**BASE, "parallel.strategy": "ep", "parallel.nproc": world, "train.iters": 2, "train.checkpoint_every": 2}
    tr = Trainer.build(RunConfig().with_overrides(over).validate())
    tr.out_dir = out
    tr.run()


def _parm_from(rank, world, opts, ckpt):
    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer

    over = {**BASE, "parallel.nproc": world, "parallel.strategy_options": opts, "train.init_from": ckpt}
    return _full_params(Trainer.build(RunConfig().with_overrides(over).validate()))


def test_a_parm_run_starts_from_another_strategys_full_checkpoint(tmp_path):
    """``train.init_from`` of an ``ep`` run: every rank's TP shards and ESP expert slices are cut from the
    checkpoint's full tensors (reassembled: equal entry by entry, gate included); a parm run's own
    checkpoint (per-rank shards, no full model) is refused before launch."""
    from moelab.config import ConfigError, RunConfig
    from moelab.runtime.checkpoint import latest_checkpoint

    run_ranks(_ep_checkpoint, 2, str(tmp_path / "ep"), timeout=120)
    ckpt = latest_checkpoint(tmp_path / "ep")
    dense = torch.load(ckpt / "dense.pt", weights_only=False)["params"]
    experts = {}
    for f in ckpt.glob("rank*.pt"):
        experts.update(torch.load(f, weights_only=False)["experts"])
    got = run_ranks(_parm_from, 4, {"mp": 2, "esp": 2, "schedule": "s1"}, str(tmp_path / "ep"), timeout=120)
    for r in range(4):
        seen = 0
        for name, t in got[r].items():
            if name.endswith(".ffn.wg"):  # the one MoE layer (block 1): layer 0 of the checkpoint
                want = dense[name[:-2] + "gate.wg.weight"]
            elif name.endswith((".ffn.w1", ".ffn.w2")):
                want = torch.stack([experts[(0, e)]["params"][name[-2:]] for e in range(4)])
            else:
                want = dense[name]
            assert torch.equal(t, want), (r, name)
            seen += 1
        assert seen == len(got[r]) and any(n.endswith(".ffn.w1") for n in got[r])
    run_ranks(_resumable, 4, {"mp": 2, "esp": 2, "schedule": "s2"}, 3, str(tmp_path / "parm"), False, timeout=240)
    with pytest.raises(ConfigError, match="holds each rank's own shards"):
        RunConfig().with_overrides({**BASE, "parallel.nproc": 4, "train.init_from": str(tmp_path / "parm"),
                                    "parallel.strategy_options": {"mp": 2, "esp": 2}}).validate()
