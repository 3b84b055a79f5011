"""Event engine refinements: stream priority on shared links, per-flow limits (a shared CPU pool)."""
import pytest

from moelab.sim import OpGraph, simulate

GB = 1e9
LINK = ("nic_out", 0)


def _two_flows(priority=None, b_delay=0.0):
    g = OpGraph(2, {LINK: GB}, stream_priority=priority)
    a = g.add("allreduce", 0, stream="grad", links={LINK: 2 * GB})
    w = g.compute(1, "wait", b_delay)
    b = g.add("a2a", 1, stream="a2a", links={LINK: GB}, deps=(w,))
    return simulate(g), a, b


def test_equal_priority_shares_fairly():
    r, a, b = _two_flows()
    assert r.end[b] == pytest.approx(2.0) and r.end[a] == pytest.approx(3.0)


def test_higher_priority_stream_wins_the_link():
    """Lina: the all-to-all preempts the gradient all-reduce it shares a link with."""
    r, a, b = _two_flows({"a2a": 1})
    assert r.end[b] == pytest.approx(1.0)  # alone on the link, as if the all-reduce were not there
    assert r.end[a] == pytest.approx(3.0)  # waited 1 s, then its 2 s alone
    # arriving late, it preempts a flow already running: a has moved 0.5 GB when b arrives
    r, a, b = _two_flows({"a2a": 1}, b_delay=0.5)
    assert r.end[b] == pytest.approx(1.5) and r.end[a] == pytest.approx(3.0)
    # the other way round: the all-reduce first, the all-to-all waits
    r, a, b = _two_flows({"grad": 1})
    assert r.end[a] == pytest.approx(2.0) and r.end[b] == pytest.approx(3.0)


def test_a_started_nonpreemptive_flow_keeps_its_share():
    """A whole bucket (or one micro-op) in flight is not stopped by an arriving all-to-all; one that
    has not started yet waits for it."""
    def run(b_delay, a_delay=0.0):
        g = OpGraph(2, {LINK: GB}, stream_priority={"a2a": 1})
        g.nonpreemptive.add("grad")
        wa = g.compute(0, "wait", a_delay)
        a = g.add("allreduce", 0, stream="grad", links={LINK: 2 * GB}, deps=(wa,))
        w = g.compute(1, "wait", b_delay)
        b = g.add("a2a", 1, stream="a2a", links={LINK: GB}, deps=(w,))
        return simulate(g), a, b

    r, a, b = run(b_delay=0.5)  # a moved 0.5 GB alone, then both share: b needs 2 s at half rate
    assert r.end[b] == pytest.approx(2.5) and r.end[a] == pytest.approx(3.0)
    r, a, b = run(b_delay=0.0, a_delay=0.5)  # b first: a waits until b is gone
    assert r.end[b] == pytest.approx(1.0) and r.end[a] == pytest.approx(3.0)


def test_the_call_gate_serializes_calls_per_rank_on_links_they_do_not_share():
    """Lina's scheduler decides per rank and call, not per link: a micro-op over ranks {0, 1} and an
    all-to-all of rank 1 on separate links. Gated, the all-to-all arriving at 0.5 s waits for the micro-op
    (non-preemptive) and a micro-op ready while an all-to-all waits or runs on one of its ranks is held;
    without ``high_waits`` the all-to-all starts beside it; ungated, both run at once."""
    links = {("a", 0): GB, ("b", 1): GB}

    def run(gate, ar_delay=0.0, a2a_delay=0.5):
        g = OpGraph(2, links)
        g.call_gate = gate
        w0, w1 = g.compute(0, "wait", ar_delay), g.compute(1, "wait", a2a_delay)
        ar = g.add("micro-op", (0, 1), stream="grad", links={("a", 0): GB}, deps=(w0,))
        a2a = g.add("a2a", 1, stream="a2a", links={("b", 1): GB}, deps=(w1,))
        return simulate(g), ar, a2a

    gate = ({"a2a"}, {"grad"}, True)
    r, ar, a2a = run(None)
    assert r.end[ar] == pytest.approx(1.0) and r.start[a2a] == pytest.approx(0.5)
    r, ar, a2a = run(gate)  # the all-to-all waits for the micro-op in flight
    assert r.end[ar] == pytest.approx(1.0) and r.start[a2a] == pytest.approx(1.0) and r.end[a2a] == pytest.approx(2.0)
    r, ar, a2a = run(({"a2a"}, {"grad"}, False))  # no wait: beside it
    assert r.start[a2a] == pytest.approx(0.5) and r.end[a2a] == pytest.approx(1.5)
    r, ar, a2a = run(gate, ar_delay=0.75)  # the all-to-all runs from 0.5 s: the micro-op is held until 1.5 s
    assert r.start[ar] == pytest.approx(1.5) and r.end[ar] == pytest.approx(2.5)
    r, ar, a2a = run(gate, ar_delay=0.5)  # both ready at 0.5 s: the all-to-all first
    assert r.start[a2a] == pytest.approx(0.5) and r.start[ar] == pytest.approx(1.5)


