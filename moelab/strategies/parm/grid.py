"""The Table III configuration grid and the §2.10d memory filter (spec §4, §6 P6, P7), pure.

Grid per setting (A-8, B-8, B-16, B-32): N_MP, N_ESP in {1,2,4}; B in {2,4,8}; L in {512,1024,2048};
h = H/N_ESP in {1024,2048,4096}; M in {1024,2048,4096} (the default reading of "H/N_ES and M/N_ES", P6;
``scale_m_with_esp`` gives M = N_ESP*m, the literal one); f in {1.2, 2.4}; k and E = E_l * P/N_ESP are not
stated (P6): ``k`` and ``experts_per_rank`` (E_l) default to 1 here, and Parm's reproduction passes its
assumptions file's ``top_k`` and ``experts_per_rank``. 3^6 * 2 = 1458 configurations per setting. A
configuration is kept when the *baseline* fits in the GPU's memory minus a reserve (P7: the paper's count of
valid configurations cannot be rebuilt; moelab reports its own).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from moelab.sim.profiles import get_profile
from moelab.strategies.parm.layout import ParmLayout
from moelab.strategies.parm.plan import Shape, sizes

SETTINGS = {"A-8": ("parm_A", 1, 8), "B-8": ("parm_B", 2, 4), "B-16": ("parm_B", 4, 4), "B-32": ("parm_B", 8, 4)}
GiB = 2 ** 30


@dataclass(frozen=True)
class Config:
    setting: str
    profile: str
    nodes: int
    g: int  # GPUs per node
    n_mp: int
    n_esp: int
    B: int
    L: int
    M: int
    h: int  # expert hidden size per shard
    f: float
    k: int = 1
    e_local: int = 1  # experts per EP rank (E_l)

    @property
    def P(self) -> int:
        return self.nodes * self.g

    @property
    def E(self) -> int:
        return self.e_local * (self.P // self.n_esp)

    def layout(self) -> ParmLayout:
        return ParmLayout(self.P, self.n_mp, self.n_esp, self.E, self.g)

    def shape(self, dispatcher: str = "einsum", elem_bytes: int = 4) -> Shape:
        return Shape(S=self.B * self.L, M=self.M, H=self.h * self.n_esp, k=self.k, f=self.f, elem_bytes=elem_bytes,
                     dispatcher=dispatcher)


def configs(setting: str, scale_m_with_esp: bool = False, k: int = 1, experts_per_rank: int = 1) -> list:
    """Every configuration of one setting, in a fixed order; ``k``: top-k, ``experts_per_rank``: E_l (E = E_l *
    P / N_ESP); both default to 1 (not stated by the paper: a reproduction passes its assumptions)."""
    prof, nodes, g = SETTINGS[setting]
    out = []
    for n_mp, n_esp, B, L, h, m, f in itertools.product((1, 2, 4), (1, 2, 4), (2, 4, 8), (512, 1024, 2048),
                                                      (1024, 2048, 4096), (1024, 2048, 4096), (1.2, 2.4)):
        if (nodes * g) % n_mp or (nodes * g) % n_esp or g % n_mp or g % n_esp:
            continue
        out.append(Config(setting, prof, nodes, g, n_mp, n_esp, B, L, m * n_esp if scale_m_with_esp else m, h, f, k,
                          experts_per_rank))
    return out


def memory_bytes(c: Config, schedule: str = "baseline", dispatcher: str = "einsum", elem_bytes: int = 4) -> dict:
    """Per-rank peak bytes of one layer's forward + backward (§2.10d estimate, fp32): saved activations
    (gate input, capacity buffers in and out of each all-to-all, expert hidden pre/post activation,
    partial and reduced outputs, output), the dense C mask (n_gate x E x T, for dispatch and combine)
    with the einsum dispatcher, gradients of the largest activation twice over (the backward's working
    set), weights and their gradients."""
    z = sizes(c.layout(), c.shape(dispatcher, elem_bytes), schedule)
    n, T, rows, E, M, h = z["gate"], z["T"], z["rows"], c.E, c.M, c.h
    cap = E * T * M
    acts = {"input": n * M, "capacity_buffers": 4 * max(cap, rows * M), "expert_hidden": 2 * rows * h,
            "output": n * M + c.B * c.L * M}
    if dispatcher == "einsum":
        acts["c_mask"] = 2 * n * E * T
    weights = M * E + (E // c.layout().n_ep) * 2 * M * h
    out = {k: v * elem_bytes for k, v in acts.items()}
    out["backward_working"] = 2 * max(acts.values()) * elem_bytes
    out["weights_and_grads"] = 2 * weights * elem_bytes
    out["total"] = sum(out.values())
    return out


def fits_memory(c: Config, mem_GB: float, reserve_GiB: float = 1.5, **kw) -> bool:
    """The §2.10d filter: the baseline's peak within ``mem_GB`` (decimal GB, as GPUs are sold) minus the reserve."""
    return memory_bytes(c, "baseline", **kw)["total"] <= mem_GB * 1e9 - reserve_GiB * GiB


def filtered(setting: str, reserve_GiB: float = 1.5, **kw) -> tuple:
    """(kept configurations, dropped configurations) of one setting (``kw``: :func:`configs`'s)."""
    mem = get_profile(SETTINGS[setting][0]).mem_GB
    keep, drop = [], []
    for c in configs(setting, **kw):
        (keep if fits_memory(c, mem, reserve_GiB) else drop).append(c)
    return keep, drop
