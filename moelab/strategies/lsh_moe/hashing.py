"""LSH-MoE's hash families (spec §2.3): pure functions from detached rows to integer codes.

Every family maps ``x [A, d]`` (one rank's dispatched rows, no gradient) to ``codes [A, L]`` (int64);
rows with equal codes *within one (source rank, expert) group* share a bucket
(:mod:`moelab.strategies.lsh_moe.buckets` adds the expert as the leading key). Nothing here
communicates: hashing is local to the source rank, so every rank computes its own codes.

- ``cross_polytope`` (the paper's Eq. 3, made precise): ``z = x R_l`` with ``R_l [d, r]`` the first
  ``r`` columns of a seeded orthonormal Q; the code is the nearest vertex of the cross-polytope,
  ``argmax(cat(z, -z))`` in ``[0, 2r)``. ``R_l`` depends only on (seed, layer, l[, step]), so
  function ``l`` is the same for every L (nested refinement, §5.8) and identical on every rank.
- ``hyperplane`` (SimHash): ``[x R_l[:, 0] < 0]``, bit-identical to cross-polytope with r = 1.
- ``spherical`` (Heo et al. 2012, our reading of the paper's "spherical" hashing, §6.3): per group,
  L pivots drawn from the group's rows, each radius the median distance (balanced bits); optional
  pivot refinement.
- ``identity`` (every row its own bucket: the uncompressed baseline) and ``constant`` (one bucket
  per group: the centroid is the group mean) for tests and ablations.
"""
from __future__ import annotations

from typing import Optional

import torch

from moelab.moe.experts import seeded_generator

FAMILIES = ("cross_polytope", "spherical", "hyperplane", "identity", "constant", "none")
PROJECTED = ("cross_polytope", "hyperplane")  # families hashing through the seeded rotations


def radix(family: str, r: int) -> Optional[int]:
    """Distinct values one code column takes (None: unbounded, the identity's row index)."""
    return {"cross_polytope": 2 * r, "hyperplane": 2, "spherical": 2, "constant": 1}.get(family)


def max_buckets(family: str, r: int, L: int) -> Optional[int]:
    """``Bmax`` of the §2.9 rate bound: buckets one group can have ((2r)^L for CP, 2^L for bits)."""
    if family == "identity":
        return None
    if family == "constant":
        return 1
    return radix(family, r) ** L


def rotation(d: int, r: int, seed: int, layer: int, l: int, step: Optional[int] = None) -> torch.Tensor:
    """``R_l [d, r]`` (float64): the first r columns of Q from QR of a seeded Gaussian d x d matrix,
    drawn from (seed, layer, l[, step]) only, so it is the same on every rank, in every run and for
    any number of hash functions."""
    if not 1 <= r <= d:
        raise ValueError(f"cp_dim r={r} must be in 1..d_model={d}")
    key = ("lsh_rotation", seed, layer, l) if step is None else ("lsh_rotation", seed, layer, l, step)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=seeded_generator(*key), dtype=torch.float64))
    return q[:, :r].contiguous()


def rotations(d: int, r: int, L: int, seed: int, layer: int, step: Optional[int] = None) -> torch.Tensor:
    """``[L, d, r]``: the rotations of hash functions 0..L-1."""
    return torch.stack([rotation(d, r, seed, layer, l, step) for l in range(L)])


