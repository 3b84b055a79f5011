"""Logical bytes each collective sends, per peer: the one accounting rule shared by the runtime's
communication records and the simulator, so "simulated bytes == measured bytes" is checkable.

The model is *direct/pairwise* (what a rank must ship to each peer, independent of the backend's
internal algorithm): uneven all-to-all sends ``splits[j]`` bytes to peer j; all-gather sends its
block to every peer; reduce-scatter sends each peer that peer's 1/n block; all-reduce is
reduce-scatter + all-gather (``2(n-1)/n * S`` per rank, as a ring); broadcast sends S from the root
to every peer; reduce sends S from every non-root to the root; point-to-point sends S to its peer.
Bytes a rank "sends" to itself are counted under link class ``local``.
"""
from __future__ import annotations

from typing import Optional, Sequence

from moelab.comm.topology import LINK_CLASSES, Topology

OPS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "send", "p2p", "recv")


def peer_bytes(op: str, group: Sequence[int], me: int, nbytes: int = 0,
               splits: Optional[Sequence[int]] = None, root: Optional[int] = None,
               peer: Optional[int] = None) -> dict:
    """Bytes ``me`` sends to each global rank for one call of ``op`` over ``group`` (global ranks).

    ``nbytes``: the rank's input size (all_gather: its block; reduce_scatter/all_reduce/broadcast/
    reduce/send: the full tensor). ``splits``: per group member bytes, for all_to_all.
    """
    n = len(group)
    out: dict = {}
    if op == "all_to_all":
        assert splits is not None and len(splits) == n, "all_to_all needs one split per group member"
        for r, b in zip(group, splits):
            out[r] = out.get(r, 0) + int(b)
    elif op == "all_gather":
        for r in group:
            out[r] = int(nbytes)
    elif op == "reduce_scatter":
        for r in group:
            out[r] = int(nbytes) // n
    elif op == "all_reduce":
        for r in group:
            out[r] = 2 * (int(nbytes) // n) if n > 1 else int(nbytes)
    elif op == "broadcast":
        if me == root:
            for r in group:
                out[r] = int(nbytes)
    elif op == "reduce":
        if me != root or n == 1:
            out[root] = int(nbytes)
    elif op in ("send", "p2p"):  # p2p: what Communicator.exchange records
        out[peer] = int(nbytes)
    elif op == "recv":
        pass
    else:
        raise ValueError(f"unknown op {op!r}; known: {OPS}")
    return out


def recv_bytes(op: str, group: Sequence[int], me: int, nbytes: int = 0,
               splits: Optional[Sequence[int]] = None, root: Optional[int] = None,
               peer: Optional[int] = None) -> dict:
    """Bytes ``me`` receives from each global rank: by construction ``recv_bytes(.., me)[j] ==
    peer_bytes(.., j)[me]`` when every member passes the same ``nbytes`` / ``root``. ``splits``: per
    member bytes received (all_to_all); ``peer``/``nbytes``: the sender and size (p2p/recv)."""
    n = len(group)
    nb = int(nbytes)
    if op == "all_to_all":
        assert splits is not None and len(splits) == n, "all_to_all needs one split per group member"
        out: dict = {}
        for r, b in zip(group, splits):
            out[r] = out.get(r, 0) + int(b)
        return out
    if op == "all_gather":
        return {r: nb for r in group}
    if op == "reduce_scatter":
        return {r: nb // n for r in group}
    if op == "all_reduce":
        return {r: 2 * (nb // n) if n > 1 else nb for r in group}
    if op == "broadcast":
        return {root: nb}
    if op == "reduce":
        if me != root:
            return {}
        return {r: nb for r in group if r != root or n == 1}
    if op in ("recv", "p2p"):
        return {peer: nb}
    if op == "send":
        return {}
    raise ValueError(f"unknown op {op!r}; known: {OPS}")


def by_link_class(topo: Topology, me: int, per_peer: dict) -> dict:
    """Fold per-peer bytes into ``{"local": .., "intra": .., "inter": ..}``; self-traffic is local."""
    acc = dict.fromkeys(LINK_CLASSES, 0)
    for r, b in per_peer.items():
        acc[topo.link_class(me, r)] += int(b)
    return acc
