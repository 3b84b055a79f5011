"""Declared topology: which ranks share a node, and the link class between any two ranks.

Ranks are node-major (node n holds ranks n*rpn .. n*rpn+rpn-1), as torchrun numbers them.
"2 nodes x 4 ranks" can be declared on one machine: the link classes then drive link emulation,
the byte accounting and the simulator, all labelled EMULATED where time is affected.
"""
from __future__ import annotations

from dataclasses import dataclass

LINK_CLASSES = ("local", "intra", "inter")


@dataclass(frozen=True)
class Topology:
    world_size: int
    ranks_per_node: int

    def __post_init__(self):
        if self.world_size < 1 or self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"{self.world_size} ranks do not split into nodes of {self.ranks_per_node}")

    @classmethod
    def from_config(cls, nproc: int, nodes: int = 1, ranks_per_node: int | None = None) -> "Topology":
        return cls(nproc, ranks_per_node if ranks_per_node is not None else nproc // max(nodes, 1))

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def link_class(self, src: int, dst: int) -> str:
        if src == dst:
            return "local"
        return "intra" if self.node_of(src) == self.node_of(dst) else "inter"

    def describe(self) -> str:
        return f"{self.nodes} node(s) x {self.ranks_per_node} rank(s)"
