"""Parm in the simulator: the layer graph is the plan the runtime executes (bytes per rank = the
door's, which tests/strategies/parm/test_comm.py ties to real records), SAA is priced as its P phases, and the
link model decides what overlaps."""
from __future__ import annotations

import dataclasses

import pytest

from moelab.comm.bytes import peer_bytes
from moelab.sim.profiles import get_profile
from moelab.strategies.parm.layout import ParmLayout
from moelab.strategies.parm.plan import Shape, rank_calls, steps
from moelab.strategies.parm.sim_graph import layer_time, parm_layer_graph

SHAPE = Shape(S=64, M=32, H=64, k=1, f=1.2)


def _graph_calls(g, rank):
    out = []
    for op in g.ops:
        c = op.comm
        if c is None or rank not in c["group"]:
            continue
        args = {k: v for k, v in c.items() if k not in ("op", "group")}
        if "splits" in args:
            args["splits"] = [int(v) for v in args["splits"][c["group"].index(rank)]]
        sent = peer_bytes(c["op"], c["group"], rank, **args)
        out.append((c["op"], op.meta.get("phase"), sent))
    return out


@pytest.mark.parametrize("P, g, cells", [(4, 2, [(2, 2), (1, 2), (2, 1)]), (8, 4, [(2, 2), (2, 4), (4, 2), (4, 4)])])
def test_simulated_bytes_are_the_plans(P, g, cells):
    prof = dataclasses.replace(get_profile("parm_B"), nodes=P // g, gpus_per_node=g)
    for n_mp, n_esp in cells:
        lay = ParmLayout(P, n_mp, n_esp, P // n_esp, g)
        for sched, variant, mode in (("baseline", "fig3a", "raw"), ("baseline", "ds081", "raw"), ("s1", "fig3a", "raw"),
                                     ("s2", "fig3a", "raw"), ("s2_aas", "fig3a", "raw"), ("s2", "fig3a", "combined")):
            graph = parm_layer_graph(prof, lay, SHAPE, sched, variant, saa_mode=mode)
            plan = steps(lay, SHAPE, sched, variant, saa_mode=mode)
            for r in range(P):
                want = [(op, ph, sent) for op, _, ph, sent in rank_calls(lay, r, plan)]
                assert _graph_calls(graph, r) == want, (n_mp, n_esp, sched, variant, mode, r)


def test_saa_is_priced_as_phases_and_overlap_is_earned():
    prof = get_profile("parm_B").with_nodes(2)
    lay = ParmLayout(8, 2, 2, 4, 4)
    g = parm_layer_graph(prof, lay, SHAPE, "s2")
    phases = [op for op in g.ops if op.category == "saa"]
    assert len(phases) == 2 * 8  # forward and backward SAA, P phases each
    # combined: the MP peers exchange N_ESP x fewer gathered chunks, so the intra-node gather halves cost less
    big = Shape(S=2048, M=256, H=512, k=1, f=1.2)
    assert layer_time(prof, lay, big, "s2", saa_mode="combined")["time_s"] < layer_time(prof, lay, big, "s2")["time_s"]
    # a slower intra-node link slows the intra-node parts (SAA's gather half, intra all-to-all traffic)
    slow = dataclasses.replace(prof, intra_bw_GBps=prof.intra_bw_GBps / 50)
    assert layer_time(slow, lay, big, "s2")["time_s"] > 1.5 * layer_time(prof, lay, big, "s2")["time_s"]
    r = layer_time(prof, lay, big, "baseline")
    assert 0 < r["comm_share"] < 1 and r["time_s"] > 0


def test_tp_iteration_has_two_mp_allreduces_per_block_per_pass():
    from moelab.strategies.parm.sim_graph import model_steps, parm_model_graph

    for n_mp in (1, 2, 4):
        lay = ParmLayout(8, n_mp, 2, 4, 4)
        plan = model_steps(lay, SHAPE, n_layers=4, seq_len=16, vocab=100, d_ff=64, schedule="s1")
        tp = [s for s in plan if s.name == "tp_allreduce"]
        # g forward after attention and after each dense FFN (2 per block), f backward (the same): 4 blocks
        want = 0 if n_mp == 1 else 2 * (4 + 2)  # attention in all 4 blocks, dense FFN in 2 (MoE every other)
        assert len(tp) == want and all(s.group == "mp" for s in tp)
        assert sum(1 for s in plan if s.name == "dense_grad_allreduce") == 1
        attn = [s.flops for s in plan if s.name == "attention" and s.phase == "fwd"]
        assert len(attn) == 4 and len(set(attn)) == 1
    t1 = simulate_makespan(parm_model_graph(get_profile("parm_A"), ParmLayout(8, 2, 2, 4, 8), SHAPE, n_layers=2,
                                            seq_len=16, vocab=100, d_ff=64, schedule="s1"))
    assert t1 > 0


def simulate_makespan(graph):
    from moelab.sim import simulate

    return simulate(graph).makespan


def test_iteration_bytes_equal_the_real_runs():
    """I6 at the iteration level: real training iterations of the tiny MoE-BERT through the trainer (TP
    all-reduces, the MoE layer's schedule, the dense-DP and gate all-reduces of the update) record, per rank,
    op and link class, exactly the bytes the strategy's iteration graph gives: every schedule, P = 4 and 8."""
    import warnings

    from moelab.config import RunConfig
    from moelab.measure.local import machine_profile
    from moelab.measure.realruns import run_real_many
    from moelab.measure.validate import BytesMismatchWarning, compare, simulate_real

    base = {"model.arch": "bert", "model.d_model": 16, "model.d_ff": 32, "model.n_layers": 2, "model.n_heads": 4,
            "model.seq_len": 8, "model.vocab_size": 64, "model.moe.num_experts": 4, "model.moe.top_k": 1,
            "model.moe.gate": "switch", "model.moe.capacity_factor": 1.5, "model.moe.dispatcher": "dense",
            "train.iters": 1, "train.batch_size": 2, "train.trace": False, "parallel.strategy": "parm"}
    cal = {"nproc": 2, "gemm_flops": 1e9, "collectives": {op: {"alpha": 1e-4, "beta": 1e-9}
                                                          for op in ("all_to_all", "all_reduce", "all_gather")}}
    cells = {4: [{"schedule": "baseline", "mp": 2, "esp": 2}, {"schedule": "baseline", "mp": 2, "esp": 2,
                                                               "baseline_variant": "ds081"},
                 {"schedule": "s1", "mp": 4, "esp": 1}, {"schedule": "s2", "mp": 2, "esp": 2},
                 {"schedule": "s2", "mp": 2, "esp": 2, "saa_mode": "combined"},
                 {"schedule": "s2_aas", "mp": 1, "esp": 2}],
             8: [{"schedule": "s2", "mp": 4, "esp": 2}, {"schedule": "s1", "mp": 2, "esp": 4}]}
    for P, opts in cells.items():
        cfgs = [RunConfig().with_overrides({**base, "parallel.nproc": P, "model.moe.num_experts": 8 if P == 8 else 4,
                                            "parallel.strategy_options": o}).validate() for o in opts]
        for cfg, o, real in zip(cfgs, opts, run_real_many(cfgs, P, timeout=240)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", BytesMismatchWarning)
                c = compare(real, simulate_real(cfg, real.loads, machine_profile(cfg, cal, compute="gemm"),
                                                plans=real.graph_plans()), warmup=0, names=[str(o)])
            assert c.metrics["bytes_exact"], (P, o, c.mismatches)
            ops = set(real.comm["op"])
            assert {"all_reduce", "all_to_all"} <= ops and ("saa" in ops) == (o["schedule"] == "s2" and o["mp"] > 1)


def test_saa_phase_alpha_scales_only_saas_phase_fixed_costs():
    """The ``saa_phase_alpha`` assumption: each of SAA's P phases pays that share of its class latency; the
    all-to-all then all-gather it is compared with (S2-AAS) and the other schedules do not move."""
    from moelab.strategies.parm.sim_graph import sim_curve

    prof = get_profile("parm_A")
    lay = ParmLayout(8, 2, 1, 8, 8)
    lat = prof.latency("intra")
    full, none = (sim_curve(prof, lay, "SAA", [2 ** 12], a)[0] for a in (1.0, 0.0))
    assert full - none == pytest.approx(8 * lat, rel=1e-9)  # P = 8 phases, one latency each
    for sched in ("baseline", "s1", "s2_aas"):
        assert layer_time(prof, lay, SHAPE, sched, saa_phase_alpha=0.0)["time_s"] == \
            layer_time(prof, lay, SHAPE, sched)["time_s"]
    s2, s2_cheap = (layer_time(prof, lay, SHAPE, "s2", saa_phase_alpha=a)["time_s"] for a in (1.0, 0.5))
    assert s2 - s2_cheap == pytest.approx(2 * 8 * lat * 0.5, rel=1e-6)  # forward and backward SAA
