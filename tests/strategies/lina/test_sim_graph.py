"""Lina's training graph in the simulator (spec §5.15): bytes conserved across policies, Lina's
backward all-to-all never slower than the baseline's, infinite bandwidth makes the policies equal,
``fixed`` releases buckets only between MoE layers, and the gradient-ready points cover the model."""
from __future__ import annotations

import dataclasses
import functools

import pytest

from moelab.config import RunConfig
from moelab.sim import simulate
from moelab.sim.graphs import dense_param_count, synthetic_loads
from moelab.sim.profiles import get_profile
from moelab.strategies.lina.sim_graph import lina_iteration_graph
from moelab.testing import peak_overlap

POLICIES = ("after_backward", "ddp_overlap", "fixed", "priority", "lina")


def paper_cfg(E=16, layers=12):
    return RunConfig().with_overrides({
        "model.d_model": 512, "model.d_ff": 2048, "model.n_layers": layers, "model.n_heads": 8,
        "model.seq_len": 256, "model.vocab_size": 8192, "model.moe.num_experts": E, "model.moe.top_k": 2,
        "model.moe.dispatcher": "dense", "model.moe.capacity_factor": 1.0, "train.batch_size": 8,
        "parallel.nproc": 16, "parallel.topology.nodes": 4, "parallel.topology.ranks_per_node": 4,
        "parallel.strategy": "lina", "parallel.strategy_options": {"partition_bytes": 4e6},
        "parallel.bucket_mb": 8}).validate()


def run(cfg, profile, policy):
    g = lina_iteration_graph(cfg, profile, synthetic_loads(cfg), policy=policy, elem_bytes=2)
    return g, simulate(g)


def bwd_a2a_time(res):
    df = res.ops_frame()
    return float(df[(df.category == "a2a") & (df.phase == "bwd")].duration.sum())


@pytest.fixture(scope="module")
def results():
    cfg, prof = paper_cfg(), get_profile("lina")
    return cfg, {p: run(cfg, prof, p) for p in POLICIES}


def test_allreduce_bytes_are_the_same_under_every_policy(results):
    cfg, res = results
    for p, (g, _) in res.items():
        b = sum(o.comm["nbytes"] for o in g.ops if o.category == "allreduce")
        assert b == dense_param_count(cfg.model) * 2, p  # fp16


def test_lina_backward_all_to_all_is_faster_where_the_baseline_overlaps_it(results):
    """Here the baseline's all-reduces overlap its backward all-to-alls and Lina's priority takes that away (the
    invariant itself, never slower, is checked on every paper configuration below)."""
    _, res = results
    assert bwd_a2a_time(res["lina"][1]) < bwd_a2a_time(res["ddp_overlap"][1])


# Spec §5.15: "Lina's backward a2a time <= baseline's for every config". The configurations: the paper's, as the
# reproduction prices them (moelab.papers.lina.paper_scale: Table 1's three models x E = 2..16 in PAPER_GRID, on
# the calibrated profile with the fitted interference gamma, one GPU per expert), each of Lina's policies (the
# priority scheduler, + partition, + pipelining, + packing: Fig. 14's ablation) against ddp_overlap.
LINA_POLICIES = ("priority", "lina", "lina_pipe", "lina_full")
# (policy, layers, E) -> Lina's backward all-to-all time over the baseline's where the spec's claim is wrong, and why
# (each cause is shown by the test below it: the same configuration without that cause keeps the invariant)
PACKED_INTRA = ("packing q = 2 moves the all-to-all into one node's 4 ranks, where Table 1's calibration prices the "
                "intra-node link at ~4 GB/s per GPU, barely above a GPU's share of the 100 Gb/s NIC: 3/4 of a rank's "
                "tokens cross that one link, where the baseline's spread over the intra link and the NIC side by side")
CHUNK_LATENCY = ("pipelining cuts each all-to-all into a2a_chunks calls, each paying the call latency, and the "
                 "baseline's all-reduce meets only 1 of the 24 backward all-to-alls here, so priority saves less "
                 "than the added latencies (the layer is still faster: the chunks overlap the experts)")
