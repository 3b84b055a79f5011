"""The Hecate (FSSDP) MoE layer: the core layer with a sharding P as its static placement and, per call, a
materialization plan P' ⊇ P whose replicas come by SparseAllGather and whose gradients go back by
SparseReduceScatter (spec ``papers/hecate.md`` §2.1-§2.8).

Stages it changes: ``place`` (P', calibrated after the gate), ``materialize`` (the replicas enter the
graph; :mod:`.replicas`), ``compute_experts`` (re-materialization's gate). The plan P' of an iteration is
set by the driver (:class:`.update.HecateUpdate`: load window, Alg. 1, Alg. 2) with :meth:`begin_iteration`;
the driver also calls :meth:`prefetch` from a forward pre-hook on the block's attention, so the gather
runs while attention computes, and adds the owners' reduced gradients in its ``sync``. Without a driver
(a layer used on its own) P' = P plus ``replicate_force``, the gather is issued in ``materialize`` and
the reduce-scatter waited at the end of backward, which returns the owners' gradients through autograd.
Tokens go to holders by Hecate's rule (local, else same node, else any holder:
:class:`~moelab.placement.rules.LocalityFirst`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from moelab.comm.sparse import NODE_BACKENDS, sp_all_gather, sp_reduce_scatter, sparse_plan
from moelab.comm.stream import comm_stream
from moelab.moe.experts import expert_numel, expert_param_shapes, flatten_slot, unflatten
from moelab.moe.layer import MoELayer
from moelab.placement import Placement
from moelab.placement.rules import LocalityFirst
from moelab.sim.placement_cost import PlacementCost
from moelab.sim.profiles import get_profile
from moelab.strategies.hecate.policy import calibrate_plan, holders_of

from .options import LATER_GROUP, HecateOptions
from .replicas import ReplicaPool, materialize, rm_gate


class HecateCall:
    """What one forward call of a layer materialized, for its backward."""

    def __init__(self, layer: "HecateMoELayer", P, final, pool: ReplicaPool):
        self.layer, self.P, self.final, self.pool = layer, P, final, pool
        self.rm_handle = None
        # the same on every rank (the plan is global, not this rank's pool): RM frees, re-gathers and waits
        self.rm = bool(layer.options.rm and layer.driver is not None and not layer.is_last and torch.is_grad_enabled())

    def backward_end(self, g_rows):
        """The experts' backward is done: reduce-scatter the replicas' gradients to the owners (async),
        and, under RM, re-gather the previous layer's replicas. Returns the owners' gradients when the
        layer has no driver (waited here), else None (the driver adds them in ``sync``)."""
        lay = self.layer
        grads = {e: (g.reshape(-1) if g is not None else torch.zeros(lay.numel, dtype=lay.dtype))
                 for e, g in zip(self.pool.experts, g_rows)}
        plan = sparse_plan(self.P, self.final, lay.comm.rank, lay.comm.world_size, lay.G)
        lay.sprs_grads = list(grads.values())  # gradient memory until the spRS is waited (owner_grads)
        if lay.driver is not None:  # the replicas and their gradients, both alive at this point
            lay.driver.memory.sample()
        self.pool.release()  # the replicas are dead once their gradients exist: free them now, not at sync
        with lay.comm.rec.tagged(layer=lay.layer_id, phase="sprs"):
            lay.rs_handle = sp_reduce_scatter(lay.comm, plan, grads, lay.numel, lay.dtype, lay.group, lay.backend,
                                              later=lay.later)
        prev = lay.prev_layer
        if lay.driver is not None and prev is not None and prev._call is not None and prev._call.rm:
            prev.regather()
        if lay.driver is None:
            return lay.owner_grads(torch.zeros_like)
        return None

    def before_expert_backward(self):
        if self.rm_handle is not None:
            self.pool.refill(self.rm_handle.wait())
            self.rm_handle = None


class HecateMoELayer(MoELayer):
    def __init__(self, d_model, d_ff, moe_cfg, layer_id=0, seed=0, comm=None, placement=None,
                 dtype=torch.float32, options: Optional[HecateOptions] = None):
        super().__init__(d_model, d_ff, moe_cfg, layer_id=layer_id, seed=seed, comm=comm, placement=placement,
                         dtype=dtype)
        self.options = options or HecateOptions()
        self.G = self.comm.topo.ranks_per_node
        self.placement = self.placement.with_rule(LocalityFirst(self.G))
        self.dispatcher = type(self.dispatcher)(self.comm, self.placement)
        self.dtype = dtype
        self.shapes = expert_param_shapes(self.experts)
        self.numel = expert_numel(self.experts)
        try:
            self.comm.group_ranks("sparse")
            self.group = "sparse"
        except KeyError:  # a layer built on its own communicator: the world group
            self.group = "world"
        self.backend = self.options.spag_backend
        self.later = None  # staged backends: (stream, group) for the stages after the first
        if self.backend in NODE_BACKENDS and self.group == "sparse":
            self.comm.group_ranks(LATER_GROUP)  # declared with the strategy's groups (KeyError: a config bug)
            self.later = (comm_stream(self.comm, name="hecate-sparse"), LATER_GROUP)
        self.driver = None  # the HecateUpdate driving this layer, if any
        self.prev_layer: Optional["HecateMoELayer"] = None
        self.is_last = True
        self.t, self.m = self.options.t or 0, self.options.m if self.options.m is not None else (self.options.t or 0)
        self.t_nonmoe_s: Optional[float] = None  # T_nonMoE t was computed from, and T_nonMoE · bw / s_e (unfloored)
        self.t_quotient: Optional[float] = None
        self._plan: Optional[tuple] = None  # P' set by the driver for this iteration
        self._prefetch = None  # (holders, handle) issued beside attention
        self._call: Optional[HecateCall] = None
        self.rs_handle = None
        self.sprs_grads: list = []  # replica gradients in flight in the spRS (memory accounting)
        self.record: dict = {}
        self.moved: list = []
        self._cost = None

    # ---- the plan ------------------------------------------------------------------------------------
    @property
    def owners(self) -> list:
        return [self.placement.owner(e) for e in range(self.cfg.num_experts)]

    @property
    def cost(self):
        """The §2.9 model calibration prices plans with: ``cost_profile``'s constants, except that under link
        emulation the links are the emulated ones (as t is sized on them), the compute rate still the profile's."""
        if self._cost is None:
            eb = torch.empty(0, dtype=self.dtype).element_size()
            cost = PlacementCost.from_profile(get_profile(self.options.cost_profile), self.experts.w1.shape[1],
                                          self.experts.w1.shape[2], ranks_per_node=self.G,
                                          expert_numel=self.numel, param_bytes=eb, act_bytes=eb,
                                          hier=self.backend in NODE_BACKENDS)
            em = getattr(self.comm, "emulation", None)
            if em is not None:
                cost = dataclasses.replace(cost, intra_Bps=em.intra_bw_GBps * 1e9,
                                           nic_Bps=em.inter_bw_GBps * 1e9 * self.G,
                                           alpha_a2a_s=em.inter_latency_us * 1e-6)
            self._cost = cost
        return self._cost

    def begin_iteration(self, holders, t: int, m: int, moved=()) -> None:
        """The driver's plan P' for this iteration (before the forward)."""
        self._plan, self.t, self.m, self.moved = tuple(tuple(h) for h in holders), int(t), int(m), list(moved)
        self._prefetch = None

    def call_holders(self) -> tuple:
        """P' of this call: the driver's plan (or P), plus ``replicate_force`` on every rank."""
        P = self._plan if (self._plan is not None and self.options.materialize) else holders_of(self.owners)
        force = self.options.replicate_force or ()
        N = self.comm.world_size
        return tuple((h[0],) + tuple(sorted(set(h[1:]) | ({r for r in range(N) if r != h[0]} if e in force else set())))
                     for e, h in enumerate(P))

    def _owned_flats(self, plan) -> dict:
        stacked = self.experts.stacked()
        mine = {e for e, _ in plan.new_copies if plan.holders_from[e][0] == self.comm.rank}
        return {e: flatten_slot(stacked, self.experts.experts.index(e)) for e in sorted(mine)}

    def _gather(self, holders_to, phase: str, base=None):
        P = holders_of(self.owners) if base is None else base
        plan = sparse_plan(P, holders_to, self.comm.rank, self.comm.world_size, self.G)
        if plan.empty:
            return None
        with self.comm.rec.tagged(layer=self.layer_id, phase=phase), torch.no_grad():
            return sp_all_gather(self.comm, plan, self._owned_flats(plan), self.numel, self.dtype, self.group,
                                 self.backend, later=self.later)

    def prefetch(self) -> None:
        """Issue spAG(P, P') for this call (the driver calls it from the attention pre-hook)."""
        holders = self.call_holders()
        self._prefetch = (holders, self._gather(holders, "spag"))

    # ---- the stages Hecate changes ------------------------------------------------------------------------
    def place(self, counts):
        if self._prefetch is None:  # no driver (or no attention hook): gather now
            self.prefetch()
        holders = self._prefetch[0]
        final, status, cpu = holders, "off", 0.0
        if self.options.calibration and self.options.materialize and self.m > 0:
            c0 = time.thread_time()
            cal = calibrate_plan(holders, self.owners, counts, self.m, self.comm.world_size, self.G, self.cost,
                                 self.options.assign, self.options.calibration_rule)
            cpu = time.thread_time() - c0  # the policy's own CPU time, on the critical path before dispatch
            final, status = cal.holders, cal.status
        self.record = {"prefetch": holders, "holders": final, "calibration": status, "calibration_cpu_s": cpu}
        return Placement(self.cfg.num_experts, self.comm.world_size, final, LocalityFirst(self.G)), ()

    def materialize(self, x, plan):
        holders, handle = self._prefetch
        self._prefetch = None
        final = self.record["holders"]
        t = time.perf_counter()
        flats = handle.wait() if handle is not None else {}
        self.record["spag_exposed_s"] = time.perf_counter() - t  # the gather's part not hidden by attention
        if final != holders:  # calibration accepted: a blocking gather of the added copies only
            delta = tuple((h[0],) + tuple(d for d in f[1:] if d not in h) for h, f in zip(holders, final))
            extra = self._gather(delta, "calibrate")
            flats = {**flats, **(extra.wait() if extra is not None else {})}
        self.last_materialized = tuple(sorted(flats))
        if not flats and holders_of(self.owners) == final:
            self._call = None
            return x
        pool = ReplicaPool(flats, self.numel, self.dtype)
        self._call = HecateCall(self, holders_of(self.owners), final, pool)
        x, rows = materialize(x, self._call, self.experts.stacked())
        self._call_materialized = {e: unflatten(r, self.shapes) for e, r in zip(pool.experts, rows)}
        return x

    def compute_experts(self, xe, plan):
        ye = super().compute_experts(xe, plan)
        return rm_gate(ye, self._call if self.rm_active() else None)

    def forward(self, x):
        y = super().forward(x)
        if self.rm_active():
            self._call.pool.release()
        return y

    # ---- re-materialization and gradients -----------------------------------------------------------------
    def rm_active(self) -> bool:
        """Whether this call's replicas are freed after forward (RM on, driven, not the last layer, a plan
        with replicas somewhere): decided from global facts only, so every rank frees, re-gathers and
        waits alike."""
        return self._call is not None and self._call.rm

    def regather(self) -> None:
        """RM: re-fetch this layer's replicas (issued from the next layer's backward)."""
        call = self._call
        call.rm_handle = self._gather(call.final, "spag_rm", base=call.P)

    def owner_grads(self, zeros) -> list:
        """Wait for this layer's spRS and return its sums as gradients shaped like the stacked params."""
        h, self.rs_handle = self.rs_handle, None
        got = h.wait() if h is not None else {}
        self.sprs_grads = []
        acc = [None if p is None else zeros(p) for p in self.experts.stacked()]
        for e, t in got.items():
            s = self.experts.experts.index(e)
            for j, g in enumerate(unflatten(t, self.shapes)):
                if g is not None:
                    acc[j][s] += g
        return acc

    def finish_backward(self) -> None:
        """Driver's sync: add the owners' reduced replica gradients into the stacked grads."""
        if self.rs_handle is None:
            return
        for p, g in zip(self.experts.stacked(), self.owner_grads(torch.zeros_like)):
            if p is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        self._call = None

    def replica_tensors(self) -> list:
        return [self._call.pool.pool] if self._call is not None else []

    def replica_grad_tensors(self) -> list:
        """The replicas' gradients this rank sends by spRS, alive from the experts' backward until it is waited."""
        return self.sprs_grads

    def plan_record(self) -> dict:
        rec = super().plan_record()
        r = self.record
        prefetch = r.get("prefetch") or holders_of(self.owners)
        final = r.get("holders") or prefetch
        rec["hecate"] = {
            "owners": self.owners,
            "prefetch": {str(e): list(h[1:]) for e, h in enumerate(prefetch) if len(h) > 1},
            "holders": [list(h) for h in final],
            "calibrated": final != prefetch, "calibration": r.get("calibration", "off"),
            "calibration_cpu_s": r.get("calibration_cpu_s", 0.0),
            "rm": bool(self.options.rm and self.driver is not None and not self.is_last),
            "t": self.t, "t_nonmoe_s": self.t_nonmoe_s, "t_quotient": self.t_quotient, "m": self.m,
            "m_source": getattr(self.driver, "m_source", None), "backend": self.backend,
            "moved": [list(mv) for mv in self.moved], "spag_exposed_s": r.get("spag_exposed_s", 0.0)}
        return rec
