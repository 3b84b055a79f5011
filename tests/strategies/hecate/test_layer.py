"""The Hecate layer on gloo ranks against the single-process fp64 reference (spec §5.1) for random plans
P' ⊇ P (2 and 2x2 ranks, with calibration), and the sparse collectives' bytes per rank from the door
(§5.5: spAG inbound = s_e·|{e: d ∈ R_e, owner(e) ≠ d}|, total spAG = total spRS = s_e·Σ(n_e − 1)). Edge
loads and the P' = P / P' = D×E cases run in tests/strategies/test_conformance.py for every registered strategy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.runtime.ranks import run_ranks
from moelab.testing import rank_inputs, reference_grads

D, F, E = 8, 16, 8
TOKENS = [5, 0, 9, 3]  # a rank without tokens


def plans(N, seed):
    rng = np.random.default_rng(seed)
    owners = [e // (E // N) for e in range(E)]
    out = []
    for _ in range(3):
        out.append(tuple((o,) + tuple(sorted(int(r) for r in rng.choice([r for r in range(N) if r != o],
                                                                        size=int(rng.integers(0, N)), replace=False)))
                         for o in owners))
    return out


def _layer(rank, world, G, cases):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.config import MoEConfig
    from moelab.strategies.hecate.layer import HecateMoELayer
    from moelab.strategies.hecate.options import HecateOptions
    from moelab.testing import expert_grads

    torch.set_num_threads(1)
    out = []
    for holders, opts in cases:
        comm = Communicator(Topology(world, G), groups={"sparse": [list(range(world))]})
        layer = HecateMoELayer(D, F, MoEConfig(num_experts=E, top_k=2), layer_id=3, seed=7, comm=comm,
                               dtype=torch.float64, options=HecateOptions(**opts))
        layer.begin_iteration(holders, opts.get("t", 0), opts.get("m", 0))
        xs, gys = rank_inputs(TOKENS[:world], D, seed=1)
        x = xs[rank].clone().requires_grad_()
        y = layer(x)
        ((y * gys[rank]).sum() + layer.aux_loss).backward()
        recs = [(r.tags.get("phase"), {q: b for q, b in r.sent_to.items() if q != rank},
                 {q: b for q, b in r.recv_from.items() if q != rank}) for r in comm.rec.comm if r.group == "sparse"]
        comm.close()  # one spawn runs every case: hand the groups on to the next
        out.append(dict(y=y.detach(), gx=x.grad, gg=layer.gate.wg.weight.grad.clone(), eg=expert_grads(layer.experts),
                        rec=layer.plan_record()["hecate"], recs=recs))
    return out


@pytest.mark.parametrize("world,G", [(2, 1), (4, 2)], ids=["2ranks", "2x2ranks"])
def test_random_plans_match_the_fp64_reference_and_move_the_plan_bytes(world, G):
    from moelab.config import MoEConfig
    from moelab.moe.reference import ReferenceMoE

    cases = [(p, {"t": 2, "m": 2, "calibration": c}) for p in plans(world, world) for c in (False, True)]
    res = run_ranks(_layer, world, G, cases, timeout=120)
    xs, gys = rank_inputs(TOKENS[:world], D, seed=1)
    ref = reference_grads(ReferenceMoE(D, F, MoEConfig(num_experts=E, top_k=2), layer_id=3, seed=7), xs, gys)
    s_e = (2 * D * F + F + D) * 8
    for i, (holders, _) in enumerate(cases):
        got = [r[i] for r in res]
        for r, g in enumerate(got):
            torch.testing.assert_close(g["y"], ref["y"][r], rtol=1e-9, atol=1e-10)
            torch.testing.assert_close(g["gx"], ref["gx"][r], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(sum(g["gg"] for g in got), ref["gg"], rtol=1e-9, atol=1e-10)
        for e, want in ref["eg"].items():  # the owner alone holds the full gradient after spRS
            owners = [g for g in got if e in g["eg"]]
            assert len(owners) == 1
            for j, w in enumerate(want):
                torch.testing.assert_close(owners[0]["eg"][e][j], w, rtol=1e-9, atol=1e-10)
        final = [tuple(h) for h in got[0]["rec"]["holders"]]
        assert all(tuple(f[:len(h)]) == h or set(h) <= set(f) for h, f in zip(holders, final))  # P' ⊆ final
        n = [len(h) - 1 for h in final]
        for r, g in enumerate(got):
            inbound = sum(sum(x[2].values()) for x in g["recs"] if x[0] in ("spag", "calibrate"))
            assert inbound == s_e * sum(1 for h in final if r in h[1:])
        sent_ag = sum(sum(x[1].values()) for g in got for x in g["recs"] if x[0] in ("spag", "calibrate"))
        sent_rs = sum(sum(x[1].values()) for g in got for x in g["recs"] if x[0] == "sprs")
        assert sent_ag == sent_rs == s_e * sum(n)
