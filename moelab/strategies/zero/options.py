"""Options of the ``zero`` strategy (``parallel.strategy_options``), validated with clear errors.

| option | default | meaning |
|---|---|---|
| ``stage`` | 3 | 1: optimizer state sharded; 2: + gradients; 3: + parameters (FasterMoE's main baseline). 0: plain data parallelism of the whole model (nothing sharded; the memory reference the stages are compared with) |
| ``regather_backward`` | True | stage 3: free the full parameters after the forward pass and all-gather them again when backward starts (DeepSpeed/FasterMoE; 3(N-1)/N S bytes per iteration); False: keep them from the forward all-gather until the gradient reduce-scatter (2(N-1)/N S, full parameters resident during the whole forward+backward) |
| ``grad_collective`` | ``"reduce_scatter"`` | stage 1 only: ``"all_reduce"`` reduces the full gradient on every rank and each keeps its shard (the literal "stage 1 shards only the optimizer state"; 3(N-1)/N S per iteration with the parameter all-gather instead of 2(N-1)/N S). Stage 0 always all-reduces, stages 2-3 always reduce-scatter |
| ``global_loads`` | True | after each MoE forward, all-gather the per-expert token counts (8 E bytes, *unrecorded* metric traffic like the Trainer's loss all-reduce) so ``last_global_counts`` holds every rank's row (loads metrics, simulator validation). False: only this rank's row, no collective in the layer |
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moelab.config import ConfigError

STAGES = (0, 1, 2, 3)
GRAD_COLLECTIVES = ("reduce_scatter", "all_reduce")


class ZeroOptionError(ConfigError):
    """A ``ConfigError`` (hence a ``ValueError``) naming the bad zero option."""


@dataclass(frozen=True)
class ZeroOptions:
    stage: int = 3
    regather_backward: bool = True
    grad_collective: str = "reduce_scatter"
    global_loads: bool = True

    @property
    def grad_op(self) -> str:
        """The gradient collective this stage runs."""
        if self.stage == 0:
            return "all_reduce"
        if self.stage == 1:
            return self.grad_collective
        return "reduce_scatter"

    @classmethod
    def from_dict(cls, d) -> "ZeroOptions":
        d = dict(d or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise ZeroOptionError(f"unknown zero option(s) {unknown}; known: {sorted(fields)}")
        errs, kw = [], {}
        for name, v in d.items():
            default = fields[name].default
            if isinstance(default, bool):
                if not isinstance(v, bool):
                    errs.append(f"{name} must be true or false, got {v!r}")
                    continue
            elif name == "stage":
                if isinstance(v, bool) or not isinstance(v, (int, str)) or str(v).strip() not in {str(s) for s in STAGES}:
                    errs.append(f"stage must be one of {list(STAGES)} (1: optimizer state, 2: + gradients, "
                                f"3: + parameters; 0: plain data parallel), got {v!r}")
                    continue
                v = int(v)
            elif name == "grad_collective":
                if v not in GRAD_COLLECTIVES:
                    errs.append(f"grad_collective must be one of {list(GRAD_COLLECTIVES)}, got {v!r}")
                    continue
            kw[name] = v
        if errs:
            raise ZeroOptionError("invalid zero option(s):\n  - " + "\n  - ".join(errs))
        opts = cls(**kw)
        if opts.grad_collective != "reduce_scatter" and opts.stage != 1:
            raise ZeroOptionError(f"grad_collective applies to stage 1 only (stage {opts.stage} always "
                                  f"{opts.grad_op.replace('_', '-')}s the gradients)")
        return opts

    def check_against(self, dispatcher: str, has_placement: bool) -> None:
        """Errors that need the run's shape (raised before any process starts)."""
        errs = []
        if has_placement:
            errs.append("zero replicates every expert on every rank (data parallelism of the whole model): "
                        "leave parallel.placement unset")
        if dispatcher != "sparse":
            errs.append("zero runs every expert locally on the rank's own tokens (no dispatch, no padding): "
                        "set model.moe.dispatcher='sparse' (the default)")
        if errs:
            raise ZeroOptionError("invalid zero option(s):\n  - " + "\n  - ".join(errs))
