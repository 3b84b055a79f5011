"""The smart schedule's step plan (FasterMoE §4.2, spec §2.5) as pure data.

``Gs`` consecutive ranks form a group (``group = rank // Gs``; ranks are node-major, so
well-connected workers share a group) and the ``G = N / Gs`` groups form a ring. In step
``s = 0 .. G-1`` the workers of group ``g`` send their tokens to the members of group
``(g + s) % G`` and receive tokens for their own experts from group ``(g - s) % G``. Step 0 stays
inside the group (the cheapest exchange, so it goes first); in step ``G-1`` every group talks to a
ring neighbour (group ``g-1`` sends to it). Over the G steps every ordered (src, dst) pair is
served exactly once. The paper writes the mirror image (send to ``g - s``); either direction is
valid (spec §6.5), tests check coverage and validity rather than a direction.

No torch.distributed here: every rank computes the same plan without talking, and the
performance model (:mod:`.perf_model`) prices the same steps.
"""
from __future__ import annotations

from typing import List, Tuple


def check_group_size(world_size: int, group_size: int) -> int:
    """Validate ``Gs`` and return ``G = N / Gs`` (clear errors, raised before any exchange)."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if group_size < 1:
        raise ValueError(f"smart schedule group_size must be >= 1, got {group_size}")
    if group_size > world_size:
        raise ValueError(f"smart schedule group_size={group_size} exceeds the {world_size} ranks")
    if world_size % group_size:
        raise ValueError(f"smart schedule needs N % group_size == 0: {world_size} ranks, group_size={group_size}")
    return world_size // group_size


def group_of(rank: int, group_size: int) -> int:
    return rank // group_size


def group_members(group: int, group_size: int) -> List[int]:
    return list(range(group * group_size, (group + 1) * group_size))


def send_group(rank: int, step: int, world_size: int, group_size: int) -> int:
    """The group ``rank`` sends its tokens to in ``step``."""
    G = check_group_size(world_size, group_size)
    return (group_of(rank, group_size) + step) % G


def recv_group(rank: int, step: int, world_size: int, group_size: int) -> int:
    """The group whose tokens ``rank`` receives (for its own experts) in ``step``."""
    G = check_group_size(world_size, group_size)
    return (group_of(rank, group_size) - step) % G


def send_peers(rank: int, step: int, world_size: int, group_size: int) -> List[int]:
    return group_members(send_group(rank, step, world_size, group_size), group_size)


def recv_peers(rank: int, step: int, world_size: int, group_size: int) -> List[int]:
    return group_members(recv_group(rank, step, world_size, group_size), group_size)


def step_pairs(world_size: int, group_size: int) -> List[List[Tuple[int, int]]]:
    """``plan[s]`` = every ordered ``(src, dst)`` pair served in step s (self pairs included)."""
    G = check_group_size(world_size, group_size)
    return [[(src, dst) for src in range(world_size) for dst in send_peers(src, s, world_size, group_size)]
            for s in range(G)]
