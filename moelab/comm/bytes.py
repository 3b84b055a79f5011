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

import numpy as np

from moelab.comm.collectives import collective, known_collectives
from moelab.comm.topology import LINK_CLASSES, Topology

OPS = known_collectives()  # the built-in ones; more may be registered (moelab.comm.collectives)


def peer_bytes(op: str, group: Sequence[int], me: int, nbytes: int = 0,
               splits: Optional[Sequence[int]] = None, root: Optional[int] = None,
               peer: Optional[int] = None, **extra) -> dict:
    """Bytes ``me`` sends to each global rank for one call of ``op`` over ``group`` (global ranks).

    ``nbytes``: the rank's input size (all_gather: its block; reduce_scatter/all_reduce/broadcast/
    reduce/send: the full tensor). ``splits``: per group member bytes, for all_to_all. ``extra``: what
    an op's own rule takes besides (SAA: ``sub``, ``combine``). The rule is the op's declaration
    (:mod:`moelab.comm.collectives`).
    """
    return collective(op).sent(group, me, nbytes=nbytes, splits=splits, root=root, peer=peer, **extra)


def recv_bytes(op: str, group: Sequence[int], me: int, nbytes: int = 0,
               splits: Optional[Sequence[int]] = None, root: Optional[int] = None,
               peer: Optional[int] = None, **extra) -> dict:
    """Bytes ``me`` receives from each global rank: by construction ``recv_bytes(.., me)[j] ==
    peer_bytes(.., j)[me]`` when every member passes the same ``nbytes`` / ``root``. ``splits``: per
    member bytes received (all_to_all); ``peer``/``nbytes``: the sender and size (p2p/recv)."""
    return collective(op).received(group, me, nbytes=nbytes, splits=splits, root=root, peer=peer, **extra)


def by_link_class(topo: Topology, me: int, per_peer: dict) -> dict:
    """Fold per-peer bytes into ``{"local": .., "intra": .., "inter": ..}``; self-traffic is local."""
    acc = dict.fromkeys(LINK_CLASSES, 0)
    for r, b in per_peer.items():
        acc[topo.link_class(me, r)] += int(b)
    return acc


def sent_bytes(op: str, group: Sequence[int], topo: Topology, nbytes: int = 0,
               splits=None, root: Optional[int] = None) -> int:
    """The most non-local bytes any member sends, by the byte rule (the calibrator's x, and the cost model's for
    a fitted op)."""
    best = 0
    for i, me in enumerate(group):
        row = None if splits is None else list(np.asarray(splits)[i])
        cls = by_link_class(topo, me, peer_bytes(op, group, me, nbytes, splits=row, root=root))
        best = max(best, cls["intra"] + cls["inter"])
    return best


def moved_bytes(comm: dict) -> dict:
    """Per member of a call (a simulator op's ``comm`` record: op, group, nbytes or splits, ...): the bytes it
    sends to and receives from the other members, summed: what a host copies through its transport for it."""
    group = [int(r) for r in comm["group"]]
    splits = comm.get("splits")
    S = None if splits is None else np.asarray(splits)
    extra = {k: v for k, v in comm.items() if k not in ("op", "group", "nbytes", "splits", "root", "peer")}
    kw = dict(nbytes=int(comm.get("nbytes", 0) or 0), root=comm.get("root"), peer=comm.get("peer"), **extra)
    out = {}
    for i, me in enumerate(group):
        sent = peer_bytes(comm["op"], group, me, splits=None if S is None else [int(x) for x in S[i]], **kw)
        got = recv_bytes(comm["op"], group, me, splits=None if S is None else [int(x) for x in S[:, i]], **kw)
        out[me] = sum(int(b) for r, b in sent.items() if r != me) + sum(int(b) for r, b in got.items() if r != me)
    return out


def exchange_by_class(S, node, received: bool = False) -> tuple:
    """The array twin of :func:`by_link_class` for a per-member exchange ``S[i, j]`` (bytes member i
    sends member j; ``node[i]``: member i's node): per member, ``(local, intra, inter)`` bytes it
    sends (``received``: it receives). O(n^2) array work: block sums per node, on views when the
    members are node-major with equal counts per node."""
    S = np.asarray(S)
    n = len(node)
    local = np.diagonal(S)
    nodes, nd = np.unique(node, return_inverse=True)
    if len(nodes) == n:  # one member per node: nothing is intra-node
        total = S.sum(0 if received else 1)
        return local, np.zeros_like(total), total - local
    g = n // len(nodes)
    if g * len(nodes) == n and np.array_equal(nd, np.repeat(np.arange(len(nodes)), g)):
        blocks = S.reshape(len(nodes), g, n).sum(1).T if received else S.reshape(n, len(nodes), g).sum(2)
    else:  # members in any order: block sums after one stable sort
        order = np.argsort(nd, kind="stable")
        starts = np.searchsorted(nd[order], np.arange(len(nodes)))
        blocks = (np.add.reduceat(S[order], starts, axis=0).T if received
                  else np.add.reduceat(S[:, order], starts, axis=1))
    own = blocks[np.arange(n), nd]  # [n]: bytes to (from) the member's own node, itself included
    return local, own - local, blocks.sum(1) - own

