"""Options of the ``fsdp_expert`` strategy (``parallel.strategy_options``), validated with clear errors.

| option | default | meaning |
|---|---|---|
| ``reshard_after_forward`` | False | free each MoE layer's gathered expert buffer when its forward ends (storage
  resized to 0, as FSDP does) and all-gather it again when that layer's backward starts: two all-gathers per layer per
  iteration instead of one, the full experts resident only while the layer computes. False: the gathered buffer lives
  from the layer's forward to the end of its backward (FSDP's ``SHARD_GRAD_OP``) |
| ``global_loads`` | True | after each MoE gate, all-gather the per-expert token counts (*unrecorded* metric traffic, as
  ``zero``'s) so ``last_global_counts`` holds every rank's row; False: only this rank's row, no count collective |
"""
from __future__ import annotations

from dataclasses import dataclass

from moelab.config import ConfigError
from moelab.registry import StrategyOptions


class FsdpExpertOptionError(ConfigError):
    """A ``ConfigError`` (hence a ``ValueError``) naming the bad fsdp_expert option or run setting."""


@dataclass(frozen=True)
class FsdpExpertOptions(StrategyOptions):
    strategy = "fsdp_expert"
    error = FsdpExpertOptionError

    reshard_after_forward: bool = False
    global_loads: bool = True

    def run_errors(self, run_cfg) -> list:
        return self.shape_errors(run_cfg.model.moe.dispatcher, has_placement=run_cfg.parallel.placement is not None)

    @staticmethod
    def shape_errors(dispatcher: str, has_placement: bool) -> list:
        errs = []
        if has_placement:
            errs.append("fsdp_expert shards every layer's experts 1/N over all ranks and gathers them whole "
                        "(every rank computes with every expert): leave parallel.placement unset")
        if dispatcher != "sparse":
            errs.append("fsdp_expert runs every expert locally on the rank's own tokens (no dispatch, no "
                        "padding): set model.moe.dispatcher='sparse' (the default)")
        return errs
