"""SAA as the paper's kernel runs it (saa_streams=2): the same bytes on the same links as moelab's phase-by-phase
SAA, the all-to-all's rounds never waiting for the gather's, and each gather round after the all-to-all round
that received its chunk."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from moelab.sim.engine import simulate
from moelab.sim.profiles import get_profile
from moelab.strategies.parm.layout import ParmLayout
from moelab.strategies.parm.plan import Shape
from moelab.strategies.parm.sim_graph import layer_time, parm_layer_graph, sim_curve

BIG = Shape(S=2048, M=256, H=512, k=1, f=1.2)


def _link_bytes(g) -> Counter:
    out = Counter()
    for op in g.ops:
        if op.category == "saa":
            out.update({k: v for k, v in (op.links or {}).items()})
    return out


@pytest.mark.parametrize("mode", ["raw", "combined"])
def test_the_kernel_moves_the_phase_by_phase_bytes(mode):
    prof = get_profile("parm_B").with_nodes(2)
    lay = ParmLayout(8, 2, 2, 4, 4)
    one = parm_layer_graph(prof, lay, BIG, "s2", saa_mode=mode)
    two = parm_layer_graph(prof, lay, BIG, "s2", saa_mode=mode, saa_streams=2)
    assert _link_bytes(one) == _link_bytes(two) and sum(_link_bytes(two).values()) > 0
    # one accounting record per SAA call, as the door records it
    assert sum(1 for op in one.ops if op.comm and op.comm["op"] == "saa") == \
        sum(1 for op in two.ops if op.comm and op.comm["op"] == "saa") == 2


def test_the_all_to_all_never_waits_for_the_gather():
    """The kernel's all-to-all rounds follow each other on their own stream; gather round i waits for all-to-all
    round i - 1. Without fixed costs that is never slower than phase by phase (here, with the NIC the bottleneck,
    a little faster: the gather's rounds hide under the slow cross-node rounds)."""
    prof = get_profile("parm_B").with_nodes(2)
    slow = dataclasses.replace(prof, inter_bw_GBps=prof.inter_bw_GBps / 4)
    lay = ParmLayout(8, 4, 1, 8, 4)
    one, two = (sim_curve(slow, lay, "SAA", [2 ** 22], 0.0, s)[0] for s in (1, 2))
    assert two < one
    g = parm_layer_graph(slow, lay, BIG, "s2", saa_streams=2)
    res = simulate(g)
    saa = [op for op in g.ops if op.category == "saa" and op.links]
    a2a = [op for op in saa if ".a2a#" in op.name and op.meta.get("phase") == "fwd"]
    gat = [op for op in saa if ".gather#" in op.name and op.meta.get("phase") == "fwd"]
    assert len(a2a) == 8 - 1 and len(gat) == 8
    # every all-to-all round depends only on the round before it (or the call's inputs), never on a gather round
    ids = {op.id for op in gat}
    assert not any(set(op.deps) & ids for op in a2a)
    # gather round i (i < P) waits for all-to-all round i - 1
    by_round = {int(op.name.rsplit("#", 1)[1]): op for op in a2a}
    for op in gat:
        i = int(op.name.rsplit("#", 1)[1])
        if 1 < i < 8:
            assert by_round[i - 1].id in op.deps
    assert res.makespan > 0


def test_paper_scale_takes_its_saa_schedule_from_the_assumptions():
    from moelab.papers.kit.assumptions import load_assumptions
    from moelab.papers.parm.paper_scale import _saa_options

    a = load_assumptions("parm")
    for tb in ("A", "B"):
        o = _saa_options((), tb)
        assert o["saa_streams"] == 2 and o["saa_round_s"] == pytest.approx(a.value(f"saa_round_us_{tb}") * 1e-6)
    assert _saa_options((("saa_streams", 1),))["saa_round_s"] is None
    prof = get_profile("parm_B").with_nodes(2)
    lay = ParmLayout(8, 2, 2, 4, 4)
    t1, t2 = (layer_time(prof, lay, BIG, "s2", saa_streams=s)["time_s"] for s in (1, 2))
    assert t1 != t2


def test_the_kernel_pays_one_call_and_a_latency_per_round():
    """With ``round_s`` the call pays one class latency (the host call) and each round ``round_s``: at a tiny size the
    all-to-all chain's P - 1 rounds and the call bound the time from below, and a slower round slows it."""
    prof = get_profile("parm_B").with_nodes(2)
    lay = ParmLayout(8, 2, 1, 8, 4)
    t = {r: sim_curve(prof, lay, "SAA", [8], 1.0, 2, r)[0] for r in (10e-6, 40e-6)}
    call = prof.latency("inter")
    assert t[10e-6] >= call + 7 * 10e-6 and t[40e-6] >= call + 7 * 40e-6
    assert t[40e-6] > t[10e-6]
