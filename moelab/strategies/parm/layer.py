"""Parm's MoE layer on real process groups: the baseline, S1, S2 and S2-AAS schedules (spec §2.5-2.8).

One :class:`ParmMoE` per MoE layer per rank. Its input ``x`` [S, M] is the rank's MP group's
micro-batch (replicated over the MP group); its output is the same for every schedule when nothing
is dropped. What differs is who gates which tokens and which collectives move them:

- ``baseline`` (Fig. 3a): ESP all-gather, gate the N_ESP*S pool, EP all-to-all, experts (f-op),
  ESP all-reduce, EP all-to-all, combine, ESP split. Every MP copy is dispatched: expert work and
  expert grads x N_MP. ``ds081`` uses DeepSpeed v0.8.1's own special cases where they apply (§3).
- ``s1``: MP split of the tokens, gate S/N_MP, dump x N_ESP, one all-to-all over every rank,
  expert partials, all-to-all back, local sum over the ESP copies, combine, MP all-gather of tokens.
- ``s2``: gate all S tokens, split the capacity slots over MP, dump, all-to-all, partials, then SAA
  (the return all-to-all with the MP all-gather riding on it), local sum, combine on all S tokens.
  ``s2_aas``: the return all-to-all, the sum, then a plain MP all-gather of the slots.

Every collective goes through the comm door on the groups :class:`~.layout.ParmLayout` declares,
and a group of one member costs nothing (no call). Gradient factors (§2.9) are :func:`grad_factors`;
the update applies them.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from moelab.comm import autograd as ag
from moelab.comm.saa import saa
from moelab.moe.experts import init_expert, seeded_generator
from moelab.strategies.parm import gating
from moelab.strategies.parm.layout import EP, EPESP, ESP, MP, SAA, SAA_MODES, ParmLayout, saa_combine

RUNNABLE = ("baseline", "s1", "s2", "s2_aas")


def baseline_form(layout: ParmLayout, variant: str) -> str:
    """Which baseline runs: ``fig3a`` always for that variant; ``ds081`` is S2-AAS when experts are not
    sharded but MP is (DeepSpeed's MP token drop, §3 i), ``esp_is_mp`` when ESP = MP (§3 ii), else Fig. 3a."""
    if variant == "ds081":
        if layout.n_esp == 1 and layout.n_mp > 1:
            return "s2_aas"
        if layout.n_esp == layout.n_mp > 1:
            return "esp_is_mp"
    return "fig3a"


def grad_factors(layout: ParmLayout, schedule: str, variant: str = "fig3a") -> tuple:
    """(c_gate, c_exp): the reference gate grad is the world sum of the local gate grads / c_gate;
    the reference expert grad is the local shard grad / c_exp (§2.9)."""
    if schedule == "baseline":
        form = baseline_form(layout, variant)
        if form == "fig3a":
            return layout.n_mp * layout.n_esp, layout.n_mp
        schedule = "s2" if form == "s2_aas" else "esp_is_mp"
    return {"s1": (1, 1), "s2": (layout.n_mp, 1), "s2_aas": (layout.n_mp, 1), "esp_is_mp": (layout.n_mp, 1)}[schedule]


class _SAAGather(torch.autograd.Function):
    """Forward: SAA (return all-to-all + MP all-gather; ``combine`` = N_ESP: the ESP partials summed
    inside SAA, output ``[N_MP, N_EP * rows, ...]``). Backward: keep the own MP block of the grad (grads
    are MP-replicated), copy each block's grad to its ``combine`` partials, reverse all-to-all."""

    @staticmethod
    def forward(ctx, Yp, anchor, comm, combine=1):
        ctx.comm, ctx.tags, ctx.combine = comm, dict(comm.rec.tags), combine
        out = saa(comm, Yp.reshape(comm.world_size, -1), SAA, MP, combine=combine)
        return out.view((out.shape[0], Yp.shape[0] // combine) + tuple(Yp.shape[1:]))

    @staticmethod
    def backward(ctx, g):
        comm, c = ctx.comm, ctx.combine
        u = comm.group_ranks(MP).index(comm.rank)
        with comm.rec.tagged(**{**ctx.tags, "phase": "bwd"}):
            mine = g[u].reshape(comm.world_size // c, -1).repeat_interleave(c, dim=0)  # [P, chunk]
            rows = [g.shape[1] * c // comm.world_size] * comm.world_size
            return comm.all_to_all_raw(mine.reshape((-1,) + tuple(g.shape[2:])), rows, rows, SAA), None, None, None


class _SlotSplitDumpA2A(torch.autograd.Function):
    """S2's way in with ``saa_backward``: forward = keep own slot block (local), dump x N_ESP, all-to-all
    over every rank; backward = SAA of the grads (all MP peers' slot blocks at once), sum the ESP copies."""

    @staticmethod
    def forward(ctx, G, anchor, comm, layout, combine=1):
        ctx.comm, ctx.layout, ctx.tags, ctx.combine = comm, layout, dict(comm.rec.tags), combine
        u = comm.group_ranks(MP).index(comm.rank)
        t2 = G.shape[1] // layout.n_mp
        D = dump(G[:, u * t2:(u + 1) * t2], layout)
        rows = [D.shape[0] // layout.world] * layout.world
        return comm.all_to_all_raw(D.contiguous(), rows, rows, EPESP)

    @staticmethod
    def backward(ctx, g):
        comm, L = ctx.comm, ctx.layout
        with comm.rec.tagged(**{**ctx.tags, "phase": "bwd"}):
            ob = saa(comm, g.reshape(L.world, -1), SAA, MP, combine=ctx.combine)  # [N_MP, P / combine, E_l*t2*M]
        t2, M = g.shape[1], g.shape[2]
        gm = ob.view(L.n_mp, L.n_ep, L.n_esp // ctx.combine, L.e_local, t2, M).sum(2)  # [N_MP, N_EP, E_l, t2, M]
        return (gm.reshape(L.n_mp, L.num_experts, t2, M).transpose(0, 1).reshape(L.num_experts, L.n_mp * t2, M),
                None, None, None, None)


def dump(G: torch.Tensor, layout: ParmLayout) -> torch.Tensor:
    """(E, T, M) -> (P*E_l, T, M): block q = the experts of rank q's EP index, one copy per ESP shard."""
    _, T, M = G.shape
    L = layout
    return G.view(L.n_ep, 1, L.e_local, T, M).expand(L.n_ep, L.n_esp, L.e_local, T, M).reshape(-1, T, M)


def local_combine(B: torch.Tensor, layout: ParmLayout) -> torch.Tensor:
    """(P*E_l, T, M) partials from every rank -> (E, T, M): sum over the N_ESP shards of each expert."""
    L = layout
    _, T, M = B.shape
    return B.view(L.n_ep, L.n_esp, L.e_local, T, M).sum(1).reshape(L.num_experts, T, M)


class ParmMoE(nn.Module):
    """One MoE layer of a rank: the replicated gate [E, M] and this rank's ESP shard of its experts."""

    def __init__(self, comm, layout: ParmLayout, d_model: int, d_ff: int, *, schedule: str, gate: str = "switch",
                 capacity_factor: float = 1.2, dispatcher: str = "einsum", baseline_variant: str = "fig3a",
                 saa_backward: bool = True, saa_mode: str = "raw", activation: str = "gelu", expert_bias: bool = False,
                 seed: int = 0, layer_id: int = 0, dtype=torch.float32):
        super().__init__()
        layout.check()
        if schedule not in RUNNABLE:
            raise ValueError(f"schedule must be one of {list(RUNNABLE)} (auto is resolved from live fits before the "
                             f"layer runs), got {schedule!r}")
        if dispatcher not in gating.DISPATCHERS:
            raise ValueError(f"dispatcher must be one of {list(gating.DISPATCHERS)}, got {dispatcher!r}")
        if gate not in gating.GATE_K:
            raise ValueError(f"gate must be one of {list(gating.GATE_K)} (topk with k=1 has a constant weight: use "
                             f"switch), got {gate!r}")
        if capacity_factor is None or not capacity_factor > 0:
            raise ValueError(f"parm needs a positive capacity factor, got {capacity_factor!r}")
        if saa_mode not in SAA_MODES:
            raise ValueError(f"saa_mode must be one of {list(SAA_MODES)}, got {saa_mode!r}")
        if d_ff % layout.n_esp:
            raise ValueError(f"expert d_ff={d_ff} does not split over esp={layout.n_esp}")
        self.comm, self.layout = comm, layout
        self.schedule, self.gate_name, self.f, self.mode = schedule, gate, float(capacity_factor), dispatcher
        self.variant, self.saa_backward, self.activation = baseline_variant, saa_backward, activation
        self.saa_combine = saa_combine(layout, saa_mode)
        self.k = gating.GATE_K[gate]
        c = layout.coords(comm.rank)
        self.esp_index = c["esp"]
        E = layout.num_experts
        g = seeded_generator("parm_gate", seed, layer_id)
        bound = 1 / math.sqrt(d_model)
        self.wg = nn.Parameter(((torch.rand(E, d_model, generator=g, dtype=torch.float64) * 2 - 1) * bound).to(dtype))
        W1, _, W2, B2 = (torch.stack(t) for t in zip(*(init_expert(d_model, d_ff, seed, layer_id, e, dtype=dtype)
                                                        for e in layout.experts_of(comm.rank))))
        w1, w2 = gating.expert_shards(W1, W2, layout.n_esp, self.esp_index)
        self.w1 = nn.Parameter(w1.contiguous())
        self.w2 = nn.Parameter(w2.contiguous())
        self.b2 = nn.Parameter(B2) if expert_bias and self.esp_index == 0 else None
        self.aux = None
        self.last: dict = {}

    # ---- pieces -------------------------------------------------------------------------------
    def _size(self, group: str) -> int:
        return len(self.comm.group_ranks(group))

    def _op(self, fn, x, group, **kw):
        """A collective block on ``group``, skipped on a one-member group (nothing to move)."""
        return x if self._size(group) == 1 else fn(self.comm, x, group, **kw)

    def _gate(self, pool: torch.Tensor, cap: int):
        with self.comm.rec.span("gate", "compute"):
            r = gating.route(self.wg, pool, self.gate_name, self.f, cap)
        self.aux = r.aux_loss
        return r

    def _dispatch(self, X, r, cap):
        with self.comm.rec.span("dispatch", "compute"):
            return gating.dispatch(X, r, self.layout.num_experts, cap, self.mode)

    def _combine(self, Z, r, cap):
        with self.comm.rec.span("combine", "compute"):
            return gating.combine(Z, r, cap, self.mode)

    def _experts(self, R: torch.Tensor) -> torch.Tensor:
        L = self.layout
        n_src = R.shape[0] // L.e_local
        with self.comm.rec.span("experts", "compute"):
            return gating.expert_partials(R.view(n_src, L.e_local, *R.shape[1:]), self.w1, self.w2, self.b2,
                                          self.activation).reshape(R.shape)

    def _note(self, schedule, pool, cap, expert_rows):
        self.last = {"schedule": schedule, "gate_tokens": int(pool), "capacity": int(cap),
                     "expert_rows": int(expert_rows)}

    # ---- schedules ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.schedule
        if s == "baseline":
            form = baseline_form(self.layout, self.variant)
            if form == "s2_aas":
                return self._s2(x, aas=True, label="baseline(ds081)")
            return self._baseline(x, esp_gather=form == "fig3a")
        if s == "s1":
            return self._s1(x)
        return self._s2(x, aas=s == "s2_aas")

    def _baseline(self, x, esp_gather: bool = True):
        E = self.layout.num_experts
        X = self._op(ag.gather_rows, x, ESP) if esp_gather else x
        cap = gating.capacity(X.shape[0], E, self.k, self.f)
        r = self._gate(X, cap)
        G = self._dispatch(X, r, cap)  # (E, T_b, M) = (N_EP, E_l, T_b, M)
        R = self._op(ag.all_to_all, G, EP)
        R = self._op(ag.reduce_bwd, R, ESP)  # f: the replicated expert input feeds sharded work
        Y = self._op(ag.reduce_fwd, self._experts(R), ESP)
        Z = self._op(ag.all_to_all, Y, EP)
        O = self._combine(Z, r, cap)
        self._note("baseline" if esp_gather else "baseline(ds081 esp=mp)", X.shape[0], cap, R.shape[0] * cap)
        return self._op(ag.split_rows, O, ESP) if esp_gather else O

    def _s1(self, x):
        L, E = self.layout, self.layout.num_experts
        xm = self._op(ag.split_rows, x, MP)
        cap = gating.capacity(xm.shape[0], E, self.k, self.f)
        r = self._gate(xm, cap)
        G = self._dispatch(xm, r, cap)
        R = self._op(ag.all_to_all, dump(G, L), EPESP)
        B = self._op(ag.all_to_all, self._experts(R), EPESP)
        Om = self._combine(local_combine(B, L), r, cap)
        self._note("s1", xm.shape[0], cap, R.shape[0] * cap)
        return self._op(ag.gather_rows, Om, MP)

    def _s2(self, x, aas: bool, label: str = ""):
        L, E, n_mp = self.layout, self.layout.num_experts, self.layout.n_mp
        cap = gating.capacity(x.shape[0], E, self.k, self.f, multiple=n_mp)  # T_2
        r = self._gate(x, cap)
        G = self._dispatch(x, r, cap)
        t2 = cap // n_mp
        if n_mp > 1 and self.saa_backward and not aas:
            R = _SlotSplitDumpA2A.apply(G, torch.empty(0, requires_grad=torch.is_grad_enabled()), self.comm, L,
                                        self.saa_combine)
        else:
            R = self._op(ag.all_to_all, dump(self._op(ag.split_rows, G, MP, dim=1), L), EPESP)
        Yp = self._experts(R)
        if aas or n_mp == 1:
            C = self._op(ag.gather_rows, local_combine(self._op(ag.all_to_all, Yp, EPESP), L), MP, dim=1)
        else:
            c = self.saa_combine
            ob = _SAAGather.apply(Yp, torch.empty(0, requires_grad=torch.is_grad_enabled()), self.comm, c)
            C = ob.view(n_mp, L.n_ep, L.n_esp // c, L.e_local, t2, -1).sum(2)  # [N_MP, N_EP, E_l, t2, M]
            C = C.reshape(n_mp, E, t2, -1).transpose(0, 1).reshape(E, cap, -1)
        self._note(label or ("s2_aas" if aas else "s2"), x.shape[0], cap, R.shape[0] * t2)
        return self._combine(C, r, cap)
