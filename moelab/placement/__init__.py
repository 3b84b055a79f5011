"""Expert placement as data: expert -> owner rank + replica ranks, and the pure routing rule over it.

EP is the trivial placement (expert e on rank e // (E/N), no replicas). Shadowing, FSSDP and Lina
produce other placements; one replica-aware dispatcher and one replica gradient sync serve them all.
Everything here is a pure function: every rank computes the same answer without talking.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Placement:
    num_experts: int
    world_size: int
    holders: tuple  # holders[e] = (owner, replica, ...), all distinct ranks

    def __post_init__(self):
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
        return Placement(self.num_experts, self.world_size, tuple(tuple(h) for h in holders))

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

    @property
    def is_trivial(self) -> bool:
        return all(len(h) == 1 for h in self.holders)

    @property
    def num_replicas(self) -> int:
        return sum(len(h) - 1 for h in self.holders)

    def to_mapping(self) -> dict:
        return {e: list(h) for e, h in enumerate(self.holders)}

    # ---- the routing rule --------------------------------------------------------------------
    def blocks(self, src: int, e: int, count: int) -> list:
        """Where ``src``'s ``count`` tokens for expert ``e`` go, as ordered ``[(rank, n), ...]`` blocks.

        Deterministic rule: a rank holding e keeps all its tokens for e; otherwise the tokens (in
        their sorted order) are split into contiguous, near-equal blocks over e's holders, starting
        at holder ``src mod n`` so different sources start at different replicas. (Topology-aware
        replica choice belongs to strategies that need it and can override this rule.)
        """
        h = self.holders[e]
        if count == 0:
            return []
        if src in h:
            return [(src, count)]
        n = len(h)
        base, rem = divmod(count, n)
        return [(h[(src + i) % n], base + (1 if i < rem else 0)) for i in range(n) if base + (1 if i < rem else 0)]

    def split_counts(self, src: int, counts) -> torch.Tensor:
        """``counts[e]`` tokens of ``src`` for expert e -> ``out[e, r]`` tokens sent to rank r."""
        counts = torch.as_tensor(counts).to(torch.int64).cpu().tolist()
        out = torch.zeros(self.num_experts, self.world_size, dtype=torch.int64)
        for e, c in enumerate(counts):
            for r, n in self.blocks(src, e, int(c)):
                out[e, r] += n
        return out

    @cached_property
    def slot_table(self) -> torch.Tensor:
        """``[world, E]``: slot index of expert e on rank r, or -1."""
        t = torch.full((self.world_size, self.num_experts), -1, dtype=torch.int64)
        for r, es in enumerate(self._local):
            for s, e in enumerate(es):
                t[r, e] = s
        return t
