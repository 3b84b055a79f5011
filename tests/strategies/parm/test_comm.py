"""Parm's collectives on real gloo ranks: SAA is all-gather(all-to-all) bitwise, forward and backward
(spec §5 I4); every schedule's recorded calls and bytes per rank, group and pass equal the §2.5-2.7
formulas with capacity ceilings and padding (I6); two runs are bitwise equal (I12)."""
from __future__ import annotations

import math

import torch

from moelab.comm.bytes import peer_bytes
from moelab.runtime.ranks import run_ranks
from moelab.strategies.parm.layout import EP, EPESP, ESP, MP, SAA, ParmLayout

S, M, K, F_CAP = 8, 8, 1, 1.2


def _saa_rank(rank, world):
    from moelab.comm import autograd as ag
    from moelab.comm.door import Communicator
    from moelab.comm.saa import saa
    from moelab.comm.topology import Topology
    from moelab.strategies.parm.layer import _SAAGather

    out = {}
    for n_mp in (1, 2, 4):
        lay = ParmLayout(world, n_mp, 1, world, 4)
        comm = Communicator(Topology(world, 4), groups=lay.groups())
        g = torch.Generator().manual_seed(100 + rank)
        D = torch.randn(world, 3, 2, generator=g, dtype=torch.float64)
        n0, s0 = len(comm.rec.comm), len(comm.rec.spans)
        A = saa(comm, D.reshape(world, -1), SAA, MP)
        rec = comm.rec.comm[n0]
        phases = [s for s in comm.rec.spans[s0:] if s[0].startswith("saa phase")]
        B = comm.all_gather(comm.all_to_all_raw(D.reshape(world, -1), [1] * world, [1] * world, EPESP), group=MP)
        # backward: SAA's autograd against the sequential pair, with MP-replicated upstream grads
        W = torch.randn(n_mp, world, 3, 2, generator=torch.Generator().manual_seed(lay.coords(rank)["dp"]),
                        dtype=torch.float64)
        x1 = D.clone().requires_grad_()
        (_SAAGather.apply(x1, torch.empty(0, requires_grad=True), comm) * W).sum().backward()
        x2 = D.clone().requires_grad_()
        y2 = ag.gather_rows(comm, ag.all_to_all(comm, x2, EPESP), MP) if n_mp > 1 else ag.all_to_all(comm, x2, EPESP)
        (y2 * W.reshape(y2.shape)).sum().backward()
        out[n_mp] = dict(equal=torch.equal(A, B), grad_equal=torch.equal(x1.grad, x2.grad), op=rec.op,
                         group=rec.group, sent=rec.sent_to, phases=len(phases), mp=comm.group_ranks(MP))
        comm.close()  # one spawn runs every case: hand the groups on to the next
    return out


def test_saa_is_allgather_of_alltoall_bitwise():
    for world in (4, 8):
        res = run_ranks(_saa_rank, world, timeout=180)
        for r, per in enumerate(res):
            for n_mp, o in per.items():
                assert o["equal"] and o["grad_equal"], (world, n_mp, r)
                assert (o["op"], o["group"], o["phases"]) == ("saa", SAA, world)
                c = 3 * 2 * 8
                want = {q: c + (world * c if q in o["mp"] and q != r else 0) for q in range(world)}
                assert o["sent"] == want, (world, n_mp, r)


