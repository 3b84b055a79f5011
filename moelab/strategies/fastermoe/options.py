"""Options of the ``fastermoe`` strategy (``parallel.strategy_options``), validated with clear errors.

| option | default | meaning |
|---|---|---|
| ``shadow`` | False | dynamic shadowing (§2.4), decided per layer per forward by the policy |
| ``shadow_force`` | None | testing/exploration aid: a fixed list of expert ids shadowed every forward (bypasses the
  policy; implies shadowing) |
| ``shadow_net_bw`` | 6.25e9 | policy ``W_net``, bytes/s (FMOE_FASTER_GLBPLC_NETBW = 50 Gb/s) |
| ``shadow_gpu_flops`` | 11.5e12 | policy ``P``, FLOP/s (FMOE_FASTER_GLBPLC_GPUTP) |
| ``shadow_elem_bytes`` | 4 | policy ``s`` |
| ``shadow_comm_factor`` | 2 | policy ``c``: collectives per shadowed expert (2: bcast + reduce; FastMoE code: 1) |
| ``shadow_max`` | None | at most this many shadows (None: ``N*E - 1``) |
| ``shadow_exact`` | True | recompute ``max L(S)`` exactly (False: FastMoE's (|S|+1)-th largest total) |
| ``shadow_d_model`` / ``shadow_d_ff`` | None | ``h`` / ``h_ff`` the policy prices with (None: the layer's own) |
| ``smart`` | False | smart fine-grained schedule (§2.5) |
| ``group_size`` | 4 | ``Gs``, clamped to N; N % Gs must be 0 |
| ``smart_threaded`` | True | comm on its own thread (False: same steps, on the main thread) |
| ``topo_gate`` | False | congestion-avoiding topology-aware gate (§2.6); changes the model |
| ``topo_fraction`` | 0.14 | ``f``: fraction of a worker's tokens allowed to leave its node |
| ``topo_strict`` | False | apply the cap even when few tokens prefer remote experts |
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

from moelab.config import ConfigError
from moelab.registry import StrategyOptions
from moelab.strategies.fastermoe.perf_model import ELEM_BYTES, P_V100_PCIE, W_NET_DEFAULT
from moelab.strategies.fastermoe.topo_gate import DEFAULT_FRACTION


class FasterMoEOptionError(ConfigError):
    """A ``ConfigError`` (hence a ``ValueError``) naming the bad fastermoe option."""


@dataclass(frozen=True)
class FasterMoEOptions(StrategyOptions):
    strategy = "fastermoe"
    error = FasterMoEOptionError

    shadow: bool = False
    shadow_force: Optional[Tuple[int, ...]] = field(default=None, metadata={"type": tuple})
    shadow_net_bw: float = W_NET_DEFAULT
    shadow_gpu_flops: float = P_V100_PCIE
    shadow_elem_bytes: int = ELEM_BYTES
    shadow_comm_factor: int = 2
    shadow_max: Optional[int] = field(default=None, metadata={"type": int})
    shadow_exact: bool = True
    shadow_d_model: Optional[int] = field(default=None, metadata={"type": int})
    shadow_d_ff: Optional[int] = field(default=None, metadata={"type": int})
    smart: bool = False
    group_size: int = 4
    smart_threaded: bool = True
    topo_gate: bool = False
    topo_fraction: float = DEFAULT_FRACTION
    topo_strict: bool = False

    @property
    def shadowing(self) -> bool:
        return self.shadow or self.shadow_force is not None

    def value_errors(self) -> list:
        errs = []
        for name in ("shadow_net_bw", "shadow_gpu_flops"):
            if not getattr(self, name) > 0:
                errs.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.shadow_elem_bytes < 1:
            errs.append(f"shadow_elem_bytes must be >= 1, got {self.shadow_elem_bytes}")
        if self.shadow_comm_factor < 0:
            errs.append(f"shadow_comm_factor must be >= 0, got {self.shadow_comm_factor}")
        if self.shadow_max is not None and self.shadow_max < 0:
            errs.append(f"shadow_max must be >= 0 or null, got {self.shadow_max}")
        for name in ("shadow_d_model", "shadow_d_ff"):
            v = getattr(self, name)
            if v is not None and v < 1:
                errs.append(f"{name} must be >= 1 or null, got {v}")
        if self.group_size < 1:
            errs.append(f"group_size must be >= 1, got {self.group_size}")
        if not self.topo_fraction >= 0:
            errs.append(f"topo_fraction must be >= 0, got {self.topo_fraction}")
        if self.shadow_force is not None and len(set(self.shadow_force)) != len(self.shadow_force):
            errs.append(f"shadow_force lists an expert twice: {list(self.shadow_force)}")
        return errs

    def run_errors(self, run_cfg) -> list:
        moe = run_cfg.model.moe
        return self.shape_errors(moe.num_experts, run_cfg.parallel.nproc, moe.top_k, moe.gate, moe.dispatcher,
                                 has_placement=run_cfg.parallel.placement is not None)

    def check_against(self, num_experts: int, world_size: int, top_k: int, gate: str, dispatcher: str,
                      has_placement: bool = False) -> None:
        """Raise for options that do not fit the layer's shape (before any collective)."""
        self.raise_if(self.shape_errors(num_experts, world_size, top_k, gate, dispatcher, has_placement))

    def shape_errors(self, num_experts: int, world_size: int, top_k: int, gate: str, dispatcher: str,
                     has_placement: bool = False) -> list:
        errs = []
        if has_placement:
            errs.append("fastermoe runs on plain expert parallelism: leave parallel.placement unset "
                        "(shadowing replicates experts itself)")
        if dispatcher != "sparse":
            errs.append("fastermoe builds on the sparse (FastMoE) dispatcher: set model.moe.dispatcher='sparse'")
        if self.shadow_force is not None:
            bad = [e for e in self.shadow_force if not 0 <= e < num_experts]
            if bad:
                errs.append(f"shadow_force experts {bad} are outside 0..{num_experts - 1}")
        if self.smart:
            gs = min(self.group_size, world_size)
            if world_size % gs:
                errs.append(f"smart schedule needs N % group_size == 0: {world_size} ranks, group_size={gs}")
        if self.topo_gate and (top_k != 2 or gate != "topk"):
            errs.append("topo_gate is a top-2 gate: set model.moe.gate='topk' and model.moe.top_k=2")
        return errs