BWD_A2A_SLOWER = {("lina_pipe", 12, 8): (1.0026, CHUNK_LATENCY), ("lina_pipe", 12, 16): (1.0017, CHUNK_LATENCY),
                  ("lina_full", 12, 8): (1.186, PACKED_INTRA), ("lina_full", 24, 8): (1.159, PACKED_INTRA),
                  ("lina_full", 36, 8): (1.150, PACKED_INTRA)}


def _paper_params():
    from moelab.papers.lina.paper_scale import PAPER_GRID

    for policy in LINA_POLICIES:
        for layers in PAPER_GRID[0]:
            for E in PAPER_GRID[1]:
                r, why = BWD_A2A_SLOWER.get((policy, layers, E), (None, ""))
                marks = () if r is None else pytest.mark.xfail(strict=True, reason=(
                    f"spec §5.15 is wrong here: moelab computes {policy}'s backward all-to-all at {r:.4g}x "
                    f"ddp_overlap's ({1 / r:.3f}x speedup) at {layers} layers, E = {E}, because {why}"))
                yield pytest.param(policy, layers, E, marks=marks, id=f"{policy}-{layers}L-E{E}")


@functools.lru_cache(maxsize=None)
def paper_bwd_a2a(layers: int, E: int, policy: str) -> float:
    """Backward all-to-all seconds of one paper configuration, as paper_scale.training prices it (SIMULATED)."""
    from moelab.papers.lina import paper_scale as ps

    return bwd_a2a_time(ps._simulate(ps.paper_config(layers, E, policy)))


@pytest.mark.parametrize("policy, layers, E", list(_paper_params()))
def test_lina_backward_all_to_all_is_never_slower_than_the_baseline_at_every_paper_configuration(policy, layers, E):
    ratio = paper_bwd_a2a(layers, E, policy) / paper_bwd_a2a(layers, E, "ddp_overlap")
    assert ratio <= 1 + 1e-9, f"{policy} at {layers} layers, E = {E}: {ratio:.4f}x the baseline's"


def _bwd_ratio(layers, E, policy, profile) -> float:
    from moelab.papers.lina import paper_scale as ps

    return (bwd_a2a_time(ps._simulate(ps.paper_config(layers, E, policy), profile=profile))
            / bwd_a2a_time(ps._simulate(ps.paper_config(layers, E, "ddp_overlap"), profile=profile)))


def test_packing_is_slower_at_eight_experts_only_through_the_calibrated_intra_node_link():
    """PACKED_INTRA: lina_full at E = 8 is slower than the baseline on the calibrated profile and far faster where
    the node's link is the lina profile's own (NVLink-class) bandwidth: the link, not the scheduler, decides."""
    from moelab.papers.lina import paper_scale as ps

    cal = ps.calibrated_profile()
    nvlink = dataclasses.replace(cal, intra_bw_GBps=get_profile("lina").intra_bw_GBps)
    assert cal.intra_bw_GBps < 2 * cal.inter_bw_GBps / 4 < nvlink.intra_bw_GBps
    assert _bwd_ratio(12, 8, "lina_full", cal) > 1 > _bwd_ratio(12, 8, "lina_full", nvlink)


def test_pipelining_is_slower_at_twelve_layers_only_through_the_chunks_call_latency():
    """CHUNK_LATENCY: without the per-call latency lina_pipe's backward all-to-alls are not slower than the
    baseline's at 12 layers, E = 8 and 16."""
    from moelab.papers.lina import paper_scale as ps

    cal = ps.calibrated_profile()
    free = dataclasses.replace(cal, intra_latency_us=0.0, inter_latency_us=0.0)
    for E in (8, 16):
        assert _bwd_ratio(12, E, "lina_pipe", cal) > 1 >= _bwd_ratio(12, E, "lina_pipe", free)


def test_micro_ops_and_buckets_have_their_sizes(results):
    _, res = results
    lina = [o.comm["nbytes"] for o in res["lina"][0].ops if o.category == "allreduce"]
    buckets = [o.comm["nbytes"] for o in res["ddp_overlap"][0].ops if o.category == "allreduce"]
    assert max(lina) <= 4e6 and len(lina) > len(buckets) > 1


