"""FasterMoE's MoE layer: the core :class:`~moelab.moe.layer.MoELayer` with the stages FasterMoE
changes - route (topology-aware gate), place (dynamic shadowing) and dispatch+compute+combine
(smart schedule) - each switched by an option (:mod:`.options`).

Per forward (spec §2.4 runtime protocol; every collective in the same order on every rank):

1. gate -> routing; the count exchange ``C = all_gather(lec)`` (the core's, done here because the
   shadow set has to be known before the dispatch plan);
2. ``S = select_shadows(C)`` (pure, same on every rank) or the forced set; sorted by expert id;
3. the tokens of non-shadowed experts go through the sparse path (uneven all-to-all, experts,
   reverse all-to-all) - or the smart schedule;
4. for each ``e in S`` the owner broadcasts the current parameters of e (one flat buffer,
   ``Communicator.broadcast_``); every rank runs its own tokens for e on a private graph built on
   the broadcast tensors, writing the outputs straight to their slots (never through the
   all-to-all).

Backward: the private graphs give ``grad_x`` locally and a flat parameter grad per shadowed
expert, ``reduce``d (SUM) to the owner (``Communicator.reduce_``; a rank with no token for e joins
with zeros) and returned as the owner's parameter gradient, so autograd *adds* it to whatever the
owner's grad holds (micro-batch accumulation works). Shadow buffers live in the autograd context
only: nothing is cached across iterations (the params change every step).

Ordering: the shadow work is one autograd Function that takes the combine all-to-all's output as a
pass-through input, so in forward it runs after that all-to-all (broadcasts after it) and in
backward before its backward (reduces first) - by data dependence, not by the engine's scheduling.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from moelab.moe.dispatch import DispatchPlan, block_permutation, combine_slots
from moelab.moe.layer import MoELayer
from moelab.strategies.fastermoe.options import FasterMoEOptions
from moelab.strategies.fastermoe.shadow import select_shadows
from moelab.strategies.fastermoe.topo_gate import TopoGate


# ---- the expert FFN on explicit tensors (same arithmetic as Experts.forward_slot) --------------------
def ffn(x: torch.Tensor, w1, b1, w2, b2, act) -> torch.Tensor:
    h = x @ w1
    if b1 is not None:
        h = h + b1
    y = act(h) @ w2
    if b2 is not None:
        y = y + b2
    return y


def expert_param_shapes(experts) -> list:
    """Shapes of one expert's tensors (w1, b1, w2, b2; None where there is no bias)."""
    return [None if p is None else tuple(p.shape[1:]) for p in (experts.w1, experts.b1, experts.w2, experts.b2)]


def flatten_slot(params: Sequence[Optional[torch.Tensor]], slot: int) -> torch.Tensor:
    return torch.cat([p[slot].detach().reshape(-1) for p in params if p is not None])


def unflatten(buf: torch.Tensor, shapes) -> list:
    out, off = [], 0
    for shp in shapes:
        if shp is None:
            out.append(None)
            continue
        n = 1
        for v in shp:
            n *= v
        out.append(buf[off:off + n].view(shp))
        off += n
    return out


@dataclass
class ShadowPlan:
    """Who computes what for the shadowed experts, as data."""

    experts: Tuple[int, ...]  # S, sorted by id
    owners: Tuple[int, ...]  # owner rank of each
    slots: Tuple[int, ...]  # the expert's slot on its owner
    counts: Tuple[int, ...]  # this rank's assignments for each (rows of x_shadow, in this order)
    totals: Tuple[int, ...]  # global assignments for each
    pos: torch.Tensor  # flat (token*k + j) slot index of each shadow row, expert-major


