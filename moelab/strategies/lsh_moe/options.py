"""Options of the ``lsh_moe`` strategy (``parallel.strategy_options``), checked before launch.

| option | default | meaning (spec ``papers/lsh-moe.md``) |
|---|---|---|
| ``hash_family`` | cross_polytope | ``cross_polytope`` / ``spherical`` / ``hyperplane`` / ``identity`` / ``constant`` /
  ``none`` (§2.3; ``none``: the plain EP path, no bucketing) |
| ``num_hashes`` | 6 | L, hash functions AND-combined into one bucket key (§2.3, §6.1) |
| ``cp_dim`` | 2 | r, the cross-polytope projection dimension (codes in [0, 2r)) [choice §2.3] |
| ``error_compensation`` | true | add the residual ``x - c`` to the centroid's expert output (Eq. 5) |
| ``ec_scale`` | 1.0 | the residual's weight (not in the paper) |
| ``resample_each_step`` | false | draw new rotations every forward call (else fixed per layer) |
| ``center_before_hash`` | false | subtract each group's mean before hashing [choice, off for fidelity] |
| ``sp_refine_iters`` | 0 | spherical hashing: Heo et al.'s pivot refinement iterations |
| ``eval_mode`` | exact | the forward in evaluation (``model.eval()``): ``exact`` (uncompressed, the headline) or
  ``compressed`` |
| ``error_sample`` | 64 | rows per layer call (routed to this rank's own experts) on which the compression error is
  measured; 0: off |
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from moelab.config import ConfigError
from moelab.registry import StrategyOptions
from moelab.strategies.lsh_moe.hashing import FAMILIES


class LSHMoEOptionError(ConfigError):
    """A ``ConfigError`` naming the bad lsh_moe option."""


@dataclass(frozen=True)
class LSHMoEOptions(StrategyOptions):
    strategy = "lsh_moe"
    error = LSHMoEOptionError

    hash_family: str = field(default="cross_polytope", metadata={"choices": FAMILIES})
    num_hashes: int = 6
    cp_dim: int = 2
    error_compensation: bool = True
    ec_scale: float = 1.0
    resample_each_step: bool = False
    center_before_hash: bool = False
    sp_refine_iters: int = 0
    eval_mode: str = field(default="exact", metadata={"choices": ("exact", "compressed")})
    error_sample: int = 64

    @property
    def ec(self):
        """The residual weight the decompression uses (None: no error compensation)."""
        return self.ec_scale if self.error_compensation else None

    def value_errors(self) -> list:
        errs = []
        if self.num_hashes < 1:
            errs.append(f"num_hashes (L) must be >= 1, got {self.num_hashes}")
        if self.cp_dim < 1:
            errs.append(f"cp_dim must be >= 1, got {self.cp_dim}")
        if not math.isfinite(self.ec_scale):
            errs.append(f"ec_scale must be finite, got {self.ec_scale}")
        if self.sp_refine_iters < 0:
            errs.append(f"sp_refine_iters must be >= 0, got {self.sp_refine_iters}")
        if self.error_sample < 0:
            errs.append(f"error_sample must be >= 0, got {self.error_sample}")
        return errs

    def run_errors(self, run_cfg) -> list:
        return self.shape_errors(run_cfg.model.d_model, run_cfg.model.moe.dispatcher,
                                 has_placement=run_cfg.parallel.placement is not None)

    def shape_errors(self, d_model: int, dispatcher: str, has_placement: bool = False) -> list:
        errs = []
        if self.cp_dim > d_model:
            errs.append(f"cp_dim must be in 1..d_model={d_model}, got {self.cp_dim}")
        if dispatcher != "sparse":
            errs.append("lsh_moe needs model.moe.dispatcher='sparse': the dense dispatcher pads every expert "
                        "to its capacity, which hides the saving")
        if has_placement:
            errs.append("lsh_moe runs on plain expert parallelism: leave parallel.placement unset "
                        "(a placement with replicas would split a bucket's centroid across holders)")
        return errs