def test_coalesced_micro_ops_keep_the_bytes_in_fewer_calls(results):
    cfg, res = results
    co = cfg.with_overrides({"parallel.strategy_options": {"partition_bytes": 4e6, "coalesce_bytes": 1e5}})
    g, _ = run(co, get_profile("lina"), "lina")
    got = [o.comm["nbytes"] for o in g.ops if o.category == "allreduce"]
    per_grad = [o.comm["nbytes"] for o in res["lina"][0].ops if o.category == "allreduce"]
    assert sum(got) == sum(per_grad) and max(got) <= 4e6
    assert len(got) < len(per_grad)


def test_fixed_releases_buckets_only_between_moe_layers(results):
    _, res = results
    g, r = res["fixed"]
    df = r.ops_frame()
    between = df[(df.category == "a2a") & (df.phase == "bwd") & df.name.str.contains("dispatch")].end.values
    starts = df[df.category == "allreduce"].start.values
    back_end = df[df.phase == "bwd"].end.max()
    for t in starts:  # every bucket starts at a between-layer point or after the backward
        assert any(abs(t - b) < 1e-12 or t >= b for b in between) or t >= back_end - 1e-12


def test_infinite_bandwidth_makes_the_policies_equal():
    cfg = paper_cfg(E=16, layers=2)
    prof = dataclasses.replace(get_profile("lina"), intra_bw_GBps=1e12, inter_bw_GBps=1e12,
                               intra_latency_us=0.0, inter_latency_us=0.0)
    times = {p: run(cfg, prof, p)[1].makespan for p in POLICIES}
    assert max(times.values()) <= min(times.values()) * (1 + 1e-6), times


def test_pipelined_graph_conserves_bytes_and_is_the_plain_one_at_one_chunk():
    prof = get_profile("lina")
    cfg = paper_cfg(layers=2)

    def a2a_bytes(g):
        return sum(int(o.comm["splits"].sum()) for o in g.ops if o.category == "a2a")

    plain_g, plain = run(cfg, prof, "lina")
    one = cfg.with_overrides({"parallel.strategy_options": {"partition_bytes": 4e6, "a2a_chunks": 1}})
    four = cfg.with_overrides({"parallel.strategy_options": {"partition_bytes": 4e6, "a2a_chunks": 4}})
    g1, r1 = run(one, prof, "lina_pipe")
    g4, r4 = run(four, prof, "lina_pipe")
    assert len(g1.gate_holds) == 2  # one chunk still holds the scheduler over the layer's backward, as the runtime
    g1.gate_holds.clear()
    assert simulate(g1).makespan == pytest.approx(plain.makespan, rel=1e-12)
    assert a2a_bytes(g4) == a2a_bytes(g1) == a2a_bytes(plain_g)
    assert sum(o.category == "a2a" for o in g4.ops) == 4 * sum(o.category == "a2a" for o in g1.ops)


def test_packing_keeps_all_to_alls_inside_blocks_and_adds_the_expert_gradient_sync():
    """q = 2 on 16 ranks, E = 16, 4 MoE layers: blocks of 8 ranks (two nodes), no all-to-all byte crosses a block;
    the copies' expert gradients are all-reduced over groups of 2 (one rank per block); Lina queues them
    as its layer's backward ends (some start during backward, in the gaps between all-to-alls: one chunk
    per all-to-all here, since chunked ones keep the all-to-all stream busy through this backward and the
    call gate holds micro-ops until it ends; outside the MoE layers' backward, which the pipelined path
    holds), a bucketed policy after backward."""
    def graph(policy):
        c = paper_cfg(layers=4).with_overrides({"parallel.strategy_options": {
            "policy": policy, "experts_per_device": 2, "partition_bytes": 4e6, "a2a_chunks": 1}})
        g = lina_iteration_graph(c, get_profile("lina"), synthetic_loads(c), elem_bytes=2)
        df = simulate(g).ops_frame()
        names = {o.name for o in g.ops if o.category == "allreduce" and len(o.comm["group"]) == 2}
        return c, g, df[df.name.isin(names)].start, df[df.phase == "bwd"].end.max()

    cfg, g, starts, bwd_end = graph("lina_full")
    assert (starts < bwd_end).any()
    _, _, bucketed, bwd_end = graph("priority")
    assert len(bucketed) and (bucketed >= bwd_end - 1e-12).all()
    for o in g.ops:
        if o.category == "a2a":
            M = o.comm["splits"]
            assert M[:8, 8:].sum() == 0 and M[8:, :8].sum() == 0
    edp = [o for o in g.ops if o.category == "allreduce" and len(o.comm["group"]) == 2]
    m = cfg.model
    assert sum(o.comm["nbytes"] for o in edp) == 4 * 8 * 2 * (2 * m.d_model * m.d_ff + m.d_ff + m.d_model) * 2


