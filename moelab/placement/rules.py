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

import functools
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

    def route_replicated(self, placement, e: int, counts, out) -> None:
        """Add every source's tokens for expert ``e`` to ``out[src, dst]``: :meth:`blocks` for all
        sources at once (``counts[src]``), by :func:`add_routes`."""
        add_routes(self, placement.world_size, placement.holders[e], counts, out)


def add_routes(rule, world_size: int, holders: Sequence[int], counts, out) -> None:
    """``out[src, dst] +=`` the tokens ``counts[src]`` of one expert with ``holders`` that ``rule`` sends from
    every source to every holder: :meth:`KeepLocalRule.blocks` for all sources in one vectorised step. In
    :func:`rotating_split` the candidate at position j gets ``count // n`` tokens plus one when
    ``(j - src) mod n < count mod n``; which candidates a source has depends on the holders only, so that
    table is built once per holder set (:func:`_route_table`) and the policies' pricing, which routes the
    same sets again and again, pays a few array operations per expert."""
    src, dst, pos, n = _route_table(rule, int(world_size), tuple(int(r) for r in holders))
    c = np.asarray(counts, dtype=np.int64)[src]
    out[src, dst] += c // n + (pos < c % n)  # (src, dst) pairs are distinct: plain fancy-index addition


@functools.lru_cache(maxsize=65536)
def _route_table(rule, world_size: int, holders: tuple) -> tuple:
    """Every (source, candidate) pair of ``rule`` for one holder set as int64 arrays ``(src, dst, j - src mod n,
    n)``; a holder's only candidate is itself."""
    rows = []
    for s in range(world_size):
        cand = (s,) if s in holders else tuple(rule.candidates(s, holders))
        rows.extend((s, d, (j - s) % len(cand), len(cand)) for j, d in enumerate(cand))
    return tuple(np.ascontiguousarray(a) for a in np.asarray(rows, dtype=np.int64).T)


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
