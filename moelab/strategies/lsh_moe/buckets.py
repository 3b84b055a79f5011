"""Buckets, centroids and residual compensation (spec §2.4, §2.6): local to the source rank.

A bucket is a set of this rank's rows with the same destination expert and the same hash codes
(never grouped per destination rank: a centroid must not mix experts, §6.9). Its centroid is the
mean of its rows (``1/N_j``); the residuals ``x - c`` stay here, only centroids travel. The
partition is a pure function of integer keys ``(expert, codes, own)``; ``own`` gives every
non-finite row a bucket of its own, so a NaN cannot spread to its neighbours.

Centroids are numbered in ascending key order, expert first, so they are already in dispatch
order for expert parallelism. Two ways to number them give the same partition and order: one
mixed-radix int64 key where it fits (fast), ``unique(dim=0)`` over the key columns otherwise.

The compressed forward is differentiable with the bucket ids as constants, so autograd gives the
exact gradient of §2.7 (centroid rows get ``Σ_{S_j} g·dy``; no per-token gradient is sent).
A singleton bucket's residual is identically zero: it is left out instead of adding ``x - x``,
so with every row alone (``identity``) the layer is the uncompressed one bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

INT64_MAX = (1 << 63) - 1


@dataclass
class Buckets:
    """One rank's partition of its A rows into M buckets (centroids)."""

    inv: torch.Tensor  # [A] centroid of each row
    expert: torch.Tensor  # [M] destination expert of each centroid (ascending)
    size: torch.Tensor  # [M] rows per centroid (N_j)
    nonfinite: int = 0  # rows given a bucket of their own because they hold inf/NaN

    @property
    def A(self) -> int:
        return int(self.inv.numel())

    @property
    def M(self) -> int:
        return int(self.expert.numel())

    @property
    def groups(self) -> int:
        """Non-empty (source rank, expert) groups: the floor of M."""
        return int(torch.unique(self.expert).numel())

    @property
    def singletons(self) -> int:
        return int((self.size == 1).sum())


def _key_columns(expert: torch.Tensor, codes: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    return torch.cat([expert.unsqueeze(1), codes, own.unsqueeze(1)], dim=1)


def mixed_radix_keys(cols: torch.Tensor, bases) -> Optional[torch.Tensor]:
    """One int64 per row, most significant column first (so integer order = lexicographic order),
    or None when ``prod(bases)`` does not fit in int64."""
    total = 1
    for b in bases:
        total *= int(b)
    if total - 1 > INT64_MAX:
        return None
    key = torch.zeros(cols.shape[0], dtype=torch.int64)
    for j, b in enumerate(bases):
        key = key * int(b) + cols[:, j]
    return key


def make_buckets(expert: torch.Tensor, codes: torch.Tensor, num_experts: int,
                 finite: Optional[torch.Tensor] = None, method: str = "auto") -> Buckets:
    """The partition of rows by ``(expert[A], codes[A, L])`` (codes >= 0); rows with
    ``finite[A] == False`` each alone. ``method``: ``radix`` (int64 key; raises if it does not fit),
    ``unique`` (rows of key
    columns) or ``auto`` (radix where it fits)."""
    A = int(expert.numel())
    expert = expert.reshape(-1).to(torch.int64).cpu()
    codes = codes.reshape(A, codes.shape[-1] if codes.dim() > 1 else 1).to(torch.int64).cpu()
    own = torch.zeros(A, dtype=torch.int64)
    n_bad = 0
    if finite is not None:
        bad = (~finite.reshape(-1).cpu()).nonzero().squeeze(1)
        n_bad = int(bad.numel())
        own[bad] = bad + 1
        codes = codes.clone()
        codes[bad] = 0
    cols = _key_columns(expert, codes, own)
    if A == 0:
        z = torch.zeros(0, dtype=torch.int64)
        return Buckets(z, z.clone(), z.clone(), 0)
    if codes.numel() and int(codes.min()) < 0:
        raise ValueError("hash codes must be >= 0")
    radix = int(codes.max()) + 1 if codes.numel() else 1  # the codes' own range: same order as unique
    bases = [num_experts] + [radix] * codes.shape[1] + [int(own.max()) + 1]
    key = mixed_radix_keys(cols, bases) if method in ("auto", "radix") else None
    if key is None and method == "radix":
        raise ValueError(f"mixed-radix key of bases {bases} overflows int64; use method='unique'")
    if key is not None:
        ukey, inv = torch.unique(key, return_inverse=True)
        cexp = ukey // (torch.tensor(bases[1:], dtype=torch.int64).prod() if len(bases) > 1 else 1)
    else:
        ukeys, inv = torch.unique(cols, dim=0, return_inverse=True)
        cexp = ukeys[:, 0].contiguous()
    size = torch.bincount(inv, minlength=int(cexp.numel()))
    return Buckets(inv, cexp, size, n_bad)


def centroids(xa: torch.Tensor, b: Buckets) -> torch.Tensor:
    """``[M, d]``: each bucket's mean, differentiable in ``xa`` (a one-row bucket is its row exactly)."""
    C = xa.new_zeros(b.M, xa.shape[1]).index_add(0, b.inv.to(xa.device), xa)
    return C / b.size.to(device=xa.device, dtype=xa.dtype).unsqueeze(1)


def decompress(ec_out: torch.Tensor, xa: torch.Tensor, C: torch.Tensor, b: Buckets,
               ec_scale: Optional[float]) -> torch.Tensor:
    """Per-row outputs ``[A, d]``: ``E(c) + ec_scale·(x - c)`` (residual error compensation, Eq. 5),
    or ``E(c)`` when ``ec_scale`` is None. Singleton buckets get no residual term (it is zero)."""
    inv = b.inv.to(ec_out.device)
    ya = ec_out.index_select(0, inv)
    if ec_scale is None:
        return ya
    rows = (b.size[b.inv] > 1).nonzero().squeeze(1).to(ec_out.device)
    if rows.numel() == 0:
        return ya
    res = xa.index_select(0, rows) - C.index_select(0, inv.index_select(0, rows))
    return ya.index_add(0, rows, res if ec_scale == 1.0 else ec_scale * res)


def rate_bounds(n: torch.Tensor, bmax: Optional[int]):
    """Per group of ``n`` rows: the §2.9 bounds on its centroids, ``min(1, n)`` and ``min(n, Bmax)``."""
    n = torch.as_tensor(n, dtype=torch.int64)
    lo = torch.clamp(n, max=1)
    hi = n if bmax is None else torch.clamp(n, max=int(bmax))
    return lo, hi