def _a2a_and_allreduce_overlap(res) -> bool:
    df = res.ops_frame()
    ar = df[df.category == "allreduce"]
    a2a = df[(df.category == "a2a") & (df.phase == "bwd")]
    return any(((ar.start < e) & (ar.end > s)).any() for s, e in zip(a2a.start, a2a.end))


@pytest.mark.parametrize("policy", ["ddp_overlap", "lina", "lina_full"])
def test_interference_at_gamma_one_is_fair_sharing_bit_for_bit(policy):
    """The engine's interference path with gamma = 1 gives the same schedule as without it (every op's
    start and end equal), on Lina graphs that overlap all-to-alls and all-reduces (the scheduled
    policies with an all-to-all not waiting for the micro-op in flight: the call gate lets it start beside)."""
    cfg = paper_cfg()
    if policy != "ddp_overlap":
        cfg = cfg.with_overrides({"parallel.strategy_options": {"partition_bytes": 4e6,
                                                                "a2a_waits_for_inflight": False}})
    g = lina_iteration_graph(cfg, get_profile("lina"), synthetic_loads(cfg), policy=policy, elem_bytes=2)
    plain = simulate(g)
    assert _a2a_and_allreduce_overlap(plain)  # the graph exercises the sharing
    g.interfere(("comm", "allreduce"), 1.0)
    same = simulate(g)
    assert (same.start == plain.start).all() and (same.end == plain.end).all()


def test_interference_slows_the_overlapped_backward_all_to_alls_only():
    """gamma > 1 slows the baseline's backward all-to-alls that an all-reduce overlaps, leaves the ones
    alone untouched, and changes nothing where nothing overlaps (after_backward)."""
    cfg, prof = paper_cfg(), get_profile("lina")

    def bwd(policy, gamma):
        res = simulate(lina_iteration_graph(cfg, prof, synthetic_loads(cfg), policy=policy, elem_bytes=2, gamma=gamma))
        df = res.ops_frame()
        return res, df[(df.category == "a2a") & (df.phase == "bwd")].set_index("name").duration

    r1, fair = bwd("ddp_overlap", 1.0)
    r2, slow = bwd("ddp_overlap", 2.0)
    assert (slow >= fair * (1 - 1e-12)).all() and (slow > fair * 1.05).any()
    assert r2.makespan > r1.makespan
    a1, alone1 = bwd("after_backward", 1.0)
    a2, alone2 = bwd("after_backward", 3.0)
    assert a1.makespan == a2.makespan and (alone1 == alone2).all()


def test_gamma_fit_reaches_its_target_median_on_a_small_grid():
    """The fit (regula falsi) lands on the target median of the overlapped ops within its tolerance, and a
    larger gamma gives a larger median (the monotonicity the bracketing relies on)."""
    from moelab.papers.lina import paper_scale as ps

    grid = ((24,), (8,))
    fit = ps.fitted_gamma(grid)
    assert fit["overlapped_ops"] > 0 and fit["reached"] and fit["gamma"] > 1
    alone = ps._alone(*grid)
    meds = [ps._median_overlapped(ps._slowdowns(g, alone))
            for g in (fit["gamma"] - 0.01, fit["gamma"], 2 * fit["gamma"])]
    assert meds[0] < fit["target_median"] <= meds[1] + 1e-9 < meds[2]
    assert fit["median"] == pytest.approx(fit["target_median"], rel=0.02)


