"""Options of Parm (``parallel.strategy_options``), checked before any process starts.

| option | default | meaning (spec ``papers/parm.md``) |
|---|---|---|
| ``mp`` | 1 | N_MP, the tensor-parallel degree of the dense parts (MP groups: contiguous blocks) |
| ``esp`` | 1 | N_ESP, shards per expert (ESP groups: contiguous blocks); N_EP = nproc / esp |
| ``schedule`` | auto | ``baseline`` (Fig. 3a), ``s1``, ``s2`` (with SAA), ``s2_aas`` (no overlap), ``auto`` (Alg. 1) |
| ``baseline_variant`` | fig3a | ``fig3a`` (the paper's model of DeepSpeed) or ``ds081`` (DeepSpeed v0.8.1's own special
  cases, §3) |
| ``baseline_dedup_grad`` | true | divide the baseline's expert grads by N_MP (it processes every token N_MP times,
  §2.9) |
| ``dispatcher`` | einsum | ``einsum`` (DeepSpeed's dense mask) or ``index`` (§2.2, P18) |
| ``saa_backward`` | true | S2's backward gathers through SAA too (the paper describes only the forward) |
| ``saa_mode`` | raw | SAA forwards the raw partial slices (the paper's kernel and Alg. 1's cost); ``combined`` sums an
  expert's N_ESP partials before forwarding them (N_ESP x fewer gathered bytes; ``auto`` still prices S2 with the raw
  SAA line) |
| ``allow_cross_node`` | false | let MP/ESP groups span declared nodes (the paper keeps them intra-node) |
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moelab.config import ConfigError
from moelab.registry import StrategyOptions
from moelab.runtime.train import topology_for
from moelab.strategies.parm.gating import DISPATCHERS
from moelab.strategies.parm.layout import SAA_MODES, ParmLayout

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
    saa_mode: str = field(default="raw", metadata={"choices": SAA_MODES})
    allow_cross_node: bool = False

    def value_errors(self) -> list:
        return [f"{k} must be >= 1, got {v}" for k, v in (("mp", self.mp), ("esp", self.esp)) if v < 1]

    def run_errors(self, run_cfg) -> list:
        """Everything about the run that Parm cannot execute, each naming the option and its values."""
        m, moe, p, t = run_cfg.model, run_cfg.model.moe, run_cfg.parallel, run_cfg.train
        errs = list(layout_of(run_cfg, self).errors())
        if m.d_ff % self.esp:
            errs.append(f"model.d_ff={m.d_ff} (the expert hidden size) is not divisible by esp={self.esp}")
        for name, v in (("model.n_heads", m.n_heads), ("model.d_model", m.d_model), ("model.d_ff", m.d_ff)):
            if v % self.mp:
                errs.append(f"{name}={v} is not divisible by mp={self.mp} (tensor-parallel dense parts)")
        tokens = t.batch_size * m.seq_len
        if self.schedule in ("s1", "auto") and tokens % self.mp:
            errs.append(f"schedule {self.schedule!r} splits the tokens of an MP group over mp={self.mp}: "
                        f"train.batch_size * model.seq_len = {tokens} is not divisible by it")
        if moe.capacity_factor is None:
            errs.append("parm needs model.moe.capacity_factor (its buffers are capacity-padded, DeepSpeed-style)")
        if moe.dispatcher != "dense":
            errs.append(f"parm dispatches capacity buffers: set model.moe.dispatcher='dense' (got {moe.dispatcher!r}); "
                        "strategy_options.dispatcher picks einsum or index")
        if p.placement is not None:
            errs.append("parm places experts by its layout (ESP blocks, strided EP): parallel.placement must be unset")
        if moe.gate == "topk" and moe.top_k == 1:
            errs.append("model.moe.gate='topk' with top_k=1 has a constant weight of 1: use gate='switch'")
        elif moe.gate not in ("switch", "gshard"):
            errs.append(f"parm gates like DeepSpeed: model.moe.gate must be 'switch' (k=1) or 'gshard' (k=2), "
                        f"got {moe.gate!r}")
        return errs


def layout_of(run_cfg, opts: ParmOptions) -> ParmLayout:
    """The rank layout of this run under ``opts`` (its process groups and what it cannot hold)."""
    P = run_cfg.parallel.nproc
    return ParmLayout(P, opts.mp, opts.esp, run_cfg.model.moe.num_experts, topology_for(run_cfg, P).ranks_per_node,
                      opts.allow_cross_node)
