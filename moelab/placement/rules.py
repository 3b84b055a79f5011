"""Routing rules: which holder of an expert receives a source rank's tokens for it.

A rule is a small frozen object with one pure method, ``blocks(placement, src, e, count)``: the
``count`` tokens ``src`` routes to expert ``e`` (in their sorted order) as ordered contiguous
``[(rank, n), ...]`` blocks over holders of ``e``. Every rank evaluates it on the all-gathered
counts and gets the same answer without talking, so the dispatcher (send order, receive counts)
and the simulator's route matrix share one code path: :meth:`Placement.split`.

- :class:`HolderOrder` (the default, moelab's rule since the start): a holder keeps its own tokens;
  otherwise the tokens are split near-equally over the holders in holder order (owner first),
  starting at holder ``src mod n`` so different sources start at different replicas.
- :class:`LocalityFirst` (Hecate §2.6, spec ``papers/hecate.md``): a holder keeps its own tokens;
  else the holders on ``src``'s node; else all holders; candidates sorted by rank, split with the
  same rotating offset ``src mod |candidates|`` (the first ``count mod |candidates|`` from the
  offset get one extra token).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


def rotating_split(src: int, candidates: Sequence[int], count: int) -> list:
    """``count`` tokens over ``candidates`` in near-equal contiguous blocks, starting at ``src mod n``."""
    n = len(candidates)
    base, rem = divmod(count, n)
    out = []
    for i in range(n):
        m = base + (1 if i < rem else 0)
        if m:
            out.append((candidates[(src + i) % n], m))
    return out


class KeepLocalRule:
    """What every rule here shares: a holder keeps its own tokens; everyone else splits them over the
    rule's :meth:`candidates` with :func:`rotating_split`."""

    def blocks(self, placement, src: int, e: int, count: int) -> list:
        h = placement.holders[e]
        if count == 0:
            return []
        if src in h:
            return [(src, count)]
        return rotating_split(src, self.candidates(src, h), count)

    def candidates(self, src: int, holders: Sequence[int]) -> Sequence[int]:
        raise NotImplementedError

    def source_groups(self, world_size: int, holders: Sequence[int]):
        """``(sources, candidates)`` pairs covering every rank once: sources sharing a candidate list."""
        return [(np.arange(world_size), list(self.candidates(0, holders)))]

    def route_replicated(self, placement, e: int, counts, out) -> None:
        """Add every source's tokens for expert ``e`` to ``out[src, dst]``: :meth:`blocks` for all
        sources at once (``counts[src]``). In :func:`rotating_split` the candidate at position c gets
        ``count // n`` tokens plus one when ``(c - src) mod n < count mod n``."""
        h = placement.holders[e]
        counts = np.asarray(counts, dtype=np.int64)
        keep = np.zeros(placement.world_size, dtype=bool)
        keep[list(h)] = True
        own = np.flatnonzero(keep)
        out[own, own] += counts[own]
        for srcs, cand in self.source_groups(placement.world_size, h):
            srcs = srcs[~keep[srcs]]
            if not len(srcs):
                continue
            n = len(cand)
            base, rem = np.divmod(counts[srcs], n)
            for c, dst in enumerate(cand):
                out[srcs, dst] += base + (((c - srcs) % n) < rem)


@dataclass(frozen=True)
class HolderOrder(KeepLocalRule):
    """Today's rule: a holder keeps its tokens, else split over all holders in holder order."""

    name = "holder_order"

    def candidates(self, src: int, holders: Sequence[int]) -> Sequence[int]:
        return holders

    def to_dict(self) -> dict:
        return {"rule": self.name}


@dataclass(frozen=True)
class LocalityFirst(KeepLocalRule):
    """Hecate's dispatcher rule (§2.6): local holder, else same-node holders, else any holder."""

    ranks_per_node: int
    name = "locality_first"

    def __post_init__(self):
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be an integer >= 1, got {self.ranks_per_node!r}")

    def candidates(self, src: int, holders: Sequence[int]) -> Sequence[int]:
        node = src // self.ranks_per_node
        return sorted(r for r in holders if r // self.ranks_per_node == node) or sorted(holders)

    def source_groups(self, world_size: int, holders: Sequence[int]):
        """Nodes holding the expert route to their own holders; all other nodes to every holder."""
        G = self.ranks_per_node
        nodes = sorted({r // G for r in holders})
        ranks = np.arange(world_size)
        groups = [(ranks[ranks // G == nd], self.candidates(nd * G, holders)) for nd in nodes]
        return groups + [(ranks[~np.isin(ranks // G, nodes)], sorted(holders))]

    def to_dict(self) -> dict:
        return {"rule": self.name, "ranks_per_node": self.ranks_per_node}


RULES = {HolderOrder.name: HolderOrder, LocalityFirst.name: LocalityFirst}


def rule_from_dict(d: dict):
    """Inverse of ``rule.to_dict()`` (plan records, checkpoints)."""
    d = dict(d)
    name = d.pop("rule")
    if name not in RULES:
        raise ValueError(f"unknown routing rule {name!r}; known: {sorted(RULES)}")
    return RULES[name](**d)