def test_calls_beside_backward_pay_the_busy_fixed_costs_after_backward_does_not():
    """A profile with busy fixed costs (calls issued while the ranks compute) lengthens the policies whose
    all-reduces run beside backward, by more for Lina's many micro-ops than for DDP's few buckets, and
    leaves ``after_backward`` (its one call after backward) as with the idle costs."""
    cfg = paper_cfg(layers=4)
    idle = dataclasses.replace(get_profile("lina"), call_overhead_s=1e-4)
    busy = dataclasses.replace(idle, busy_call_overhead_s=2e-3)

    def step(prof, policy):
        return simulate(lina_iteration_graph(cfg, prof, synthetic_loads(cfg), policy=policy, elem_bytes=2)).makespan

    assert step(busy, "after_backward") == step(idle, "after_backward")
    grew = {p: step(busy, p) - step(idle, p) for p in ("ddp_overlap", "lina")}
    assert grew["ddp_overlap"] >= 0 and grew["lina"] > grew["ddp_overlap"]


def test_pipelined_chunks_that_move_beside_expert_compute_pay_the_busy_costs():
    """With four chunks, each layer's dispatches c1..c3 and combines c0..c2 move while experts compute
    (busy fixed costs); the first dispatch and the last combine wait for nothing to compute (idle)."""
    cfg = paper_cfg(layers=2).with_overrides({"parallel.strategy_options": {"partition_bytes": 4e6, "a2a_chunks": 4}})
    prof = dataclasses.replace(get_profile("lina"), call_overhead_s=1e-4, emulated_sync_s=0.0,
                               busy_call_overhead_s=2e-3, busy_emulated_sync_s=0.0)
    g, _ = run(cfg, prof, "lina_pipe")
    cost = {o.name[:-len(".software")]: o.duration for o in g.ops if o.name.endswith(".software")}
    for phase, first, second in (("fwd", "dispatch", "combine"), ("bwd", "combine.bwd", "dispatch.bwd")):
        for i in sorted({int(n.split(".")[0][1:]) for n in cost if n.startswith("L")}):
            got = [cost[f"L{i}.{first}.c{c}"] for c in range(4)], [cost[f"L{i}.{second}.c{c}"] for c in range(4)]
            assert got == ([1e-4, 2e-3, 2e-3, 2e-3], [2e-3, 2e-3, 2e-3, 1e-4]), (phase, i, got)


def test_micro_ops_in_flight_run_on_as_many_streams_and_one_in_flight_is_a_chain():
    """``max_inflight`` k: Lina's micro-ops dealt over k all-reduce streams, unit n after unit n - k; at
    k = 1 one stream and each micro-op after the one before. More in flight never lengthens the
    iteration on a fair-sharing profile with a per-call cost, and here shortens it."""
    prof = dataclasses.replace(get_profile("lina"), call_overhead_s=2e-3)

    def graph(k):
        cfg = paper_cfg(layers=4).with_overrides({"parallel.strategy_options": {"partition_bytes": 4e6,
                                                                                "max_inflight": k}})
        return lina_iteration_graph(cfg, prof, synthetic_loads(cfg), policy="lina", elem_bytes=2)

    spans = {}
    for k in (1, 2, 4):
        g = graph(k)
        grads = [o for o in g.ops if o.category == "allreduce"]
        assert {o.stream for o in grads} == ({"allreduce"} | {f"allreduce.{i}" for i in range(1, k)})
        for n, o in enumerate(grads):
            if n >= k:
                assert grads[n - k].id in o.deps, (k, n)
        res = simulate(g)
        spans[k] = res.makespan
        if k == 1:  # a chain: each starts when the one before has ended
            assert all(res.start[b.id] >= res.end[a.id] - 1e-12 for a, b in zip(grads, grads[1:]))
    assert spans[4] <= spans[2] <= spans[1] and spans[4] < spans[1]


def test_drain_inflight_lifts_the_bound_only_after_backward():
    """``drain_inflight`` k': during backward one micro-op in flight (unit n after unit n - 1), once the
    backward's last gradient is ready up to k' at once; with a per-call cost that shortens the iteration."""
    prof = dataclasses.replace(get_profile("lina"), call_overhead_s=2e-3)

    def run(k2):
        cfg = paper_cfg(layers=4).with_overrides({"parallel.strategy_options": {"partition_bytes": 4e6,
                                                                                "drain_inflight": k2}})
        g = lina_iteration_graph(cfg, prof, synthetic_loads(cfg), policy="lina", elem_bytes=2)
        return g, simulate(g)

    (g1, one), (g4, four) = run(0), run(4)
    assert not g1.any_of and four.makespan < one.makespan
    backward_end = max(four.end[o.id] for o in g4.ops if o.category in ("attention", "expert"))
    grads = [o for o in g4.ops if o.category == "allreduce"]

    def peak(ops):
        return peak_overlap([(four.start[o.id], four.end[o.id]) for o in ops])

    during = [o for o in grads if four.start[o.id] < backward_end - 1e-12]
    assert during and peak(during) == 1
    assert peak(grads) == 4


