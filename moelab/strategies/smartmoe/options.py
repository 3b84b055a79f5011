"""Options of the ``smartmoe`` strategy (``parallel.strategy_options``), validated before launch.

| option | default | meaning (spec ``papers/hecate.md`` §3 SmartMoE) |
|---|---|---|
| ``interval`` | 25 | K: re-place every K iterations (the paper's tuned best; Hecate's M3 sweeps it) |
| ``window`` | 5 | iterations of global loads the LPT placement is computed from |
| ``decision`` | cost | ``cost``: apply iff the K-iteration gain (§2.9 model) exceeds the migration; ``always``;
  ``never`` |
| ``cost_profile`` | hecate_A | the cluster whose constants the cost model uses |
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moelab.config import ConfigError
from moelab.placement.rebalance import DECISIONS
from moelab.registry import StrategyOptions
from moelab.sim.profiles import ALIASES, PROFILES


class SmartMoEOptionError(ConfigError):
    """A ``ConfigError`` naming the bad smartmoe option."""


@dataclass(frozen=True)
class SmartMoEOptions(StrategyOptions):
    strategy = "smartmoe"
    error = SmartMoEOptionError

    interval: int = 25
    window: int = 5
    decision: str = field(default="cost", metadata={"choices": DECISIONS})
    cost_profile: str = "hecate_A"

    def value_errors(self) -> list:
        errs = [f"{n} must be >= 1, got {getattr(self, n)}" for n in ("interval", "window") if getattr(self, n) < 1]
        if self.cost_profile not in PROFILES and self.cost_profile not in ALIASES:
            errs.append(f"cost_profile must be a cluster profile of moelab.sim.profiles, got {self.cost_profile!r}")
        return errs

    def run_errors(self, run_cfg) -> list:
        moe, par = run_cfg.model.moe, run_cfg.parallel
        errs = []
        if par.placement is not None:
            errs.append("smartmoe decides its own placement: leave parallel.placement unset")
        if moe.dispatcher != "sparse":
            errs.append("smartmoe runs on the sparse dispatcher: set model.moe.dispatcher='sparse'")
        if moe.num_experts % par.nproc:
            errs.append(f"smartmoe permutes E/N experts per device: {moe.num_experts} experts are not divisible by "
                        f"{par.nproc} ranks")
        elif moe.num_experts == par.nproc and par.nproc > 1:
            errs.append("SmartMoE is useless when E/N = 1: every permutation has the same per-device load "
                        "(use more experts than ranks)")
        return errs