class ShadowWork:
    """Broadcast + private compute of the shadowed experts (forward), and the private backward +
    reduce to the owner (backward). Used by both the plain and the smart path."""

    def __init__(self, layer: "FasterMoELayer", plan: ShadowPlan):
        self.comm, self.plan = layer.comm, plan
        self.me = layer.comm.rank
        self.shapes = expert_param_shapes(layer.experts)
        self.act = layer.experts.act
        self.graphs = []

    def broadcast(self, params, e_index: int) -> list:
        """Collective: the owner's current params of ``S[e_index]`` on every rank, as fresh leaves."""
        pl = self.plan
        o, slot = pl.owners[e_index], pl.slots[e_index]
        real = [p for p in params if p is not None]
        if self.me == o:
            buf = flatten_slot(params, slot).clone()
        else:
            n = sum(p[0].numel() for p in real)
            buf = torch.empty(n, dtype=real[0].dtype, device=real[0].device)
        self.comm.broadcast_(buf, root=o)
        return [None if t is None else t.detach().requires_grad_() for t in unflatten(buf, self.shapes)]

    def compute(self, x_rows: torch.Tensor, leaves: list) -> torch.Tensor:
        xe = x_rows.detach().requires_grad_()
        with torch.enable_grad():
            ye = ffn(xe, *leaves, act=self.act)
        self.graphs.append((xe, leaves, ye))
        return ye.detach()

    def forward(self, xs: torch.Tensor, params) -> torch.Tensor:
        outs, off = [], 0
        for i, n in enumerate(self.plan.counts):
            leaves = self.broadcast(params, i)
            outs.append(self.compute(xs[off:off + n], leaves))
            off += n
        return torch.cat(outs, 0) if outs else xs.new_zeros(0, xs.shape[1])

    def backward_expert(self, i: int, g_rows: torch.Tensor):
        """Private backward of ``S[i]``: ``(grad_x_rows, flat param grad)`` (reduce not done here)."""
        xe, leaves, ye = self.graphs[i]
        real = [t for t in leaves if t is not None]
        grads = torch.autograd.grad(ye, [xe] + real, g_rows, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, [xe] + real)]
        return grads[0], torch.cat([g.reshape(-1) for g in grads[1:]])

    def reduce_to_owner(self, i: int, flat: torch.Tensor, acc: list) -> None:
        """Collective: SUM the flat grads of ``S[i]`` onto its owner; the owner adds them into ``acc``
        (full-size grads of its stacked params, created on demand)."""
        pl = self.plan
        o = pl.owners[i]
        self.comm.reduce_(flat, root=o)
        if self.me != o or pl.totals[i] == 0:  # no token anywhere: EP would leave no grad either
            return
        for j, g in enumerate(unflatten(flat, self.shapes)):
            if g is None:
                continue
            acc[j][pl.slots[i]] += g

    def backward(self, g_ys: torch.Tensor, params) -> tuple:
        acc = [None if p is None else torch.zeros_like(p) for p in params]
        touched = False
        gx, off = [], 0
        for i, n in enumerate(self.plan.counts):
            g_rows, flat = self.backward_expert(i, g_ys[off:off + n])
            gx.append(g_rows)
            off += n
            self.reduce_to_owner(i, flat, acc)
            touched |= self.me == self.plan.owners[i] and self.plan.totals[i] > 0
        self.graphs = []
        gx = torch.cat(gx, 0) if gx else g_ys.new_zeros(0, g_ys.shape[1])
        return gx, [a if touched else None for a in acc]


class _ShadowFn(torch.autograd.Function):
    """``(back, ys) = f(back, xs, work, *params)``: ``back`` passes through (it orders the shadow
    collectives after the combine all-to-all in forward and before its backward)."""

    @staticmethod
    def forward(ctx, back, xs, work, *params):
        ctx.work = work
        ctx.tags = dict(work.comm.rec.tags)  # the layer's tags, for the backward's records
        ctx.save_for_backward(*[p for p in params])
        return back, work.forward(xs, params)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_back, g_ys):
        params = ctx.saved_tensors
        with ctx.work.comm.rec.tagged(**{**ctx.tags, "phase": "bwd"}):
            gx, gp = ctx.work.backward(g_ys.contiguous(), params)
        ctx.work = None
        return (g_back, gx, None, *gp)