def test_three_levels_a_pinned_low_flow_shares_with_the_top_and_the_middle_waits():
    """On one link: a started non-preemptive low flow counts beside the top level (it is below the
    top, so only the pinned count puts it there); the middle level waits for both."""
    g = OpGraph(3, {LINK: GB}, stream_priority={"grad": 0, "mid": 1, "a2a": 2})
    g.nonpreemptive.add("grad")
    a = g.add("allreduce", 0, stream="grad", links={LINK: GB})
    w1, w2 = g.compute(1, "wait", 0.5), g.compute(2, "wait", 0.5)
    m = g.add("mid", 1, stream="mid", links={LINK: GB}, deps=(w1,))
    b = g.add("a2a", 2, stream="a2a", links={LINK: 0.5 * GB}, deps=(w2,))
    r = simulate(g)
    # from 0.5 s: a (0.5 GB left) and b (0.5 GB) at half rate each, m stopped; then m alone
    assert r.end[a] == pytest.approx(1.5) and r.end[b] == pytest.approx(1.5)
    assert r.end[m] == pytest.approx(2.5)


def test_a_flow_is_rated_by_its_most_crowded_link():
    """A multi-link flow (an all-to-all) moves at its smallest share: two flows meet on one of its
    three links only."""
    links = {("intra_out", 0): GB, ("intra_out", 1): GB, ("nic_out", 0): GB}
    g = OpGraph(2, links)
    a = g.add("a2a", (0, 1), links={("intra_out", 0): GB, ("intra_out", 1): GB, ("nic_out", 0): GB})
    b = g.add("other", 1, stream="x", links={("nic_out", 0): GB})
    r = simulate(g)
    assert r.end[a] == pytest.approx(2.0) and r.end[b] == pytest.approx(2.0)


def test_priority_only_acts_on_shared_links():
    g = OpGraph(2, {LINK: GB, ("nic_out", 1): GB}, stream_priority={"a2a": 1})
    a = g.add("allreduce", 0, stream="grad", links={LINK: GB})
    b = g.add("a2a", 1, stream="a2a", links={("nic_out", 1): GB})
    r = simulate(g)
    assert r.end[a] == pytest.approx(1.0) and r.end[b] == pytest.approx(1.0)


@pytest.mark.parametrize("ranks, cores, want", [(1, 2, 1.0), (2, 2, 1.0), (4, 2, 2.0), (3, 2, 1.5)])
def test_cpu_pool_slows_concurrent_compute_by_ranks_over_cores(ranks, cores, want):
    """A pool of C cores (capacity C, at most 1 per flow): R ranks computing 1 s each take max(1, R/C) s."""
    pool = ("cpu", 0)
    g = OpGraph(ranks, {pool: cores}, flow_limits={pool: 1.0})
    for r in range(ranks):
        g.compute(r, "work", 0.0, links={pool: 1.0})
    assert simulate(g).makespan == pytest.approx(want)


