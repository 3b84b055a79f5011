"""Lina's inference cost model (spec §5.15): balanced traces make baseline and Ideal equal and Lina
pay only its phase-2 checks; skewed traces make the baseline slower than Lina; every token's bytes
are on the wire exactly once per all-to-all."""
from __future__ import annotations

import numpy as np
import pytest

from moelab.comm.topology import Topology
from moelab.sim.profiles import get_profile
from moelab.strategies.lina.options import LinaServeOptions
from moelab.strategies.lina.popularity import PathTable, markov_traces
from moelab.strategies.lina.sim_infer import InferShape, plans_for_batch, simulate_serving

N, E, L = 16, 16, 6
SV = LinaServeOptions(path_len=2, max_pack=4, k_est=2, k_cmp=2)
COSTS = {"o_check_s": 1e-3, "o_plan_s": 5e-3}  # round scheduler costs (the simulator's default is none)


def setup(traces, batch=2048):
    table = PathTable.fit(traces, E, SV.path_len)
    src = np.arange(len(traces)) % N
    batches = [np.arange(i, i + batch) for i in range(0, len(traces), batch)]
    return table, src, batches


def run(traces, variants, overheads=None, batch=2048):
    table, src, batches = setup(traces, batch)
    return simulate_serving(traces, src, batches, variants, SV, table, get_profile("lina"), Topology(N, 4),
                            InferShape(), overheads=COSTS if overheads is None else overheads)


