"""Replica-aware dispatch at inference (spec §5 I10, I11): for any placement - static, Lina's,
random, everything on one rank, everything replicated - the distributed layer output equals the
single-process computation, every token computed once and back in its place; replica loads differ
by at most the number of sources."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.runtime.ranks import run_ranks
from moelab.strategies.lina.dispatch import route_table
from moelab.strategies.lina.placement import allocate

E, D, F = 4, 8, 16
TOKENS = [5, 0, 9, 3]  # a rank without tokens


def placements(N):
    rng = np.random.default_rng(0)
    rand = [sorted(set(rng.choice(E, size=rng.integers(1, 3), replace=False).tolist())) for _ in range(N)]
    for e in range(E):  # every expert somewhere
        if not any(e in d for d in rand):
            rand[e % N].append(e)
    n = [v * N / E for v in (2.2, 0.9, 0.6, 0.0)]  # devices each expert wants
    return {"static": [list(range(r * E // N, (r + 1) * E // N)) for r in range(N)],
            "lina": allocate(n, N, 4, seed=1),
            "balanced": allocate(n, N, 4, rounding="balanced"),  # replicas packed beside others
            "random": rand, "one_rank": [list(range(E))] + [[] for _ in range(N - 1)],
            "replicated": [list(range(E)) for _ in range(N)]}


def _run(rank, world):
    return {hot: _one(rank, world, hot) for hot in (False, True)}


def _one(rank, world, hot):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.moe.experts import Experts
    from moelab.strategies.lina.dispatch import serve_forward

    comm = Communicator(Topology(world, world))
    bank = Experts(D, F, tuple(range(E)), seed=3, layer_id=1, activation="gelu", bias=True, dtype=torch.float64)
    g = torch.Generator().manual_seed(rank)
    T = TOKENS[rank]
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    idx = torch.full((T,), 2, dtype=torch.int64) if hot else torch.randint(0, E, (T,), generator=g)
    w = torch.rand(T, generator=g, dtype=torch.float64)
    ref = torch.cat([bank(x[i:i + 1], [1], experts=[int(idx[i])]) for i in range(T)]) * w[:, None] if T else x
    out = {}
    with torch.no_grad():
        ref = ref.detach()
        for name, devs in placements(world).items():
            out[name] = (serve_forward(x, idx, w, devs, bank, comm), ref)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_any_placement_computes_the_reference_output(world):
    res = run_ranks(_run, world, timeout=120)
    for hot in (False, True):  # uniform routing, then every token to one expert
        for r in range(world):
            for name, (got, ref) in res[r][hot].items():
                assert got.shape == ref.shape
                assert torch.allclose(got, ref, rtol=1e-12, atol=1e-14), (hot, r, name)


def test_replica_loads_differ_by_at_most_the_number_of_sources():
    rng = np.random.default_rng(1)
    for _ in range(100):
        N = int(rng.integers(2, 6))
        counts = rng.integers(0, 50, size=(N, E))
        devs = allocate(N * rng.dirichlet(np.ones(E)), N, 4, seed=2)
        t = route_table(counts, devs).numpy()  # [src, e, dst]
        assert (t.sum(2) == counts).all()  # every token sent exactly once
        for e in range(E):
            holders = [d for d in range(N) if e in devs[d]]
            loads = t[:, e, holders].sum(0)
            assert loads.max() - loads.min() <= N
            assert t[:, e, [d for d in range(N) if d not in holders]].sum() == 0


def test_the_route_table_is_each_sources_parts():
    """The table (every source at once) holds exactly what :func:`parts` sends from each source: near-equal
    contiguous parts over the expert's holders, rotated by the source."""
    from moelab.strategies.lina.dispatch import holders_of, parts

    rng = np.random.default_rng(2)
    for _ in range(100):
        N = int(rng.integers(2, 6))
        counts = rng.integers(0, 50, size=(N, E))
        devs = allocate(N * rng.dirichlet(np.ones(E)), N, 4, seed=3)
        want = np.zeros((N, E, N), dtype=np.int64)
        for s in range(N):
            for e, h in enumerate(holders_of(devs, E)):
                for d, n in parts(int(counts[s, e]), h, s):
                    want[s, e, d] += n
        assert (route_table(counts, devs).numpy() == want).all()
