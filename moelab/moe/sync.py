"""Gradient synchronisation.

- Dense (non-expert) parameters are data-parallel: one bucketed all-reduce (SUM) over ``dp``. The
  convention (FasterMoE spec 2.1): each rank scales its loss by 1/N, so after the SUM every grad
  equals that of one process on the concatenated global batch with the mean loss.
- Expert parameters are not all-reduced: the owner already holds the sum over all tokens routed to
  it. With replicas, each holder has a partial sum; the replicas send theirs to the owner, the
  owner adds them and sends the total back, so every copy takes the same optimizer step.
- Packed experts (a layer whose EP runs over a sub-group, ``layer.expert_dp_group`` naming the
  group of ranks holding the same experts, Lina's packing): each copy holds its block's partial sum;
  one all-reduce (SUM) over that group makes every copy the full sum (:func:`sync_packed_grads`).
"""
from __future__ import annotations

import torch

from moelab.comm.door import Communicator


def _grads(params):
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def sync_dense_grads(params, comm: Communicator, group: str = "dp") -> None:
    params = [p for p in params if p.requires_grad]
    if comm.world_size == 1 or not params:
        return
    grads = _grads(params)
    flat = torch.cat([g.reshape(-1) for g in grads])
    with comm.rec.tagged(phase="grad_sync"):
        comm.all_reduce_(flat, group=group)
    off = 0
    for p in params:
        n = p.numel()
        p.grad = flat[off:off + n].view_as(p).clone()
        off += n


def sync_replica_grads(layer, comm: Communicator) -> None:
    """Sum each replicated expert's grad over its holders (owner gathers, then sends the total back)."""
    pl, me = layer.placement, comm.rank
    if pl.is_trivial or comm.world_size == 1:
        return
    ex = layer.experts
    full = [(p, p.grad if p.grad is not None else torch.zeros_like(p)) for p in (ex.w1, ex.b1, ex.w2, ex.b2)
            if p is not None]
    with comm.rec.tagged(layer=layer.layer_id, phase="replica_sync"):
        for e, holders in enumerate(pl.holders):
            if len(holders) < 2 or me not in holders:
                continue
            s = pl.slot_of(me, e)
            g = torch.cat([grad[s].reshape(-1) for _, grad in full])
            owner, replicas = holders[0], holders[1:]
            tag = 2 * e
            if me == owner:
                bufs = {r: torch.empty_like(g) for r in replicas}
                comm.exchange({}, bufs, tag=tag)
                for b in bufs.values():
                    g += b
                comm.exchange({r: g for r in replicas}, {}, tag=tag + 1)
            else:
                comm.exchange({owner: g}, {}, tag=tag)
                total = torch.empty_like(g)
                comm.exchange({}, {owner: total}, tag=tag + 1)
                g = total
            off = 0
            for _, grad in full:
                n = grad[s].numel()
                grad[s].copy_(g[off:off + n].view_as(grad[s]))
                off += n
    for p, grad in full:
        p.grad = grad


def packed_expert_params(layer) -> list:
    """The expert parameters of a packed layer (empty when its experts are not replicated by blocks)."""
    if getattr(layer, "expert_dp_group", None) is None:
        return []
    ex = layer.experts
    return [p for p in (ex.w1, ex.b1, ex.w2, ex.b2) if p is not None and p.requires_grad]


def sync_packed_grads(layer, comm: Communicator) -> None:
    """All-reduce a packed layer's expert grads over ``layer.expert_dp_group`` (one flat SUM)."""
    params = packed_expert_params(layer)
    if not params or len(comm.group_ranks(layer.expert_dp_group)) < 2:
        return
    with comm.rec.tagged(layer=layer.layer_id):
        sync_dense_grads(params, comm, group=layer.expert_dp_group)