def test_balanced_traces_make_baseline_equal_ideal():
    i = np.arange(8192)  # token i on rank i mod N: every rank sends every expert T/(N E) tokens per layer
    t = (i[:, None] // N + np.arange(L)[None, :]) % E
    rows = run(t, ("baseline", "ideal", "lina"))
    by = {v: [r["batch_s"] for r in rows if r["variant"] == v] for v in ("baseline", "ideal", "lina")}
    assert by["baseline"] == pytest.approx(by["ideal"], rel=1e-9)
    assert all(lin >= base - 1e-12 for lin, base in zip(by["lina"], by["baseline"]))
    assert all(r["load_max_over_mean"] == pytest.approx(1.0) for r in rows if r["variant"] != "lina")


def test_skewed_traces_make_lina_faster_than_the_baseline_before_its_overheads():
    """The mechanism: balancing the experts' loads shortens the slowest rank's FFN and the all-to-all;
    with the scheduler's own costs set to zero and 4k tokens per rank (where the FFN, not the launch
    cost, dominates a packed device), Lina is faster than the static placement and slower than Ideal."""
    t = markov_traces(2 * 65536, L, E, order=1, seed=5, sharpness=6.0)
    rows = run(t, ("baseline", "lina", "lina_no_finetune", "ideal"),
               {"o_check_s": 0.0, "o_plan_s": 0.0, "h2d_GBps": 1e12}, batch=65536)
    med = {v: np.median([r["batch_s"] for r in rows if r["variant"] == v]) for v in ("baseline", "lina", "ideal")}
    assert med["ideal"] < med["lina"] < med["baseline"]
    load = {v: np.median([r["load_max_over_mean"] for r in rows if r["variant"] == v])
            for v in ("baseline", "lina", "ideal")}
    # the placement balances, not fully
    assert load["ideal"] == pytest.approx(1.0) and 1.0 < load["lina"] < load["baseline"]
    assert not any(r["replans"] for r in rows if r["variant"] == "lina_no_finetune")


def test_balanced_replicas_leave_the_busiest_device_nearer_the_mean():
    """serve.strategy_options.replica_rounding "balanced" prices the same batches with replica counts chosen for the
    busiest device: from the actual counts (lina_no_estimation) its scheduled layers come near the mean."""
    import dataclasses

    from moelab.strategies.lina.placement import BALANCE_TOL

    t = markov_traces(8192, L, E, order=1, seed=5, sharpness=6.0)
    table, src, batches = setup(t)
    load = {}
    for rounding in ("floor", "balanced"):
        sv = dataclasses.replace(SV, replica_rounding=rounding)
        rows = simulate_serving(t, src, batches, ("lina_no_estimation",), sv, table, get_profile("lina"),
                                Topology(N, 4), InferShape())
        load[rounding] = np.median([r["load_max_over_mean"] for r in rows])
    assert load["balanced"] < min(load["floor"], 1 + 2 * BALANCE_TOL)  # the tolerance, plus whole tokens per replica


def test_every_token_crosses_each_all_to_all_once():
    t = markov_traces(2048, L, E, order=1, seed=2)
    table = PathTable.fit(t, E, SV.path_len)
    src = np.arange(len(t)) % N
    for v in ("baseline", "lina", "lina_no_estimation"):
        for devs, how, replanned, counts, _ in plans_for_batch(t, src, v, SV, table, N, E):
            from moelab.strategies.lina.dispatch import route_table

            assert route_table(counts, devs).sum() == len(t)


def test_phase_one_loads_overlap_the_previous_layer_and_phase_two_swaps_block():
    """Spec §2.4: phase 1 plans and loads layer l's experts while layer l-1 runs (its experts wait for
    the load); without a re-plan nothing is swapped on the critical path; a re-plan's extra experts are."""
    from moelab.sim.engine import simulate as run_graph
    from moelab.strategies.lina.sim_infer import batch_graph, static_loaded

    t = markov_traces(8192, L, E, order=1, seed=5, sharpness=6.0)
    table, src, _ = setup(t)
    static = static_loaded(N, E, L)
    for v in ("lina_no_finetune", "lina"):
        plans = plans_for_batch(t[:4096], src[:4096], v, SV, table, N, E)
        g = batch_graph(plans, get_profile("lina"), Topology(N, 4), InferShape(), {**COSTS, "o_check_s": 0.0},
                        [[set(s) for s in layer] for layer in static])
        res = run_graph(g)
        df = res.ops_frame()
        for j, (devs, how, replanned, counts, early) in enumerate(plans):
            if j < SV.path_len:
                assert early is None and not len(df[(df.layer == j) & (df.name.str.endswith("prefetch"))])
                continue
            plan = df[df.name == f"L{j}.phase1"].sort_values("id")
            pre = df[df.name == f"L{j}.prefetch"].sort_values("id")
            att = df[df.name == f"L{j}.attn"].sort_values("id")
            exp = df[df.name == f"L{j}.experts"].sort_values("id")
            assert len(plan) == len(pre) == N
            assert (plan.start.values < att.start.values).all()  # phase 1 runs during layer j-1
            assert (pre.start.values >= plan.end.values - 1e-15).all() and pre.duration.sum() > 0  # then the load
            assert (exp.start.values >= pre.end.values - 1e-15).all()  # layer j's experts wait for it
            crit = df[(df.layer == j) & (df.name == f"L{j}.phase2+swap")]
            if not replanned:
                assert (crit.duration == 0).all()
            else:
                assert (crit.duration > 0).all()


def test_batch_size_fit_reaches_table_one_all_to_all_per_layer(monkeypatch):
    """fig16s's batch fit: the tokens it picks give the baseline the paper's all-to-all time per MoE layer
    (Table 1, 16 GPUs: 102 ms / 12 layers) within 2 %, in whole served batches (synthetic traces stand in for
    the REAL suite here)."""
    from moelab.papers.kit.compare import paper_value
    from moelab.papers.lina import runs
    from moelab.papers.lina import serving_scale as ps

    traces = markov_traces(4096, 4, 8, order=1, seed=3)
    monkeypatch.setattr(runs, "inference_suite", lambda scale, seed=0: {"traces": traces})
    ps.inference.cache_clear(), ps.fitted_infer_tokens.cache_clear()
    try:
        fit = ps.fitted_infer_tokens("smoke")
        assert fit["target_s"] == pytest.approx(paper_value("lina", "infer_a2a_16gpu_12L") / 1e3 / 12)
        assert fit["a2a_per_layer_s"] == pytest.approx(fit["target_s"], rel=0.02)
        # whole batches of the smoke scale
        assert fit["tokens"] % (8 * 32) == 0 and fit["tokens"] != fit["start_tokens"]
        assert ps.inference("smoke").attrs["batch_tokens"] == fit["tokens"]
    finally:
        ps.inference.cache_clear(), ps.fitted_infer_tokens.cache_clear()


def test_which_layers_get_a_plan_and_from_what():
    """Spec §2.3: lina_no_estimation plans every layer from the actual counts (from layer 1, [R]); lina and
    lina_no_finetune keep the static placement before path_len (no full path yet), and lina plans those from
    the actual counts with serve.strategy_options.first_layers=actual. The simulator and the runtime share the rule."""
    import dataclasses

    t = markov_traces(2048, L, E, order=1, seed=2)
    table = PathTable.fit(t, E, SV.path_len)
    src = np.arange(len(t)) % N
    first = dataclasses.replace(SV, first_layers="actual")
    for v, sv, before in (("lina", SV, "static"), ("lina_no_finetune", SV, "static"),
                          ("lina_no_finetune", first, "static"), ("lina", first, "actual"),
                          ("lina_no_estimation", SV, "actual")):
        hows = [how for _, how, *_ in plans_for_batch(t, src, v, sv, table, N, E)]
        after = "actual" if v == "lina_no_estimation" else "estimate"
        assert hows == [before] * SV.path_len + [after] * (L - SV.path_len), (v, sv.first_layers, hows)


def _records(plans, batch, rnd=0):
    """Layer records as the runtime writes them (lists as JSON) for one batch's plans."""
    import json

    return [{"batch": batch, "round": rnd, "layer": j, "devs": json.dumps(devs), "planned_from": how,
             "replanned": replanned, "counts": json.dumps(counts.tolist()),
             **({"p1_devs": json.dumps(early)} if early is not None else {})}
            for j, (devs, how, replanned, counts, early) in enumerate(plans)]


def test_a_served_runs_records_are_priced_as_the_simulator_prices_its_own_plans():
    """predict_served rebuilds every batch's plans from the REAL run's records (recorded_plans) and prices
    them as simulate_serving prices the same decisions: equal batch times, swaps carried across batches,
    a new round starting again from the static placement."""
    t = markov_traces(4096, L, E, order=1, seed=3, sharpness=6.0)
    table, src, batches = setup(t, 1024)
    topo, prof = Topology(N, 4), get_profile("lina")
    from moelab.strategies.lina.sim_infer import predict_served, recorded_plans

    for v in ("lina", "lina_no_estimation", "baseline"):
        want = [r["batch_s"] for r in simulate_serving(t, src, batches, (v,), SV, table, prof, topo, InferShape(),
                                                        overheads={**COSTS, "o_check_s": 0.0})]
        rows = []
        for rnd in (0, 1):
            for b, sel in enumerate(batches):
                rows += _records(plans_for_batch(t[sel], src[sel], v, SV, table, N, E, 0, b), b, rnd)
        assert [p[:2] for p in recorded_plans(rows)] == [(r, b) for r in (0, 1) for b in range(len(batches))]
        got = predict_served(rows, prof, topo, InferShape(), {**COSTS, "o_check_s": 0.0})
        for rnd in (0, 1):
            assert [got[(rnd, b)] for b in range(len(batches))] == pytest.approx(want, rel=1e-12), v


def test_replayed_latencies_follow_the_batcher_and_the_batch_times():
    """A partial first batch waits for its first request's max_wait, a full one for its last member;
    each batch starts when the one before ends; a faster batch shortens every later request's wait."""
    from moelab.strategies.lina.sim_infer import replay_latencies

    reqs = [{"batch": 0, "arrival_s": 0.0}, {"batch": 0, "arrival_s": 0.001}] + \
        [{"batch": 1, "arrival_s": 0.02 + 0.01 * i} for i in range(4)] + [{"batch": 2, "arrival_s": 0.5}]
    lat = replay_latencies(reqs, {(0, 0): 0.1, (0, 1): 0.2, (0, 2): 0.1}, 4, 0.01)
    assert lat[:2] == pytest.approx([0.11, 0.109])  # ready at 0.0 + 0.01, ends 0.11
    assert lat[2:6] == pytest.approx([0.31 - a for a in (0.02, 0.03, 0.04, 0.05)])  # starts at 0.11, ends 0.31
    assert lat[6] == pytest.approx(0.1)  # the last batch: ready on its arrival at 0.5, the server is free
    fast = replay_latencies(reqs, {(0, 0): 0.05, (0, 1): 0.2, (0, 2): 0.1}, 4, 0.01)
    assert all(f < s for f, s in zip(fast[:6], lat[:6])) and fast[6] == pytest.approx(lat[6])


def test_host_costs_separate_a_cost_per_layer_from_one_per_expert():
    """The serving prediction's host terms, fitted on held-out runs over free links (frames._host_costs):
    batch times made of the simulator's own price plus 2 ms per layer and 0.5 ms per expert on the busiest
    rank give back exactly those two costs when one run holds E/N experts a rank and the other more."""
    import dataclasses

    from moelab.papers.lina.frames import _host_costs
    from moelab.papers.lina.runs import FREE_LINKS
    from moelab.strategies.lina.sim_infer import predict_served, recorded_plans

    t = markov_traces(4096, L, E, order=1, seed=3, sharpness=6.0)
    table, src, batches = setup(t, 1024)
    topo, prof = Topology(N, 4), get_profile("lina")
    free = dataclasses.replace(prof, **FREE_LINKS)
    runs = {}
    for v, rounding in (("baseline", "floor"), ("lina_no_estimation", "balanced")):
        sv = dataclasses.replace(SV, replica_rounding=rounding)
        rows = [r for b, sel in enumerate(batches)
                for r in _records(plans_for_batch(t[sel], src[sel], v, sv, table, N, E, 0, b), b)]
        guess = predict_served(rows, free, topo, InferShape(), {"o_check_s": 0.0, "expert_launch_s": 0.0,
                                                                 "o_plan_s": 1e-3 if v == "baseline" else 3e-3})
        most = {b: sum(max(len(d) for d in p[0]) for p in plans) for _, b, plans in recorded_plans(rows)}
        runs[v] = {"layers": rows, "batches": [{"batch": b, "batch_s": guess[(0, b)] + 2e-3 * L + 5e-4 * most[b]}
                                               for b in range(len(batches))]}
    assert len({sum(max(len(d) for d in p[0]) for p in plans)
                for _, _, plans in recorded_plans(runs["lina_no_estimation"]["layers"])}
               | {L * E // N}) > 1  # the replicated run holds more experts on its busiest rank: the terms separate
    plan_s = {"baseline": 1e-3, "lina_no_estimation": 3e-3}  # each run's blocking plan, priced as it was timed
    assert _host_costs(runs, prof, topo, InferShape(), None, plan_s) == pytest.approx((2e-3, 5e-4), rel=1e-6)


def test_per_layer_times_tile_the_batch_and_keep_every_all_to_all():
    """Figs. 17, 18 read a batch per MoE layer: the layers' times add up to the batch (phase 1 prefetched beside a
    layer is not counted again in the next) and their all-to-alls to the batch's; on skewed traces Lina's
    scheduled layers carry less all-to-all than the baseline's and its static first layers the same."""
    t = markov_traces(2 * 8192, L, E, order=1, seed=5, sharpness=6.0)
    rows = run(t, ("baseline", "lina"), batch=8192)
    for r in rows:
        assert len(r["layer_s"]) == len(r["layer_a2a_s"]) == L and min(r["layer_s"]) > 0
        assert sum(r["layer_s"]) == pytest.approx(r["batch_s"], rel=1e-9)
        assert sum(r["layer_a2a_s"]) == pytest.approx(r["a2a_s"], rel=1e-9)
    base, lina = (np.array([r["layer_a2a_s"] for r in rows if r["variant"] == v]) for v in ("baseline", "lina"))
    assert lina[:, :SV.path_len] == pytest.approx(base[:, :SV.path_len])
    assert (lina[:, SV.path_len:].sum(axis=1) < base[:, SV.path_len:].sum(axis=1)).all()
