"""Pure dispatch plans (issue #8 item 4): ``plan_from_counts`` equals the plans moelab computed
before the split (the sparse dispatcher's and FasterMoE's private copy, kept below verbatim as
oracles) on every layer-test case and on arbitrary destination vectors; send/receive agree across
ranks; the same counts give the same plans on every real rank."""
from __future__ import annotations

import json

import pytest
import torch

from moelab.config import MoEConfig
from moelab.moe.dispatch import block_permutation, local_counts, plan_from_counts
from moelab.moe.reference import ReferenceMoE
from moelab.placement import Placement
from moelab.runtime.ranks import run_ranks


# ---- the plans as computed before item 4 (oracles; do not "improve") ---------------------------------
def legacy_sparse_plan(C, pl: Placement, idx, me):
    """``SparseDispatcher.plan`` as of ed5f869, with the count exchange's result ``C`` given."""
    E, N = pl.num_experts, pl.world_size
    flat = idx.reshape(-1)
    valid_pos = (flat >= 0).nonzero().squeeze(1)
    experts = flat[valid_pos]
    order = torch.argsort(experts, stable=True)
    pos_sorted, exp_sorted = valid_pos[order], experts[order]
    lec = torch.bincount(experts, minlength=E).to(torch.int64)
    ranks, ns = [], []
    for e in range(E):
        for r, n in pl.blocks(me, e, int(lec[e])):
            ranks.append(r)
            ns.append(n)
    dest = torch.repeat_interleave(torch.tensor(ranks, dtype=torch.int64), torch.tensor(ns, dtype=torch.int64)) \
        if ranks else torch.zeros(0, dtype=torch.int64)
    key = dest * E + pl.slot_table[dest, exp_sorted]
    send_pos = pos_sorted[torch.argsort(key, stable=True)]
    in_rows = torch.bincount(dest, minlength=N).tolist()
    local = pl.local_experts(me)
    local_idx = torch.tensor(local, dtype=torch.int64)
    if pl.is_trivial:
        recv_counts = C[:, local_idx]
    else:
        recv_counts = torch.zeros(N, len(local), dtype=torch.int64)
        for j in range(N):
            if len(local):
                recv_counts[j] = pl.split_counts(j, C[j])[local_idx, me]
    return dict(in_rows=in_rows, out_rows=recv_counts.sum(1).tolist(), rows_per_slot=recv_counts.sum(0).tolist(),
                send_pos=send_pos, recv_perm=block_permutation(recv_counts), recv_counts=recv_counts)


