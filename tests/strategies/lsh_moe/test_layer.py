"""The LSH-MoE layer on gloo ranks (spec §5): identity hash == the EP layer bit for bit (1); every family
against a single-process fp64 reference that buckets per source rank with plain loops (2, 12); the four
all-to-alls move centroid rows only, bytes = rho × EP's, the count exchange apart (7); routing untouched
(10); fp64 gradcheck with frozen buckets (11); bad options rejected before launch."""
from __future__ import annotations

import pytest
import torch

from moelab.runtime.ranks import run_ranks
from moelab.testing import expert_grads, rank_inputs

D, F = 8, 16
TOKENS = {2: [11, 0], 4: [5, 0, 9, 13]}  # a rank with no tokens
FAMILIES = [{"hash_family": "none"}, {"hash_family": "cross_polytope", "num_hashes": 2},
            {"hash_family": "cross_polytope", "num_hashes": 1, "error_compensation": False},
            {"hash_family": "spherical", "num_hashes": 2}, {"hash_family": "constant"},
            {"hash_family": "hyperplane", "num_hashes": 2, "ec_scale": 0.5}]


def moe_cfg(E):
    from moelab.config import MoEConfig

    return MoEConfig(num_experts=E, top_k=2)


def _run(rank, world, E, cases, hot):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.moe.layer import MoELayer
    from moelab.strategies.lsh_moe.layer import LSHMoELayer
    from moelab.strategies.lsh_moe.options import LSHMoEOptions

    out = []
    for opts in cases:
        comm = Communicator(Topology(world, world))
        kw = {} if opts is None else {"options": LSHMoEOptions(**opts)}
        layer = (MoELayer if opts is None else LSHMoELayer)(D, F, moe_cfg(E), layer_id=3, seed=7, comm=comm,
                                                            dtype=torch.float64, **kw)
        if hot:
            with torch.no_grad():
                layer.gate.wg.weight[1] += 3.0
        xs, gys = rank_inputs(TOKENS[world], D, seed=1, shift=4.0 if hot else 0.0)
        x = xs[rank].clone().requires_grad_()
        y = layer(x)
        ((y * gys[rank]).sum() + layer.aux_loss).backward()
        a2a = [(r.tags.get("phase"), dict(r.sent_to), dict(r.recv_from)) for r in comm.rec.comm if r.op == "all_to_all"]
        gathers = [sum(r.sent_to.values()) for r in comm.rec.comm if r.op == "all_gather"]
        comm.close()  # one spawn runs every case: hand the groups on to the next
        out.append(dict(y=y.detach(), gx=x.grad, gg=layer.gate.wg.weight.grad.clone(), aux=layer.aux_loss.detach(),
                        eg=expert_grads(layer.experts), idx=layer.last_routing.idx,
                        w=layer.last_routing.weights.detach(),
                        rec=layer.plan_record(), metrics=dict(getattr(layer, "last_metrics", {})), a2a=a2a,
                        gathers=gathers))
    return out


