"""Placement per iteration: pure policies ``(counts [N, E], static placement) -> this call's placement``.

The static placement says who *holds* each expert (its parameters and optimizer state); a policy
says where this call *computes* it. Every rank runs the policy on the same all-gathered counts and
gets the same placement without talking. Experts the call's placement puts on a rank that does not
hold them are materialized there for the call (:mod:`moelab.moe.materialize`): parameters brought
from the owner in forward, gradients returned to it in backward.

Instances: :class:`StaticPolicy` (today's: the static placement), :class:`ReplicateHottest`
(the ``n`` most loaded experts on every rank; with the default rule a holder keeps its own
tokens, so their rows are computed where they are), FasterMoE's dynamic shadowing
(:mod:`moelab.strategies.fastermoe.layer`: :func:`replicate` of the shadow set everywhere). Hecate's
materialization and Lina's inference placement are further policies of this shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

import numpy as np

from moelab.placement import Placement


def replicate(static: Placement, experts: Iterable[int], ranks: Optional[Iterable[int]] = None) -> Placement:
    """``static`` with every expert of ``experts`` also placed on ``ranks`` (all ranks by default).
    The owner stays first; the rule is kept. No expert listed: ``static`` itself."""
    experts = sorted({int(e) for e in experts})
    if not experts:
        return static
    bad = [e for e in experts if not 0 <= e < static.num_experts]
    if bad:
        raise ValueError(f"cannot replicate experts {bad}: outside 0..{static.num_experts - 1}")
    ranks = tuple(range(static.world_size)) if ranks is None else tuple(int(r) for r in ranks)
    return static.with_replicas({e: ranks for e in experts})


def hottest(counts, n: int) -> Tuple[int, ...]:
    """The ``n`` experts with the most rows over all sources (ties: lower id first), sorted by id."""
    C = np.asarray(counts, dtype=np.int64)
    if C.ndim != 2:
        raise ValueError(f"counts must be [N, E], got shape {C.shape}")
    order = np.argsort(-C.sum(0), kind="stable")
    return tuple(sorted(int(e) for e in order[:max(int(n), 0)]))


@dataclass(frozen=True)
class StaticPolicy:
    """This call's placement is the static one (nothing materialized)."""

    def __call__(self, counts, static: Placement) -> Placement:
        return static


@dataclass(frozen=True)
class ReplicateHottest:
    """The ``n`` most loaded experts of this call also placed on ``ranks`` (default: every rank)."""

    n: int = 1
    ranks: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 0:
            raise ValueError(f"ReplicateHottest.n must be an integer >= 0, got {self.n!r}")

    def __call__(self, counts, static: Placement) -> Placement:
        return replicate(static, hottest(counts, self.n), self.ranks)
