"""Options of the ``hecate`` strategy (``parallel.strategy_options``), validated before launch.

| option | default | meaning (spec ``papers/hecate.md``) |
|---|---|---|
| ``t`` | null | overlap degree (§2.3); null: ⌊T_nonMoE · bw / s_e⌋ from ``t_nonmoe_s`` (or the measured attention
  forward time, see ``t_iters``), the emulated links (else ``cost_profile``) |
| ``t_iters`` | 3 | measured T_nonMoE: the median of the first ``t_iters`` iterations' mean attention forward time (max
  over ranks); t is re-decided before each of iterations 1..``t_iters`` from the iterations so far, then fixed (1:
  iteration 0 alone) |
| ``m`` | null | replica slots per device (§2.3); null: from ``replica_budget_bytes``, else profiled from free memory
  (§2.10) |
| ``replica_budget_bytes`` | null | free bytes for replicas → m = ⌊budget / (live layers · (param + grad bytes of an
  expert))⌋; null: each rank's free memory (its GPU's, or its share of the host's ``MemAvailable``), the least over
  ranks, measured once; m capped at E. Slots beyond t are calibration's |
| ``t_nonmoe_s`` | null | T_nonMoE in seconds (identical on every rank) instead of measuring it |
| ``assign`` | proportional | Alg. 1's replica count rule: ``proportional`` or ``mean_load`` (§2.3, §6.2) |
| ``window`` | 5 | iterations of the integer load window F̂ (§2.7) |
| ``reshard_interval`` | 100 | Alg. 2 every R iterations (0: never; §2.5) |
| ``reshard_window`` | null | a longer window for Alg. 2 (§6.6); null: ``window`` |
| ``prefer_fewer_free`` | true | Alg. 2's tie-break as written (false inverts it, §6.6) |
| ``calibration`` | true | re-plan after the gate when the cost model says it pays (§2.4) |
| ``calibration_rule`` | all_slots | what calibration proposes: ``all_slots`` (t_cal = the free slots, spec §2.4
  [choice]: all or nothing) or ``best`` (the fastest t_cal of 1..free slots by the cost model) |
| ``rm`` | false | re-materialization: free replicas after forward, re-gather them in backward (§2.8) |
| ``spag_backend`` | a2a | ``a2a`` / ``p2p`` / ``hier`` / ``stripe`` / ``relay`` (§2.2; ``stripe``: ``hier`` with each
  crossing expert split over the node's G NICs; ``relay``: ``stripe`` sending it out of the owner's node once) |
| ``materialize`` | true | false: "sharding only" ablation (P' = P) |
| ``shard`` | true | false: "materialization only" ablation (no Alg. 2) |
| ``cost_profile`` | hecate_A | the cluster whose constants the cost model uses (calibration, t without emulation) |
| ``debug_plan_hash`` | false | all-gather a hash of every plan and fail if ranks differ |
| ``replicate_force`` | null | experts replicated on every rank in every call (tests: P' = D×E with all experts) |
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

from moelab.comm.sparse import BACKENDS, NODE_BACKENDS
from moelab.config import ConfigError
from moelab.registry import StrategyOptions
from moelab.sim.profiles import ALIASES, PROFILES
from moelab.strategies.hecate.policy import ASSIGN, CALIBRATION_RULES

LATER_GROUP = "sparse_later"  # the staged backends' later stages, posted by a comm stream


class HecateOptionError(ConfigError):
    """A ``ConfigError`` naming the bad hecate option."""


def _profiles() -> tuple:
    return tuple(sorted(PROFILES)) + tuple(sorted(ALIASES))


@dataclass(frozen=True)
class HecateOptions(StrategyOptions):
    strategy = "hecate"
    error = HecateOptionError

    t: Optional[int] = field(default=None, metadata={"type": int})
    m: Optional[int] = field(default=None, metadata={"type": int})
    replica_budget_bytes: Optional[float] = field(default=None, metadata={"type": float})
    t_nonmoe_s: Optional[float] = field(default=None, metadata={"type": float})
    t_iters: int = 3
    assign: str = field(default="proportional", metadata={"choices": ASSIGN})
    window: int = 5
    reshard_interval: int = 100
    reshard_window: Optional[int] = field(default=None, metadata={"type": int})
    prefer_fewer_free: bool = True
    calibration: bool = True
    calibration_rule: str = field(default="all_slots", metadata={"choices": CALIBRATION_RULES})
    rm: bool = False
    spag_backend: str = field(default="a2a", metadata={"choices": BACKENDS})
    materialize: bool = True
    shard: bool = True
    cost_profile: str = "hecate_A"
    debug_plan_hash: bool = False
    replicate_force: Optional[Tuple[int, ...]] = field(default=None, metadata={"type": tuple})

    def value_errors(self) -> list:
        errs = []
        for name in ("t", "m", "replica_budget_bytes", "t_nonmoe_s", "reshard_interval"):
            v = getattr(self, name)
            if v is not None and v < 0:
                errs.append(f"{name} must be >= 0, got {v}")
        for name in ("window", "reshard_window", "t_iters"):
            v = getattr(self, name)
            if v is not None and v < 1:
                errs.append(f"{name} must be >= 1, got {v}")
        if self.cost_profile not in _profiles():
            errs.append(f"cost_profile must be a cluster profile of moelab.sim.profiles {list(_profiles())}, "
                        f"got {self.cost_profile!r}")
        if not self.materialize:
            for name in ("rm", "calibration"):
                if getattr(self, name):
                    errs.append(f"{name} needs materialization: set {name}: false with materialize: false")
        return errs

    def run_errors(self, run_cfg) -> list:
        errs = []
        moe, par = run_cfg.model.moe, run_cfg.parallel
        if par.placement is not None:
            errs.append("hecate decides its own placement (sharding + materialization): leave parallel.placement unset")
        if moe.dispatcher != "sparse":
            errs.append("hecate dispatches uneven token counts to replicas: set model.moe.dispatcher='sparse'")
        if moe.num_experts % par.nproc:
            errs.append(f"hecate starts from the EP sharding: {moe.num_experts} experts are not divisible by "
                        f"{par.nproc} ranks")
        if self.spag_backend in NODE_BACKENDS and par.topology.nodes < 2:
            errs.append(f"spag_backend {self.spag_backend!r} crosses nodes once per expert: it needs "
                        "parallel.topology.nodes > 1 (on one node use 'a2a')")
        if self.replicate_force is not None:
            bad = [e for e in self.replicate_force if not 0 <= e < moe.num_experts]
            if bad:
                errs.append(f"replicate_force experts {bad} are outside 0..{moe.num_experts - 1}")
        return errs
