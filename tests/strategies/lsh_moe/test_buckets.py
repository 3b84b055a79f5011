"""LSH-MoE's pure parts (spec §5): hash properties (9), nested monotonicity in L (8), lossless duplicates (3),
the constant hash (4), residuals summing to zero (5), error compensation's exactness and its failure (6), the
group rate bounds (14), the two key methods giving one partition, a non-finite row kept to itself."""
from __future__ import annotations

import pytest
import torch

from moelab.strategies.lsh_moe import buckets as bk
from moelab.strategies.lsh_moe import hashing as hs


def clustered(n=96, d=16, k=4, noise=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(k, d, generator=g, dtype=torch.float64)
    lab = torch.randint(k, (n,), generator=g)
    return centers[lab] + noise * torch.randn(n, d, generator=g, dtype=torch.float64)


def test_rotations_are_orthonormal_seeded_and_independent_of_L():
    R = hs.rotations(16, 3, 4, seed=1, layer=2)
    for l in range(4):
        torch.testing.assert_close(R[l].T @ R[l], torch.eye(3, dtype=torch.float64))
    assert torch.equal(hs.rotations(16, 3, 2, seed=1, layer=2), R[:2])
    assert not torch.equal(hs.rotations(16, 3, 2, seed=1, layer=3), R[:2])
    with pytest.raises(ValueError, match="cp_dim"):
        hs.rotation(4, 5, 0, 0, 0)


def test_cross_polytope_properties():
    x = clustered()
    R = hs.rotations(16, 3, 5, seed=0, layer=0)
    c = hs.cross_polytope(x, R)
    assert c.shape == (96, 5) and c.dtype == torch.int64
    assert int(c.min()) >= 0 and int(c.max()) < 6 and len(c.unique()) > 1
    assert torch.equal(hs.cross_polytope(3.7 * x, R), c)  # scale invariance
    assert torch.equal(hs.cross_polytope(-x, R), (c + 3) % 6)  # the opposite vertex
    R1 = hs.rotations(16, 1, 5, seed=0, layer=0)
    assert torch.equal(hs.cross_polytope(x, R1), hs.hyperplane(x, R1))  # r = 1 is SimHash
    z = torch.zeros(2, 16, dtype=torch.float64)  # a zero row: both agree on the tie
    assert torch.equal(hs.cross_polytope(z, R1), hs.hyperplane(z, R1))


@pytest.mark.parametrize("refine", [0, 3])
def test_spherical_bits_are_balanced_per_group(refine):
    x = clustered(n=101)
    groups = torch.tensor([0] * 60 + [3] * 41)
    codes = hs.spherical(x, groups, 6, torch.Generator().manual_seed(0), refine_iters=refine)
    assert set(codes.unique().tolist()) <= {0, 1}
    for gid, n in ((0, 60), (3, 41)):
        ones = codes[groups == gid].sum(0)
        assert ((ones - n / 2).abs() <= 1).all(), (gid, ones)


def test_nested_partitions_refine_and_rate_rises_with_L():
    x, ex = clustered(n=200), torch.arange(200) % 3
    R = hs.rotations(16, 2, 8, seed=0, layer=0)
    codes = hs.cross_polytope(x, R)
    prev = None
    for L in range(1, 9):
        b = bk.make_buckets(ex, codes[:, :L], 3)
        assert b.M <= min(b.A, b.groups * hs.max_buckets("cross_polytope", 2, L))
        if prev is not None:
            assert b.M >= prev.M
            # refinement: rows sharing an L-bucket shared the (L-1)-bucket
            for j in range(b.M):
                assert len(prev.inv[b.inv == j].unique()) == 1
        prev = b


def test_identity_and_duplicates_are_lossless():
    x = clustered(n=40)
    dup = torch.cat([x[:10], x[:10], x[:20]])  # 10 rows three times, 10 rows once
    ex = torch.zeros(40, dtype=torch.int64)
    _, row_id = torch.unique(dup, dim=0, return_inverse=True)
    b = bk.make_buckets(ex, row_id.unsqueeze(1), 1)
    assert b.M == 20 and b.M / b.A == 0.5  # rho = unique (expert, row) / A
    W = torch.randn(16, 16, dtype=torch.float64)
    f = lambda z: torch.tanh(z @ W)
    C = bk.centroids(dup, b)
    for ec in (None, 1.0):
        torch.testing.assert_close(bk.decompress(f(C), dup, C, b, ec), f(dup), rtol=0, atol=1e-14)
    ident = bk.make_buckets(ex, hs.identity(40), 1)
    assert ident.M == 40 and torch.equal(bk.centroids(dup, ident)[ident.inv], dup)


def test_constant_hash_is_the_group_mean():
    x, ex = clustered(n=30), torch.tensor([1] * 12 + [4] * 18)
    b = bk.make_buckets(ex, hs.constant(30), 5)
    assert b.M == 2 and b.expert.tolist() == [1, 4]
    C = bk.centroids(x, b)
    torch.testing.assert_close(C[0], x[:12].mean(0))
    f = lambda z: z.sin()
    torch.testing.assert_close(bk.decompress(f(C), x, C, b, None)[5], f(x[:12].mean(0)))
    torch.testing.assert_close(bk.decompress(f(C), x, C, b, 1.0)[20], f(x[12:].mean(0)) + x[20] - x[12:].mean(0))


def test_residuals_sum_to_zero_per_bucket():
    x, ex = clustered(), torch.arange(96) % 4
    b = bk.make_buckets(ex, hs.cross_polytope(x, hs.rotations(16, 2, 3, 0, 0)), 4)
    C = bk.centroids(x, b)
    out = torch.randn(b.M, 16, dtype=torch.float64)
    ya = bk.decompress(out, x, C, b, 1.0)
    means = torch.zeros_like(out).index_add(0, b.inv, ya) / b.size.unsqueeze(1)
    torch.testing.assert_close(means, out, rtol=0, atol=1e-12)


def test_error_compensation_exact_for_identity_plus_constant_not_always_better():
    x, ex = clustered(noise=0.3), torch.arange(96) % 2
    b = bk.make_buckets(ex, hs.cross_polytope(x, hs.rotations(16, 2, 2, 0, 0)), 2)
    assert b.singletons < b.M  # some buckets really average
    C = bk.centroids(x, b)
    bias = torch.randn(16, dtype=torch.float64)
    torch.testing.assert_close(bk.decompress(C + bias, x, C, b, 1.0), x + bias)
    W = torch.randn(16, 16, dtype=torch.float64)
    resid = x - C[b.inv]
    torch.testing.assert_close(bk.decompress(C @ W, x, C, b, 1.0) - x @ W,
                               resid @ (torch.eye(16, dtype=torch.float64) - W))
    torch.testing.assert_close(bk.decompress(C @ W, x, C, b, None) - x @ W, -resid @ W)
    zero = torch.zeros(b.M, 16, dtype=torch.float64)  # E = 0: EC adds pure error
    assert bk.decompress(zero, x, C, b, 1.0).norm() > 0 == bk.decompress(zero, x, C, b, None).norm()


def test_group_rate_bounds():
    x = clustered(n=300)
    ex = torch.randint(6, (300,), generator=torch.Generator().manual_seed(1))
    L, r = 2, 2
    b = bk.make_buckets(ex, hs.cross_polytope(x, hs.rotations(16, r, L, 0, 0)), 6)
    n = torch.bincount(ex, minlength=6)
    m = torch.bincount(b.expert, minlength=6)
    lo, hi = bk.rate_bounds(n, hs.max_buckets("cross_polytope", r, L))
    assert ((m >= lo) & (m <= hi)).all() and 0 < b.M / b.A <= 1


def test_radix_and_unique_keys_give_one_partition_and_order():
    x, ex = clustered(n=150), torch.arange(150) % 5
    codes = hs.cross_polytope(x, hs.rotations(16, 3, 4, 0, 0))
    a = bk.make_buckets(ex, codes, 5, method="radix")
    u = bk.make_buckets(ex, codes, 5, method="unique")
    assert torch.equal(a.inv, u.inv) and torch.equal(a.expert, u.expert) and torch.equal(a.size, u.size)
    big = torch.randint(1 << 20, (150, 4), generator=torch.Generator().manual_seed(0))  # 2^80 keys: no int64
    with pytest.raises(ValueError, match="overflows"):
        bk.make_buckets(ex, big, 5, method="radix")
    auto, uq = bk.make_buckets(ex, big, 5), bk.make_buckets(ex, big, 5, method="unique")
    assert torch.equal(auto.inv, uq.inv)
    assert torch.equal(a.expert, a.expert.sort().values)  # expert-major: dispatch order for EP


def test_a_non_finite_row_gets_its_own_bucket():
    x = clustered(n=20)
    x[3, 0] = float("nan")
    ex = torch.zeros(20, dtype=torch.int64)
    finite = torch.isfinite(x).all(1)
    b = bk.make_buckets(ex, hs.constant(20), 1, finite=finite)
    assert b.M == 2 and b.nonfinite == 1 and int(b.size[b.inv[3]]) == 1
    C = bk.centroids(x, b)
    others = [i for i in range(20) if i != 3]
    assert torch.isfinite(C[b.inv[others]]).all()


def test_same_seed_same_buckets_on_every_call():
    x, ex = clustered(), torch.arange(96) % 4
    one = [bk.make_buckets(ex, hs.hash_rows("cross_polytope", x, ex, R=hs.rotations(16, 2, 6, 5, 1)), 4)
           for _ in range(2)]
    assert torch.equal(one[0].inv, one[1].inv)
    sp = [hs.hash_rows("spherical", x, ex, L=4, gen=torch.Generator().manual_seed(9)) for _ in range(2)]
    assert torch.equal(sp[0], sp[1])
