"""Hecate's executor as an :class:`~moelab.runtime.update.Update` (spec ``papers/hecate.md`` §2.8).

Per iteration, on every rank, from all-reduced integers only (so every rank computes the same plans):

- ``before_forward``: every ``reshard_interval`` iterations Alg. 2 re-shards all layers jointly from the
  load window and :func:`moelab.moe.migrate.migrate_owners` moves params + Adam state (only if owners
  change); then Alg. 1 gives each layer's P' from the window F̂ (iteration 0: no history, P' = P);
- forward: each layer's spAG is issued from a forward pre-hook on its block's attention (registered
  here), waited in the layer before dispatch (:class:`.layer.HecateMoELayer`);
- backward: each layer issues its spRS (and, with RM, the previous layer's re-gather) when its experts'
  backward ends;
- ``sync``: wait the spRS handles in issue order, owners add the replicas' sums; then the data-parallel
  sync of the dense parameters; every owned expert gets a gradient (zeros without tokens);
- ``step``: Adam on what the rank owns (owned experts + dense); the window takes this iteration's loads.

The overlap degree ``t`` (unless given) is ⌊T_nonMoE · bw / s_e⌋ with T_nonMoE the median over the first
``t_iters`` iterations of the attention forward time (max over ranks, exchanged unrecorded; re-decided before
each of iterations 1..t_iters, so one slow first iteration does not fix t) or ``t_nonmoe_s``, bw the emulated
per-node inter-node bandwidth (hier, stripe) or its per-rank share (flat), else ``cost_profile``'s NIC.
"""
from __future__ import annotations

import copy
import os
import statistics
import threading
import time
from typing import Optional

import torch

from moelab.comm.record import Span
from moelab.comm.sparse import NODE_BACKENDS
from moelab.moe.migrate import migrate_owners
from moelab.runtime.memory import free_memory_bytes
from moelab.runtime.update import DataParallelUpdate
from moelab.sim.placement_cost import overlap_degree
from moelab.strategies.hecate.policy import (
    LoadWindow,
    holders_of,
    materialize_plan,
    memory_slots,
    plan_hash,
    reshard_owners,
)

from .options import HecateOptions


class HecatePlanError(RuntimeError):
    """Ranks computed different plans (they would pair different collectives and hang)."""


