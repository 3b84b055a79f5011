"""SAA: an all-to-all overlapped with an all-gather over a sub-group (Parm spec §2.8), as one collective.

``saa(D) == all_gather_sub(all_to_all(D))`` bitwise: every rank ends up holding what each member of
its sub-group (Parm's MP group) received from every rank. Instead of running the two one after the
other, the all-to-all runs as P-1 rotation phases and each phase also forwards the chunk the
previous phase received to the sub-group peers, so the gather rides on the all-to-all:

- phase 0: own chunk, local copy;
- phase i = 1..P: all-to-all half (i < P) sends ``D[(r+i)%P]`` to rank ``(r+i)%P`` and receives
  from ``(r-i)%P``; gather half sends the chunk received in phase i-1 to every sub-group peer and
  receives theirs. Each half is one batched point-to-point call on its own process group (gloo refuses
  a batch that mixes groups); a phase ends when both are done.

``combine = c`` (Parm's ``saa_mode: combined``): the members of ``group`` form consecutive blocks of
``c`` ranks whose chunks are partial sums of one result (Parm's ESP shards). A block's chunks reach a
rank in consecutive phases; once the last has arrived the rank sums them and forwards the sum, so
the gather half moves ``P/c`` chunks instead of ``P``, and ``saa(D, combine=c)`` equals ``saa(D)``
with each block summed. A rank forwards block ``g`` in the phase after the one that completed it
(:func:`forward_phases`), which every rank computes alike for itself and its sub-group peers.

Recorded by the comm door as **one** ``saa`` call (bytes per peer: ``c`` to each all-to-all peer,
plus ``P/combine`` chunks forwarded to each sub-group peer), and one ``saa phase i`` span per phase,
so a trace shows the phases (Parm's Fig. 5). The link emulator prices it phase by phase (the
collective declares its ``phases``).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moelab.comm.collectives import Collective, register_collective
from moelab.comm.costs import alltoall_demands


def sub_groups(sub) -> list:
    """``sub`` is one sub-group (a rank list: what a rank records) or all of them (what the simulator passes)."""
    return [list(sub)] if sub and isinstance(sub[0], int) else [list(s) for s in sub]


def forward_phases(P: int, combine: int, x: int) -> dict:
    """``{phase: block}``: in which phase member ``x`` forwards each block of ``combine`` consecutive
    members' chunks (the phase after its last chunk arrived; chunk m arrives in phase (x - m) % P)."""
    return {1 + max((x - m) % P for m in range(g * combine, (g + 1) * combine)): g for g in range(P // combine)}


def _peers(group, me, sub) -> list:
    return [p for p in next((s for s in sub_groups(sub) if me in s), []) if p != me]


def _sent(group, me, nbytes=0, sub=(), combine=1, **_):
    """Bytes ``me`` sends each rank (= receives from it: the pattern is symmetric): a chunk to every
    all-to-all member (itself: local), plus ``P/combine`` chunks forwarded to every other member of
    its sub-group."""
    out = {q: int(nbytes) for q in group}
    for p in _peers(group, me, sub):
        out[p] += len(group) // combine * int(nbytes)
    return out


def _phases(group, me, nbytes=0, sub=(), combine=1, **_):
    """Per phase 1..P, ``(sent, received)`` bytes per rank of ``me`` (phase 0, the own chunk, is local)."""
    group, P, nbytes = list(group), len(group), int(nbytes)
    x = group.index(me)
    peers = _peers(group, me, sub)
    mine = forward_phases(P, combine, x)
    theirs = {p: forward_phases(P, combine, group.index(p)) for p in peers}
    out = []
    for i in range(1, P + 1):
        sent, recv = {}, {}
        if i < P:
            sent[group[(x + i) % P]] = nbytes
            recv[group[(x - i) % P]] = nbytes
        for p in peers:
            if i in mine:
                sent[p] = sent.get(p, 0) + nbytes
            if i in theirs[p]:
                recv[p] = recv.get(p, 0) + nbytes
        out.append((sent, recv))
    return out


def _demands(group, topo, profile, nbytes=0, sub=(), combine=1, **_):
    """The simulator's demands: one all-to-all step per phase (``sub``: every sub-group), in order."""
    group = list(group)
    idx = {r: i for i, r in enumerate(group)}
    per_member = [_phases(group, me, nbytes=nbytes, sub=sub, combine=combine) for me in group]
    out = []
    for i in range(len(group)):
        m = np.zeros((len(group), len(group)), dtype=np.int64)
        for a, phases in enumerate(per_member):
            for q, b in phases[i][0].items():
                m[a, idx[q]] = b
        out += alltoall_demands(m, group, topo, profile, False)
    return out


register_collective(Collective("saa", _sent, _sent, "direct", _demands, phases=_phases))


def saa(comm, D: torch.Tensor, group: str, sub: str, combine: int = 1) -> torch.Tensor:
    """``[n_sub, P / combine, *chunk]``: block ``[v, g]`` is what sub-group member v received from the
    ranks of block g (``combine`` consecutive ranks, summed in rank order; ``combine = 1``: from rank g).

    ``D``: ``[P, *chunk]`` (chunk q goes to member q of ``group``, which spans the world in rank
    order); ``sub``: the name of the sub-group (each rank's instance), e.g. Parm's ``mp``."""
    pg, ranks = comm.group(group)
    spg, sranks = comm.group(sub)
    P, me = len(ranks), comm.rank
    if D.shape[0] != P:
        raise ValueError(f"saa: D has {D.shape[0]} chunks, group {group!r} has {P} members")
    if ranks != list(range(comm.world_size)):
        raise ValueError(f"saa: group {group!r} must span the world in rank order, got {ranks}")
    if combine < 1 or P % combine:
        raise ValueError(f"saa: combine={combine} must divide the group's {P} members")
    D = D.contiguous()
    u, n_sub = sranks.index(me), len(sranks)
    out = torch.empty((n_sub, P // combine) + tuple(D.shape[1:]), dtype=D.dtype, device=D.device)
    raw = out[u] if combine == 1 else torch.empty_like(D)  # chunks received by this rank
    when = {p: forward_phases(P, combine, p) for p in sranks}
    chunk = D[0].numel() * D.element_size()

    def issue(_pg, _ranks):
        raw[me].copy_(D[me])
        for i in range(1, P + 1):
            with comm.rec.span(f"saa phase {i}", cat="comm_phase"):
                works = []
                if i < P:
                    works += dist.batch_isend_irecv([
                        dist.P2POp(dist.isend, D[(me + i) % P], (me + i) % P, group=pg),
                        dist.P2POp(dist.irecv, raw[(me - i) % P], (me - i) % P, group=pg)])
                g = when[me].get(i)
                if g is not None and combine > 1:  # its block is complete since the last phase
                    torch.sum(raw[g * combine:(g + 1) * combine], dim=0, out=out[u, g])
                ops = []
                for v, p in enumerate(sranks):
                    if v != u:
                        if g is not None:
                            ops.append(dist.P2POp(dist.isend, out[u, g], p, group=spg))
                        if i in when[p]:
                            ops.append(dist.P2POp(dist.irecv, out[v, when[p][i]], p, group=spg))
                if ops:
                    works += dist.batch_isend_irecv(ops)
                for w in works:
                    w.wait()
        return None

    if P == 1:
        out[0, 0].copy_(D[0])
        return out
    return comm.run("saa", group, issue, result=lambda: out, nbytes=chunk, sub=tuple(sranks), combine=combine)