def test_cpu_pool_gives_idle_cores_to_the_ranks_still_computing():
    """4 ranks on 2 cores, one with 3x the work: the others finish at 2 s (1 s of work at half speed);
    then the long one (1 of its 3 s done) has a core of its own and runs its last 2 s at full speed."""
    pool = ("cpu", 0)
    g = OpGraph(4, {pool: 2.0}, flow_limits={pool: 1.0})
    ids = [g.compute(r, "work", 0.0, links={pool: 3.0 if r == 0 else 1.0}) for r in range(4)]
    r = simulate(g)
    assert [r.end[i] for i in ids[1:]] == pytest.approx([2.0] * 3)
    assert r.end[ids[0]] == pytest.approx(2.0 + 2.0)


def test_moe_layer_times_span_each_layers_non_attention_ops():
    from moelab.config import RunConfig
    from moelab.sim.engine import simulate
    from moelab.sim.graphs import iteration_graph, synthetic_loads
    from moelab.sim.profiles import get_profile

    cfg = RunConfig().with_overrides({"parallel.nproc": 4, "model.n_layers": 2, "model.moe.num_experts": 4})
    prof = get_profile("hecate_A")
    res = simulate(iteration_graph(cfg, prof, synthetic_loads(cfg, seed=1)))
    t = res.moe_layer_times([0, 1])
    assert t.shape == (2,) and (t > 0).all() and t.sum() < res.makespan
    ops = res.ops_frame()
    o = ops[(ops.layer == 0) & (ops.phase == "fwd") & ~ops.category.isin(["attention", "ffn", "head"])]
    assert t[0] >= float(o.end.max() - o.start.min())  # fwd span is part of it; bwd adds its own
    fwd, bwd = res.moe_layer_times([0, 1], phases=("fwd",)), res.moe_layer_times([0, 1], phases=("bwd",))
    assert fwd[0] == pytest.approx(float(o.end.max() - o.start.min())) and fwd + bwd == pytest.approx(t)


def test_compute_busy_of_the_run_and_inside_windows():
    """Rank 0 computes 1 s of a 2 s all-to-all on another stream, then 1 s alone; rank 1 only moves bytes."""
    g = OpGraph(2, {LINK: GB})
    a = g.add("a2a", (0, 1), stream="comm", links={LINK: 2 * GB}, category="a2a")
    g.compute(0, "ffn", 1.0)
    g.compute(0, "after", 1.0, deps=(a,))
    r = simulate(g)
    assert r.makespan == pytest.approx(3.0)
    assert r.compute_busy().tolist() == pytest.approx([2 / 3, 0.0])
    assert r.compute_busy("a2a").tolist() == pytest.approx([0.5, 0.0])  # Lina's pipelining efficiency
    assert r.compute_busy([(0.5, 2.5)]).tolist() == pytest.approx([1.0 / 2, 0.0])  # 0.5-1 and 2-2.5 busy


def test_union_seconds_counts_overlaps_once():
    from moelab.sim.result import union_seconds

    assert union_seconds([0.0, 1.0, 5.0, 5.5], [2.0, 3.0, 6.0, 5.7]) == pytest.approx(4.0)
    assert union_seconds([], []) == 0 and union_seconds([1.0], [1.0]) == 0