class HecateUpdate(DataParallelUpdate):
    checkpoint_ready = True  # its state: iteration, both load windows, t and m (the owners are the placement)

    def __init__(self, model, comm, cfg, options: Optional[HecateOptions] = None):
        super().__init__(model, comm, cfg)
        self.options = options or HecateOptions.from_dict(cfg.parallel.strategy_options)
        o = self.options
        self.layers = model.moe_layers()
        L, E = len(self.layers), cfg.model.moe.num_experts
        for i, layer in enumerate(self.layers):
            layer.driver = self
            layer.prev_layer = self.layers[i - 1] if i else None
            layer.is_last = i == L - 1
        self.N, self.G = comm.world_size, comm.topo.ranks_per_node
        self.window = LoadWindow(o.window, L, E)
        self.reshard_window = LoadWindow(o.reshard_window or o.window, L, E)
        self.iteration = 0
        self.t: Optional[int] = o.t
        self.m: Optional[int] = None
        self.m_source = None  # given, replica_budget_bytes or free memory (spec §2.3's profiled default); plans read it
        self._free_bytes: Optional[int] = None
        self._attn_s: list = []  # per measured iteration: its attention forward times, one per layer
        self._hooks = []
        for block in getattr(model, "blocks", []):
            if block.ffn in self.layers:
                self._hooks.append(block.attn.register_forward_pre_hook(self._before_attention(block.ffn)))
                self._hooks.append(block.attn.register_forward_hook(self._after_attention(block.ffn)))
                self._hooks.append(block.attn.register_full_backward_pre_hook(self._attention_bwd(block.ffn)))

    # ---- hooks ---------------------------------------------------------------------------------------
    def _before_attention(self, layer):
        def hook(module, args):
            layer.prefetch()  # spAG(l) runs while attention_l computes
            self._t_attn = time.time()
        return hook

    def _after_attention(self, layer):
        def hook(module, args, output):
            t1 = time.time()
            if self._measuring() and torch.is_grad_enabled():
                while len(self._attn_s) <= self.iteration:
                    self._attn_s.append([])
                self._attn_s[self.iteration].append(t1 - self._t_attn)
            rec = self.comm.rec
            if rec.enabled:  # attention on the trace, so the overlap with the gather is visible
                rec.spans.append(Span("attention", "attention", self._t_attn, t1,
                                      {**rec.tags, "layer": layer.layer_id, "phase": "fwd"},
                                      threading.current_thread().name))
        return hook

    def _attention_bwd(self, layer):
        def hook(module, grad_output):  # attention's backward is about to run: mark it on the trace
            rec = self.comm.rec
            if rec.enabled:
                t = time.time()
                rec.spans.append(Span("attention.bwd.start", "attention", t, t,
                                      {**rec.tags, "layer": layer.layer_id, "phase": "bwd"},
                                      threading.current_thread().name))
        return hook

    # ---- t and m ----------------------------------------------------------------------------------------
    def _measured(self) -> bool:
        """Whether t comes from the measured attention time (neither t nor T_nonMoE given)."""
        return self.options.t is None and self.options.t_nonmoe_s is None

    def _measuring(self) -> bool:
        """Whether this iteration's attention time feeds t."""
        return self._measured() and self.iteration < self.options.t_iters

    def _decide_t_m(self) -> None:
        o, layer = self.options, self.layers[0]
        s_e = layer.numel * torch.empty(0, dtype=layer.dtype).element_size()
        E = self.cfg.model.moe.num_experts
        if o.t is None:
            T = o.t_nonmoe_s
            if T is None:
                mine = statistics.median([sum(a) / len(a) for a in self._attn_s if a] or [0.0])
                with self.comm.rec.paused():  # metric traffic: every rank takes the same (max) time
                    T = float(self.comm.all_gather(torch.tensor([mine], dtype=torch.float64)).max())
            em = self.cfg.emulation
            if em.enabled:
                bw, size = em.inter_bw_GBps * 1e9 * (self.G if o.spag_backend in NODE_BACKENDS else 1), s_e
                self.t = overlap_degree(T, bw, size, E)
            else:
                bw, size = layer.cost.overlap_bw_Bps(), layer.cost.expert_bytes
                self.t = layer.cost.overlap_degree(T, E)
            for lay in self.layers:  # T_nonMoE, and how near an integer t's quotient was (the benchmark prints them)
                lay.t_nonmoe_s, lay.t_quotient = T, T * bw / size
        live = 2 if o.rm else len(self.layers)
        if o.m is not None:
            self.m, self.m_source = o.m, "given"
        elif o.replica_budget_bytes is not None:
            self.m, self.m_source = memory_slots(o.replica_budget_bytes, live, s_e, s_e), "replica_budget_bytes"
        else:
            if self._free_bytes is None:  # profiled once, before any replica exists; the least over ranks
                self._free_bytes = self._least_free_bytes()
            self.m, self.m_source = min(E, memory_slots(self._free_bytes, live, s_e, s_e)), "free memory"

    def _least_free_bytes(self) -> int:
        """Spec §2.3: m is profiled from free memory. Each rank's free bytes (its GPU's, or its share of the
        host's available memory among the ranks there), the least over ranks, so every rank gets one m."""
        sharers = int(os.environ.get("LOCAL_WORLD_SIZE", self.N))
        mine = free_memory_bytes(self.layers[0].experts.w1.device, sharers=sharers)
        with self.comm.rec.paused():  # metric traffic, as T_nonMoE's exchange
            return int(self.comm.all_gather(torch.tensor([mine], dtype=torch.int64)).min())

    # ---- the Update interface -------------------------------------------------------------------------------
    def _decide_now(self) -> bool:
        """Whether t and m are (re)decided before this iteration: once, as soon as they can be (at once when t
        is given, else after iteration 0's attention time), and again before each iteration 1..t_iters while
        the attention time is still being measured."""
        first = self.m is None and (self.iteration > 0 or self.options.t is not None)
        return first or (self._measured() and 0 < self.iteration <= self.options.t_iters)

    def before_forward(self) -> None:
        o = self.options
        if self._decide_now():
            self._decide_t_m()
        t, m = self.t or 0, self.m or 0
        moved = []
        if (o.shard and o.reshard_interval and self.iteration > 0 and self.iteration % o.reshard_interval == 0
                and len(self.reshard_window)):
            owners = [layer.owners for layer in self.layers]
            new = reshard_owners(self.reshard_window.estimate(), t, owners, self.N, self.G, o.prefer_fewer_free)
            if new != owners:
                moved = migrate_owners(self.comm, self.layers, new, self.optimizer)
                self.refresh_params()
        F = self.window.estimate()
        plans = []
        for li, layer in enumerate(self.layers):
            P = holders_of(layer.owners)
            holders = (materialize_plan(layer.owners, F[li].tolist(), t, m, self.N, self.G, o.assign)
                       if o.materialize and len(self.window) else P)
            plans.append(holders)
            layer.begin_iteration(holders, t, m, [(e, s, d) for l, e, s, d in moved if l == li])
        if o.debug_plan_hash:
            self._check_same_plan(plans)

    def _check_same_plan(self, plans) -> None:
        h = int(plan_hash(plans)[:15], 16)
        with self.comm.rec.paused():
            got = self.comm.all_gather(torch.tensor([h], dtype=torch.int64)).reshape(-1).tolist()
        if len(set(got)) > 1:
            raise HecatePlanError(f"iteration {self.iteration}: ranks computed different Hecate plans "
                                  f"(hashes {got}); every rank must see the same loads and options")

    def checkpoint_state(self) -> dict:
        return {"iteration": self.iteration, "window": copy.deepcopy(self.window),
                "reshard_window": copy.deepcopy(self.reshard_window), "t": self.t, "m": self.m,
                "m_source": self.m_source, "free_bytes": self._free_bytes, "attn_s": list(self._attn_s)}

    def restore_state(self, state: dict) -> None:
        self.iteration, self.t, self.m = int(state["iteration"]), state["t"], state["m"]
        self.m_source, self._free_bytes = state.get("m_source"), state.get("free_bytes")
        self.window, self.reshard_window = state["window"], state["reshard_window"]
        a = list(state["attn_s"])
        self._attn_s = a if all(isinstance(x, list) for x in a) else [a]  # older checkpoints: iteration 0's, flat

    def sync(self) -> None:
        for layer in reversed(self.layers):  # spRS were issued last layer first: wait in that order
            layer.finish_backward()
        super().sync()
        loads = torch.stack([layer.last_global_counts.sum(0) for layer in self.layers]).numpy()
        self.window.push(loads)
        self.reshard_window.push(loads)

    def step(self) -> None:
        super().step()
        self.iteration += 1

    def param_tensors(self) -> list:
        return super().param_tensors() + [t for layer in self.layers for t in layer.replica_tensors()]

    def grad_tensors(self) -> list:
        return super().grad_tensors() + [t for layer in self.layers for t in layer.replica_grad_tensors()]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