def _saa_combined_rank(rank, world, cells):
    """``saa_mode: combined`` against raw SAA with each ESP block summed afterwards: values, the grads of the
    autograd block, and the recorded bytes (an MP peer gets P / N_ESP chunks instead of P)."""
    from moelab.comm.door import Communicator
    from moelab.comm.saa import saa
    from moelab.comm.topology import Topology
    from moelab.strategies.parm.layer import _SAAGather

    out = {}
    for n_mp, n_esp in cells:
        lay = ParmLayout(world, n_mp, n_esp, world // n_esp, 4)
        comm = Communicator(Topology(world, 4), groups=lay.groups())
        D = torch.randn(world, 3, 2, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)
        raw = saa(comm, D.reshape(world, -1), SAA, MP)
        comb = saa(comm, D.reshape(world, -1), SAA, MP, combine=n_esp)
        rec = comm.rec.comm[-1]
        want = raw.view(n_mp, world // n_esp, n_esp, -1).sum(2)
        W = torch.randn(n_mp, world // n_esp, 3, 2, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(lay.coords(rank)["dp"]))
        x1, x2 = D.clone().requires_grad_(), D.clone().requires_grad_()
        (_SAAGather.apply(x1, torch.empty(0, requires_grad=True), comm, n_esp) * W).sum().backward()
        y2 = _SAAGather.apply(x2, torch.empty(0, requires_grad=True), comm).view(n_mp, world // n_esp, n_esp, 3, 2)
        (y2.sum(2) * W).sum().backward()
        out[(n_mp, n_esp)] = dict(equal=torch.equal(comb, want),
                                  grad=torch.equal(x1.grad, x2.grad), sent=rec.sent_to, mp=comm.group_ranks(MP))
        comm.close()  # one spawn runs every case: hand the groups on to the next
    return out


def test_saa_combined_is_raw_with_each_esp_block_summed():
    for world, cells in ((4, [(2, 2), (1, 2), (1, 4)]), (8, [(2, 2), (2, 4), (4, 2)])):
        res = run_ranks(_saa_combined_rank, world, cells, timeout=180)
        for r, per in enumerate(res):
            for (n_mp, n_esp), o in per.items():
                assert o["equal"] and o["grad"], (world, n_mp, n_esp, r)  # bitwise: the same sums, same order
                c = 3 * 2 * 8
                want = {q: c + (world // n_esp * c if q in o["mp"] and q != r else 0) for q in range(world)}
                assert o["sent"] == want, (world, n_mp, n_esp, r)


def _fusion_rank(rank, world):
    """I5 on one rank: S1's fused path ``LocalCombine(A2A_EPESP(experts(A2A_EPESP(Dump(G)))))`` against the
    baseline's ``A2A_EP(ReduceFwd_ESP(experts(ReduceBwd_ESP(A2A_EP(G)))))``, outputs and input grads. G and
    the upstream grads depend on the EP index only (the baseline's G is the ESP group's gathered tokens)."""
    from moelab.comm import autograd as ag
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.strategies.parm.layer import dump, local_combine

    out = {}
    for n_esp, E in ((2, 2), (2, 4), (4, 2), (1, 4)):
        lay = ParmLayout(world, 1, n_esp, E, 4)
        comm = Communicator(Topology(world, 4), groups=lay.groups())
        c = lay.coords(rank)
        El, T = lay.e_local, 3
        A = torch.randn(E, n_esp, M, M, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        mine = A[c["ep"] * El:(c["ep"] + 1) * El, c["esp"]]  # [E_l, M, M]: this rank's shard of its experts

        def partial(R):  # [blocks * E_l, T, M] -> this shard's partial outputs
            return torch.einsum("betm,emn->betn", R.view(-1, El, T, M), mine).reshape(R.shape)

        g = torch.Generator().manual_seed(50 + c["ep"])
        G = torch.randn(E, T, M, generator=g, dtype=torch.float64)
        W = torch.randn(E, T, M, generator=g, dtype=torch.float64)
        g1, g2 = G.clone().requires_grad_(), G.clone().requires_grad_()
        fused = local_combine(ag.all_to_all(comm, partial(ag.all_to_all(comm, dump(g1, lay), EPESP)), EPESP), lay)
        base = ag.all_to_all(comm, ag.reduce_fwd(comm, partial(ag.reduce_bwd(comm, ag.all_to_all(comm, g2, EP), ESP)),
                                                  ESP), EP)
        (fused * W).sum().backward()
        (base * W).sum().backward()
        out[(n_esp, E)] = dict(fused=fused.detach(), base=base.detach(), g1=g1.grad, g2=g2.grad)
        comm.close()  # one spawn runs every case: hand the groups on to the next
    return out


def test_local_fusions_equal_the_baseline_collectives():
    """I5: LocalCombine(A2A(expert partials)) equals the baseline's ESP all-reduce + A2A, and Dump's backward
    (the local sum of the copies' grads) equals the ESP all-reduce of the input grads; P = 4, fp64."""
    res = run_ranks(_fusion_rank, 4)
    for r in range(4):
        for cell, v in res[r].items():
            assert v["fused"].abs().sum() > 0
            assert torch.allclose(v["fused"], v["base"], rtol=1e-12, atol=1e-12), (r, cell)
            assert torch.allclose(v["g1"], v["g2"], rtol=1e-12, atol=1e-12), (r, cell)


def test_saa_phases_add_up_to_its_byte_rule():
    from moelab.comm.saa import _phases, _sent, forward_phases

    for P, combine, n_sub in ((4, 1, 2), (4, 2, 2), (8, 4, 2), (8, 2, 4), (8, 8, 1), (6, 3, 3)):
        sub = [list(range(a, a + n_sub)) for a in range(0, P, n_sub)]
        for me in range(P):
            assert sorted(forward_phases(P, combine, me).values()) == list(range(P // combine))  # each block once
            ph = _phases(list(range(P)), me, nbytes=10, sub=sub, combine=combine)
            assert len(ph) == P
            sent = {me: 10}  # phase 0: the own chunk, local
            for s, _ in ph:
                for q, b in s.items():
                    sent[q] = sent.get(q, 0) + b
            assert sent == _sent(list(range(P)), me, nbytes=10, sub=sub, combine=combine), (P, combine, me)
            for i, (s, rcv) in enumerate(ph):  # what me receives in phase i is what its peers send it then
                for q, b in rcv.items():
                    assert _phases(list(range(P)), q, nbytes=10, sub=sub, combine=combine)[i][0][me] == b


# ---- I6: calls and bytes per schedule ----------------------------------------------------------------
def _bytes_rank(rank, world, n_mp, n_esp):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.strategies.parm.layer import ParmMoE

    lay = ParmLayout(world, n_mp, n_esp, world // n_esp, 4)
    comm = Communicator(Topology(world, 4), groups=lay.groups())
    out = {}
    for sched in ("baseline", "s1", "s2", "s2_aas"):
        ys = []
        for _ in range(2):  # twice: I12, bitwise equal
            layer = ParmMoE(comm, lay, M, 16, schedule=sched, capacity_factor=F_CAP, dtype=torch.float64)
            x = torch.randn(S, M, generator=torch.Generator().manual_seed(lay.coords(rank)["dp"]),
                            dtype=torch.float64, requires_grad=True)
            n0 = len(comm.rec.comm)
            y = layer(x)
            (y * y).sum().backward()
            ys.append((y.detach(), x.grad, layer.wg.grad, layer.w1.grad))
        out[sched] = dict(calls=[(r.op, r.group, r.tags.get("phase", "fwd"), r.sent_to) for r in comm.rec.comm[n0:]],
                          same=all(torch.equal(a, b) for a, b in zip(*ys)))
    return out


def _expected(lay: ParmLayout, rank: int, sched: str) -> list:
    """The §2.5-2.7 calls of one pass pair, sizes from the formulas (8-byte elements)."""
    E, E_l, b = lay.num_experts, lay.e_local, 8
    g = lay.groups()
    mine = lambda name: next(i for i in g[name] if rank in i)  # noqa: E731
    T_b = math.ceil(K * F_CAP * lay.n_esp * S / E - 1e-9)
    T_1 = math.ceil(K * F_CAP * (S // lay.n_mp) / E - 1e-9)
    T_2 = lay.n_mp * math.ceil(math.ceil(K * F_CAP * S / E - 1e-9) / lay.n_mp)
    t_2 = T_2 // lay.n_mp

    def call(op, group, phase, **kw):
        return (op, group, phase, peer_bytes(op, mine(group), rank, **kw))

    def a2a(group, rows, T, phase):
        n = len(mine(group))
        return call("all_to_all", group, phase, splits=[rows * T * M * b] * n)

    saa = lambda phase: ("saa", SAA, phase, {q: E_l * t_2 * M * b + (lay.world * E_l * t_2 * M * b if q in mine(MP) and q != rank else 0)  # noqa: E501
                                             for q in range(lay.world)})
    if sched == "baseline":
        ag = call("all_gather", ESP, "fwd", nbytes=S * M * b)
        ar = lambda ph: call("all_reduce", ESP, ph, nbytes=E * T_b * M * b)  # noqa: E731
        return [ag, a2a(EP, E_l, T_b, "fwd"), ar("fwd"), a2a(EP, E_l, T_b, "fwd"),
                call("all_gather", ESP, "bwd", nbytes=S * M * b), a2a(EP, E_l, T_b, "bwd"), ar("bwd"),
                a2a(EP, E_l, T_b, "bwd")]
    if sched == "s1":
        agm = lambda ph: call("all_gather", MP, ph, nbytes=(S // lay.n_mp) * M * b)  # noqa: E731
        return [a2a(EPESP, E_l, T_1, "fwd"), a2a(EPESP, E_l, T_1, "fwd"), agm("fwd"),
                a2a(EPESP, E_l, T_1, "bwd"), a2a(EPESP, E_l, T_1, "bwd"), agm("bwd")]
    if sched == "s2":
        return [a2a(EPESP, E_l, t_2, "fwd"), saa("fwd"), a2a(SAA, E_l, t_2, "bwd"), saa("bwd")]
    agm = lambda ph: call("all_gather", MP, ph, nbytes=E * t_2 * M * b)  # noqa: E731
    return [a2a(EPESP, E_l, t_2, "fwd"), a2a(EPESP, E_l, t_2, "fwd"), agm("fwd"),
            a2a(EPESP, E_l, t_2, "bwd"), a2a(EPESP, E_l, t_2, "bwd"), agm("bwd")]


def test_recorded_calls_and_bytes_follow_the_formulas():
    world, n_mp, n_esp = 4, 2, 2
    lay = ParmLayout(world, n_mp, n_esp, world // n_esp, 4)
    res = run_ranks(_bytes_rank, world, n_mp, n_esp, timeout=180)
    for r, per in enumerate(res):
        for sched, o in per.items():
            assert o["same"], (sched, r)
            want = _expected(lay, r, sched)
            assert o["calls"] == want, (sched, r, o["calls"], want)
    # the capacities the formulas gave really differ (ceil and padding matter here): T_b, T_1, T_2
    assert (math.ceil(1.2 * 16 / 2), math.ceil(1.2 * 4 / 2), 2 * math.ceil(math.ceil(1.2 * 8 / 2) / 2)) == (10, 3, 6)


# ---- the plan the simulator prices is the door's record, call by call -----------------------------
def _records_rank(rank, world, cells, f):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.strategies.parm.layer import ParmMoE

    out = {}
    for n_mp, n_esp in cells:
        lay = ParmLayout(world, n_mp, n_esp, 2 * world // n_esp, 4)
        comm = Communicator(Topology(world, 4), groups=lay.groups())
        for sched, variant, saa_bwd, mode in RECORDED:
            layer = ParmMoE(comm, lay, M, 16, schedule=sched, capacity_factor=f, baseline_variant=variant,
                            saa_backward=saa_bwd, saa_mode=mode, gate="gshard", dtype=torch.float64)
            x = torch.randn(S, M, generator=torch.Generator().manual_seed(lay.coords(rank)["dp"]), requires_grad=True,
                            dtype=torch.float64)
            n0 = len(comm.rec.comm)
            y = layer(x)
            (y * y).sum().backward()
            out[(n_mp, n_esp, sched, variant, saa_bwd, mode)] = dict(
                calls=[(r.op, r.group, r.tags.get("phase", "fwd"), r.sent_to) for r in comm.rec.comm[n0:]],
                values=(y.detach(), x.grad, layer.wg.grad, layer.w1.grad, layer.w2.grad))
        comm.close()  # one spawn runs every case: hand the groups on to the next
    return out


RECORDED = (("baseline", "fig3a", True, "raw"), ("baseline", "ds081", True, "raw"), ("s1", "fig3a", True, "raw"),
            ("s2", "fig3a", True, "raw"), ("s2", "fig3a", False, "raw"), ("s2_aas", "fig3a", True, "raw"),
            ("s2", "fig3a", True, "combined"), ("s2", "fig3a", False, "combined"))


def test_plan_calls_equal_the_door_records():
    from moelab.strategies.parm.plan import Shape, rank_calls, sizes, steps

    for world, cells in ((4, [(1, 2), (2, 1), (4, 2)]), (8, [(2, 2), (2, 4), (4, 2), (4, 4)])):
        res = run_ranks(_records_rank, world, cells, 1.7, timeout=240)
        for (n_mp, n_esp, sched, variant, saa_bwd, mode), got in res[0].items():
            lay = ParmLayout(world, n_mp, n_esp, 2 * world // n_esp, 4)
            plan = steps(lay, Shape(S, M, 16, k=2, f=1.7, elem_bytes=8), sched, variant, saa_bwd, mode)
            for r in range(world):
                o = res[r][(n_mp, n_esp, sched, variant, saa_bwd, mode)]
                assert o["calls"] == rank_calls(lay, r, plan), (world, n_mp, n_esp, sched, variant, saa_bwd, mode, r)
                if mode == "combined":  # the same layer as with raw SAA: outputs and every gradient
                    raw = res[r][(n_mp, n_esp, sched, variant, saa_bwd, "raw")]["values"]
                    for a, b in zip(o["values"], raw):
                        assert torch.allclose(a, b, rtol=1e-12, atol=1e-13), (world, n_mp, n_esp, saa_bwd, r)
                    if n_mp > 1 and n_esp > 1:  # fewer bytes gathered: N_ESP x fewer forwarded chunks
                        sent = lambda calls: sum(sum(c[3].values()) for c in calls if c[0] == "saa")  # noqa: E731
                        assert sent(o["calls"]) < sent(res[r][(n_mp, n_esp, sched, variant, saa_bwd, "raw")]["calls"])
            z = sizes(lay, Shape(S, M, 16, k=2, f=1.7), sched, variant)
            assert z["rows"] >= 1 and z["T"] >= z["slots"]