def test_interference_slows_both_streams_by_gamma_while_both_move():
    """Lina's gamma: an all-to-all and an all-reduce on one link each move at capacity/(2 gamma)."""
    def run(gamma, priority=None, b_delay=0.0, streams=("grad", "a2a")):
        g = OpGraph(2, {LINK: GB}, stream_priority=priority)
        a = g.add("allreduce", 0, stream="grad", links={LINK: 2 * GB})
        w = g.compute(1, "wait", b_delay)
        b = g.add("a2a", 1, stream="a2a", links={LINK: GB}, deps=(w,))
        g.interfere(streams, gamma)
        return simulate(g), a, b

    r, a, b = run(1.0)  # gamma 1 is fair sharing, as without interference
    assert r.end[b] == pytest.approx(2.0) and r.end[a] == pytest.approx(3.0)
    r, a, b = run(2.0)  # both at GB/4 until b is done (4 s), then a's last GB alone
    assert r.end[b] == pytest.approx(4.0) and r.end[a] == pytest.approx(5.0)
    r, a, b = run(2.0, b_delay=1.0)  # a alone for 1 s (1 GB), then both at GB/4: 4 s more for each
    assert r.end[b] == pytest.approx(5.0) and r.end[a] == pytest.approx(5.0)
    r, a, b = run(2.0, priority={"a2a": 1})  # a preempted does not move, so it does not interfere
    assert r.end[b] == pytest.approx(1.0) and r.end[a] == pytest.approx(3.0)
    r, a, b = run(2.0, streams=("grad", "other"))  # a2a not an interfering stream: fair sharing
    assert r.end[b] == pytest.approx(2.0) and r.end[a] == pytest.approx(3.0)
    r, a, b = run(lambda o: 3.0 if o.stream == "a2a" else 1.0)  # per op: b at GB/6, a at GB/2 ...
    assert r.end[a] == pytest.approx(4.0)  # ... until a's 2 GB are done; then b's last third alone
    assert r.end[b] == pytest.approx(4.0 + 1 / 3)


def test_interference_with_a_pinned_flow_and_within_one_stream():
    """A started non-preemptive flow moves beside the top level, so the two interfere; two flows of one
    stream only share fairly."""
    g = OpGraph(2, {LINK: GB}, stream_priority={"a2a": 1})
    g.nonpreemptive.add("grad")
    a = g.add("allreduce", 0, stream="grad", links={LINK: 2 * GB})
    w = g.compute(1, "wait", 0.5)
    b = g.add("a2a", 1, stream="a2a", links={LINK: GB}, deps=(w,))
    g.interfere(("grad", "a2a"), 2.0)
    r = simulate(g)  # a: 0.5 GB alone; then both at GB/4: b done at 4.5 s, a has 1.5 - 1 = 0.5 GB left
    assert r.end[b] == pytest.approx(4.5) and r.end[a] == pytest.approx(5.0)
    g = OpGraph(2, {LINK: GB})
    a = g.add("x", 0, stream="grad", links={LINK: GB})
    b = g.add("y", 1, stream="grad", links={LINK: GB})
    g.interfere(("grad", "a2a"), 2.0)
    r = simulate(g)
    assert r.end[a] == pytest.approx(2.0) and r.end[b] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="gamma"):
        g.interfere(("grad", "a2a"), 0.5)
    with pytest.raises(ValueError, match="two streams"):
        g.interfere(("grad",), 2.0)


def test_an_interference_class_of_streams_does_not_interfere_inside():
    """``("a2a", ("grad", "grad.1"))``: the two all-reduce streams share a link fairly with each other and
    each interferes with the all-to-all's, as one stream would."""
    def run(classes, third="grad.1"):
        g = OpGraph(3, {LINK: GB})
        ops = [g.add("x", 0, stream="grad", links={LINK: GB}), g.add("y", 1, stream=third, links={LINK: GB})]
        g.interfere(classes, 2.0)
        return simulate(g), ops

    r, (a, b) = run(("a2a", ("grad", "grad.1")))  # one class: fair sharing, 2 s each
    assert r.end[a] == pytest.approx(2.0) and r.end[b] == pytest.approx(2.0)
    r, (a, b) = run(("a2a", "grad", "grad.1"))  # separate streams: they interfere, GB/4 each
    assert r.end[a] == pytest.approx(4.0) and r.end[b] == pytest.approx(4.0)
    r, (a, b) = run(("grad.1", ("grad", "x")))  # against another class: they interfere
    assert r.end[a] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="two interference classes"):
        OpGraph(2).interfere(("a2a", ("grad", "a2a")), 2.0)


# ---- fixed software costs of a call: before its links (hardware) or beside them (EMULATED) ----------
def _two_phase_call(**graph):
    from moelab.comm.costs import Demand

    g = OpGraph(2, {"L": 1.0})
    for k, v in graph.items():
        setattr(g, k, v)
    phases = [Demand(0.1, {"L": 1.0}), Demand(0.1, {"L": 1.0})]  # 1.1 s each alone
    return g, phases