def test_leader_agreement_prices_one_control_broadcast_before_each_micro_op():
    """``launch_agreement: leader``: each micro-op follows its leader's go, a 1-element broadcast on the
    micro-op's stream and ranks; with a per-call cost the iteration gets longer by those calls."""
    prof = dataclasses.replace(get_profile("lina"), call_overhead_s=2e-3)

    def run(agreement):
        cfg = paper_cfg(layers=4).with_overrides({"parallel.strategy_options": {
            "partition_bytes": 4e6, "launch_agreement": agreement}})
        g = lina_iteration_graph(cfg, prof, synthetic_loads(cfg), policy="lina", elem_bytes=2)
        return g, simulate(g)

    (g0, none), (g1, lead) = run("none"), run("leader")
    assert not [o for o in g0.ops if o.name.endswith(".lead")]
    by_id = {o.id: o for o in g1.ops}
    grads = [o for o in g1.ops if o.category == "allreduce"]
    goes = [o for o in g1.ops if o.name.endswith(".lead")]
    assert len(goes) == len(grads) == len([o for o in g0.ops if o.category == "allreduce"])
    for o in grads:
        (go,) = [by_id[d] for d in o.deps]
        assert go.name == o.name + ".lead" and go.stream == o.stream and go.ranks == o.ranks
        assert lead.start[o.id] >= lead.end[go.id] - 1e-12
    assert lead.makespan > none.makespan


def test_no_micro_op_starts_inside_a_pipelined_layers_backward():
    """``lina_pipe``: from a layer's first backward chunk call to its last one, the runtime's hold keeps
    every micro-op back, the layer's expert backward between them included. Compute slow enough that each
    chunk's call ends before its experts do: without the holds, micro-ops start in those gaps. No hold under
    ``launch_agreement: plan`` or without the combine block, as in the runtime."""
    cfg = paper_cfg(layers=4).with_overrides({"parallel.strategy_options": {"partition_bytes": 4e6, "a2a_chunks": 4}})
    g, _ = run(cfg, dataclasses.replace(get_profile("lina"), call_overhead_s=1e-4, achieved_flops=1e12), "lina_pipe")
    by = {o.name: o for o in g.ops}
    layers = sorted({int(n.split(".")[0][1:]) for n in by if n.startswith("L") and ".combine.bwd.c0" in n})
    grads = [o for o in g.ops if o.category == "allreduce"]

    def inside(res):
        for i in layers:
            a, b = res.start[by[f"L{i}.combine.bwd.c0"].id], res.start[by[f"L{i}.dispatch.bwd.c3"].id]
            assert b > a
            yield from (o.name for o in grads if a - 1e-12 < res.start[o.id] < b - 1e-12)

    assert layers and len(g.gate_holds) == len(layers)
    assert not list(inside(simulate(g)))
    g.gate_holds.clear()
    assert list(inside(simulate(g)))
    for unheld in ({"launch_agreement": "plan"}, {"block_on_combine_backward": False}):
        c = cfg.with_overrides({"parallel.strategy_options": {"partition_bytes": 4e6, "a2a_chunks": 4, **unheld}})
        assert not run(c, get_profile("lina"), "lina_pipe")[0].gate_holds, unheld  # the scheduler holds nothing


def _planned(policy="lina", **extra):
    cfg = paper_cfg(layers=4).with_overrides({"parallel.strategy_options": {
        "partition_bytes": 4e6, "launch_agreement": "plan", **extra}})
    return cfg, get_profile("lina")


