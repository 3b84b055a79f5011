"""SmartMoE's executor (spec ``papers/hecate.md`` §3): data parallelism of the dense parts, EP of the
experts, and every ``interval`` iterations a re-placement round (:func:`moelab.placement.rebalance.smartmoe_round`,
the pure function its paper-scale replay runs too) whose accepted permutations
:func:`moelab.moe.migrate.migrate_owners` executes with params + Adam state, before the forward."""
from __future__ import annotations

from typing import Optional

import numpy as np

from moelab.moe.migrate import migrate_owners, owners_of
from moelab.placement.rebalance import smartmoe_round
from moelab.runtime.update import DataParallelUpdate
from moelab.sim.placement_cost import cost_for_run

from .options import SmartMoEOptions


class SmartMoEUpdate(DataParallelUpdate):
    checkpoint_ready = True  # its state: the iteration count and the load window (the placement is the model's)

    def __init__(self, model, comm, cfg, options: Optional[SmartMoEOptions] = None):
        super().__init__(model, comm, cfg)
        self.options = options or SmartMoEOptions.from_dict(cfg.parallel.strategy_options)
        self.layers = model.moe_layers()
        self.iteration = 0
        self._window: list = []
        self._cost = None

    @property
    def cost(self):
        """The §2.9 model on ``cost_profile`` with this run's experts (built once)."""
        if self._cost is None:
            self._cost = cost_for_run(self.cfg, self.options.cost_profile, self.comm.topo.ranks_per_node)
        return self._cost

    def before_forward(self) -> None:
        o = self.options
        for layer in self.layers:
            layer.smart_record = {"owners": owners_of(layer), "moved": [], "decision": "none"}
        if not (self.iteration > 0 and self.iteration % o.interval == 0 and self._window):
            return
        W = np.sum(self._window, axis=0, dtype=np.int64)
        rnd = smartmoe_round([owners_of(layer) for layer in self.layers], W, o.interval, self.cost,
                             self.comm.world_size, o.decision, len(self._window))
        moved = migrate_owners(self.comm, self.layers, [r[0] for r in rnd], self.optimizer)
        if moved:
            self.refresh_params()
        for li, (layer, (owners, status, _, _)) in enumerate(zip(self.layers, rnd)):
            layer.smart_record = {"owners": owners, "moved": [[e, s, d] for l, e, s, d in moved if l == li],
                                  "decision": status}

    def checkpoint_state(self) -> dict:
        return {"iteration": self.iteration, "window": [w.copy() for w in self._window]}

    def restore_state(self, state: dict) -> None:
        self.iteration, self._window = int(state["iteration"]), [np.asarray(w) for w in state["window"]]

    def sync(self) -> None:
        super().sync()
        self._window.append(np.stack([layer.last_global_counts.numpy().astype(np.int64) for layer in self.layers]))
        del self._window[:-self.options.window]

    def step(self) -> None:
        super().step()
        self.iteration += 1
