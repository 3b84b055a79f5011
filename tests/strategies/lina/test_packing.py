"""Lina's packing controller (spec §2.2 "Expert packing", §5 I2 "a controller switch ≡ none"):
the block ladder, the moves of a halving, the rule, and real runs on 4 gloo ranks whose switches move
parameters and Adam moments so that they train the model a run without switches trains."""
from __future__ import annotations

import pytest
import torch

from moelab.runtime.ranks import run_ranks
from moelab.strategies.lina.options import LinaOptionError, LinaOptions
from moelab.strategies.lina.packing import decide, repack_moves
from moelab.testing import TINY_TRAIN

BASE = {"model.moe.dispatcher": "dense", "model.moe.capacity_factor": 2.0, "train.iters": 5,
        "parallel.strategy": "lina", "parallel.bucket_mb": 0.004}
CTL = {"policy": "lina_full", "pack_controller": True, "pack_start_step": 1, "pack_every": 1, "a2a_chunks": 2,
       "partition_bytes": 1024}


def test_block_ladder_and_groups():
    o = LinaOptions(policy="lina_full", pack_controller=True)
    assert o.q == 1 and o.block_sizes(8, 8) == [8, 4, 2, 1]
    assert o.block_sizes(4, 8) == [4, 2, 1]  # E = 2N: the world block holds 2 experts per rank
    assert o.block_sizes(6, 6) == [6, 3]  # 3 is odd: no further halving
    assert LinaOptions(policy="lina_full").block_sizes(8, 8) == [4]  # static q = 2
    g = o.groups(8, 8)
    assert set(g) == {"lina_ep4", "lina_edp4", "lina_ep2", "lina_edp2", "lina_ep1", "lina_edp1"}
    assert g["lina_ep2"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and g["lina_edp2"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert o.block_groups(8, 8) == ("ep", None)
    with pytest.raises(LinaOptionError, match="pack_controller"):
        LinaOptions.from_dict({"policy": "lina", "pack_controller": True})
    with pytest.raises(LinaOptionError, match="pack_every"):
        LinaOptions.from_dict({"policy": "lina_full", "pack_controller": True, "pack_every": 0})


@pytest.mark.parametrize("N,E,P0,P1", [(8, 8, 8, 4), (8, 8, 4, 2), (8, 8, 2, 1), (4, 8, 4, 2), (4, 4, 2, 1)])
def test_repack_moves_give_each_rank_its_new_experts_from_its_old_block(N, E, P0, P1):
    moves = repack_moves(2, N, E, P0, P1)
    q0, q1 = E // P0, E // P1
    for dst in range(N):
        old = {e for e in range(E) if e // q0 == dst % P0}
        new = set(range((dst % P1) * q1, (dst % P1 + 1) * q1))
        for li in range(2):
            got = {e: s for l, e, s, d in moves if d == dst and l == li}
            assert set(got) == new - old  # exactly what it lacks, nothing it keeps
            for e, s in got.items():
                assert s // P0 == dst // P0 and e // q0 == s % P0  # from the holder in its own old block
    assert repack_moves(1, N, E, P0, P0) == []


def test_rule():
    assert decide(1.0, 2.0, 2, True) == "halve"
    assert decide(2.0, 2.0, 2, True).startswith("freeze: ffn")
    assert decide(1.0, 2.0, None, True) == "freeze: no smaller block"
    assert decide(1.0, 2.0, 2, False) == "freeze: memory"


def _run(rank, world, runs):
    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer

    out = {}
    for key, (opts, extra) in runs.items():
        cfg = RunConfig().with_overrides({**TINY_TRAIN, **BASE, "parallel.nproc": world, **extra,
                                          "parallel.strategy_options": opts}).validate()
        tr = Trainer.build(cfg)
        losses = [row["loss"] for row in tr.run()]
        experts, moments = {}, {}
        for li, layer in enumerate(tr.model.moe_layers()):
            ex = layer.experts
            for s, e in enumerate(ex.experts):
                experts[(li, e)] = torch.cat([p[s].detach().reshape(-1) for p in (ex.w1, ex.b1, ex.w2, ex.b2)]).clone()
                moments[(li, e)] = torch.cat([tr.update.optimizer.state[p]["exp_avg_sq"][s].reshape(-1)
                                              for p in (ex.w1, ex.b1, ex.w2, ex.b2)]).clone()
        dense = torch.cat([p.detach().reshape(-1) for p in tr.model.dense_parameters()]).clone()
        packing = getattr(tr.update, "packing", None)
        out[key] = dict(losses=losses, experts=experts, moments=moments, dense=dense,
                        log=list(packing.log) if packing else None,
                        migrated=sum(r.tags.get("phase") == "migrate" for r in tr.comm.rec.comm),
                        metrics=[m for m in tr.layer_metrics if "pack_decision" in m])
        tr.close()  # the communication thread, then the groups (handed on to the next run)
    return out


def test_controller_halves_the_block_and_trains_the_model_of_a_run_without_switches():
    """4 ranks, E = 4, emulated all-to-all latency so the FFN micro-op is the faster: blocks 4 → 2 → 1 at
    steps 1 and 2 (then frozen: no smaller block), every switch moving parameters and Adam moments. Losses,
    dense and expert parameters and Adam moments equal the plain-EP run's; the copies of an expert are
    identical; every rank logged the same decisions (GShard's random second expert on: its draws do not depend
    on the block). A memory budget below one doubling freezes at once."""
    rnd = {"model.moe.gate": "gshard", "model.moe.random_routing": True}  # draws keyed by the global rank
    emu = {**rnd, "emulation.enabled": True, "emulation.intra_latency_us": 3000.0, "emulation.inter_latency_us": 3000.0}
    runs = {"ref": ({"policy": "ddp_overlap"}, rnd), "ctl": (CTL, emu),
            "mem": ({**CTL, "pack_memory_mb": 1e-4}, emu)}
    res = run_ranks(_run, 4, runs, timeout=300)
    ref = res[0]["ref"]
    ref_experts = {k: v for r in range(4) for k, v in res[r]["ref"]["experts"].items()}
    ref_moments = {k: v for r in range(4) for k, v in res[r]["ref"]["moments"].items()}
    logs = [res[r]["ctl"]["log"] for r in range(4)]
    assert all(log == logs[0] for log in logs)
    assert [(e["iter"], e["block"], e["decision"]) for e in logs[0]] == \
        [(1, 4, "halve"), (2, 2, "halve"), (3, 1, "freeze: no smaller block")]
    assert all(e["t_ffn_s"] < e["t_a2a_s"] for e in logs[0][:2])
    for r in range(4):
        got = res[r]["ctl"]
        assert got["migrated"] == 2  # one all-to-all per switch
        assert ([m["pack_decision"] for m in got["metrics"] if m["layer"] == 0]
                == ["halve", "halve", "freeze: no smaller block"])
        assert len(got["experts"]) == 2 * 4  # block of 1: every rank holds every expert of both layers
        assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-10)
        assert torch.allclose(got["dense"], ref["dense"], rtol=1e-9, atol=1e-12)
        for k, v in got["experts"].items():
            assert torch.allclose(v, ref_experts[k], rtol=1e-9, atol=1e-12), k
            assert torch.allclose(got["moments"][k], ref_moments[k], rtol=1e-8, atol=1e-14), k
            assert torch.equal(v, res[0]["ctl"]["experts"][k])  # the copies are the same tensor, bit for bit
        mem = res[r]["mem"]
        assert [e["decision"] for e in mem["log"]] == ["freeze: memory"] and mem["migrated"] == 0
        assert len(mem["experts"]) == 2 * 1
