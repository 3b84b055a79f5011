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

Recorded by the comm door as **one** ``saa`` call (bytes per peer: ``c`` to each all-to-all peer,
plus ``P*c`` forwarded to each sub-group peer), and one ``saa phase i`` span per phase, so a trace
shows the phases (Parm's Fig. 5). ``mode="combined"`` is not implemented: the raw mode is what the
paper's kernel and its Alg. 1 cost model use.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moelab.comm.collectives import Collective, register_collective


def sub_groups(sub) -> list:
    """``sub`` is one sub-group (a rank list: what a rank records) or all of them (what the simulator passes)."""
    return [list(sub)] if sub and isinstance(sub[0], int) else [list(s) for s in sub]


def _sent(group, me, nbytes=0, sub=(), **_):
    """Bytes ``me`` sends each rank (= receives from it: the pattern is symmetric): a chunk to every
    all-to-all member (itself: local), plus all P chunks forwarded to every other member of its sub-group."""
    out = {q: int(nbytes) for q in group}
    for p in next((s for s in sub_groups(sub) if me in s), []):
        if p != me:
            out[p] += len(group) * int(nbytes)
    return out


def _demands(group, topo, profile, nbytes=0, sub=(), **_):
    """The simulator's demand of one call alone: the pairwise matrix as one all-to-all step (``sub``:
    every sub-group; the phases' order is the runtime's business)."""
    import numpy as np

    from moelab.sim.costs import alltoall_demands

    idx = {r: i for i, r in enumerate(group)}
    m = np.zeros((len(group), len(group)))
    for me in group:
        for q, b in _sent(group, me, nbytes=nbytes, sub=sub).items():
            m[idx[me], idx[q]] = b
    return alltoall_demands(m, group, topo, profile, False)


register_collective(Collective("saa", _sent, _sent, "direct", _demands))


def saa(comm, D: torch.Tensor, group: str, sub: str) -> torch.Tensor:
    """``[n_sub, P, *chunk]``: block ``[v, q]`` is the chunk sub-group member v received from rank q.

    ``D``: ``[P, *chunk]`` (chunk q goes to member q of ``group``, which spans the world in rank
    order); ``sub``: the name of the sub-group (each rank's instance), e.g. Parm's ``mp``."""
    pg, ranks = comm.group(group)
    spg, sranks = comm.group(sub)
    P, me = len(ranks), comm.rank
    if D.shape[0] != P:
        raise ValueError(f"saa: D has {D.shape[0]} chunks, group {group!r} has {P} members")
    if ranks != list(range(comm.world_size)):
        raise ValueError(f"saa: group {group!r} must span the world in rank order, got {ranks}")
    D = D.contiguous()
    u, n_sub = sranks.index(me), len(sranks)
    out = torch.empty((n_sub,) + tuple(D.shape), dtype=D.dtype, device=D.device)
    chunk = D[0].numel() * D.element_size()

    def issue(_pg, _ranks):
        out[u, me].copy_(D[me])
        for i in range(1, P + 1):
            with comm.rec.span(f"saa phase {i}", cat="comm_phase"):
                works = []
                if i < P:
                    works += dist.batch_isend_irecv([
                        dist.P2POp(dist.isend, D[(me + i) % P], (me + i) % P, group=pg),
                        dist.P2POp(dist.irecv, out[u, (me - i) % P], (me - i) % P, group=pg)])
                ops = []
                for v, p in enumerate(sranks):
                    if v != u:
                        ops.append(dist.P2POp(dist.isend, out[u, (me - i + 1) % P], p, group=spg))
                        ops.append(dist.P2POp(dist.irecv, out[v, (p - i + 1) % P], p, group=spg))
                if ops:
                    works += dist.batch_isend_irecv(ops)
                for w in works:
                    w.wait()
        return None

    if P == 1:
        out[0, 0].copy_(D[0])
        return out
    return comm.run("saa", group, issue, result=lambda: out, nbytes=chunk, sub=tuple(sranks))
