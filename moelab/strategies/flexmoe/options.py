"""Options of the ``flexmoe`` strategy (``parallel.strategy_options``), validated before launch.

| option | default | meaning (spec ``papers/hecate.md`` §3 FlexMoE) |
|---|---|---|
| ``r`` | 1 | reserved expert slots per device and layer (slot budget E/N + r); 0: FlexMoE can only Migrate, and with
  every slot full it never changes EP |
| ``reserve`` | true | hold the budget's unfilled slots as real storage (params, grads, Adam moments), as FlexMoE
  reserves memory for incoming experts and their optimizer states; false: only filled slots use memory |
| ``interval`` | 10 | K: the scheduler runs every K iterations (and its steps must pay back within K iterations) |
| ``threshold`` | 1.2 | it also runs when the window's balance ratio max/mean device load exceeds this (> 1) |
| ``max_steps`` | 4 | at most this many greedy steps (Expand / Shrink / Migrate) per layer and round |
| ``window`` | 5 | iterations of global loads the scheduler plans from |
| ``cost_profile`` | hecate_A | the cluster whose constants price a step's gain (§2.9 ``t_moe``) and its migration
  bytes |
| ``migration_cost_s`` | null | seconds charged per copied expert; null: the §2.9 cost (params + Adam state bytes over
  one node's NIC); 0: any step that gains is kept (tiny CPU models, where the profile's migration always outweighs the
  gain) |
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from moelab.config import ConfigError
from moelab.registry import StrategyOptions
from moelab.sim.profiles import ALIASES, PROFILES


class FlexMoEOptionError(ConfigError):
    """A ``ConfigError`` naming the bad flexmoe option."""


def _profiles() -> tuple:
    return tuple(sorted(PROFILES)) + tuple(sorted(ALIASES))


@dataclass(frozen=True)
class FlexMoEOptions(StrategyOptions):
    strategy = "flexmoe"
    error = FlexMoEOptionError

    r: int = 1
    reserve: bool = True
    interval: int = 10
    threshold: float = 1.2
    max_steps: int = 4
    window: int = 5
    cost_profile: str = "hecate_A"
    migration_cost_s: Optional[float] = field(default=None, metadata={"type": float})

    def value_errors(self) -> list:
        errs = []
        if self.r < 0:
            errs.append(f"r (reserved slots per layer) must be >= 0, got {self.r}")
        if self.threshold <= 1:
            errs.append(f"threshold (balance ratio max/mean) must be > 1, got {self.threshold}")
        for name in ("interval", "max_steps", "window"):
            if getattr(self, name) < 1:
                errs.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.migration_cost_s is not None and self.migration_cost_s < 0:
            errs.append(f"migration_cost_s must be >= 0 or null, got {self.migration_cost_s}")
        if self.cost_profile not in _profiles():
            errs.append(f"cost_profile must be a cluster profile of moelab.sim.profiles {list(_profiles())}, "
                        f"got {self.cost_profile!r}")
        return errs

    def run_errors(self, run_cfg) -> list:
        errs = []
        moe, par = run_cfg.model.moe, run_cfg.parallel
        if par.placement is not None:
            errs.append("flexmoe decides its own placement (Expand/Shrink/Migrate from EP): "
                        "leave parallel.placement unset")
        if moe.dispatcher != "sparse":
            errs.append("flexmoe splits an expert's tokens over its replicas (uneven counts): "
                        "set model.moe.dispatcher='sparse'")
        if moe.num_experts % par.nproc:
            errs.append(f"flexmoe starts from EP with E/N slots per device: {moe.num_experts} experts are not "
                        f"divisible by {par.nproc} ranks")
        return errs
