"""The MoE layer as stages, each a method a strategy may override (Megatron-Core's staged dispatcher):

    route -> exchange_counts -> place(counts) -> plan -> materialize
          -> dispatch_preprocess / token_dispatch (all-to-all) / dispatch_postprocess
          -> compute_experts
          -> combine_preprocess / token_combine (all-to-all) / combine_postprocess

``place`` gives this call's placement (a pure policy, :mod:`moelab.placement.policy`); ``materialize``
brings the parameters of experts it puts on ranks that do not hold them (and returns their
gradients in backward, :mod:`moelab.moe.materialize`). ``dispatch_compute_combine`` chains the stages
from ``materialize`` on, for a strategy that pipelines them as one
(FasterMoE's smart schedule). Backward mirrors the stages through autograd (the all-to-alls are
autograd Functions). The gate rule and the dispatcher are looked up by name in registries
(:func:`moelab.moe.gates.register_gate`, :func:`moelab.moe.dispatch.register_dispatcher`), so a
strategy adds one without editing the core. Usable as a drop-in replacement of a Transformer FFN:
``y = layer(x)`` for any ``x[..., d_model]``; the auxiliary loss is left in ``layer.aux_loss`` for
the model to add, and :meth:`MoELayer.plan_record` describes the call's plan as JSON-able data.

``layer.aux_loss`` is this rank's: its gate saw this rank's tokens only (DeepSpeed's per-device
``l_aux``). What training adds is :func:`global_aux_losses` (through the model's ``aux_loss()``): the
balance loss over the global batch, so the loss and its gradients do not depend on how the batch is
split over the ranks (a checkpoint resumes at another EP size with the same losses).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from moelab.comm.door import Communicator
from moelab.comm.topology import Topology
from moelab.config import MoEConfig
from moelab.moe.dispatch import DISPATCHERS, CountExchange, DispatchPlan
from moelab.moe.experts import Experts, seeded_generator
from moelab.moe.gates import Gate
from moelab.moe.materialize import Materialization, Materializer
from moelab.moe.routing import Routing, balance_share
from moelab.placement import Placement


def init_gate_(gate: Gate, seed: int, layer_id: int) -> None:
    """Gate weights identical on every rank (and in the reference): seeded by (seed, layer)."""
    g = seeded_generator("gate", seed, layer_id)
    bound = 1 / math.sqrt(gate.wg.in_features)
    w = (torch.rand(gate.wg.weight.shape, generator=g, dtype=torch.float64) * 2 - 1) * bound
    with torch.no_grad():
        gate.wg.weight.copy_(w.to(gate.wg.weight.dtype))


def global_aux_losses(layers: Sequence, group: str = "dp") -> list:
    """The auxiliary loss of each of ``layers``' last forward, with its balance loss taken over the global
    batch: the tokens of every rank of ``group`` (the ranks that split one batch, over which the
    data-parallel sync averages the replicated gate's gradients: ``dp`` for every strategy built on
    :class:`MoELayer`, a packed layer's block included).

    One all-reduce (SUM) of every layer's first-choice counts (int64, ``E`` per layer), then per layer
    ``balance_loss_coef * balance_share + z_term`` (:func:`moelab.moe.routing.balance_share`): this
    rank's share, whose mean over the ranks is ``coef * E * sum_e f_e * P_e`` of the global batch and
    whose gradients, averaged by the sync, are that loss's exactly. The z-loss stays the rank's mean
    of ``logsumexp^2``, which is the global mean when every rank holds as many tokens (training does).
    The all-reduce is collective over ``group`` (every rank calls this after the same forward, before
    backward) and is training traffic like any other: recorded and link-emulated, ``8 E`` bytes per layer
    in one call (:func:`balance_allreduce_bytes`), which the simulator's iteration graph prices at the
    same point with the same record (:func:`moelab.sim.graphs.transformer_iteration_graph`).

    A layer keeps its own ``aux_loss`` (this rank's tokens) when it has no balance statistics (a gate
    without auxiliary loss, a layer not built on :class:`MoELayer`: Parm's), a balance coefficient of 0,
    or a one-rank ``group`` (its tokens are then the whole batch). Returns one tensor (or None) per layer."""
    out = [getattr(m, "aux_loss", None) for m in layers]
    todo: dict = {}  # id(communicator) -> (communicator, [(layer index, stats)]): the same order on every rank
    for i, m in enumerate(layers):
        stats = getattr(getattr(m, "last_routing", None), "balance_stats", None)
        if stats is None or not m.cfg.balance_loss_coef > 0:
            continue
        base = getattr(m.comm, "base", m.comm)  # a GroupView's whole world: the batch spans every block
        if len(base.group_ranks(group)) > 1:
            todo.setdefault(id(base), (base, []))[1].append((i, stats))
    for base, items in todo.values():
        counts = torch.cat([s.top1_counts for _, s in items])
        with base.rec.tagged(phase="fwd"):  # the forward's last collective (the simulator's too)
            base.all_reduce_(counts, group=group)
        ranks, off = len(base.group_ranks(group)), 0
        for i, s in items:
            E = s.top1_counts.numel()
            out[i] = layers[i].cfg.balance_loss_coef * balance_share(s, counts[off:off + E], ranks) + s.z_term
            off += E
    return out


GATES_WITHOUT_BALANCE_STATS = frozenset({"base"})  # balanced by construction (:mod:`moelab.moe.base_gate`)


def balance_allreduce_bytes(moe_cfg: MoEConfig, n_layers: int, group_size: int) -> int:
    """Bytes of the one all-reduce :func:`global_aux_losses` issues per step for ``n_layers`` layers of
    ``moe_cfg`` built on :class:`MoELayer`, sharing one communicator, over a ``group_size``-rank group:
    ``8 E`` per layer (int64 first-choice counts); 0 when it issues none (the gate keeps no balance
    statistics, the balance coefficient is 0, one rank, no layer). The simulator's one rule for it."""
    if (moe_cfg.gate in GATES_WITHOUT_BALANCE_STATS or not moe_cfg.balance_loss_coef > 0 or group_size <= 1
            or n_layers <= 0):
        return 0
    return n_layers * moe_cfg.num_experts * torch.int64.itemsize


class MoELayer(nn.Module):
    def __init__(self, d_model: int, d_ff: int, moe_cfg: MoEConfig, layer_id: int = 0, seed: int = 0,
                 comm: Optional[Communicator] = None, placement: Optional[Placement] = None,
                 dtype=torch.float32):
        super().__init__()
        self.cfg, self.layer_id, self.seed = moe_cfg, layer_id, seed
        self.comm = comm if comm is not None else Communicator(Topology(1, 1))
        self.placement = placement or Placement.expert_parallel(moe_cfg.num_experts, self.comm.world_size)
        if self.placement.world_size != self.comm.world_size or self.placement.num_experts != moe_cfg.num_experts:
            raise ValueError("placement does not match the communicator's world size or the expert count")
        if moe_cfg.dispatcher not in DISPATCHERS:
            raise ValueError(f"unknown dispatcher model.moe.dispatcher={moe_cfg.dispatcher!r}; "
                             f"registered: {sorted(DISPATCHERS)}")
        self.gate = Gate(d_model, moe_cfg, dtype=dtype)
        init_gate_(self.gate, seed, layer_id)
        self.experts = Experts(d_model, d_ff, self.placement.local_experts(self.comm.rank), seed=seed,
                               layer_id=layer_id, activation=moe_cfg.activation, bias=moe_cfg.expert_bias, dtype=dtype)
        self.experts.kernels = moe_cfg.kernels
        self.dispatcher = self._dispatcher(self.placement)
        self.forward_calls = 0
        self.aux_loss = torch.zeros(())
        self.last_counts = torch.zeros(moe_cfg.num_experts, dtype=torch.int64)
        self.last_global_counts = None
        self.last_routing = None
        self.last_plan: Optional[DispatchPlan] = None
        self.last_materialized: Tuple[int, ...] = ()
        self._call_materialized: dict = {}  # this call's materialized slots (reset after each forward)

    def route_rng(self) -> Optional[torch.Generator]:
        """Random routing draws from (seed, layer, call, global rank): reproducible and rank-distinct, the
        same whatever group the layer runs its experts over (a :class:`~moelab.comm.view.GroupView`'s base)."""
        if not self.cfg.random_routing:
            return None
        rank = getattr(self.comm, "base", self.comm).rank
        return seeded_generator("route", self.seed, self.layer_id, self.forward_calls, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        rec = self.comm.rec
        with rec.tagged(layer=self.layer_id, phase="fwd"):
            with rec.span("gate", "gate"):
                routing = self.route(x)
            counts = self.exchange_counts(routing)
            placement, shadowed = self.place(counts.counts)
            plan = self.plan(routing, counts, placement, shadowed)
            self.last_materialized = ()  # set by the materialization, if this call has one
            try:
                y = self.dispatch_compute_combine(x, plan, routing)
            finally:
                self._call_materialized = {}  # the call's graph keeps them; nothing survives the call
        self.forward_calls += 1
        self.aux_loss = routing.aux_loss
        self.last_routing = routing
        self.last_plan = plan
        self.last_global_counts = plan.global_counts
        self.last_counts = plan.global_counts[self.comm.rank]
        return y.reshape(shape)

    # ---- route, count exchange, place, plan ---------------------------------------------------
    def route(self, x: torch.Tensor) -> Routing:
        return self.gate(x, rng=self.route_rng())

    def exchange_counts(self, routing: Routing) -> CountExchange:
        return self.dispatcher.exchange_counts(routing)

    def place(self, counts: torch.Tensor) -> Tuple[Placement, Tuple[int, ...]]:
        """This call's placement and the experts computed where their rows are (shadowed), from the
        global ``[N, E]`` counts. The default: the static placement, nothing shadowed. A placement
        may add holders (materialized for the call), not take an expert from a rank holding it."""
        return self.placement, ()

    def plan(self, routing: Routing, counts: CountExchange, placement: Placement,
             shadowed: Sequence[int] = ()) -> DispatchPlan:
        here = placement.local_experts(self.comm.rank)
        if not set(self.experts.experts) <= set(here):
            raise ValueError(f"this call's placement puts experts {here} on rank "
                             f"{self.comm.rank}, whose expert slots hold {self.experts.experts}")
        return self.dispatcher.plan_from_counts(counts, routing, placement, shadowed)

    def materialization(self, plan: DispatchPlan) -> Materialization:
        """The experts this call materializes: those its placement puts outside their static holders."""
        if plan.placement is None or plan.placement is self.placement:
            return Materialization((), (), (), ())
        return Materialization.between(self.placement, plan.placement, plan.global_counts)

    def materialize(self, x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Bring this call's materialized experts (:mod:`moelab.moe.materialize`); returns ``x``
        passed through the materialization, which every later stage must read (it orders the
        broadcasts before the dispatch and the gradient reduces after its backward)."""
        mat = self.materialization(plan)
        self.last_materialized = mat.experts
        if not mat.experts:
            return x
        x, self._call_materialized = Materializer(self.comm, self.experts, mat).apply(x, self.experts.stacked())
        return x

    # ---- dispatch, experts, combine -------------------------------------------------------------
    def dispatch_compute_combine(self, x: torch.Tensor, plan: DispatchPlan, routing: Routing) -> torch.Tensor:
        x = self.materialize(x, plan)
        xe = self.dispatch_postprocess(self.token_dispatch(self.dispatch_preprocess(x, plan, routing), plan), plan)
        with self.comm.rec.span("experts", "expert"):
            ye = self.compute_experts(xe, plan)
        back = self.token_combine(self.combine_preprocess(ye, plan), plan)
        return self.combine_postprocess(back, x, plan, routing)

    def dispatch_preprocess(self, x: torch.Tensor, plan: DispatchPlan, routing: Routing) -> torch.Tensor:
        return self.dispatcher.dispatch_preprocess(x, plan, routing)

    def token_dispatch(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return self.dispatcher.token_dispatch(rows, plan)

    def dispatch_postprocess(self, recv: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return self.dispatcher.dispatch_postprocess(recv, plan)

    def compute_experts(self, xe: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        here = plan.placement.local_experts(self.comm.rank) if plan.placement is not None else self.experts.experts
        if here == self.experts.experts:
            return self.experts(xe, plan.rows_per_slot)
        return self.experts(xe, plan.rows_per_slot, experts=here, materialized=self._call_materialized)

    def combine_preprocess(self, ye: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return self.dispatcher.combine_preprocess(ye, plan)

    def token_combine(self, back: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return self.dispatcher.token_combine(back, plan)

    def combine_postprocess(self, back: torch.Tensor, x: torch.Tensor, plan: DispatchPlan,
                            routing: Routing) -> torch.Tensor:
        """``x`` is the layer input, for strategies that compute some rows here (shadowed experts)."""
        return self.dispatcher.combine_postprocess(back, plan, routing)

    def set_placement(self, placement: Placement, tensors: Sequence[Optional[torch.Tensor]]) -> None:
        """Swap the static placement and this rank's expert slots (a migration: Hecate's Alg. 2,
        SmartMoE, FlexMoE; :mod:`moelab.moe.migrate`). ``tensors``: the new stacked ``[w1, b1, w2, b2]``
        of ``placement.local_experts(rank)`` (any count, 0 included), moved from their old holders,
        never re-initialised. The stacked parameters become new ``nn.Parameter`` objects (their shapes
        change): whoever holds the old ones (optimizer, hooks) must follow them
        (:meth:`moelab.runtime.update.Update.refresh_params`)."""
        if placement.world_size != self.comm.world_size or placement.num_experts != self.cfg.num_experts:
            raise ValueError("placement does not match the communicator's world size or the expert count")
        here = tuple(placement.local_experts(self.comm.rank))
        ex = self.experts
        for name, t in zip(("w1", "b1", "w2", "b2"), tensors):
            if (t is None) != (getattr(ex, name) is None):
                raise ValueError(f"set_placement: {name} given={t is not None}, the experts have it: "
                                 f"{getattr(ex, name) is not None}")
            if t is None:
                continue
            if t.shape[0] != len(here):
                raise ValueError(f"set_placement: {name} stacks {t.shape[0]} experts, the rank holds {len(here)}")
            p = nn.Parameter(t.detach(), requires_grad=getattr(ex, name).requires_grad)
            p.moelab_expert = True
            setattr(ex, name, p)
        ex.experts = here
        self.placement = placement
        self.dispatcher = self._dispatcher(placement)

    def _dispatcher(self, placement: Placement):
        d = DISPATCHERS[self.cfg.dispatcher](self.comm, placement)
        d.kernels = self.cfg.kernels  # model.moe.kernels: the sparse dispatcher's permute / unpermute
        return d

    # ---- the plan as data -------------------------------------------------------------------------
    def plan_record(self) -> dict:
        """JSON-able description of the latest call's plan (one line of ``plans.jsonl``): layer, call,
        dispatcher, global counts; the placement when it is not plain EP; the shadow set and the
        materialized experts if any;
        the capacity when the dispatcher pads to one."""
        plan = self.last_plan
        if plan is None:
            raise RuntimeError("plan_record() needs a forward call first")
        rec = {"layer": self.layer_id, "call": self.forward_calls - 1, "dispatcher": self.cfg.dispatcher,
               "counts": plan.global_counts.tolist()}
        pl = plan.placement
        if pl is not None and not pl.is_expert_parallel:
            rec["placement"] = pl.to_record()
        if plan.shadowed:
            rec["shadowed"] = list(plan.shadowed)
        if self.last_materialized:
            rec["materialized"] = list(self.last_materialized)
        if plan.capacity is not None:
            rec["capacity"] = plan.capacity
        return rec
