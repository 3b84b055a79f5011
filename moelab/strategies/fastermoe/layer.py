"""FasterMoE's MoE layer: the core :class:`~moelab.moe.layer.MoELayer` with the stages FasterMoE
changes - route (topology-aware gate), place (dynamic shadowing) and dispatch+compute+combine
(smart schedule) - each switched by an option (:mod:`.options`). Everything else is the core's.

Per forward (spec §2.4 runtime protocol; every collective in the same order on every rank):

1. route (the gate, or the topology gate with the shadow hint); the core's count exchange
   ``C = all_gather(lec)``;
2. place: ``S = select_shadows(C)`` (pure, same on every rank) or the forced set, sorted by id;
3. plan: the core's :func:`~moelab.moe.dispatch.plan_from_counts` with ``shadowed=S``: the rows of
   shadowed experts are not sent (``plan.shadow_pos``);
4. the other rows go through the sparse path (uneven all-to-all, experts, reverse all-to-all) - or
   the smart schedule (``dispatch_compute_combine``);
5. for each ``e in S`` the owner broadcasts the current parameters of e (one flat buffer,
   ``Communicator.broadcast_``); every rank runs its own rows for e on a private graph built on
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
from typing import Tuple

import torch

from moelab.moe.dispatch import DispatchPlan
from moelab.moe.experts import expert_param_shapes, ffn, flatten_slot, unflatten
from moelab.moe.layer import MoELayer
from moelab.strategies.fastermoe.options import FasterMoEOptions
from moelab.strategies.fastermoe.shadow import select_shadows
from moelab.strategies.fastermoe.smart_schedule import TAG_STRIDE, SmartMoE, SmartPipeline, SmartPlan, comm_stream
from moelab.strategies.fastermoe.topo_gate import TopoGate


@dataclass
class ShadowPlan:
    """Who computes what for the shadowed experts, as data (read off the call's dispatch plan)."""

    experts: Tuple[int, ...]  # S, sorted by id
    owners: Tuple[int, ...]  # owner rank of each
    slots: Tuple[int, ...]  # the expert's slot on its owner
    counts: Tuple[int, ...]  # this rank's assignments for each (rows of x_shadow, in this order)
    totals: Tuple[int, ...]  # global assignments for each
    pos: torch.Tensor  # flat (token*k + j) slot index of each shadow row, expert-major

    @classmethod
    def from_plan(cls, plan: DispatchPlan) -> "ShadowPlan":
        pl, S = plan.placement, plan.shadowed
        owners = tuple(pl.owner(e) for e in S)
        totals = plan.global_counts.sum(0)
        return cls(tuple(S), owners, tuple(pl.slot_of(o, e) for o, e in zip(owners, S)), tuple(plan.shadow_counts),
                   tuple(int(totals[e]) for e in S), plan.shadow_pos)


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
    ``options`` (a dict or :class:`FasterMoEOptions`). Overrides ``route`` (topology gate),
    ``place`` (the shadow decision), ``combine_postprocess`` (the shadowed experts' work) and, with
    ``smart``, ``dispatch_compute_combine`` (the pipelined schedule).

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
        if self.options.topo_gate:
            tg = TopoGate(d_model, moe_cfg, topo=self.comm.topo, placement=self.placement, rank=self.comm.rank,
                          fraction=self.options.topo_fraction, strict=self.options.topo_strict, dtype=dtype)
            tg.load_state_dict(self.gate.state_dict())
            self.gate = tg
        self.group_size = min(self.options.group_size, self.comm.world_size)
        self.last_shadowed: Tuple[int, ...] = ()
        self.shadow_log: list = []  # the shadow set of every forward (Fig. 11's map)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        self.last_shadowed = self.last_plan.shadowed
        self.shadow_log.append(self.last_shadowed)
        return y

    # ---- route: the topology-aware gate ----------------------------------------------------------
    def route(self, x: torch.Tensor):
        if isinstance(self.gate, TopoGate):
            hint = self.options.shadow_force if self.options.shadow_force is not None else self.last_shadowed
            return self.gate(x, rng=self.route_rng(), shadowed=hint)
        return super().route(x)

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

    def place(self, counts: torch.Tensor):
        return self.placement, self.decide_shadows(counts)

    # ---- the shadowed experts' work, after the combine all-to-all --------------------------------
    def expert_params(self) -> list:
        return self.experts.stacked()

    def combine_postprocess(self, back, x, plan: DispatchPlan, routing) -> torch.Tensor:
        ys = None
        if plan.shadowed:
            k = routing.idx.shape[1]
            xs = x.index_select(0, (plan.shadow_pos // k).to(x.device))
            with self.comm.rec.span("shadow", "expert"):
                back, ys = _ShadowFn.apply(back, xs, ShadowWork(self, ShadowPlan.from_plan(plan)),
                                           *self.expert_params())
        return self.dispatcher.combine_postprocess(back, plan, routing, shadow_out=ys)

    # ---- the smart schedule: dispatch, compute and combine pipelined ------------------------------
    def dispatch_compute_combine(self, x, plan: DispatchPlan, routing) -> torch.Tensor:
        if not self.options.smart:
            return super().dispatch_compute_combine(x, plan, routing)
        N, me, pl = self.comm.world_size, self.comm.rank, plan.placement
        send_counts = torch.stack([plan.send_split[list(pl.local_experts(d)), d] for d in range(N)])
        splan = SmartPlan(me, N, self.group_size, send_counts, plan.recv_counts,
                          tag_base=(self.layer_id % 10000) * 4 * TAG_STRIDE)
        shadow = ShadowWork(self, ShadowPlan.from_plan(plan)) if plan.shadowed else None
        pipe = SmartPipeline(self.comm, comm_stream(self.comm, self.options.smart_threaded), splan,
                             self.experts.act, shadow)
        k = routing.idx.shape[1]
        x_send = x.index_select(0, (plan.send_pos // k).to(x.device))
        xs = x.index_select(0, (plan.shadow_pos // k).to(x.device)) if plan.shadowed else x.new_zeros(0, x.shape[1])
        y_back, ys = SmartMoE.apply(x_send, xs, pipe, *self.expert_params())
        return self.dispatcher.combine_postprocess(y_back, plan, routing, shadow_out=ys if plan.shadowed else None)