@pytest.mark.parametrize("policy, extra", [("lina", {}), ("lina_pipe", {"a2a_chunks": 4})])
def test_a_plan_launches_each_micro_op_in_its_window_and_its_call_waits_for_it(policy, extra):
    """``launch_agreement: plan``: no call gate; a micro-op planned in window w starts once backward call w - 1
    ended (window 0: once its gradient is ready) and ends before call w starts; the ops no window holds start
    after the last backward call; two small all-gathers close the iteration. The steady plan is a fixed point:
    measuring its own timeline plans it again, and it fills at least one window here."""
    from moelab.strategies.lina.priority import plan_windows
    from moelab.strategies.lina.sim_windows import measure, window_of

    cfg, prof = _planned(policy, **extra)
    g = lina_iteration_graph(cfg, prof, synthetic_loads(cfg), policy=policy, elem_bytes=2)
    res, layout, windows = simulate(g), g.meta["window_layout"], g.meta["plan_windows"]
    assert g.call_gate is None and g.meta["plan_converged"] and windows and windows[-1] > 0
    assert plan_windows(*measure(g, res, layout)) == windows
    calls = [c for c, _ in layout.calls]
    assert len(windows) == len(calls) and calls == sorted(calls)
    # pipelined: no window inside a layer's backward (the runtime opens none while a chunk's call is in flight)
    free = measure(g, res, layout)[0]
    assert (len(layout.inner) == len(calls) - 4 if policy == "lina_pipe" else not layout.inner)
    assert all(free[w] == 0 and windows[w] == windows[w - 1] for w in layout.inner)
    heads = {c: g.call_heads[c] for c in calls}
    for n, (ops, _) in enumerate(layout.units):
        w = window_of(windows, n)
        began = min(res.start[h] for x in ops for h in g.call_heads[x])
        if w is None:
            assert began >= res.end[calls[-1]] - 1e-12
            continue
        if w > 0:
            assert began >= res.end[calls[w - 1]] - 1e-12
        assert max(res.end[x] for x in ops) <= min(res.start[h] for h in heads[calls[w]]) + 1e-12
    tail = [o for o in g.ops if o.name.startswith("lina_plan.")]
    assert [o.comm["op"] for o in tail] == ["all_gather", "all_gather"] and res.end[tail[-1].id] == res.makespan


def test_a_plan_opens_no_window_inside_a_pipelined_layers_backward():
    """The runtime waits a pipelined layer's chunk calls after its last chunk and opens no window while a call
    is in flight: with experts slow enough that the comm stream idles between a layer's chunks, those gaps are
    still no windows (zero free time, no op planned there); the gaps between layers are."""
    import dataclasses

    from moelab.strategies.lina.sim_windows import measure

    cfg, prof = _planned("lina_pipe", a2a_chunks=4)
    cfg = cfg.with_overrides({"model.d_ff": 32768})
    g = lina_iteration_graph(cfg, prof, synthetic_loads(cfg), policy="lina_pipe", elem_bytes=2)
    res, layout, windows = simulate(g), g.meta["window_layout"], g.meta["plan_windows"]
    free = measure(g, res, layout)[0]
    idle = measure(g, res, dataclasses.replace(layout, inner=set()))[0]  # the gaps as the comm stream sees them
    assert layout.inner and any(idle[w] > 0 for w in layout.inner)
    assert all(free[w] == 0 and windows[w] == windows[w - 1] for w in layout.inner)
    assert any(free[w] > 0 for w in range(len(free)) if w not in layout.inner)


def test_an_empty_plan_leaves_every_micro_op_to_the_drain_and_costs_the_same_bytes():
    """The runtime's first step (nothing planned): every micro-op starts after backward's last gradient; the
    all-reduce bytes are the unplanned policy's, plus the two small all-gathers."""
    cfg, prof = _planned()
    loads = synthetic_loads(cfg)
    g = lina_iteration_graph(cfg, prof, loads, policy="lina", elem_bytes=2, windows=[])
    res = simulate(g)
    backward_end = max(res.end[o.id] for o in g.ops if o.meta.get("phase") == "bwd")
    grads = [o for o in g.ops if o.category == "allreduce"]
    assert grads and min(res.start[o.id] for o in grads) >= backward_end - 1e-12
    plain = lina_iteration_graph(paper_cfg(layers=4).with_overrides({"parallel.strategy_options": {
        "partition_bytes": 4e6}}), prof, loads, policy="lina", elem_bytes=2)
    assert sum(o.comm["nbytes"] for o in grads) == sum(o.comm["nbytes"] for o in plain.ops if o.category == "allreduce")
