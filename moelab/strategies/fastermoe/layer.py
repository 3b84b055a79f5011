"""FasterMoE's MoE layer: the core :class:`~moelab.moe.layer.MoELayer` with the stages FasterMoE
changes - route (topology-aware gate), place (dynamic shadowing) and dispatch+compute+combine
(smart schedule) - each switched by an option (:mod:`.options`). Everything else is the core's.

Dynamic shadowing is one instance of placement per iteration (:mod:`moelab.placement.policy`):

1. route (the gate, or the topology gate with the shadow hint); the core's count exchange
   ``C = all_gather(lec)``;
2. place: ``S = select_shadows(C)`` (pure, same on every rank) or the forced set, sorted by id;
   this call's placement is :func:`~moelab.placement.policy.replicate` of ``S`` on every rank, so
   by the default rule (a holder keeps its own tokens) every row of a shadowed expert is computed
   where it is;
3. plan: the core's :func:`~moelab.moe.dispatch.plan_from_counts` with ``shadowed=S``: those rows are
   kept out of the all-to-all altogether (``plan.shadow_pos``; not even as self-sends), so the
   recorded bytes per collective are FasterMoE's;
4. materialize (the core's stage, :mod:`moelab.moe.materialize`): the owner of each ``e in S``
   broadcasts its parameters; in backward every rank's gradient of them is reduced (SUM) to the
   owner and added to its gradient (a rank with no token for e joins with zeros);
5. the other rows go through the sparse path (uneven all-to-all, experts, reverse all-to-all) and
   the shadowed rows through the same expert code on the call's slots (``combine_postprocess``) -
   or everything through the smart schedule (``dispatch_compute_combine``), which issues the same
   materializer's broadcasts and reduces as tasks on its comm stream.

Nothing is cached across iterations: the broadcast buffers live in the call's autograd graph.
"""
from __future__ import annotations

from typing import Tuple

import torch

from moelab.moe.dispatch import DispatchPlan
from moelab.moe.layer import MoELayer
from moelab.moe.materialize import Materialization, Materializer
from moelab.placement.policy import replicate
from moelab.strategies.fastermoe.options import FasterMoEOptions
from moelab.strategies.fastermoe.shadow import shadow_decision
from moelab.strategies.fastermoe.smart_schedule import TAG_STRIDE, SmartMoE, SmartPipeline, SmartPlan, comm_stream
from moelab.strategies.fastermoe.topo_gate import TopoGate


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
        self.last_shadow_decision = None  # the policy's ShadowDecision (modelled times), None when forced/off

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
        self.last_shadow_decision = None
        if o.shadow_force is not None:
            return tuple(o.shadow_force)
        if not o.shadow:
            return ()
        d = shadow_decision(C.to(torch.float64).numpy(), h=o.shadow_d_model or self.d_model,
                            h_ff=o.shadow_d_ff or self.d_ff, P=o.shadow_gpu_flops, W_net=o.shadow_net_bw,
                            s=o.shadow_elem_bytes, c=o.shadow_comm_factor, max_shadow=o.shadow_max,
                            exact=o.shadow_exact)
        self.last_shadow_decision = d  # what the policy compared: t_imbl vs t_chosen (the modelled gain)
        return d.chosen

    def place(self, counts: torch.Tensor):
        """The shadow decision as this call's placement: the shadowed experts on every rank."""
        S = self.decide_shadows(counts)
        return replicate(self.placement, S), S

    # ---- the shadowed experts' rows, computed where they are ---------------------------------
    def expert_params(self) -> list:
        return self.experts.stacked()

    def combine_postprocess(self, back, x, plan: DispatchPlan, routing) -> torch.Tensor:
        """``x`` has passed through the materialization (the core's stage): the shadowed rows run on
        this call's slots (owned here, else materialized), through the core's expert code."""
        ys = None
        if plan.shadowed:
            k = routing.idx.shape[1]
            xs = x.index_select(0, (plan.shadow_pos // k).to(x.device))
            with self.comm.rec.span("shadow", "expert"):
                ys = self.experts(xs, plan.shadow_counts, experts=plan.shadowed, materialized=self._call_materialized)
        return self.dispatcher.combine_postprocess(back, plan, routing, shadow_out=ys)

    # ---- the smart schedule: dispatch, compute and combine pipelined ------------------------------
    def dispatch_compute_combine(self, x, plan: DispatchPlan, routing) -> torch.Tensor:
        if not self.options.smart:
            return super().dispatch_compute_combine(x, plan, routing)
        N, me, static = self.comm.world_size, self.comm.rank, self.placement
        # the pipeline runs the held slots only: shadowed experts have no rows in the all-to-all
        send_counts = torch.stack([plan.send_split[list(static.local_experts(d)), d] for d in range(N)])
        here = plan.placement.local_experts(me)
        recv_counts = plan.recv_counts[:, [here.index(e) for e in static.local_experts(me)]]
        splan = SmartPlan(me, N, self.group_size, send_counts, recv_counts,
                          tag_base=(self.layer_id % 10000) * 4 * TAG_STRIDE)
        # every rank (the owner too) runs the shadowed rows on a fetched copy, inside the pipeline
        mat = Materialization.of(static, plan.shadowed, plan.global_counts)
        self.last_materialized = mat.experts
        materializer = Materializer(self.comm, self.experts, mat) if mat.experts else None
        pipe = SmartPipeline(self.comm, comm_stream(self.comm, self.options.smart_threaded), splan,
                             self.experts.act, materializer, plan.shadow_counts)
        k = routing.idx.shape[1]
        x_send = x.index_select(0, (plan.send_pos // k).to(x.device))
        xs = x.index_select(0, (plan.shadow_pos // k).to(x.device)) if plan.shadowed else x.new_zeros(0, x.shape[1])
        y_back, ys = SmartMoE.apply(x_send, xs, pipe, *self.expert_params())
        return self.dispatcher.combine_postprocess(y_back, plan, routing, shadow_out=ys if plan.shadowed else None)
