"""The paper's performance model (spec §2.10a, §2.11, §2.13), pure: alpha-beta lines per collective,
Eq. 1 / 2 / 11 / 14 (``paper_mode``: exactly the paper's formulas, with the §6 P1/P2 fixes), Alg. 1 and
its closed form.

A fit is a :class:`moelab.measure.calibrate.AlphaBeta` whose ``beta`` is seconds per **element** and whose x
is counted as the paper counts it (AllGather output, AlltoAll per-rank send, AllReduce tensor,
ReduceScatter input, SAA output; :mod:`.fits` measures them that way). Keys: ``AG_MP``, ``AG_ESP``,
``AR_ESP``, ``RS_ESP``, ``A2A_EP``, ``A2A_EPESP``, ``SAA``.
"""
from __future__ import annotations

from dataclasses import dataclass

from moelab.comm.costs import AlphaBeta
from moelab.moe.routing import capacity_for


@dataclass(frozen=True)
class ParmShape:
    """One MoE layer configuration as Alg. 1 sees it (B*L tokens per MP group)."""
    B: int
    L: int
    M: int
    E: int
    k: int
    f: float
    n_mp: int
    n_esp: int

    def __post_init__(self):
        for name in ("B", "L", "M", "E", "k", "n_mp", "n_esp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ParmShape.{name} must be a positive integer, got {v!r}")
        if not self.f > 0:
            raise ValueError(f"ParmShape.f must be > 0, got {self.f!r}")

    @property
    def T(self) -> int:
        """ceil(k*f*B*L/E) (§6 P1: no stray M)."""
        return capacity_for(self.B * self.L, self.E, self.k, self.f)

    @property
    def x(self) -> int:
        """B*L*M: the S1 gather's elements."""
        return self.B * self.L * self.M

    @property
    def y(self) -> int:
        """E*T*M*N_ESP: the fused all-to-all's (and SAA's output) elements."""
        return self.E * self.T * self.M * self.n_esp


def from_dicts(fits: dict) -> dict:
    """``{name: AlphaBeta}`` from :func:`moelab.strategies.parm.fits.fit`'s plain dicts (a run folder's JSON)."""
    return {k: AlphaBeta(v["alpha"], v["beta"], v.get("r2", float("nan")), v.get("n", 0), v.get("alpha_se", 0.0),
                         v.get("beta_se", 0.0)) for k, v in fits.items()}


def line(fits: dict, name: str, x: float) -> float:
    f = fits[name]
    return f.alpha + f.beta * x


# ---- paper_mode: the paper's equations --------------------------------------------------------------
def t_baseline(s: ParmShape, fits: dict) -> float:
    """Eq. 1: AG_ESP(B*L*M*N_ESP) + AR_ESP(E*T*M*N_ESP) + 2*A2A_EP(E*T*M*N_ESP)."""
    y = s.y
    return line(fits, "AG_ESP", s.x * s.n_esp) + line(fits, "AR_ESP", y) + 2 * line(fits, "A2A_EP", y)


def t_fused(s: ParmShape, fits: dict) -> float:
    """Eq. 2 (N_MP = 1): 2*A2A_EPESP(E*T*M*N_ESP)."""
    return 2 * line(fits, "A2A_EPESP", s.y)


def t_s1(s: ParmShape, fits: dict) -> float:
    """Eq. 11/13 with N_ESP kept (§6 P2): 2*A2A_EPESP(y/N_MP) + AG_MP(B*L*M)."""
    return 2 * line(fits, "A2A_EPESP", s.y / s.n_mp) + line(fits, "AG_MP", s.x)


def t_s2(s: ParmShape, fits: dict) -> float:
    """Eq. 14 with the P2 fixes (no extra AG_MP; SAA fitted against its output y):
    A2A_EPESP(y/N_MP) + SAA(y)."""
    return line(fits, "A2A_EPESP", s.y / s.n_mp) + line(fits, "SAA", s.y)


def select(s: ParmShape, fits: dict) -> tuple:
    """Alg. 1: ``("s1" | "s2", tD1, tD2)``; ties and N_MP = 1 (one schedule) give S1."""
    if s.n_mp == 1:
        t = t_fused(s, fits) if "A2A_EPESP" in fits else 0.0
        return "s1", t, t
    d1, d2 = t_s1(s, fits), t_s2(s, fits)
    return ("s1" if d1 <= d2 else "s2"), d1, d2


def delta(s: ParmShape, fits: dict) -> float:
    """tD1 - tD2 in closed form with y = k*f*N_ESP*x (T without its ceiling):
    (aA + aG - a_o) + x*(bG - k*f*N_ESP*(b_o - bA/N_MP)). S1 iff <= 0."""
    A, G, O = fits["A2A_EPESP"], fits["AG_MP"], fits["SAA"]
    return (A.alpha + G.alpha - O.alpha) + s.x * (G.beta - s.k * s.f * s.n_esp * (O.beta - A.beta / s.n_mp))


def f_star(s: ParmShape, fits: dict):
    """The capacity factor above which S1 is chosen (closed form), None when the denominator <= 0
    (then the sign of ``delta`` does not change with f)."""
    A, G, O = fits["A2A_EPESP"], fits["AG_MP"], fits["SAA"]
    den = s.k * s.n_esp * (O.beta - A.beta / s.n_mp)
    if den <= 0:
        return None
    return (G.beta + (A.alpha + G.alpha - O.alpha) / s.x) / den


def paper_fits(profile) -> dict:
    """The only fits the paper quotes (Fig. 6, AG_MP; seconds and s per output element assumed, §2.10a), as
    the testbed's profile keeps them (``extra["AG_MP_fit"]`` of ``parm_A`` / ``parm_B``, whose intra-node
    link is derived from them: :mod:`moelab.sim.profiles`); the other collectives are not given and are not
    invented here."""
    f = profile.extra["AG_MP_fit"]
    return {"AG_MP": AlphaBeta(f["alpha_s"], f["beta_s_per_elem"], float("nan"), 0)}
