"""Hecate's sparse collectives (moelab.comm.sparse) on real gloo ranks: spAG copies the owner's bytes
bitwise to exactly P' (spec §5.3), spRS sums replicas exactly and repeatably (§5.4), and the door's
records carry the bytes of §2.2 (§5.5) for every backend. One spawn per world size runs every check."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.comm.sparse import BACKENDS, sparse_plan
from moelab.runtime.ranks import run_ranks

NUMEL = 6


def random_plans(N, E, seed, n=4):
    rng = np.random.default_rng(seed)
    owners = [e // (E // N) for e in range(E)]
    P = tuple((o,) for o in owners)
    plans = [P]  # EP: nothing to move
    for _ in range(n):
        plans.append(tuple((o,) + tuple(sorted(int(r) for r in rng.choice(
            [r for r in range(N) if r != o], size=int(rng.integers(0, N)), replace=False))) for o in owners))
    plans.append(tuple((o,) + tuple(r for r in range(N) if r != o) for o in owners))  # D x E
    return P, plans


def chunk(e):
    return torch.arange(NUMEL, dtype=torch.float32) + 100.0 * e + 0.25


def _checks(rank, world, G, E):
    import time

    from moelab.comm.door import Communicator
    from moelab.comm.sparse import accumulate_, sp_all_gather, sp_reduce_scatter
    from moelab.comm.topology import Topology

    torch.set_num_threads(1)
    comm = Communicator(Topology(world, G), groups={"sparse": [list(range(world))]})
    P, plans = random_plans(world, E, seed=world)
    backends = [b for b in BACKENDS if b in ("a2a", "p2p") or world // G > 1]
    out = []
    for pi, Pp in enumerate(plans):
        for b in backends:
            plan = sparse_plan(P, Pp, rank, world, G)
            owned = {e: chunk(e) for e in range(E) if P[e][0] == rank}
            n0 = len(comm.rec.comm)
            with comm.rec.tagged(phase="spag", plan=pi):
                h = sp_all_gather(comm, plan, owned, NUMEL, torch.float32, backend=b)
                issued = time.time()
                busy = torch.randn(64, 64) @ torch.randn(64, 64)  # work while the gather is in flight
                got = h.wait()
            assert h.wait() is got and busy.shape == (64, 64)  # idempotent
            ag = comm.rec.comm[n0:]
            grads = {e: torch.full((NUMEL,), float(rank + 1)) for e in plan.replicas_here}
            n1 = len(comm.rec.comm)
            with comm.rec.tagged(phase="sprs", plan=pi):
                red = sp_reduce_scatter(comm, plan, grads, NUMEL, torch.float32, backend=b).wait()
            rs = comm.rec.comm[n1:]
            again = sp_reduce_scatter(comm, plan, grads, NUMEL, torch.float32, backend=b, async_op=False)
            sums = {e: accumulate_(torch.full((NUMEL,), float(rank + 1)), red.get(e)) for e in owned}
            out.append(dict(plan=pi, backend=b, got={e: t.tolist() for e, t in got.items()},
                            sums={e: t.tolist() for e, t in sums.items()},
                            repeat=all(torch.equal(red[e], again[e]) for e in red), issued=issued,
                            ag=[(r.op, dict(r.sent_to), dict(r.recv_from), r.t_start) for r in ag],
                            rs=[(r.op, dict(r.sent_to), dict(r.recv_from)) for r in rs]))
    return out


@pytest.fixture(scope="module", params=[(2, 1, 4), (4, 2, 8), (8, 4, 8), (6, 2, 12)],
                ids=["2ranks", "2x2ranks", "2x4ranks", "3x2ranks"])
def runs(request):
    world, G, E = request.param
    return world, G, E, run_ranks(_checks, world, G, E, timeout=120)


def test_spag_replicas_equal_the_owner_bitwise_and_non_holders_get_nothing(runs):
    world, G, E, res = runs
    P, plans = random_plans(world, E, seed=world)
    for r in range(world):
        for case in res[r]:
            Pp = plans[case["plan"]]
            want = {e for e in range(E) if r in Pp[e] and P[e][0] != r}
            assert set(case["got"]) == want, (r, case["plan"], case["backend"])
            for e in want:
                assert case["got"][e] == chunk(e).tolist()


def test_sprs_sums_rank_plus_one_exactly_and_repeatably(runs):
    world, G, E, res = runs
    P, plans = random_plans(world, E, seed=world)
    for r in range(world):
        for case in res[r]:
            Pp = plans[case["plan"]]
            for e, v in case["sums"].items():
                assert v == [float(sum(d + 1 for d in Pp[e]))] * NUMEL, (r, e, case["backend"])
            assert case["repeat"]


def test_bytes_of_the_records_are_the_formulas_of_section_2_2(runs):
    world, G, E, res = runs
    P, plans = random_plans(world, E, seed=world)
    s_e = NUMEL * 4
    for pi, Pp in enumerate(plans):
        n = [len(h) - 1 for h in Pp]
        for b in {c["backend"] for c in res[0]}:
            cases = [next(c for c in res[r] if c["plan"] == pi and c["backend"] == b) for r in range(world)]
            sent_ag = [sum(v for rec in c["ag"] for q, v in rec[1].items() if q != r) for r, c in enumerate(cases)]
            recv_ag = [sum(v for rec in c["ag"] for q, v in rec[2].items() if q != r) for r, c in enumerate(cases)]
            sent_rs = [sum(v for rec in c["rs"] for q, v in rec[1].items() if q != r) for r, c in enumerate(cases)]
            if sum(n) == 0:  # EP: no sparse collective at all
                assert all(not c["ag"] and not c["rs"] for c in cases)
                continue
            assert sum(sent_ag) == sum(sent_rs)
            if b in ("stripe", "relay"):  # relay: the same pieces, the crossings entering over another node
                assert sum(sent_ag) == stripe_bytes(P, Pp, G, s_e)
            else:
                assert sum(sent_ag) == s_e * sum(n)  # = ring all-reduce total / 2
            if b in ("a2a", "p2p"):  # flat: every copy comes from its owner, straight
                for r in range(world):
                    assert recv_ag[r] == s_e * sum(1 for e in range(E) if r in Pp[e] and P[e][0] != r)
                    assert sent_ag[r] == s_e * sum(n[e] for e in range(E) if P[e][0] == r)
            else:  # an expert crosses to each other node holding it once
                inter = [sum(v for rec in c["ag"] for q, v in rec[1].items() if q // G != r // G)
                         for r, c in enumerate(cases)]
                pairs = sum(len({d // G for d in Pp[e][1:]} - {P[e][0] // G}) for e in range(E))
                assert sum(inter) == s_e * pairs
                if b == "stripe":  # ... in G equal chunks, one over each NIC of the owner's node
                    for r in range(world):
                        away = [len({d // G for d in Pp[e][1:]} - {r // G}) for e in range(E) if P[e][0] // G == r // G]
                        assert inter[r] == chunk_bytes(r % G, G) * sum(away)


def stripe_bytes(P, Pp, G, s_e) -> int:
    """All bytes of a striped spAG: same-node holders get the expert whole; for an expert leaving its node,
    the owner scatters chunk i to rank i of its node (unless that rank holds it whole), each of those sends
    its chunk to rank i of every other node holding the expert, which passes it to that node's other holders."""
    total = 0
    for e, (o,) in enumerate(P):
        new = [d for d in Pp[e] if d != o]
        local = [d for d in new if d // G == o // G]
        away = {d // G for d in new} - {o // G}
        total += s_e * len(local)
        if away:
            total += sum(chunk_bytes(i, G) for i in range(G) if o // G * G + i not in [o] + local)
            total += s_e * len(away)
            total += sum(chunk_bytes(i, G) for d in new if d // G in away for i in range(G) if d != d // G * G + i)
    return total


def chunk_bytes(i: int, G: int) -> int:
    """Chunk i of G of an expert of NUMEL fp32 elements (uneven when G does not divide NUMEL)."""
    return ((i + 1) * NUMEL // G - i * NUMEL // G) * 4


def test_the_gather_is_issued_when_called_not_when_waited(runs):
    world, G, E, res = runs
    for r in range(world):
        for case in res[r]:
            if case["ag"]:  # the first (or only) stage was posted before the caller went on working
                op, _s, _r, t_start = case["ag"][0]
                assert op in ("all_to_all", "p2p") and t_start <= case["issued"]


def test_plans_are_validated():
    with pytest.raises(ValueError, match="must contain P"):
        sparse_plan(((0,), (1,)), ((1,), (1,)), 0, 2)
    with pytest.raises(ValueError, match="one owner"):
        sparse_plan(((0, 1), (1,)), ((0, 1), (1,)), 0, 2)
    with pytest.raises(ValueError, match="more than one node"):
        sparse_plan(((0,), (1,)), ((0, 1), (1,)), 0, 2, 2).gather_stages("hier")
    p = sparse_plan(((0,), (1,)), ((0, 1), (1, 0)), 0, 2)
    assert p.send == {1: (0,)} and p.recv == {1: (1,)} and p.replicas_here == (1,)
    assert p.bytes_in(10, 4) == p.bytes_out(10, 4) == 40 and sparse_plan(((0,), (1,)), ((0, 1), (1, 0)), 0, 2) is p


def test_hier_leaders_rotate_so_a_nodes_crossings_use_all_its_links():
    """Four experts owned on node 0, each newly held by every rank of node 1: each crosses once, to a
    different rank of node 1 (the t experts of a node arrive over G links, as t's sizing assumes), and every
    holder still gets each expert exactly once."""
    G, E = 4, 4
    P = tuple((e,) for e in range(E))
    Pp = tuple((e, 4, 5, 6, 7) for e in range(E))
    first, second = sparse_plan(P, Pp, 0, 8, G).gather_stages("hier")
    assert sorted(d for _, d, _, _ in first) == [4, 5, 6, 7]  # one crossing per expert, one per link
    got = sorted((d, e) for _, d, e, _ in first + second)
    assert got == sorted((d, e) for e in range(E) for d in (4, 5, 6, 7))
    assert all(s // G == d // G for s, d, _, _ in second)  # the fan-out stays inside the node


def test_stripe_sends_a_crossing_expert_over_every_nic_of_both_nodes():
    """Expert 0 (owned by rank 1 of node 0) is newly held by ranks 2 (its node), 5 and 6 (node 1): rank 2 gets it
    whole; chunk i leaves over rank i of node 0 (rank 2 slices its own copy) and lands on rank 4 + i, which passes
    it to the other new holders of node 1. Every holder ends with every chunk once."""
    G = 4
    P = tuple((e,) for e in range(8))
    Pp = ((0, 2, 5, 6),) + P[1:]
    P = ((1,),) + P[1:]
    Pp = ((1, 2, 5, 6),) + Pp[1:]
    scatter, cross, fan = sparse_plan(P, Pp, 0, 8, G).gather_stages("stripe")
    assert scatter == ((1, 2, 0, -1), (1, 0, 0, 0), (1, 3, 0, 3))
    assert sorted((s, d, p) for s, d, _, p in cross) == [(0, 4, 0), (1, 5, 1), (2, 6, 2), (3, 7, 3)]
    got = {(d, p) for _, d, _, p in cross + fan}
    assert {(d, p) for d in (5, 6) for p in range(G)} <= got
    assert all(s // G == d // G == 1 for s, d, _, _ in fan) and len(fan) == 2 * G - 2


def test_relay_sends_a_crossing_expert_out_of_its_node_once():
    """Expert 0 (rank 1, node 0) newly held on nodes 1 and 2 (ranks 4, 5 and 9) of 3 nodes of 4: with ``stripe`` its
    node sends it out twice (once per destination node), with ``relay`` once; each destination node receives it once
    either way, and every new holder ends with every chunk."""
    G, N = 4, 12
    P = tuple((e,) for e in range(N))
    Pp = ((0, 4, 5, 9),) + P[1:]
    out_of = {}
    for b in ("stripe", "relay"):
        stages = sparse_plan(P, Pp, 0, N, G).gather_stages(b)
        flat = [t for st in stages for t in st]
        out_of[b] = sum(1 for s, d, _, p in flat if s // G == 0 and d // G != 0)  # chunks leaving node 0
        into = {n: sorted(p for s, d, _, p in flat if d // G == n and s // G != n) for n in (1, 2)}
        assert into == {1: list(range(G)), 2: list(range(G))}, b  # each chunk enters each node once
        for d in (4, 5, 9):
            assert sorted(p for _, dd, _, p in flat if dd == d) == list(range(G)), (b, d)  # every chunk once
    assert out_of == {"stripe": 2 * G, "relay": G}
    assert len(sparse_plan(P, Pp, 0, N, G).gather_stages("relay")) == 4  # scatter, cross, relay, fan


def _staged_on_a_stream(rank, world, G, E):
    """Several staged gathers and reduce-scatters in flight at once, their later stages posted by a comm stream on
    their own group, with random per-rank delays between issue and wait: same results as waiting each at once."""
    import random
    import time

    from moelab.comm.door import Communicator
    from moelab.comm.sparse import sp_all_gather, sp_reduce_scatter
    from moelab.comm.stream import CommStream
    from moelab.comm.topology import Topology

    torch.set_num_threads(1)
    comm = Communicator(Topology(world, G), groups={"sparse": [list(range(world))], "later": [list(range(world))]})
    stream = CommStream(recorder=comm.rec, name="sparse-test")
    rng = random.Random(rank)
    P, plans = random_plans(world, E, seed=world + 1)
    out = []
    for b in ("hier", "stripe"):
        for rep in range(2):
            handles = []
            for Pp in plans[1:]:
                plan = sparse_plan(P, Pp, rank, world, G)
                owned = {e: chunk(e) for e in range(E) if P[e][0] == rank}
                grads = {e: torch.full((NUMEL,), float(rank + 1)) for e in plan.replicas_here}
                handles.append((sp_all_gather(comm, plan, owned, NUMEL, backend=b, later=(stream, "later")),
                                sp_reduce_scatter(comm, plan, grads, NUMEL, backend=b, later=(stream, "later"))))
                time.sleep(rng.uniform(0, 0.01))
            for ag, rs in reversed(handles) if rep else handles:  # waited in either order
                time.sleep(rng.uniform(0, 0.01))
                out.append((b, {e: t.tolist() for e, t in ag.wait().items()},
                            {e: t.tolist() for e, t in rs.wait().items()}))
    stream.close()
    return out


def test_staged_backends_on_a_stream_agree_with_any_wait_order_and_delays():
    world, G, E = 4, 2, 8
    res = run_ranks(_staged_on_a_stream, world, G, E, timeout=120)
    P, plans = random_plans(world, E, seed=world + 1)
    for r in range(world):
        k = 0
        for b in ("hier", "stripe"):
            for rep in range(2):
                order = list(range(len(plans) - 1))
                for i in (reversed(order) if rep else order):
                    got_b, got, sums = res[r][k]
                    k += 1
                    Pp = plans[1 + i]
                    assert got_b == b
                    assert got == {e: chunk(e).tolist() for e in range(E) if r in Pp[e] and P[e][0] != r}
                    assert sums == {e: [float(sum(d + 1 for d in Pp[e][1:]))] * NUMEL
                                    for e in range(E) if P[e][0] == r and len(Pp[e]) > 1}
