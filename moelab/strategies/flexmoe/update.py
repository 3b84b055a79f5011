"""FlexMoE's executor as an :class:`~moelab.runtime.update.Update` (spec ``papers/hecate.md`` §3).

Per iteration, every rank, from all-gathered integers only (so every rank computes the same plan):

- ``before_forward``: from iteration 1, per layer, the balance ratio of the window's loads under the
  current holders; every ``interval`` iterations, or when a layer's ratio exceeds ``threshold``, the
  pure scheduler (:func:`moelab.strategies.flexmoe.policy.schedule`) plans that layer's round, priced by the
  §2.9 cost model (``t_moe`` gain × K against the migration cost of each copied expert). The rounds of
  all layers are executed together by :func:`moelab.moe.migrate.migrate_holders` (one all-to-all of
  params + Adam moments); then every replica set gets its cached group
  (:meth:`moelab.comm.door.Communicator.replica_group`, all ranks, same order);
- ``sync``: the dense data-parallel all-reduce, then per layer and replicated expert (ascending) one
  all-reduce of the expert's flat gradient over its replica-set group: every copy then holds the full
  gradient and takes the identical Adam step (each copy has its own Adam state);
- ``step``: Adam on everything the rank holds; the window takes this iteration's ``[N, E]`` loads.

Memory: with ``reserve`` (default) the slots of the budget E/N + r that a layer does not fill on this rank
are held as real storage for parameters, gradients and both Adam moments (:meth:`FlexMoEUpdate.reserved`),
so the run holds what any round may need, the memory FlexMoE reserves for incoming experts and their
optimizer states (the paper's C1) and what the simulator's memory model counts.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from moelab.moe.experts import expert_numel
from moelab.moe.migrate import migrate_holders
from moelab.moe.sync import sync_dense_grads
from moelab.runtime.update import DataParallelUpdate, fill_missing_grads
from moelab.sim.placement_cost import cost_for_run
from moelab.strategies.flexmoe.policy import plan_round

from .options import FlexMoEOptions


class FlexMoEUpdate(DataParallelUpdate):
    checkpoint_ready = True  # its state: iteration, load window, rounds so far (the placement is the model's)

    def __init__(self, model, comm, cfg, options: Optional[FlexMoEOptions] = None):
        super().__init__(model, comm, cfg)
        self.options = options or FlexMoEOptions.from_dict(cfg.parallel.strategy_options)
        self.layers = model.moe_layers()
        self.N, self.E = comm.world_size, cfg.model.moe.num_experts
        self._window: list = []  # per iteration, [L, N, E] int64 global loads (the last `window` kept)
        self.iteration = 0
        self._cost = None
        self._reserve = (None, {})  # (held slots per layer, {category: [storage per layer]})
        self.rounds: list = []  # (iteration, layer, steps) of every round that changed a layer

    # ---- the cost model ---------------------------------------------------------------------------
    @property
    def cost(self):
        """The §2.9 model on ``cost_profile`` with this run's experts (built once)."""
        if self._cost is None:
            self._cost = cost_for_run(self.cfg, self.options.cost_profile, self.comm.topo.ranks_per_node)
        return self._cost

    @property
    def migration_cost_s(self) -> float:
        """Seconds to copy one expert with its Adam state: the option, else §2.9 bytes over one NIC."""
        o = self.options
        if o.migration_cost_s is not None:
            return float(o.migration_cost_s)
        return self.cost.migration_bytes(1) / self.cost.nic_Bps

    def window_loads(self) -> np.ndarray:
        """``[L, N, E]``: the window's summed per-source loads (zeros before any iteration)."""
        if not self._window:
            return np.zeros((len(self.layers), self.N, self.E), dtype=np.int64)
        return np.sum(self._window, axis=0, dtype=np.int64)

    # ---- the Update interface -------------------------------------------------------------------------
    def plan_round(self) -> list:
        """This iteration's new holders and steps per layer (:func:`moelab.strategies.flexmoe.policy.plan_round`)."""
        o = self.options
        return plan_round([layer.placement.holders for layer in self.layers], self.window_loads(), len(self._window),
                          self.iteration, self.N, r=o.r, interval=o.interval, threshold=o.threshold,
                          max_steps=o.max_steps, cost=self.cost, migration_cost=self.migration_cost_s)

    def before_forward(self) -> None:
        plan = self.plan_round()
        if any(h != tuple(layer.placement.holders) for (h, _), layer in zip(plan, self.layers)):
            migrate_holders(self.comm, self.layers, [h for h, _ in plan], self.optimizer)
            self.refresh_params()
        for li, (layer, (_, steps)) in enumerate(zip(self.layers, plan)):
            layer.flex_steps = [tuple(s) for s in steps]
            if steps:
                self.rounds.append((self.iteration, li, list(steps)))
        for layer in self.layers:  # collective: every rank, every replica set, the same order
            for h in layer.placement.holders:
                if len(h) > 1:
                    self.comm.replica_group(h)

    def checkpoint_state(self) -> dict:
        return {"iteration": self.iteration, "window": [w.copy() for w in self._window], "rounds": list(self.rounds)}

    def restore_state(self, state: dict) -> None:
        self.iteration, self.rounds = int(state["iteration"]), list(state["rounds"])
        self._window = [np.asarray(w) for w in state["window"]]

    def sync(self) -> None:
        sync_dense_grads(self.model.dense_parameters(), self.comm)
        fill_missing_grads(self.model.expert_parameters())
        for layer in self.layers:
            self._sync_replicas(layer)
        self._window.append(np.stack([layer.last_global_counts.numpy().astype(np.int64) for layer in self.layers]))
        del self._window[:-self.options.window]

    def _sync_replicas(self, layer) -> None:
        """One all-reduce per replicated expert held here, over its replica set's group (expert order)."""
        pl, me, ex = layer.placement, self.comm.rank, layer.experts
        params = [p for p in ex.stacked() if p is not None]
        with self.comm.rec.tagged(layer=layer.layer_id, phase="replica_sync"):
            for e, h in enumerate(pl.holders):
                if len(h) < 2 or me not in h:
                    continue
                s = pl.slot_of(me, e)
                flat = torch.cat([p.grad[s].reshape(-1) for p in params])
                self.comm.all_reduce_(flat, group=self.comm.replica_group(h))
                off = 0
                for p in params:
                    n = p.grad[s].numel()
                    p.grad[s].copy_(flat[off:off + n].view_as(p.grad[s]))
                    off += n

    def step(self) -> None:
        super().step()
        self.iteration += 1

    # ---- the slot budget's unfilled slots, held as storage (memory by category) -----------------------------
    def reserved(self) -> dict:
        """``{"params", "grads", "optim": [tensor per layer]}``: the free slots E/N + r - held of each layer
        on this rank, one expert's parameter elements per slot (two per slot for Adam's moments). Rebuilt when
        a round changes what the rank holds; empty without ``reserve``."""
        if not self.options.reserve:
            return {}
        me = self.comm.rank
        held = tuple(len(layer.placement.local_experts(me)) for layer in self.layers)
        if held != self._reserve[0]:
            budget = self.E // self.N + self.options.r
            out = {"params": [], "grads": [], "optim": []}
            for layer, n in zip(self.layers, held):
                free = max(budget - n, 0) * expert_numel(layer.experts)
                for cat, k in (("params", 1), ("grads", 1), ("optim", 2)):
                    out[cat].append(layer.experts.w1.new_empty(k * free))
            self._reserve = (held, out)
        return self._reserve[1]

    def param_tensors(self) -> list:
        return super().param_tensors() + self.reserved().get("params", [])

    def grad_tensors(self) -> list:
        return super().grad_tensors() + self.reserved().get("grads", [])

    def optimizer_tensors(self) -> list:
        return super().optimizer_tensors() + self.reserved().get("optim", [])
