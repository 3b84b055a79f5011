"""Options of Parm (``parallel.strategy_options``), checked before any process starts.

| option | default | meaning (spec ``papers/parm.md``) |
|---|---|---|
| ``mp`` | 1 | N_MP, the tensor-parallel degree of the dense parts (MP groups: contiguous blocks) |
| ``esp`` | 1 | N_ESP, shards per expert (ESP groups: contiguous blocks); N_EP = nproc / esp |
| ``schedule`` | auto | ``baseline`` (Fig. 3a), ``s1``, ``s2`` (with SAA), ``s2_aas`` (no overlap), ``auto`` (Alg. 1) |
| ``baseline_variant`` | fig3a | ``fig3a`` (the paper's model of DeepSpeed) or ``ds081`` (DeepSpeed v0.8.1's own special cases, §3) |
| ``baseline_dedup_grad`` | true | divide the baseline's expert grads by N_MP (it processes every token N_MP times, §2.9) |
| ``dispatcher`` | einsum | ``einsum`` (DeepSpeed's dense mask) or ``index`` (§2.2, P18) |
| ``saa_backward`` | true | S2's backward gathers through SAA too (the paper describes only the forward) |
| ``allow_cross_node`` | false | let MP/ESP groups span declared nodes (the paper keeps them intra-node) |
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moelab.config import ConfigError
from moelab.strategies.options import StrategyOptions
from moelab.strategies.parm.gating import DISPATCHERS

SCHEDULES = ("baseline", "s1", "s2", "s2_aas", "auto")


class ParmOptionError(ConfigError):
    """A ``ConfigError`` naming the bad parm option."""


@dataclass(frozen=True)
class ParmOptions(StrategyOptions):
    strategy = "parm"
    error = ParmOptionError

    mp: int = 1
    esp: int = 1
    schedule: str = field(default="auto", metadata={"choices": SCHEDULES})
    baseline_variant: str = field(default="fig3a", metadata={"choices": ("fig3a", "ds081")})
    baseline_dedup_grad: bool = True
    dispatcher: str = field(default="einsum", metadata={"choices": DISPATCHERS})
    saa_backward: bool = True
    allow_cross_node: bool = False

    def value_errors(self) -> list:
        return [f"{k} must be >= 1, got {v}" for k, v in (("mp", self.mp), ("esp", self.esp)) if v < 1]