def legacy_fastermoe_plan(C, E, N, me, idx, S):
    """``FasterMoELayer.plan`` as of ed5f869 (plain EP, ``El = E // N``), shadow set ``S`` given."""
    El = E // N
    flat = idx.reshape(-1)
    valid_pos = (flat >= 0).nonzero().squeeze(1)
    experts = flat[valid_pos]
    shadowed = torch.zeros(E, dtype=torch.bool)
    if S:
        shadowed[list(S)] = True
    keep = ~shadowed[experts]
    kept_pos, kept_exp = valid_pos[keep], experts[keep]
    order = torch.argsort(kept_exp, stable=True)
    send_pos = kept_pos[order]
    in_rows = torch.bincount(kept_exp // El, minlength=N).tolist()
    local = list(range(me * El, (me + 1) * El))
    recv_counts = C[:, local].clone()
    recv_counts[:, shadowed[local]] = 0
    sh_pos, sh_exp = valid_pos[~keep], experts[~keep]
    o2 = torch.argsort(sh_exp, stable=True)
    counts = torch.bincount(sh_exp, minlength=E)
    return dict(in_rows=in_rows, out_rows=recv_counts.sum(1).tolist(), rows_per_slot=recv_counts.sum(0).tolist(),
                send_pos=send_pos, recv_perm=block_permutation(recv_counts), recv_counts=recv_counts,
                shadow_pos=sh_pos[o2], shadow_counts=tuple(int(counts[e]) for e in S))


def assert_same_plan(plan, want: dict):
    for key, w in want.items():
        got = getattr(plan, key)
        if isinstance(w, torch.Tensor):
            assert torch.equal(got, w), (key, got, w)
        else:
            assert list(got) == list(w), (key, got, w)


def counts_of(dests, E):
    return torch.stack([local_counts(d, E) for d in dests])


# ---- destination vectors: the layer tests' routings and random ones --------------------------------
def layer_case_dests():
    """``(E, k, per-rank idx)`` of every case of tests/moe/test_layer.py, routed by the reference gate."""
    from tests.moe.test_layer import CASES, EDGE, bias_gate, make_inputs

    out = []
    for name, case in {**CASES, **EDGE}.items():
        cfg = MoEConfig(**case["moe"])
        xs, _ = make_inputs(case["tokens"], case.get("seed", 0), case.get("hot"))
        ref = ReferenceMoE(8, 16, cfg, layer_id=3, seed=7)
        bias_gate(ref.gate, case.get("hot"))
        with torch.no_grad():
            _, _, routes = ref(xs)
        out.append((name, cfg.num_experts, [r.idx for r in routes]))
    return out


def random_dests(seed, N, E, k=2, max_tokens=9, p_drop=0.2):
    g = torch.Generator().manual_seed(seed)
    dests = []
    for r in range(N):
        T = int(torch.randint(0, max_tokens + 1, (1,), generator=g)) if r % 3 else (0 if seed % 2 else 5)
        idx = torch.randint(0, E, (T, k), generator=g)
        idx[torch.rand(T, k, generator=g) < p_drop] = -1
        dests.append(idx)
    return dests


def random_placement(seed, N, E):
    g = torch.Generator().manual_seed(1000 + seed)
    holders = []
    for e in range(E):
        n = int(torch.randint(1, N + 1, (1,), generator=g))
        holders.append(tuple(torch.randperm(N, generator=g)[:n].tolist()))
    return Placement(E, N, tuple(holders))


PLACEMENTS = {  # the layer/train/sim tests' placements
    "train-replicas": lambda N, E: (Placement.from_mapping({0: [0, 1], 1: [1], 2: [1, 0], 3: [0]}, 4, N)
                                    if (N, E) == (2, 4) else None),
    "sim-replicas": lambda N, E: Placement.expert_parallel(E, N).with_replicas({0: list(range(1, N))}),
}


def test_equals_legacy_sparse_plan_on_layer_test_cases():
    cases = layer_case_dests()
    assert len(cases) == 18
    checked = 0
    for name, E, dests in cases:
        for N in (2, 4):
            ds = dests[:N]
            C = counts_of(ds, E)
            pls = [Placement.expert_parallel(E, N)] + [f(N, E) for f in PLACEMENTS.values()]
            for pl in [p for p in pls if p is not None]:
                for me in range(N):
                    assert_same_plan(plan_from_counts(C, pl, ds[me], me), legacy_sparse_plan(C, pl, ds[me], me))
                    checked += 1
    assert checked > 200


@pytest.mark.parametrize("seed", range(12))
def test_equals_legacy_sparse_plan_on_arbitrary_destinations(seed):
    N, E = (2, 4, 3)[seed % 3], (4, 8, 6)[seed % 3]
    dests = random_dests(seed, N, E, k=1 + seed % 4)
    C = counts_of(dests, E)
    assert any(d.numel() == 0 for d in dests) or (torch.cat([d.reshape(-1) for d in dests]) < 0).any()
    for pl in (Placement.from_mapping({e: e % N for e in range(E)}, E, N), random_placement(seed, N, E)):
        for me in range(N):
            assert_same_plan(plan_from_counts(C, pl, dests[me], me), legacy_sparse_plan(C, pl, dests[me], me))


@pytest.mark.parametrize("seed", range(8))
def test_equals_legacy_fastermoe_plan_with_shadows(seed):
    N, E = (2, 4)[seed % 2], (4, 8)[seed // 4]
    dests = random_dests(seed, N, E, k=1 + seed % 3)
    C = counts_of(dests, E)
    g = torch.Generator().manual_seed(seed)
    for S in ((), (0,), tuple(sorted(torch.randperm(E, generator=g)[:3].tolist())), tuple(range(E))):
        for me in range(N):
            plan = plan_from_counts(C, Placement.expert_parallel(E, N), dests[me], me, shadowed=S)
            assert_same_plan(plan, legacy_fastermoe_plan(C, E, N, me, dests[me], S))
            assert plan.shadowed == S


@pytest.mark.parametrize("seed", range(6))
def test_plans_agree_across_ranks_and_conserve_rows(seed):
    """What r sends to s is what s expects from r; every valid row is sent once or shadowed; a sent
    row goes to a holder of its expert, in the slot of that expert."""
    N, E = 4, 8
    dests = random_dests(seed, N, E, k=3)
    C = counts_of(dests, E)
    pl = random_placement(seed, N, E)
    S = (seed % E,) if seed % 2 else ()
    plans = [plan_from_counts(C, pl, dests[r], r, shadowed=S) for r in range(N)]
    for r, p in enumerate(plans):
        for s in range(N):
            assert p.in_rows[s] == plans[s].out_rows[r]
            assert p.send_split[:, s].sum() == p.in_rows[s]
        flat = dests[r].reshape(-1)
        valid = (flat >= 0).nonzero().squeeze(1)
        both = torch.cat([p.send_pos, p.shadow_pos]).sort().values
        assert torch.equal(both, valid)
        assert (bool(torch.isin(flat[p.shadow_pos], torch.tensor(S, dtype=torch.int64)).all()) if S
                else p.shadow_pos.numel() == 0)
        off = 0
        for s, n in enumerate(p.in_rows):
            exps = flat[p.send_pos[off:off + n]]
            assert all(s in pl.holders[e] for e in exps.tolist())
            slots = pl.slot_table[s, exps]
            assert bool((slots[1:] >= slots[:-1]).all())  # slot-major within the block for rank s
            off += n
    assert sum(sum(p.rows_per_slot) for p in plans) == int(C.sum()) - int(C[:, list(S)].sum())


def test_plan_rejects_counts_that_do_not_match_the_rows():
    pl = Placement.expert_parallel(4, 2)
    dest = torch.tensor([[0, 1], [2, -1]])
    C = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    plan_from_counts(C, pl, dest, 0)
    with pytest.raises(ValueError, match="counts row 1"):
        plan_from_counts(C, pl, dest, 1)
    with pytest.raises(ValueError, match=r"counts must be \[2, 4\]"):
        plan_from_counts(C[:, :3], pl, dest, 0)


def test_rows_need_not_be_token_slots():
    """LSH-MoE sends centroids: any 1-D destination vector plans the same as a [T, 1] routing."""
    pl = Placement.expert_parallel(4, 2).with_replicas({3: [0]})
    d0, d1 = torch.tensor([3, 0, 3, -1, 2, 3]), torch.tensor([1, 1, 3])
    C = counts_of([d0, d1], 4)
    a, b = plan_from_counts(C, pl, d0, 0), plan_from_counts(C, pl, d0.view(-1, 1), 0)
    assert torch.equal(a.send_pos, b.send_pos) and a.in_rows == b.in_rows == [4, 1]


def _purity_rank(rank, world, seed):
    """Every rank gathers every rank's rows and plans every rank's call; returns them as JSON."""
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology

    comm = Communicator(Topology(world, world))
    E = 8
    mine = random_dests(seed, world, E, k=2)[rank]
    C = comm.all_gather(local_counts(mine, E), group="ep")
    lens = comm.all_gather(torch.tensor([mine.numel()]), group="ep").reshape(-1).tolist()
    pad = torch.full((max(lens) or 1,), -2, dtype=torch.int64)
    pad[:mine.numel()] = mine.reshape(-1)
    rows = comm.all_gather(pad, group="ep")
    pl = random_placement(seed, world, E)
    out = []
    for r in range(world):
        p = plan_from_counts(C, pl, rows[r][:lens[r]], r, shadowed=(1,))
        out.append({k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in vars(p).items()
                    if k != "placement"})
    return json.dumps(out, sort_keys=True)


@pytest.mark.parametrize("world", [2, 4])
def test_plans_are_identical_on_every_rank(world):
    res = run_ranks(_purity_rank, world, 3, timeout=60)
    assert len(set(res)) == 1
    plans = json.loads(res[0])
    assert [p["in_rows"][1 % world] for p in plans] == plans[1 % world]["out_rows"]