def test_a_call_pays_its_fixed_cost_once_before_its_links():
    g, phases = _two_phase_call(call_overhead_s=0.5, phase_overhead_s=0.3)
    g.transfer("a", [0, 1], phases)
    assert simulate(g).makespan == pytest.approx(2.2 + 0.5)


def test_a_phased_call_pays_the_phase_cost_per_phase():
    g, phases = _two_phase_call(call_overhead_s=0.5, phase_overhead_s=0.3)
    g.transfer("a", [0, 1], phases, phased=True)
    assert simulate(g).makespan == pytest.approx(2.2 + 2 * 0.3)
    g, phases = _two_phase_call(call_overhead_s=0.5)  # no phase cost declared: the call's, once
    g.transfer("a", [0, 1], phases, phased=True)
    assert simulate(g).makespan == pytest.approx(2.2 + 0.5)


@pytest.mark.parametrize("fixed, expected", [(0.5, 2.2), (3.0, 3.0)])
def test_emulated_fixed_costs_run_beside_the_links_then_sync(fixed, expected):
    g, phases = _two_phase_call(call_overhead_s=fixed, emulated_sync_s=0.25)
    last = g.transfer("a", [0, 1], phases)
    g.compute(0, "after", 1.0, deps=(last,))
    res = simulate(g)
    assert res.makespan == pytest.approx(expected + 0.25 + 1.0)  # the longer of the two, the sync, then what follows
    assert res.breakdown("kind")["comm"] == pytest.approx(expected + 0.25)


@pytest.mark.parametrize("sync", [None, 0.25])
def test_a_call_beside_compute_pays_the_busy_fixed_costs_where_measured(sync):
    g, phases = _two_phase_call(call_overhead_s=0.5, emulated_sync_s=sync)
    g.transfer("a", [0, 1], phases, beside_compute=True)  # no busy costs measured: as any call
    plain = simulate(g).makespan
    g, phases = _two_phase_call(call_overhead_s=0.5, emulated_sync_s=sync, busy_fixed=(3.0, 0.75))
    g.transfer("a", [0, 1], phases)  # not beside compute: the idle costs
    assert simulate(g).makespan == pytest.approx(plain)
    g, phases = _two_phase_call(call_overhead_s=0.5, emulated_sync_s=sync, busy_fixed=(3.0, 0.75))
    g.transfer("a", [0, 1], phases, beside_compute=True)
    expected = 2.2 + 3.0 if sync is None else max(2.2, 3.0) + 0.75  # before the links, or beside them then the sync
    assert plain == pytest.approx(2.7 if sync is None else 2.2 + 0.25)
    assert simulate(g).makespan == pytest.approx(expected)


def _pooled_call(n=4, cores=2.0, cpb=0.0):
    from moelab.comm.costs import Demand

    g = OpGraph(n, {"L": 1.0})
    g.share_cores(cores)
    g.call_overhead_s, g.emulated_sync_s = 2.0, 0.5
    g.software_cpu_share, g.cpu_s_per_byte = min(1.0, cores / n), cpb
    return g, [Demand(0.0, {"L": 1e-9})]  # links that take no time: the fixed costs alone


def test_software_on_cores_reproduces_the_held_out_cost_on_idle_ranks_and_shares_the_cores_when_busy():
    """The held-out cost (every rank calling at once on the pool) is what a call costs on idle ranks; with
    every rank computing beside it, call and compute share the cores: the call stretches, the compute is
    delayed by the call's CPU, the total CPU is conserved; each byte moved adds its CPU."""
    g, d = _pooled_call()
    g.transfer("a", range(4), d)
    assert simulate(g).makespan == pytest.approx(2.0 + 0.5)
    g, d = _pooled_call()
    g.transfer("a", range(4), d, beside_compute=True)
    for r in range(4):
        g.compute(r, f"c{r}", 1.0)  # 1 s of one core on each rank: 2 s of the pool
    res = simulate(g)
    cpu = 4 * (2.0 + 0.5) * 0.5 + 4 * 1.0  # the calls' CPU (share 1/2 of each cost) and the compute's
    assert res.makespan == pytest.approx(cpu / 2)  # the pool never idles: everything in 4 s
    assert res.makespan > 2.0 + 0.5 and res.makespan > 2.0  # both slower than alone
    g.busy_fixed = (30.0, 30.0)  # the pool prices a busy host: measured busy costs do not apply on top
    assert simulate(g).makespan == pytest.approx(res.makespan)
    g, d = _pooled_call(cpb=1e-3)
    g.transfer("a", range(4), d, comm={"op": "all_reduce", "group": list(range(4)), "nbytes": 1000})
    moved = 2 * 2 * 3 / 4 * 1000  # ring all-reduce: 2(n-1)/n of the tensor sent, as much received
    assert simulate(g).makespan == pytest.approx(2.0 + moved * 1e-3 / 0.5 + 0.5)  # each rank at half a core