# ---- the single-process fp64 reference: plain loops, per source rank ------------------------------
def reference(world, E, opts, hot):
    """Outputs and gradients of every rank's chunk, bucketed per (source rank, expert) with plain loops."""
    from moelab.moe.experts import seeded_generator
    from moelab.moe.reference import ReferenceMoE
    from moelab.strategies.lsh_moe.hashing import hash_rows, rotations

    fam = opts.get("hash_family", "cross_polytope")
    L, r = opts.get("num_hashes", 6), (1 if fam == "hyperplane" else opts.get("cp_dim", 2))
    ec = opts.get("ec_scale", 1.0) if opts.get("error_compensation", True) else None
    ref = ReferenceMoE(D, F, moe_cfg(E), layer_id=3, seed=7)
    if hot:
        with torch.no_grad():
            ref.gate.wg.weight[1] += 3.0
    xs, gys = rank_inputs(TOKENS[world], D, seed=1, shift=4.0 if hot else 0.0)
    xs = [x.clone().requires_grad_() for x in xs]
    total = 0
    outs = []
    for rank, x in enumerate(xs):
        rt = ref.gate(x)
        k = rt.idx.shape[1]
        slots = sorted((int(rt.idx[t, j]), t * k + j) for t in range(x.shape[0]) for j in range(k) if rt.idx[t, j] >= 0)
        rows = torch.stack([x[p // k] for _, p in slots]).detach() if slots else x.new_zeros(0, D)
        exp = torch.tensor([e for e, _ in slots], dtype=torch.int64)
        if fam == "none":
            codes = torch.arange(len(slots)).unsqueeze(1)
        else:
            gen = seeded_generator("lsh_sp", 7, 3, 0, rank) if fam == "spherical" else None
            R = rotations(D, r, L, 7, 3) if fam in ("cross_polytope", "hyperplane") else None
            codes = hash_rows(fam, rows, exp, R=R, L=L, gen=gen)
        y = torch.zeros_like(x)
        buckets = {}
        for i, (e, p) in enumerate(slots):
            buckets.setdefault((e,) + tuple(codes[i].tolist()), []).append(p)
        for key, members in buckets.items():
            e = key[0]
            c = sum(x[p // k] for p in members) / len(members)
            w1, b1, w2, b2 = ref.expert(e)
            out_c = ref.act(c @ w1 + b1) @ w2 + b2
            for p in members:
                ya = out_c if (ec is None or len(members) == 1) else out_c + ec * (x[p // k] - c)
                y = y + torch.zeros_like(x).index_put((torch.tensor([p // k]),),
                                                      (rt.weights[p // k, p % k] * ya).unsqueeze(0))
        total = total + (y * gys[rank]).sum() + rt.aux_loss
        outs.append(y.detach())
    total.backward()
    eg = {e: [t.grad if t.grad is not None else torch.zeros_like(t) for t in ref.expert(e)] for e in range(E)}
    return dict(y=outs, gx=[x.grad for x in xs], gg=ref.gate.wg.weight.grad, eg=eg)


@pytest.fixture(scope="module", params=[(2, 2), (4, 8)], ids=["2ranks-Eloc1", "4ranks-Eloc2"])
def runs(request):
    world, E = request.param
    cases = [None, {"hash_family": "identity"}, {"hash_family": "identity", "error_compensation": False}] + FAMILIES
    res = {hot: run_ranks(_run, world, E, cases, hot, timeout=120) for hot in (False, True)}
    return world, E, cases, res


def test_identity_hash_is_the_ep_layer_bit_for_bit(runs):
    world, _, _, res = runs
    for hot in (False, True):
        for rank_res in res[hot]:
            ep = rank_res[0]
            for lsh in rank_res[1:3]:
                for key in ("y", "gx", "gg", "aux", "idx", "w"):
                    assert torch.equal(ep[key], lsh[key]), key
                for e in ep["eg"]:
                    assert all(torch.equal(a, b) for a, b in zip(ep["eg"][e], lsh["eg"][e]))
                assert [a[1:] for a in ep["a2a"]] == [a[1:] for a in lsh["a2a"]]  # same rows on the wire


@pytest.mark.parametrize("fam", range(len(FAMILIES)), ids=[str(o) for o in FAMILIES])
def test_matches_the_per_source_rank_fp64_reference(runs, fam):
    world, E, cases, res = runs
    opts = FAMILIES[fam]
    i = cases.index(opts)
    tol = dict(rtol=1e-9, atol=1e-10)
    for hot in (False, True):
        ref = reference(world, E, opts, hot)
        got = [r[i] for r in res[hot]]
        for rank, g in enumerate(got):
            torch.testing.assert_close(g["y"], ref["y"][rank], **tol)
            torch.testing.assert_close(g["gx"], ref["gx"][rank], **tol)
            assert torch.equal(g["idx"], res[hot][rank][0]["idx"])  # routing untouched
            assert torch.equal(g["aux"], res[hot][rank][0]["aux"])
        torch.testing.assert_close(sum(g["gg"] for g in got), ref["gg"], **tol)
        for e, want in ref["eg"].items():
            (owner,) = [g for g in got if e in g["eg"]]
            for a, b in zip(owner["eg"][e], want):
                torch.testing.assert_close(a, b, **tol)
        if hot:  # the edge really happened: one expert takes every first choice
            assert int(torch.tensor(got[0]["rec"]["counts"])[:, 1].sum()) == sum(TOKENS[world])


def test_the_four_all_to_alls_move_centroid_rows_only(runs):
    world, E, cases, res = runs
    row = D * 8
    saw_compression = False
    wire = lambda g: sum(sum(s.values()) for _, s, _ in g["a2a"])
    for hot in (False, True):
        ep_total = sum(wire(rank_res[0]) for rank_res in res[hot])
        for i, opts in enumerate(cases[3:], start=3):  # globally: all-to-all bytes / EP's = Σ centroids / Σ tokens
            if opts["hash_family"] != "none":
                rec = res[hot][0][i]["rec"]
                cen, tok = int(torch.tensor(rec["lsh"]["centroids"]).sum()), int(torch.tensor(rec["counts"]).sum())
                assert sum(wire(r[i]) for r in res[hot]) * tok == ep_total * cen
                assert rec["lsh"]["rho"] == cen / tok
        for rank, rank_res in enumerate(res[hot]):
            for opts, g in zip(cases[3:], rank_res[3:]):
                if opts["hash_family"] == "none":
                    assert "lsh" not in g["rec"] and g["gathers"] == [world * 8 * E]
                    continue
                cen = torch.tensor(g["rec"]["lsh"]["centroids"])
                owner = torch.arange(E) // (E // world)
                to = [int(cen[rank][owner == q].sum()) for q in range(world)]
                frm = [int(cen[q][owner == rank].sum()) for q in range(world)]
                assert len(g["a2a"]) == 4 and g["gathers"] == [world * 16 * E]  # count exchange: tokens + centroids
                fwd = [a for a in g["a2a"] if a[0] == "fwd"]
                bwd = [a for a in g["a2a"] if a[0] == "bwd"]
                assert len(fwd) == len(bwd) == 2
                dispatch, combine = fwd
                # rows out; grads of their outputs out
                for sent, recv in ((dispatch[1], dispatch[2]), (bwd[0][1], bwd[0][2])):
                    assert [sent.get(q, 0) for q in range(world)] == [row * n for n in to]
                    assert [recv.get(q, 0) for q in range(world)] == [row * n for n in frm]
                # outputs back; grads of the rows back
                for sent, recv in ((combine[1], combine[2]), (bwd[1][1], bwd[1][2])):
                    assert [sent.get(q, 0) for q in range(world)] == [row * n for n in frm]
                m = g["metrics"]
                assert m["M"] == sum(to) and m["A"] == int(torch.tensor(g["rec"]["counts"])[rank].sum())
                saw_compression |= m["M"] < m["A"]
                if m["A_remote"]:
                    assert m["rho_remote"] == m["M_remote"] / m["A_remote"]
    assert saw_compression


def test_gradcheck_with_frozen_buckets():
    from moelab.config import MoEConfig
    from moelab.strategies.lsh_moe.layer import LSHMoELayer
    from moelab.strategies.lsh_moe.options import LSHMoEOptions

    torch.manual_seed(0)
    for ec in (True, False):
        layer = LSHMoELayer(4, 6, MoEConfig(num_experts=2, top_k=2), seed=1, dtype=torch.float64,
                            options=LSHMoEOptions(hash_family="cross_polytope", num_hashes=1, error_compensation=ec))
        x0 = torch.randn(5, 4, dtype=torch.float64)
        frozen = {}
        real = layer.bucketize

        def bucketize(x, routing, codes=None):
            call = real(x, routing)
            frozen.setdefault("codes", torch.arange(call.buckets.A).unsqueeze(1) % 2)  # pairs share buckets
            return real(x, routing, codes=frozen["codes"])

        layer.bucketize = bucketize
        layer(x0)
        assert layer.last_metrics["M"] < layer.last_metrics["A"]
        assert torch.autograd.gradcheck(lambda x: layer(x), (x0.clone().requires_grad_(),), eps=1e-6, atol=1e-8)


def test_bad_options_fail_before_launch():
    from moelab.config import ConfigError, RunConfig

    base = {"parallel.nproc": 2, "parallel.strategy": "lsh_moe", "model.moe.num_experts": 4}
    bad = [({"parallel.strategy_options": {"hash_family": "minhash"}}, "hash_family"),
           ({"parallel.strategy_options": {"num_hashes": 0}}, "num_hashes"),
           ({"parallel.strategy_options": {"cp_dim": 100000}}, "cp_dim"),
           ({"parallel.strategy_options": {"ec_scale": float("nan")}}, "ec_scale"),
           ({"parallel.strategy_options": {"bucket": 3}}, "unknown"),
           ({"model.moe.dispatcher": "dense", "model.moe.capacity_factor": 1.0}, "dense"),
           ({"parallel.placement": {"holders": [[0, 1], [0], [1], [1]]}}, "placement")]
    for over, word in bad:
        with pytest.raises(ConfigError, match=word):
            RunConfig().with_overrides({**base, **over}).validate()
    RunConfig().with_overrides(base).validate()


def test_evaluation_is_exact_unless_asked_compressed():
    from moelab.config import MoEConfig
    from moelab.moe.layer import MoELayer
    from moelab.strategies.lsh_moe.layer import LSHMoELayer
    from moelab.strategies.lsh_moe.options import LSHMoEOptions

    x = torch.randn(12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ep = MoELayer(8, 16, MoEConfig(num_experts=2, top_k=2), seed=3, dtype=torch.float64)(x)
    outs = {}
    for mode in ("exact", "compressed"):
        layer = LSHMoELayer(8, 16, MoEConfig(num_experts=2, top_k=2), seed=3, dtype=torch.float64,
                            options=LSHMoEOptions(hash_family="constant", eval_mode=mode))
        layer.eval()
        with torch.no_grad():
            outs[mode] = layer(x)
        layer.train()
        outs[mode + "_train"] = layer(x).detach()
    assert torch.equal(outs["exact"], ep) and not torch.allclose(outs["compressed"], ep)
    assert (torch.equal(outs["compressed"], outs["compressed_train"])
            and torch.equal(outs["exact_train"], outs["compressed_train"]))


def _adjoint(rank, world):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology

    comm = Communicator(Topology(world, world))
    g = torch.Generator().manual_seed(rank)
    in_rows = [(rank + 2 * q) % 3 for q in range(world)]  # uneven, zeros included
    out_rows = [(q + 2 * rank) % 3 for q in range(world)]
    x = torch.randn(sum(in_rows), 5, dtype=torch.float64, generator=g).requires_grad_()
    y = torch.randn(sum(out_rows), 5, dtype=torch.float64, generator=g)
    z = comm.all_to_all(x, out_rows, in_rows)
    (z * y).sum().backward()
    return float((z.detach() * y).sum()), float((x.detach() * x.grad).sum())


@pytest.mark.parametrize("world", [2, 3])
def test_the_all_to_all_backward_is_its_adjoint(world):
    res = run_ranks(_adjoint, world, timeout=60)
    lhs, rhs = sum(r[0] for r in res), sum(r[1] for r in res)  # <A2A(x), y> = <x, A2A^T(y)> over all ranks
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12) and lhs != 0
