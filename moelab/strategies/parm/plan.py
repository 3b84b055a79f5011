"""A Parm schedule as data (spec §2.5-2.8): the ordered collectives and compute of one MoE layer's
forward and backward on every rank, with their sizes from the capacity formulas.

The runtime (:mod:`.layer`) executes the schedule; this module *describes* it, so the simulator
(:mod:`.sim_graph`) prices exactly the calls the door records (tested call by call and byte by byte
against real runs), and the paper's counts (expert rows per shard, gate tokens) are one lookup.
A step on a one-member group is left out, as the runtime skips it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moelab.comm.bytes import peer_bytes
from moelab.strategies.parm import gating
from moelab.strategies.parm.layer import baseline_form
from moelab.strategies.parm.layout import EP, EPESP, ESP, MP, SAA, ParmLayout, saa_combine


@dataclass(frozen=True)
class Step:
    phase: str  # fwd | bwd
    name: str
    op: str = ""  # a door collective, or "" for compute
    group: str = ""
    args: dict = field(default_factory=dict)  # the byte rule's arguments (nbytes, splits, sub)
    flops: float = 0.0  # per rank, for compute steps

    @property
    def is_comm(self) -> bool:
        return bool(self.op)


@dataclass(frozen=True)
class Shape:
    """One MoE layer call: S tokens per MP group (B*L), model width M, expert hidden H (all shards)."""
    S: int
    M: int
    H: int
    k: int = 1
    f: float = 1.2
    elem_bytes: int = 4
    dispatcher: str = "einsum"

    def __post_init__(self):
        for name in ("S", "M", "H", "k", "elem_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.f is None or not self.f > 0:
            raise ValueError(f"Parm's schedules are capacity-padded: model.moe.capacity_factor must be > 0, "
                             f"got {self.f} (None = dropless)")


def sizes(layout: ParmLayout, shape: Shape, schedule: str, variant: str = "fig3a") -> dict:
    """Gate tokens, capacity T, expert rows per shard of a schedule (§5 I6) and its resolved form."""
    L, E, S, k, f = layout, layout.num_experts, shape.S, shape.k, shape.f
    form = schedule
    if schedule == "baseline":
        form = {"fig3a": "baseline", "esp_is_mp": "esp_is_mp", "s2_aas": "s2_aas"}[baseline_form(L, variant)]
    if form in ("s2", "s2_aas") and L.n_mp == 1:
        form = "s2_aas"  # nothing to gather: the runtime takes the plain path
    if form == "baseline":
        n, T = L.n_esp * S, gating.capacity(L.n_esp * S, E, k, f)
        return dict(form=form, gate=n, T=T, slots=T, rows=L.n_ep * L.e_local * T)
    if form == "esp_is_mp":
        T = gating.capacity(S, E, k, f)
        return dict(form=form, gate=S, T=T, slots=T, rows=L.n_ep * L.e_local * T)
    if form == "s1":
        if S % L.n_mp:
            raise ValueError(f"S1 splits S={S} tokens over mp={L.n_mp}: not divisible")
        n = S // L.n_mp
        T = gating.capacity(n, E, k, f)
        return dict(form=form, gate=n, T=T, slots=T, rows=L.world * L.e_local * T)
    T = gating.capacity(S, E, k, f, multiple=L.n_mp)
    return dict(form=form, gate=S, T=T, slots=T // L.n_mp, rows=L.world * L.e_local * (T // L.n_mp))


def steps(layout: ParmLayout, shape: Shape, schedule: str, variant: str = "fig3a", saa_backward: bool = True,
          saa_mode: str = "raw") -> list:
    """The ordered :class:`Step` list of one forward + backward on every rank."""
    L, E, M, b = layout, layout.num_experts, shape.M, shape.elem_bytes
    z = sizes(layout, shape, schedule, variant)
    form, n, T, t, rows = z["form"], z["gate"], z["T"], z["slots"], z["rows"]
    h = shape.H // L.n_esp
    size = {MP: L.n_mp, ESP: L.n_esp, EP: L.n_ep, EPESP: L.world, SAA: L.world}
    out: list = []

    def comm(phase, name, op, group, **args):
        if size[group] > 1:
            out.append(Step(phase, name, op, group, args))

    def a2a(phase, name, group, per_member_rows):
        comm(phase, name, "all_to_all", group, splits=[per_member_rows * M * b] * size[group])

    def compute(phase, name, flops):
        out.append(Step(phase, name, flops=float(flops)))

    einsum = shape.dispatcher == "einsum"
    disp = 2.0 * n * E * T * M if einsum else 2.0 * n * shape.k * M
    gate_f = 2.0 * n * M * E
    exp_f = 4.0 * rows * M * h
    if form in ("baseline", "esp_is_mp"):
        if form == "baseline":
            comm("fwd", "esp_allgather", "all_gather", ESP, nbytes=shape.S * M * b)
        compute("fwd", "gate", gate_f)
        compute("fwd", "dispatch", disp)
        a2a("fwd", "ep_a2a", EP, L.e_local * T)
        compute("fwd", "experts", exp_f)
        comm("fwd", "esp_allreduce", "all_reduce", ESP, nbytes=E * T * M * b)
        a2a("fwd", "ep_a2a_back", EP, L.e_local * T)
        compute("fwd", "combine", disp)
        if form == "baseline":
            comm("bwd", "esp_split_bwd_allgather", "all_gather", ESP, nbytes=shape.S * M * b)
        compute("bwd", "combine", 2 * disp)
        a2a("bwd", "ep_a2a_back", EP, L.e_local * T)
        compute("bwd", "experts", 2 * exp_f)
        comm("bwd", "esp_allreduce", "all_reduce", ESP, nbytes=E * T * M * b)
        a2a("bwd", "ep_a2a", EP, L.e_local * T)
        compute("bwd", "dispatch", disp)
        compute("bwd", "gate", 2 * gate_f)
        return out
    if form == "s1":
        compute("fwd", "gate", gate_f)
        compute("fwd", "dispatch", disp)
        a2a("fwd", "epesp_a2a", EPESP, L.e_local * T)
        compute("fwd", "experts", exp_f)
        a2a("fwd", "epesp_a2a_back", EPESP, L.e_local * T)
        compute("fwd", "combine", disp)
        comm("fwd", "mp_allgather", "all_gather", MP, nbytes=n * M * b)
        compute("bwd", "combine", 2 * disp)
        a2a("bwd", "epesp_a2a_back", EPESP, L.e_local * T)
        compute("bwd", "experts", 2 * exp_f)
        a2a("bwd", "epesp_a2a", EPESP, L.e_local * T)
        compute("bwd", "dispatch", disp)
        compute("bwd", "gate", 2 * gate_f)
        comm("bwd", "mp_split_bwd_allgather", "all_gather", MP, nbytes=n * M * b)
        return out
    chunk = L.e_local * t * M * b
    compute("fwd", "gate", gate_f)
    compute("fwd", "dispatch", disp)
    a2a("fwd", "epesp_a2a", EPESP, L.e_local * t)
    compute("fwd", "experts", exp_f)
    if form == "s2":
        comm("fwd", "saa", "saa", SAA, nbytes=chunk, combine=saa_combine(L, saa_mode))
    else:
        a2a("fwd", "epesp_a2a_back", EPESP, L.e_local * t)
        comm("fwd", "mp_allgather_slots", "all_gather", MP, nbytes=E * t * M * b)
    compute("fwd", "combine", disp)
    compute("bwd", "combine", 2 * disp)
    if form == "s2":
        a2a("bwd", "saa_bwd_a2a", SAA, L.e_local * t)
    else:
        a2a("bwd", "epesp_a2a_back", EPESP, L.e_local * t)
    compute("bwd", "experts", 2 * exp_f)
    if form == "s2" and saa_backward:
        comm("bwd", "saa", "saa", SAA, nbytes=chunk, combine=saa_combine(L, saa_mode))
    else:
        a2a("bwd", "epesp_a2a", EPESP, L.e_local * t)
        comm("bwd", "mp_split_bwd_allgather", "all_gather", MP, nbytes=E * t * M * b)
    compute("bwd", "dispatch", disp)
    compute("bwd", "gate", 2 * gate_f)
    return out


def rank_calls(layout: ParmLayout, rank: int, plan: list) -> list:
    """``[(op, group, phase, bytes sent to each rank)]`` the door records on ``rank`` for ``plan``."""
    groups = layout.groups()
    out = []
    for s in plan:
        if not s.is_comm:
            continue
        inst = next(i for i in groups[s.group] if rank in i)
        sent = peer_bytes(s.op, inst, rank, **s.args, **({"sub": groups[MP]} if s.op == "saa" else {}))
        out.append((s.op, s.group, s.phase, sent))
    return out
