"""Options of the ``zero`` strategy (``parallel.strategy_options``), validated with clear errors.

| option | default | meaning |
|---|---|---|
| ``stage`` | 3 | 1: optimizer state sharded; 2: + gradients; 3: + parameters (FasterMoE's main baseline). 0: plain data
  parallelism of the whole model (nothing sharded; the memory reference the stages are compared with) |
| ``regather_backward`` | True | stage 3: free the full parameters after the forward pass and all-gather them again when
  backward starts (DeepSpeed/FasterMoE; 3(N-1)/N S bytes per iteration); False: keep them from the forward all-gather
  until the gradient reduce-scatter (2(N-1)/N S, full parameters resident during the whole forward+backward) |
| ``grad_collective`` | ``"reduce_scatter"`` | stage 1 only: ``"all_reduce"`` reduces the full gradient on every rank
  and each keeps its shard (the literal "stage 1 shards only the optimizer state"; 3(N-1)/N S per iteration with the
  parameter all-gather instead of 2(N-1)/N S). Stage 0 always all-reduces, stages 2-3 always reduce-scatter |
| ``global_loads`` | True | after each MoE forward, all-gather the per-expert token counts (8 E bytes, *unrecorded*
  metric traffic like the Trainer's loss all-reduce) so ``last_global_counts`` holds every rank's row (loads metrics,
  simulator validation). False: only this rank's row, no collective in the layer |
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moelab.config import ConfigError
from moelab.registry import StrategyOptions

STAGES = (0, 1, 2, 3)
GRAD_COLLECTIVES = ("reduce_scatter", "all_reduce")


class ZeroOptionError(ConfigError):
    """A ``ConfigError`` (hence a ``ValueError``) naming the bad zero option."""


@dataclass(frozen=True)
class ZeroOptions(StrategyOptions):
    strategy = "zero"
    error = ZeroOptionError

    stage: int = field(default=3, metadata={"choices": STAGES, "why": "1: optimizer state, 2: + gradients, "
                                                                   "3: + parameters; 0: plain data parallel"})
    regather_backward: bool = True
    grad_collective: str = field(default="reduce_scatter", metadata={"choices": GRAD_COLLECTIVES})
    global_loads: bool = True

    @property
    def grad_op(self) -> str:
        """The gradient collective this stage runs."""
        if self.stage == 0:
            return "all_reduce"
        if self.stage == 1:
            return self.grad_collective
        return "reduce_scatter"

    def value_errors(self) -> list:
        if self.grad_collective != "reduce_scatter" and self.stage != 1:
            return [f"grad_collective applies to stage 1 only (stage {self.stage} always "
                    f"{self.grad_op.replace('_', '-')}s the gradients)"]
        return []

    def run_errors(self, run_cfg) -> list:
        return self.shape_errors(run_cfg.model.moe.dispatcher, has_placement=run_cfg.parallel.placement is not None)

    def check_against(self, dispatcher: str, has_placement: bool) -> None:
        """Raise for options that do not fit the run (before any process starts)."""
        self.raise_if(self.shape_errors(dispatcher, has_placement))

    @staticmethod
    def shape_errors(dispatcher: str, has_placement: bool) -> list:
        errs = []
        if has_placement:
            errs.append("zero replicates every expert on every rank (data parallelism of the whole model): "
                        "leave parallel.placement unset")
        if dispatcher != "sparse":
            errs.append("zero runs every expert locally on the rank's own tokens (no dispatch, no padding): "
                        "set model.moe.dispatcher='sparse' (the default)")
        return errs
