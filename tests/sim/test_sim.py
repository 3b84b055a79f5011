"""Simulator: profiles, cost invariants, engine bounds and sharing, graph bytes, calibration."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from moelab.comm.bytes import by_link_class, peer_bytes
from moelab.config import RunConfig
from moelab.measure.calibrate import fit_collectives, measure_collectives, measure_gemm
from moelab.placement import Placement
from moelab.sim import (
    PROFILES,
    ClusterProfile,
    DeadlockError,
    OpGraph,
    allgather_time,
    allreduce_time,
    alltoall_demands,
    alltoall_time,
    broadcast_time,
    config_for_profile,
    costs,
    dense_param_count,
    ep_iteration_graph,
    fit_alpha_beta,
    get_graph,
    get_profile,
    graph_bytes,
    link_capacities,
    local_profile_from_calibration,
    p2p_time,
    reduce_scatter_time,
    ring_demand,
    route_matrix,
    simulate,
    synthetic_loads,
)
from moelab.sim.graphs import topology_of

GB = 1e9


def flat_profile(nodes=1, gpn=4, intra=10.0, inter=1.0, lat=0.0, flops=1e12):
    """A round-number profile for closed-form checks."""
    return ClusterProfile(name="t", nodes=nodes, gpus_per_node=gpn, gpu="x", peak_flops=flops,
                          achieved_flops=flops, intra_bw_GBps=intra, intra_latency_us=lat,
                          inter_bw_GBps=inter, inter_latency_us=lat, mem_GB=1.0)


# ---- profiles -------------------------------------------------------------------------------------
def test_profiles_cover_testbeds_with_sources():
    sizes = {"hecate_A": 32, "hecate_B": 32, "fastermoe_johnny": 16, "fastermoe_trevor": 64, "parm_A": 8,
             "parm_B": 32, "lina": 16, "lsh_v100": 16, "lsh_a100": 32}
    for name, n in sizes.items():
        p = get_profile(name)
        assert p.world_size == n, name
        for f in ("nodes", "peak_flops", "achieved_flops", "intra_bw_GBps", "inter_bw_GBps", "mem_GB"):
            assert f in p.sources, (name, f)
        assert 0 < p.achieved_flops <= p.peak_flops
    a, b = get_profile("hecate_A"), get_profile("hecate_B")
    assert (a.intra_bw_GBps, a.inter_bw_GBps, a.gpus_per_node) == (300, 12.5, 8)
    assert (b.intra_bw_GBps, b.inter_bw_GBps) == (600, 50)
    assert get_profile("trevor") is PROFILES["fastermoe_trevor"]
    assert get_profile("testbed_B").with_nodes(2).world_size == 8
    with pytest.raises(KeyError, match="known"):
        get_profile("nope")


def test_local_profile_from_calibration():
    fit = {"nproc": 2, "gemm_flops": 2e10, "collectives": {"all_to_all": {"alpha": 1e-4, "beta": 1e-9},
                                                          "all_reduce": {"alpha": 2e-4, "beta": 3e-9}}}
    p = local_profile_from_calibration(fit)
    assert p.world_size == 2 and p.achieved_flops == 2e10
    assert p.intra_bw_GBps == pytest.approx(1.0) and p.intra_latency_us == pytest.approx(100)
    topo = p.topology()
    # a fitted op is priced with its own line: x = non-local bytes per rank (2(n-1)/n S = S for n=2)
    assert allreduce_time(1e6, topo, p) == pytest.approx(2e-4 + 3e-9 * 1e6)
    M = np.array([[0, 5e5], [5e5, 0]])
    assert alltoall_time(M, topo, p) == pytest.approx(1e-4 + 1e-9 * 5e5)


# ---- cost invariants ------------------------------------------------------------------------------
def test_uniform_alltoall_one_switch():
    N, b = 8, 3e6
    p = flat_profile(nodes=1, gpn=N, intra=10.0, lat=0.0)
    M = np.full((N, N), b)
    assert alltoall_time(M, p.topology(), p) == pytest.approx((N - 1) * b / (10 * GB))
    p5 = dataclasses.replace(p, intra_latency_us=5.0)
    assert alltoall_time(M, p5.topology(), p5) == pytest.approx((N - 1) * b / (10 * GB) + 5e-6)


def test_alltoall_across_nodes_is_nic_bound_and_hierarchical_keeps_nic_bytes():
    p = flat_profile(nodes=2, gpn=4, intra=100.0, inter=1.0)
    topo = p.topology()
    b = 1e6
    M = np.full((8, 8), b)
    # node NIC carries 4 ranks x 4 remote peers x b
    assert alltoall_time(M, topo, p) == pytest.approx(16 * b / GB)
    flat = alltoall_demands(M, range(8), topo, p)[0]
    hier = alltoall_demands(M, range(8), topo, p, hierarchical=True)
    assert len(hier) == 2
    for key in (("nic_out", 0), ("nic_in", 1)):
        assert hier[1].links[key] == pytest.approx(flat.links[key])
    assert alltoall_time(M, topo, p, hierarchical=True) >= alltoall_time(M, topo, p)


def test_ring_collectives_bytes_and_times():
    N, S = 4, 8e6
    p = flat_profile(nodes=1, gpn=N, intra=10.0)
    topo = p.topology()
    d = ring_demand("all_reduce", range(N), topo, p, S)
    for r in range(N):
        assert d.links[("intra_out", r)] == pytest.approx(2 * (N - 1) / N * S)
        # the accounting rule agrees on the per-rank total
        cls = by_link_class(topo, r, peer_bytes("all_reduce", list(range(N)), r, int(S)))
        assert cls["intra"] == pytest.approx(2 * (N - 1) / N * S)
    assert allreduce_time(S, topo, p) == pytest.approx(2 * (N - 1) / N * S / (10 * GB))
    assert allgather_time(S, topo, p) == pytest.approx((N - 1) * S / (10 * GB))
    assert reduce_scatter_time(S, topo, p) == pytest.approx((N - 1) / N * S / (10 * GB))
    assert broadcast_time(S, topo, p) == pytest.approx(S / (10 * GB))
    assert p2p_time(S, 0, 1, topo, p) == pytest.approx(S / (10 * GB))
    p2 = flat_profile(nodes=2, gpn=2, intra=10.0, inter=1.0)
    assert allreduce_time(S, p2.topology(), p2) == pytest.approx(2 * 3 / 4 * S / GB)  # NIC-bound ring
    assert p2p_time(S, 0, 2, p2.topology(), p2) == pytest.approx(S / GB)


def test_nccl_allreduce_takes_the_faster_of_ring_and_halving_doubling():
    """An NCCL profile prices an all-reduce over 2^m ranks with 2m step latencies (not the ring's 2(n-1));
    its nearest-first halving-doubling keeps the big pieces inside a node, so across nodes a node's NIC
    carries the message once instead of the ring's 2(n-1)/n; every member sends the ring's 2(n-1)/n of the
    message; a group of another size, and gloo-like profiles, keep the ring."""
    from moelab.comm import costs

    nccl = dataclasses.replace(flat_profile(nodes=2, gpn=8, intra=100.0, inter=10.0, lat=10.0), allreduce="nccl")
    ring = dataclasses.replace(nccl, allreduce="ring")
    topo, lat = nccl.topology(), 10e-6
    assert ring_demand("all_reduce", range(16), topo, nccl, 1e3).alpha == pytest.approx(2 * 4 * lat)
    assert ring_demand("all_reduce", range(16), topo, ring, 1e3).alpha == pytest.approx(2 * 15 * lat)
    assert allreduce_time(1e3, topo, nccl) < allreduce_time(1e3, topo, ring) / 3
    assert allreduce_time(1e9, topo, nccl) == pytest.approx(2 * 4 * lat + 1e9 / 10e9)
    assert allreduce_time(1e9, topo, ring) == pytest.approx(2 * 15 * lat + 2 * 15 / 16 * 1e9 / 10e9)
    hd = dict(costs._halving_doubling_ports(tuple(range(16)), topo, 1)[1])
    assert all(hd[("intra_out", r)] + hd.get(("nic_out", r // 8), 0) / 8 == pytest.approx(2 * 15 / 16)
               for r in range(8))
    assert ring_demand("all_reduce", range(12), dataclasses.replace(nccl, nodes=2, gpus_per_node=6).topology(),
                       nccl, 1e3).alpha == pytest.approx(2 * 11 * lat)  # 12 is no power of two: the ring
    for p in PROFILES.values():
        assert p.allreduce == "nccl" and "allreduce" in p.sources  # the papers' clusters ran NCCL


def test_link_capacities_honour_nics_per_node():
    """The node's inter bandwidth is split over its NICs; GPUs attach to NICs in contiguous blocks."""
    p4 = dataclasses.replace(flat_profile(nodes=2, gpn=4, intra=10.0, inter=8.0), nics_per_node=4)
    caps = link_capacities(p4, p4.topology())
    nics = sorted(k[1] for k in caps if k[0] == "nic_out")
    assert nics == list(range(8)) and caps[("nic_out", 5)] == pytest.approx(2 * GB)
    p2 = dataclasses.replace(p4, nics_per_node=2)
    topo = p2.topology()
    assert [costs.nic_of(r, topo, costs.nic_count(p2, topo)) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert link_capacities(p2, topo)[("nic_in", 3)] == pytest.approx(4 * GB)
    # one NIC (the default) keeps the old naming: NIC i is node i; 0 NICs (single-node profiles) means one
    for k in (1, 0):
        c1 = link_capacities(dataclasses.replace(p4, nics_per_node=k), topo)
        assert {l for l in c1 if l[0] == "nic_out"} == {("nic_out", 0), ("nic_out", 1)}
        assert c1[("nic_out", 1)] == pytest.approx(8 * GB)
    # more NICs than GPUs pool per GPU
    assert costs.nic_count(dataclasses.replace(p4, nics_per_node=16), topo) == 4


def test_multi_nic_alltoall_unbalanced_and_balanced():
    """One NIC per GPU: a lone sender gets its own NIC only; balanced traffic gets the node's total."""
    shared = flat_profile(nodes=2, gpn=4, intra=100.0, inter=4.0)
    per_gpu = dataclasses.replace(shared, nics_per_node=4)
    topo = shared.topology()
    b = 1e6
    lone = np.zeros((8, 8))
    lone[0, 4:] = b  # rank 0 sends 4b across, nobody else sends
    assert alltoall_time(lone, topo, shared) == pytest.approx(4 * b / (4 * GB))
    assert alltoall_time(lone, topo, per_gpu) == pytest.approx(4 * b / (1 * GB))
    M = np.full((8, 8), b)
    assert alltoall_time(M, topo, per_gpu) == pytest.approx(alltoall_time(M, topo, shared))
    # hierarchical keeps every NIC's bytes balanced: phase 2 puts 4b per rank on its own NIC
    hier = alltoall_demands(M, range(8), topo, per_gpu, hierarchical=True)
    assert hier[1].links[("nic_out", 2)] == pytest.approx(4 * b)


def test_ring_channels_leave_each_node_through_every_nic():
    p = dataclasses.replace(flat_profile(nodes=2, gpn=2, intra=10.0, inter=1.0), nics_per_node=2)
    topo = p.topology()
    assert costs.ring_channels(range(4), topo, 2) == [[0, 1, 2, 3], [1, 0, 3, 2]]
    assert costs.ring_channels(range(4), topo, 1) == [[0, 1, 2, 3]]  # one NIC: the single ring
    assert costs.ring_channels(range(2), topo, 2) == [[0, 1]]  # inside one node: one ring
    S = 8e6
    d = ring_demand("all_reduce", range(4), topo, p, S)
    for r in range(4):  # each NIC carries half the ring's bytes, each port the other half
        assert d.links[("nic_out", r)] == pytest.approx(0.75 * S) == d.links[("nic_in", r)]
        assert d.links[("intra_out", r)] == pytest.approx(0.75 * S)
    # the node's NICs together move the ring's bytes: the same time as one NIC of the node's bandwidth
    one = flat_profile(nodes=2, gpn=2, intra=10.0, inter=1.0)
    assert allreduce_time(S, topo, p) == pytest.approx(allreduce_time(S, topo, one)) == pytest.approx(1.5 * S / GB)
    # a group with one rank per node rides that rank's NIC only
    assert allreduce_time(S, topo, p, group=[0, 2]) == pytest.approx(S / (0.5 * GB))
    # 4 NICs for 8 GPUs: 4 channels, 2 GPUs per NIC, NIC load = the ring's bytes / 4
    p8 = dataclasses.replace(flat_profile(nodes=2, gpn=8, intra=100.0, inter=4.0), nics_per_node=4)
    d8 = ring_demand("all_gather", range(16), p8.topology(), p8, S)
    assert len(costs.ring_channels(range(16), p8.topology(), 4)) == 4
    assert {round(b) for l, b in d8.links.items() if l[0] == "nic_out"} == {round(15 * S / 4)}
    assert allgather_time(S, p8.topology(), p8) == pytest.approx(15 * S / (4 * GB))


def test_compute_costs():
    p = flat_profile(flops=1e12)
    assert costs.compute_time(costs.ffn_flops(1000, 64, 128), p) == pytest.approx(4 * 1000 * 64 * 128 / 1e12)
    assert costs.attention_flops(10, 8, 4) == 8 * 10 * 64 + 4 * 10 * 4 * 8


# ---- engine ---------------------------------------------------------------------------------------
def _random_one_rank_graph(seed, serialize):
    rng = np.random.default_rng(seed)
    g = OpGraph(1, {("nic_out", 0): GB})
    comp = comm = 0.0
    prev = ()
    ids = []
    for i in range(12):
        if rng.random() < 0.5:
            t = float(rng.uniform(0.1, 1.0))
            comp += t
            ids.append(g.compute(0, f"c{i}", t, deps=prev))
        else:
            nb = float(rng.uniform(0.1, 1.0)) * GB
            lat = float(rng.uniform(0, 0.05))
            comm += lat + nb / GB
            ids.append(g.add(f"m{i}", 0, stream="comm", duration=lat, links={("nic_out", 0): nb}, deps=prev))
        if serialize:
            prev = (ids[-1],)
        elif rng.random() < 0.3 and len(ids) > 1:
            prev = (int(rng.integers(0, len(ids))),)
        else:
            prev = ()
    return g, comp, comm


@pytest.mark.parametrize("seed", range(5))
def test_engine_bounds_one_rank(seed):
    for serialize in (False, True):
        g, comp, comm = _random_one_rank_graph(seed, serialize)
        r = simulate(g)
        assert r.makespan >= max(comp, comm) - 1e-9
        assert r.makespan <= comp + comm + 1e-9
        if serialize:
            assert r.makespan == pytest.approx(comp + comm)
        assert sum(r.breakdown().values()) == pytest.approx(r.makespan)


def test_engine_overlap_independent_streams():
    g = OpGraph(1, {("nic_out", 0): GB})
    g.compute(0, "c", 2.0)
    g.add("m", 0, stream="comm", links={("nic_out", 0): 3 * GB})
    assert simulate(g).makespan == pytest.approx(3.0)


def test_fair_sharing_two_transfers_take_twice_as_long():
    link = ("nic_out", 0)
    one = OpGraph(2, {link: GB})
    one.add("a", 0, stream="comm", links={link: GB})
    assert simulate(one).makespan == pytest.approx(1.0)
    two = OpGraph(2, {link: GB})
    two.add("a", 0, stream="comm", links={link: GB})
    two.add("b", 1, stream="comm", links={link: GB})
    r = simulate(two)
    assert r.makespan == pytest.approx(2.0) and r.end[0] == pytest.approx(2.0)
    # a late joiner: b starts at 0.5, shares until a ends at 1.5, then runs alone to 2.0
    late = OpGraph(2, {link: GB})
    late.add("a", 0, stream="comm", links={link: GB})
    c = late.compute(1, "wait", 0.5)
    late.add("b", 1, stream="comm", links={link: GB}, deps=(c,))
    r = simulate(late)
    assert r.end[0] == pytest.approx(1.5) and r.end[2] == pytest.approx(2.0)


@pytest.mark.parametrize("nics", [1, 2, 4])
def test_alltoall_as_p2p_flows_equals_the_collective(nics):
    """N(N-1) concurrent sends sharing ports and NICs fairly finish when the one-op all-to-all does."""
    p = dataclasses.replace(flat_profile(nodes=2, gpn=4, intra=10.0, inter=2.0), nics_per_node=nics)
    topo = p.topology()
    g = OpGraph(8, link_capacities(p, topo))
    for s in range(8):
        for d in range(8):
            if s != d:
                dm = costs.p2p_demand(s, d, topo, p, 1e6)
                g.add(f"{s}->{d}", s, stream=f"to{d}", duration=dm.alpha, links=dm.links, kind="comm")
    assert simulate(g).makespan == pytest.approx(alltoall_time(np.full((8, 8), 1e6), topo, p))


def test_collective_waits_for_all_members_and_deadlock_is_reported():
    g = OpGraph(3)
    c0 = g.compute(0, "slow", 1.0)
    c1 = g.compute(1, "fast", 0.1)
    coll = g.add("ag", (0, 1, 2), stream="comm", duration=0.5, deps=(c0, c1), kind="comm")
    r = simulate(g)
    assert r.start[coll] == pytest.approx(1.0) and r.makespan == pytest.approx(1.5)
    assert r.critical_path() == [c0, coll]
    assert r.breakdown(by="kind") == pytest.approx({"compute": 1.0, "comm": 0.5})
    cyc = OpGraph(1)
    a = cyc.compute(0, "a", 1.0)
    b = cyc.add("b", 0, stream="comm", duration=1.0, deps=(a,))
    cyc.ops[a].deps = (b,)
    with pytest.raises(DeadlockError):
        simulate(cyc)


def test_mismatched_collective_order_deadlocks():
    g = OpGraph(2)
    x = g.add("x", (0, 1), stream="comm", duration=1.0)
    y = g.add("y", (0, 1), stream="comm", duration=1.0)
    # x needs y, but y is queued behind x on both ranks' comm streams: a hang in the real world
    g.ops[x].deps = (y,)
    with pytest.raises(DeadlockError):
        simulate(g)


def test_peak_memory_and_timeline():
    g = OpGraph(1)
    a = g.compute(0, "fwd", 1.0, alloc={"act": 100})
    b = g.compute(0, "fwd2", 1.0, deps=(a,), alloc={"act": 50, "buf": 10}, free={"buf": 10})
    g.compute(0, "bwd", 1.0, deps=(b,), free={"act": 150})
    r = simulate(g)
    pm = r.peak_memory()
    assert pm.loc[0, "act"] == 150 and pm.loc[0, "buf"] == 10 and pm.loc[0, "total"] == 160
    tl = r.timeline()
    assert list(tl.name) == ["fwd", "fwd2", "bwd"] and tl.end.max() == pytest.approx(3.0)
    assert r.rank_breakdown().loc[0, "idle"] == pytest.approx(0.0)


def test_peak_memory_equals_the_live_bytes_at_every_event_time():
    """Random graphs on 3 ranks (ops on one or two ranks, temporary buffers freed at their op's end, persistent
    allocations freed later or never): each category's peak and the total's are the max over event times of the
    bytes allocated at or before that time minus those freed at or before it (frees first at equal times)."""
    rng = np.random.default_rng(7)
    for trial in range(20):
        g, ids = OpGraph(3), []
        for i in range(30):
            ranks = tuple(sorted(rng.choice(3, size=int(rng.integers(1, 3)), replace=False).tolist()))
            deps = tuple(int(d) for d in rng.choice(ids, size=min(len(ids), 2), replace=False)) if ids else ()
            cat = ["act", "buf", "params"][int(rng.integers(3))]
            alloc, free = {cat: int(rng.integers(1, 100))}, {}
            if rng.random() < 0.5:
                free = dict(alloc)  # a temporary buffer
            dur = float(rng.choice([0.0, 0.5, 1.0]))  # zero and equal durations make ties
            ids.append(g.add(f"op{i}", ranks, stream=f"s{i % 2}", duration=dur, deps=deps, alloc=alloc, free=free))
        r = simulate(g)
        pm = r.peak_memory()
        for rank in range(3):
            ops = [o for o in g.ops if rank in o.ranks]
            times = sorted({float(r.start[o.id]) for o in ops} | {float(r.end[o.id]) for o in ops})
            def live(c, t):
                return (sum((o.alloc or {}).get(c, 0) for o in ops if r.start[o.id] <= t)
                        - sum((o.free or {}).get(c, 0) for o in ops if r.end[o.id] <= t))
            cats = {c for o in ops for c in (o.alloc or {})}
            for c in cats:
                assert pm.loc[rank, c] == max(live(c, t) for t in times), (trial, rank, c)
            assert pm.loc[rank, "total"] == max(sum(live(c, t) for c in cats) for t in times), (trial, rank)


# ---- graphs ---------------------------------------------------------------------------------------
def small_cfg(nproc=4, nodes=2, E=4, k=2, layers=2, moe_every=1, **kw):
    return RunConfig().with_overrides({
        "parallel.nproc": nproc, "parallel.topology.nodes": nodes, "model.moe.num_experts": E,
        "model.moe.top_k": k, "model.n_layers": layers, "model.moe_every": moe_every,
        "model.d_model": 16, "model.d_ff": 32, "model.seq_len": 8, "train.batch_size": 2, **kw})


def test_dense_param_count_rule():
    m = small_cfg(layers=2, moe_every=2).model
    d, f, E, V, s = 16, 32, 4, m.vocab_size, 8
    want = V * d + s * d + 2 * d + 2 * (4 * d * d + 8 * d) + (2 * d * f + f + d) + d * E
    assert dense_param_count(m) == want


def test_route_matrix_fast_path_equals_split_counts():
    rng = np.random.default_rng(1)
    L = rng.integers(0, 20, size=(4, 8))
    ep = Placement.expert_parallel(8, 4)
    slow = np.stack([ep.split_counts(s, torch.tensor(L[s])).sum(0).numpy() for s in range(4)])
    assert np.array_equal(route_matrix(ep, L), slow)
    rep = ep.with_replicas({0: [1, 2, 3]})
    R = route_matrix(rep, L)
    assert R.sum() == L.sum() and not np.array_equal(R, slow)


def test_ep_graph_bytes_match_analytical_count():
    cfg = small_cfg(nproc=4, nodes=2, E=4, layers=2)
    topo = topology_of(cfg)
    T = 2 * 8
    # hand-made loads: layer 0 uniform, layer 1 everything to expert 3 (rank 3)
    l0 = np.full((4, 4), T * 2 // 4)
    l1 = np.zeros((4, 4), dtype=int)
    l1[:, 3] = T * 2
    loads = np.stack([l0, l1])
    prof = flat_profile(nodes=2, gpn=2)
    g = ep_iteration_graph(cfg, prof, loads)
    got = graph_bytes(g, topo)
    d, eb, E = 16, 4, 4
    tok = lambda n: n * d * eb  # noqa: E731
    dense = dense_param_count(cfg.model) * eb
    for r in range(4):
        want = {"local": 0, "intra": 0, "inter": 0}

        def add(dst, nbytes):
            want[topo.link_class(r, dst)] += nbytes

        for dst in range(4):  # layer 0: four symmetric all-to-alls of 8 tokens per peer
            add(dst, 4 * tok(8))
        if r != 3:  # layer 1: 32 tokens to rank 3 in dispatch and combine.bwd
            add(3, 2 * tok(32))
        else:  # rank 3 returns them in combine and dispatch.bwd; its own stay local all 4 times
            for src in range(4):
                add(src, (4 if src == 3 else 2) * tok(32))
        bal = 2 * 8 * E  # the global balance loss's all-reduce: int64[E] per MoE layer, one call
        for dst in range(4):  # 2 count exchanges of int64[E]; the dense and balance all-reduces 2 * (S // n) per peer
            add(dst, 2 * 8 * E + 2 * (dense // 4) + 2 * (bal // 4))
        assert got[r] == want, r


def test_capacity_clips_loads_and_dense_dispatcher_pads():
    topo_cfg = dict(nproc=4, nodes=2, E=4, layers=1)
    l1 = np.zeros((1, 4, 4), dtype=int)
    l1[0, :, 3] = 32  # everything to expert 3; capacity = ceil(2 * 1.0 * 16 / 4) = 8
    prof = flat_profile(nodes=2, gpn=2)
    tok = 16 * 4
    sparse = small_cfg(**topo_cfg, **{"model.moe.capacity_factor": 1.0})
    g = ep_iteration_graph(sparse, prof, l1)
    got = graph_bytes(g, topology_of(sparse), categories={"a2a"})
    assert got[0]["inter"] == 2 * 8 * tok and got[3]["intra"] == 2 * 8 * tok
    dense = small_cfg(**topo_cfg, **{"model.moe.capacity_factor": 1.0, "model.moe.dispatcher": "dense"})
    g = ep_iteration_graph(dense, prof, l1)
    counts = [o for o in g.ops if o.category == "count_exchange"]  # counts + capacity, as the runtime
    assert len(counts) == 1 and counts[0].comm["nbytes"] == 8 * (4 + 1)
    got = graph_bytes(g, topology_of(dense), categories={"a2a"})
    for r in range(4):  # 4 all-to-alls, 8 padded tokens to every rank
        assert got[r] == {"local": 4 * 8 * tok, "intra": 4 * 8 * tok, "inter": 4 * 2 * 8 * tok}


def test_ep_graph_on_local_profile_prices_a2a_with_its_fit():
    fit = {"nproc": 2, "gemm_flops": 1e10, "collectives": {"all_to_all": {"alpha": 1e-4, "beta": 1e-9}}}
    prof = local_profile_from_calibration(fit)
    cfg = small_cfg(nproc=2, nodes=1, E=2, layers=1)
    loads = np.array([[[20, 12], [5, 27]]])
    r = simulate(ep_iteration_graph(cfg, prof, loads))
    ops = r.ops_frame().set_index("name")
    x = max(12, 5) * 16 * 4  # the most bytes a rank sends to its peer in the dispatch
    assert ops.loc["L0.dispatch", "duration"] == pytest.approx(1e-4 + 1e-9 * x)


def test_loopback_fits_hold_across_declared_nodes_emulated_links_do_not():
    """Declared nodes on one host (loopback) are the same links: a fitted line prices a group that spans
    them as it prices one inside a node; under emulation the nodes are apart and the in-node fit stays
    inside the node."""
    import dataclasses

    from moelab.comm.topology import Topology

    fit = {"nproc": 4, "gemm_flops": 1e10, "collectives": {"all_to_all": {"alpha": 1e-4, "beta": 1e-9},
                                                          "all_reduce": {"alpha": 2e-3, "beta": 3e-9}}}
    prof = dataclasses.replace(local_profile_from_calibration(fit), nodes=2, gpus_per_node=2)
    two_nodes, one_node = Topology(4, 2), Topology(4, 4)
    x = 2 * 3 / 4 * 1e6  # non-local bytes a rank sends in a 1 MB all-reduce over 4 ranks
    assert allreduce_time(1e6, two_nodes, prof) == pytest.approx(2e-3 + 3e-9 * x)
    assert allreduce_time(1e6, two_nodes, prof) == pytest.approx(allreduce_time(1e6, one_node, prof))
    apart = dataclasses.replace(prof, one_host=False)  # what emulation_profile makes of it
    assert allreduce_time(1e6, two_nodes, apart) != pytest.approx(2e-3 + 3e-9 * x)


def test_ep_graph_simulates_with_expected_structure():
    cfg = small_cfg(nproc=4, nodes=2, E=8, layers=4, moe_every=2)
    prof = flat_profile(nodes=2, gpn=2, lat=10.0)
    loads = synthetic_loads(cfg, seed=3)
    g = ep_iteration_graph(cfg, prof, loads)
    a2a = [o for o in g.ops if o.category == "a2a"]
    assert len(a2a) == 2 * 4  # 2 MoE layers x 4 all-to-alls
    r = simulate(g)
    bd = r.breakdown()
    assert sum(bd.values()) == pytest.approx(r.makespan)
    assert {"a2a", "expert", "attention", "allreduce", "count_exchange"} <= set(bd)
    # makespan at least every rank's own compute, at most all compute + all comm in sequence
    ops = r.ops_frame()
    comp = ops[ops.kind == "compute"].groupby("name").duration.max().sum()
    assert r.makespan <= comp + ops[ops.kind == "comm"].duration.sum() + 1e-12
    pm = r.peak_memory()
    assert (pm["total"] > pm["params"]).all()
    assert get_graph("ep") is ep_iteration_graph


def test_strategy_graph_and_config_for_profile():
    from moelab.registry import _REGISTRY, Strategy, register_strategy

    def toy(cfg, profile, loads, placement=None):
        return OpGraph(cfg.parallel.nproc)

    register_strategy(Strategy("toy_strategy", sim_graph=toy))
    try:
        assert get_graph("toy_strategy") is toy
        register_strategy(Strategy("toy_nograph"))
        with pytest.raises(KeyError, match="no simulator graph"):
            get_graph("toy_nograph")
    finally:
        _REGISTRY.pop("toy_strategy", None)
        _REGISTRY.pop("toy_nograph", None)
    cfg = config_for_profile(RunConfig(), get_profile("trevor"), **{"model.moe.num_experts": 64})
    assert cfg.parallel.nproc == 64 and topology_of(cfg).ranks_per_node == 4
    with pytest.raises(KeyError):
        get_graph("nonexistent")


def test_paper_scale_graph_simulates_every_layer():
    """24 layers x 64 experts on 64 ranks (trevor): every layer's ops are priced. Its speed is
    ``benchmarks/sim_speed.py``'s target, not a timed unit test's."""
    prof = get_profile("trevor")
    cfg = config_for_profile(RunConfig(), prof, **{"model.n_layers": 24, "model.moe.num_experts": 64,
                                                   "model.d_model": 1024, "model.d_ff": 2048,
                                                   "model.n_heads": 16})
    loads = synthetic_loads(cfg)
    r = simulate(ep_iteration_graph(cfg, prof, loads))
    ops = r.ops_frame()
    assert r.makespan > 0 and set(ops.layer[ops.layer >= 0]) == set(range(24))


# ---- calibration ----------------------------------------------------------------------------------
def test_fit_recovers_alpha_beta():
    rng = np.random.default_rng(0)
    x = np.logspace(3, 7, 20)
    t = 5e-5 + 2e-9 * x
    ab = fit_alpha_beta(x, t)
    assert ab.alpha == pytest.approx(5e-5, rel=1e-6) and ab.beta == pytest.approx(2e-9, rel=1e-6)
    assert ab.r2 == pytest.approx(1.0)
    noisy = fit_alpha_beta(x, t * (1 + 0.01 * rng.standard_normal(20)))
    assert noisy.beta == pytest.approx(2e-9, rel=0.05) and noisy.r2 > 0.99


@pytest.mark.timeout(60)
def test_measure_collectives_smoke():
    torch.set_num_threads(1)
    df = measure_collectives(2, sizes=(1 << 10, 1 << 14), reps=2, warmup=1, timeout_s=40)
    assert set(df.op) == {"all_to_all", "all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    assert len(df) == 10 and (df.time_s > 0).all()
    a2a = df[df.op == "all_to_all"].iloc[0]
    assert a2a.sent_bytes == a2a.input_bytes // 2  # half of the input goes to the peer
    fits = fit_collectives(df)
    assert set(fits) == set(df.op)


def test_measure_gemm():
    df = measure_gemm(((32, 32, 32), (64, 64, 64)), reps=2)
    assert len(df) == 2 and (df.flops_per_s > 0).all() and math.isfinite(df.flops_per_s.iloc[0])