def test_alternative_dependencies_start_an_op_when_one_alternative_has_ended():
    """``any_of``: c waits for its own dep and for every op of one alternative ((a1, a2) or (b,)), whichever
    is complete first."""
    def run(a_s, b_s):
        g = OpGraph(2)
        a1, a2 = g.compute(0, "a1", a_s), g.compute(1, "a2", 0.5)
        b = g.compute(0, "b", b_s, stream="other")
        d = g.compute(1, "d", 0.2, stream="other")
        c = g.add("c", (0, 1), stream="c", duration=0.1, deps=(d,))
        g.any_of[c] = ((a1, a2), (b,))
        return simulate(g).start[c]

    assert run(1.0, 3.0) == pytest.approx(1.0)  # (a1, a2) ended at 1.0 (a2 at 0.5), before b
    assert run(2.0, 0.7) == pytest.approx(0.7)  # b first
    assert run(0.1, 0.1) == pytest.approx(0.2)  # b's alternative met at 0.1: its own dep d (0.2) decides


def test_a_gate_hold_keeps_low_calls_back_over_the_compute_between_its_calls():
    """Two high calls of rank 0 with 1 s of compute between them, a low call ready at 0.5 s: gated, it
    starts in that compute gap (its links are free); with the pair as a gate hold, only once the second
    high call has ended (the hold ends at its start, the call itself then blocks)."""
    links = {("a", 0): GB}

    def run(hold):
        g = OpGraph(1, links)
        g.call_gate = ({"a2a"}, {"grad"}, True)
        first = g.add("a2a.0", 0, stream="a2a", links={("a", 0): 0.5 * GB})
        work = g.compute(0, "experts", 1.0, deps=(first,))
        last = g.add("a2a.1", 0, stream="a2a", links={("a", 0): 0.5 * GB}, deps=(work,))
        w = g.compute(0, "wait", 0.5, stream="other")
        low = g.add("micro-op", 0, stream="grad", links={("a", 0): 0.25 * GB}, deps=(w,))
        if hold:
            g.gate_holds.append((first, last))
        return simulate(g), low, last

    r, low, last = run(False)
    assert r.start[low] == pytest.approx(0.5)
    r, low, last = run(True)
    assert r.start[last] == pytest.approx(1.5) and r.start[low] == pytest.approx(r.end[last]) == pytest.approx(2.0)


@pytest.mark.parametrize("sync", [None, 0.25])
def test_also_after_delays_every_op_that_starts_a_call_on_ops_added_later(sync):
    """A call waits for an op added after it (a plan decided once the graph exists): its link phase and, where
    the fixed costs run beside the links, its software both start only then; without it the call starts at 0."""
    def run(wait: bool):
        g, phases = _two_phase_call(call_overhead_s=0.5, emulated_sync_s=sync)
        call = g.transfer("a", [0, 1], phases)
        later = g.compute(0, "later", 1.0, stream="other")
        if wait:
            g.also_after(call, (later,))
        res = simulate(g)
        return min(res.start[h] for h in g.call_heads[call]), res.makespan

    assert run(False)[0] == pytest.approx(0.0)
    start, end = run(True)
    assert start == pytest.approx(1.0) and end == pytest.approx(1.0 + run(False)[1])