class FasterMoELayer(MoELayer):
    """MoELayer + FasterMoE options (see :mod:`.options`). Takes MoELayer's arguments plus
    ``options`` (a dict or :class:`FasterMoEOptions`).

    - Plain EP placement and the sparse dispatcher only (checked, clear errors).
    - ``shadow_log`` keeps the shadow set of every forward (Fig. 11's experts x iterations map);
      ``last_shadowed`` the latest.
    - The topology-aware gate routes *before* this forward's shadow decision exists (the decision
      needs the counts the gate produces), so it treats the forced set, or this layer's previous
      decision, as local.
    - The smart schedule's comm thread is shared by every layer of one communicator
      (:func:`.smart_schedule.comm_stream`)."""

    def __init__(self, d_model: int, d_ff: int, moe_cfg, layer_id: int = 0, seed: int = 0, comm=None,
                 placement=None, dtype=torch.float32, options=None):
        super().__init__(d_model, d_ff, moe_cfg, layer_id=layer_id, seed=seed, comm=comm, placement=placement,
                         dtype=dtype)
        self.options = options if isinstance(options, FasterMoEOptions) else FasterMoEOptions.from_dict(options)
        self.options.check_against(moe_cfg.num_experts, self.comm.world_size, moe_cfg.top_k, moe_cfg.gate,
                                   moe_cfg.dispatcher, has_placement=not self.placement.is_trivial)
        self.d_model, self.d_ff = d_model, d_ff
        self.E_local = moe_cfg.num_experts // self.comm.world_size
        if self.options.topo_gate:
            tg = TopoGate(d_model, moe_cfg, topo=self.comm.topo, placement=self.placement, rank=self.comm.rank,
                          fraction=self.options.topo_fraction, strict=self.options.topo_strict, dtype=dtype)
            tg.load_state_dict(self.gate.state_dict())
            self.gate = tg
        self.group_size = min(self.options.group_size, self.comm.world_size)
        self.last_shadowed: Tuple[int, ...] = ()
        self.shadow_log: list = []  # the shadow set of every forward (Fig. 11's map)

    # ---- place: the shadow decision --------------------------------------------------------------
    def decide_shadows(self, C: torch.Tensor) -> Tuple[int, ...]:
        o = self.options
        if o.shadow_force is not None:
            return tuple(o.shadow_force)
        if not o.shadow:
            return ()
        return select_shadows(C.to(torch.float64).numpy(), h=o.shadow_d_model or self.d_model,
                              h_ff=o.shadow_d_ff or self.d_ff, P=o.shadow_gpu_flops, W_net=o.shadow_net_bw,
                              s=o.shadow_elem_bytes, c=o.shadow_comm_factor, max_shadow=o.shadow_max,
                              exact=o.shadow_exact)

    def plan(self, routing) -> Tuple[DispatchPlan, ShadowPlan]:
        """Count exchange, shadow decision, and the sparse plan of the non-shadowed assignments."""
        E, N, me, El = self.cfg.num_experts, self.comm.world_size, self.comm.rank, self.E_local
        flat = routing.idx.reshape(-1).cpu()
        valid_pos = (flat >= 0).nonzero().squeeze(1)
        experts = flat[valid_pos]
        lec = torch.bincount(experts, minlength=E).to(torch.int64)
        C = self.comm.all_gather(lec, group="ep")  # [N, E]: the count exchange
        S = self.decide_shadows(C)
        shadowed = torch.zeros(E, dtype=torch.bool)
        if S:
            shadowed[list(S)] = True
        keep = ~shadowed[experts]
        kept_pos, kept_exp = valid_pos[keep], experts[keep]
        order = torch.argsort(kept_exp, stable=True)  # rank-major ids: dest-major, then local slot
        send_pos = kept_pos[order]
        in_rows = torch.bincount(kept_exp // El, minlength=N).tolist()
        local = list(range(me * El, (me + 1) * El))
        recv_counts = C[:, local].clone()
        recv_counts[:, shadowed[local]] = 0
        plan = DispatchPlan(C, in_rows, recv_counts.sum(1).tolist(), recv_counts.sum(0).tolist(),
                            send_pos=send_pos, recv_perm=block_permutation(recv_counts), recv_counts=recv_counts)
        sh_pos, sh_exp = valid_pos[~keep], experts[~keep]
        o2 = torch.argsort(sh_exp, stable=True)
        counts = torch.bincount(sh_exp, minlength=E)
        totals = C.sum(0)
        sp = ShadowPlan(tuple(S), tuple(e // El for e in S), tuple(e % El for e in S),
                        tuple(int(counts[e]) for e in S), tuple(int(totals[e]) for e in S), sh_pos[o2])
        return plan, sp

    # ---- forward ---------------------------------------------------------------------------------
    def expert_params(self) -> list:
        ex = self.experts
        return [ex.w1, ex.b1, ex.w2, ex.b2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        rec = self.comm.rec
        with rec.tagged(layer=self.layer_id, phase="fwd"):
            with rec.span("gate", "gate"):
                if isinstance(self.gate, TopoGate):
                    hint = self.options.shadow_force if self.options.shadow_force is not None else self.last_shadowed
                    routing = self.gate(x, rng=self.route_rng(), shadowed=hint)
                else:
                    routing = self.gate(x, rng=self.route_rng())
            plan, sp = self.plan(routing)
            if self.options.smart:
                y = self._smart_forward(x, plan, sp, routing)
            else:
                y = self._sparse_forward(x, plan, sp, routing)
        self.forward_calls += 1
        self.aux_loss = routing.aux_loss
        self.last_routing = routing
        self.last_global_counts = plan.global_counts
        self.last_counts = plan.global_counts[self.comm.rank]
        self.last_shadowed = sp.experts
        self.shadow_log.append(sp.experts)
        return y.reshape(shape)

    def _sparse_forward(self, x, plan: DispatchPlan, sp: ShadowPlan, routing) -> torch.Tensor:
        rec, d = self.comm.rec, self.dispatcher
        T, k = routing.idx.shape
        xe = d.dispatch(x, plan, routing)
        with rec.span("experts", "expert"):
            ye = self.experts(xe, plan.rows_per_slot)
        back = torch.empty_like(ye).index_copy(0, plan.recv_perm.to(ye.device), ye)
        back = self.comm.all_to_all(back, plan.in_rows, plan.out_rows)
        out_flat = back.new_zeros(T * k, back.shape[1])
        if sp.experts:
            xs = x[(sp.pos // k).to(x.device)]
            with rec.span("shadow", "expert"):
                back, ys = _ShadowFn.apply(back, xs, ShadowWork(self, sp), *self.expert_params())
            out_flat = out_flat.index_copy(0, sp.pos.to(ys.device), ys)
        out_flat = out_flat.index_copy(0, plan.send_pos.to(back.device), back)
        return combine_slots(out_flat, routing.weights)

    def _smart_forward(self, x, plan: DispatchPlan, sp: ShadowPlan, routing) -> torch.Tensor:
        from moelab.strategies.fastermoe.smart_schedule import SmartMoE, SmartPipeline, SmartPlan, TAG_STRIDE, comm_stream

        T, k = routing.idx.shape
        N, El, me = self.comm.world_size, self.E_local, self.comm.rank
        lec = plan.global_counts[me].clone()
        if sp.experts:
            lec[list(sp.experts)] = 0
        splan = SmartPlan(me, N, self.group_size, lec.view(N, El), plan.recv_counts,
                          tag_base=(self.layer_id % 10000) * 4 * TAG_STRIDE)
        shadow = ShadowWork(self, sp) if sp.experts else None
        pipe = SmartPipeline(self.comm, comm_stream(self.comm, self.options.smart_threaded), splan,
                             self.experts.act, shadow)
        x_send = x[(plan.send_pos // k).to(x.device)]
        xs = x[(sp.pos // k).to(x.device)] if sp.experts else x.new_zeros(0, x.shape[1])
        y_back, ys = SmartMoE.apply(x_send, xs, pipe, *self.expert_params())
        out_flat = y_back.new_zeros(T * k, y_back.shape[1]).index_copy(0, plan.send_pos.to(y_back.device), y_back)
        if sp.experts:
            out_flat = out_flat.index_copy(0, sp.pos.to(ys.device), ys)
        return combine_slots(out_flat, routing.weights)