@torch.no_grad()
def cross_polytope(x: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """Codes ``[A, L]`` in ``[0, 2r)``: index of the nearest cross-polytope vertex ``±e_i`` of ``x R_l``
    (``i`` for +, ``r + i`` for -); ties go to the first maximum."""
    z = torch.einsum("ad,ldr->alr", x, R.to(x.dtype))
    return torch.cat([z, -z], dim=-1).argmax(-1)


@torch.no_grad()
def hyperplane(x: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """Codes ``[A, L]`` in {0, 1}: the sign bit of ``x`` on the first column of each ``R_l``
    (SimHash); equal to :func:`cross_polytope` with r = 1, zero included."""
    z = torch.einsum("ad,ld->al", x, R[:, :, 0].to(x.dtype))
    return (z < 0).to(torch.int64)


@torch.no_grad()
def spherical(x: torch.Tensor, groups: torch.Tensor, L: int, gen: torch.Generator,
              refine_iters: int = 0) -> torch.Tensor:
    """Codes ``[A, L]`` in {0, 1}: ``bit_l = ||x - p_l|| <= t_l`` with, per group (``groups[A]``, equal
    ids = one group), pivots ``p_l`` drawn from the group's rows (without replacement while the group
    has L rows) and ``t_l`` the median distance to ``p_l`` (half the group inside each sphere).
    ``refine_iters`` moves the pivots by Heo et al.'s pairwise force (overlaps pulled to n/4)."""
    A = x.shape[0]
    codes = torch.zeros(A, L, dtype=torch.int64)
    if A == 0 or L == 0:
        return codes
    xd = x.to(torch.float64)
    for g in torch.unique(groups).tolist():
        rows = (groups == g).nonzero().squeeze(1)
        pts = xd[rows]
        n = rows.numel()
        pick = torch.randperm(n, generator=gen)[:L] if n >= L else torch.randint(n, (L,), generator=gen)
        piv = pts[pick].clone()
        for _ in range(refine_iters):
            inside = torch.cdist(pts, piv) <= _median_radii(pts, piv)
            o = inside.T.to(torch.float64) @ inside.to(torch.float64)  # [L, L] rows inside both spheres
            f = 0.5 * (o - n / 4) / (n / 4)
            f.fill_diagonal_(0)
            # apart if overlapping
            piv = piv + (f.unsqueeze(2) * (piv.unsqueeze(1) - piv.unsqueeze(0))).sum(1) / max(L - 1, 1)
        codes[rows] = (torch.cdist(pts, piv) <= _median_radii(pts, piv)).to(torch.int64)
    return codes


def _median_radii(pts: torch.Tensor, piv: torch.Tensor) -> torch.Tensor:
    """Each pivot's lower-median distance to the points ``[1, L]`` (so at least half are inside)."""
    return torch.cdist(pts, piv).median(dim=0).values.unsqueeze(0)


def identity(A: int) -> torch.Tensor:
    """Codes ``[A, 1]``: the row index (every row its own bucket)."""
    return torch.arange(A, dtype=torch.int64).unsqueeze(1)


def constant(A: int) -> torch.Tensor:
    """Codes ``[A, 0]``: no column, so the group alone is the bucket."""
    return torch.zeros(A, 0, dtype=torch.int64)


def hash_rows(family: str, x: torch.Tensor, groups: torch.Tensor, *, R: Optional[torch.Tensor] = None,
              L: int = 0, gen: Optional[torch.Generator] = None, refine_iters: int = 0,
              center: bool = False) -> torch.Tensor:
    """``family``'s codes of the rows ``x [A, d]`` grouped by ``groups [A]``; ``center`` subtracts each
    group's mean first (hidden states are anisotropic: a shared direction can put every row of a
    group in one bucket)."""
    A = x.shape[0]
    if family == "identity":
        return identity(A)
    if family == "constant":
        return constant(A)
    x = x.detach()
    if center and A:
        x = x - _group_means(x, groups)
    if family == "cross_polytope":
        return cross_polytope(x, R)
    if family == "hyperplane":
        return hyperplane(x, R)
    if family == "spherical":
        return spherical(x, groups, L, gen, refine_iters)
    raise ValueError(f"unknown hash family {family!r}; known: {list(FAMILIES)}")


def _group_means(x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    ids, inv = torch.unique(groups, return_inverse=True)
    sums = x.new_zeros(len(ids), x.shape[1]).index_add(0, inv, x)
    cnt = torch.bincount(inv, minlength=len(ids)).to(x.dtype).unsqueeze(1)
    return (sums / cnt)[inv]
