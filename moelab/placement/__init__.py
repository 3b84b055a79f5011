"""Expert placement as data: expert -> owner rank + replica ranks, and the routing rule over it.

EP is the trivial placement (expert e on rank e // (E/N), no replicas). Shadowing, FSSDP and Lina
produce other placements; one replica-aware dispatcher and one replica gradient sync serve them all.
Which holder a token goes to is the placement's ``rule`` (:mod:`.rules`; holder order by default,
Hecate's locality-first rule as a second instance), used by the dispatcher and by the simulator's
route matrix alike through :meth:`Placement.split`. Where a call computes each expert may differ
from where it is held: :mod:`.policy` maps ``(counts, static placement)`` to the call's placement
(the core materializes the difference, :mod:`moelab.moe.materialize`). Everything here is a pure
function: every rank computes the same answer without talking.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import torch

from moelab.placement.rules import HolderOrder, LocalityFirst, rule_from_dict  # noqa: F401 (the rules live here too)


@dataclass(frozen=True)
class Placement:
    num_experts: int
    world_size: int
    holders: tuple  # holders[e] = (owner, replica, ...), all distinct ranks
    rule: object = field(default_factory=HolderOrder)  # which holder gets a source's tokens (.rules)

    def __post_init__(self):
        if not callable(getattr(self.rule, "blocks", None)):
            raise ValueError(f"placement rule {self.rule!r} has no blocks(placement, src, e, count) method")
        if len(self.holders) != self.num_experts:
            raise ValueError(f"need holders for {self.num_experts} experts, got {len(self.holders)}")
        for e, h in enumerate(self.holders):
            if not h:
                raise ValueError(f"expert {e} has no owner")
            if len(set(h)) != len(h):
                raise ValueError(f"expert {e} lists a rank twice: {list(h)}")
            bad = [r for r in h if not 0 <= r < self.world_size]
            if bad:
                raise ValueError(f"expert {e} placed on rank(s) {bad} outside 0..{self.world_size - 1}")

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def expert_parallel(cls, num_experts: int, world_size: int) -> "Placement":
        if num_experts % world_size:
            raise ValueError(f"{num_experts} experts are not divisible by {world_size} ranks")
        per = num_experts // world_size
        return cls(num_experts, world_size, tuple((e // per,) for e in range(num_experts)))

    def with_rule(self, rule) -> "Placement":
        """The same holders routed by another rule (e.g. ``LocalityFirst(ranks_per_node)``)."""
        return replace(self, rule=rule)

    @classmethod
    def from_mapping(cls, mapping: dict, num_experts: int, world_size: int) -> "Placement":
        """``{expert: [owner, replicas...]}`` (keys may be strings, as from YAML); every expert must appear."""
        holders = [None] * num_experts
        for k, v in mapping.items():
            e = int(k)
            if not 0 <= e < num_experts:
                raise ValueError(f"expert {e} is outside 0..{num_experts - 1}")
            holders[e] = tuple(int(r) for r in ([v] if isinstance(v, int) else v))
        missing = [e for e, h in enumerate(holders) if h is None]
        if missing:
            raise ValueError(f"experts {missing} have no owner")
        return cls(num_experts, world_size, tuple(holders))

    def with_replicas(self, extra: dict) -> "Placement":
        """A copy where expert e gains replica ranks ``extra[e]`` (ranks already holding it are skipped)."""
        holders = [list(h) for h in self.holders]
        for e, ranks in extra.items():
            for r in ranks:
                if r not in holders[e]:
                    holders[e].append(r)
        return Placement(self.num_experts, self.world_size, tuple(tuple(h) for h in holders), self.rule)

    # ---- queries ---------------------------------------------------------------------------
    def owner(self, e: int) -> int:
        return self.holders[e][0]

    @cached_property
    def _local(self) -> tuple:
        local = [[] for _ in range(self.world_size)]
        for e, h in enumerate(self.holders):
            for r in h:
                local[r].append(e)
        return tuple(tuple(sorted(x)) for x in local)

    def local_experts(self, rank: int) -> tuple:
        """Experts whose parameters live on ``rank`` (owned or replicated), ascending: its expert slots."""
        return self._local[rank]

    def slot_of(self, rank: int, e: int) -> int:
        return self._local[rank].index(e)

    @cached_property
    def is_trivial(self) -> bool:
        return all(len(h) == 1 for h in self.holders)

    @cached_property
    def is_expert_parallel(self) -> bool:
        """Plain EP: :meth:`expert_parallel`'s holders (any rule routes it the same way)."""
        E, N = self.num_experts, self.world_size
        return E % N == 0 and self.holders == tuple((e // (E // N),) for e in range(E))

    @property
    def num_replicas(self) -> int:
        return sum(len(h) - 1 for h in self.holders)

    def to_mapping(self) -> dict:
        return {e: list(h) for e, h in enumerate(self.holders)}

    def to_record(self) -> dict:
        """JSON-able: holders (string keys, as YAML/JSON give them back) and the rule."""
        return {"holders": {str(e): list(h) for e, h in enumerate(self.holders)}, **self.rule.to_dict()}

    # ---- the routing rule --------------------------------------------------------------------
    def blocks(self, src: int, e: int, count: int) -> list:
        """Where ``src``'s ``count`` tokens for expert ``e`` go, as ordered ``[(rank, n), ...]`` blocks
        (contiguous in the tokens' sorted order): the placement's :attr:`rule`."""
        return self.rule.blocks(self, src, e, count)

    def split_counts(self, src: int, counts) -> torch.Tensor:
        """``counts[e]`` tokens of ``src`` for expert e -> ``out[e, r]`` tokens sent to rank r."""
        counts = torch.as_tensor(counts).to(torch.int64).cpu().tolist()
        out = torch.zeros(self.num_experts, self.world_size, dtype=torch.int64)
        for e, c in enumerate(counts):
            for r, n in self.blocks(src, e, int(c)):
                out[e, r] += n
        return out

    def split(self, counts) -> np.ndarray:
        """``counts[src, e]`` (all sources) -> ``out[src, e, dst]`` tokens src sends to dst for e.

        The one routing computation behind the dispatch plans and the simulator's route matrix.
        A trivial placement has one holder per expert, which every rule must pick: vectorised
        (64 ranks x 24 layers of the Python rule cost seconds in the simulator).
        """
        C = np.asarray(counts, dtype=np.int64)
        if C.shape != (self.world_size, self.num_experts):
            raise ValueError(f"counts must be [{self.world_size}, {self.num_experts}], got {C.shape}")
        if self.is_trivial:
            out = np.zeros((self.world_size, self.num_experts, self.world_size), dtype=np.int64)
            out[:, np.arange(self.num_experts), self.owners] = C
            return out
        return np.stack([self.split_counts(src, torch.from_numpy(C[src])).numpy() for src in range(self.world_size)])

    def routes(self, counts) -> np.ndarray:
        """``counts[src, e]`` -> ``tokens[src, dst]``: :meth:`split` summed over experts, without the
        ``[N, E, N]`` tensor. Single-holder experts by one sorted reduction; replicated experts by the
        rule's vectorised ``route_replicated`` where it has one (the built-in rules), else by its
        ``blocks`` per source. Cost O(N*E + N*replicas), so the simulator scales to thousands of ranks."""
        C = np.asarray(counts, dtype=np.int64)
        N, E = self.world_size, self.num_experts
        if C.shape != (N, E):
            raise ValueError(f"counts must be [{N}, {E}], got {C.shape}")
        single = self._single_holder
        out = np.zeros((N, N), dtype=np.int64)
        owners = self.owners[single]
        if len(owners):  # sum each source's columns per owner: one reduceat (exact int64)
            cols = C if len(owners) == E else C[:, single]
            if np.any(np.diff(owners) < 0):  # owners out of order: sort the columns once
                order = np.argsort(owners, kind="stable")
                owners, cols = owners[order], cols[:, order]
            dst, starts = np.unique(owners, return_index=True)
            sums = cols if len(dst) == len(owners) else np.add.reduceat(cols, starts, axis=1)
            if dst[-1] - dst[0] + 1 == len(dst):  # owners form a range: a slice copies rows, not columns
                out[:, dst[0]:dst[-1] + 1] = sums
            else:
                out[:, dst] = sums
        vectorised = getattr(self.rule, "route_replicated", None)
        for e in np.flatnonzero(~single):
            if vectorised is not None:
                vectorised(self, int(e), C[:, e], out)
            else:
                for src in range(N):
                    for r, n in self.blocks(src, int(e), int(C[src, e])):
                        out[src, r] += n
        return out

    @cached_property
    def _single_holder(self) -> np.ndarray:
        return np.fromiter((len(h) == 1 for h in self.holders), dtype=bool, count=self.num_experts)

    @cached_property
    def owners(self) -> np.ndarray:
        return np.fromiter((h[0] for h in self.holders), dtype=np.int64, count=self.num_experts)

    @cached_property
    def slot_table(self) -> torch.Tensor:
        """``[world, E]``: slot index of expert e on rank r, or -1."""
        t = torch.full((self.world_size, self.num_experts), -1, dtype=torch.int64)
        for r, es in enumerate(self._local):
            for s, e in enumerate(es):
                t[r, e] = s
        return t
