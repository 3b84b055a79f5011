"""Lina's all-to-all micro-ops pipelined with the expert FFN (spec §2.2 "A2a micro-ops and pipelining").

The dense dispatcher's ``[E, C, d]`` capacity buffer (``E = N * E_loc`` experts, expert e on rank
``e // E_loc``) is cut along the capacity dim into ``m`` chunks; chunk j is one all-to-all micro-op
of ``[N, E_loc, c_j, d]`` rows. Forward: chunk j+1's dispatch is in flight (async, through the
door and so through the rank's priority scheduler) while the experts compute chunk j, whose combine
is issued as soon as it is done. The FFN is per token, so chunking is exact; ``m = 1`` runs the
same operations as the unchunked path. Backward mirrors it inside :class:`PipelinedExperts`: the
combine's reverse all-to-all of chunk j+1 moves while chunk j's expert backward runs (accumulating
the expert weight gradients), then chunk j's dispatch gradient goes back. Until its last chunk's
all-to-all is issued the backward holds the rank's priority scheduler (:meth:`moelab.strategies.lina.priority.
PriorityScheduler.hold`): more all-to-alls follow, so no all-reduce micro-op launches between chunks.
"""
from __future__ import annotations

import contextlib

import torch


def chunk_bounds(C: int, m: int) -> list:
    """``[(start, stop)]``: ``m`` near-equal consecutive slices of ``0..C`` (``torch.chunk`` sizes)."""
    size = -(-C // m)
    return [(a, min(a + size, C)) for a in range(0, C, size)]


def _a2a(comm, buf, tag):
    """Async equal-split all-to-all of ``buf [N, ...]`` (row block i to rank i) on ``ep``."""
    N = buf.shape[0]
    rows = buf[0].numel() // buf.shape[-1]
    with comm.rec.tagged(**tag):
        return comm.all_to_all_raw(buf.reshape(-1, buf.shape[-1]), [rows] * N, [rows] * N, group="ep", async_op=True)


class PipelinedExperts(torch.autograd.Function):
    """``[E, C, d]`` dispatch buffer -> ``[E, C, d]`` combined expert outputs, pipelined in chunks."""

    @staticmethod
    def forward(ctx, buf, experts, comm, m, tags):
        E, C, d = buf.shape
        N = comm.world_size
        El = E // N
        bounds = chunk_bounds(C, m)
        ctx.comm, ctx.experts, ctx.bounds, ctx.shape, ctx.tags = comm, experts, bounds, (N, El, C, d), tags
        view = buf.view(N, El, C, d)
        sends = [view[:, :, a:b].contiguous() for a, b in bounds]
        disp = [_a2a(comm, sends[0], {**tags, "chunk": 0, "a2a": "dispatch"})]
        recvs, outs, comb = [], [], []
        for j, (a, b) in enumerate(bounds):
            if j + 1 < len(bounds):
                disp.append(_a2a(comm, sends[j + 1], {**tags, "chunk": j + 1, "a2a": "dispatch"}))
            c = b - a
            recv = disp[j].wait().view(N, El, c, d).transpose(0, 1).reshape(-1, d)  # [(e_loc, src, c), d]
            with torch.enable_grad():
                leaf = recv.detach().requires_grad_()
                with comm.rec.span(f"experts chunk {j}", "expert"):
                    y = experts(leaf, [N * c] * El)
            recvs.append(leaf)
            outs.append(y)
            back = y.detach().view(El, N, c, d).transpose(0, 1).contiguous()  # [dst, e_loc, c, d]
            comb.append(_a2a(comm, back, {**tags, "chunk": j, "a2a": "combine"}))
        ctx.recvs, ctx.outs = recvs, outs
        parts = [h.wait().view(N, El, b - a, d) for h, (a, b) in zip(comb, bounds)]
        return torch.cat(parts, dim=2).reshape(E, C, d)

    @staticmethod
    def backward(ctx, g):
        comm, bounds, tags = ctx.comm, ctx.bounds, {**ctx.tags, "phase": "bwd"}
        N, El, C, d = ctx.shape
        gv = g.reshape(N, El, C, d)
        sends = [gv[:, :, a:b].contiguous() for a, b in bounds]
        hold = getattr(comm.scheduler, "hold", contextlib.nullcontext)
        with hold():
            comb = [_a2a(comm, sends[0], {**tags, "chunk": 0})]
            disp = []
            for j, (a, b) in enumerate(bounds):
                if j + 1 < len(bounds):
                    comb.append(_a2a(comm, sends[j + 1], {**tags, "chunk": j + 1}))
                c = b - a
                gy = comb[j].wait().view(N, El, c, d).transpose(0, 1).reshape(-1, d)  # expert-side layout
                with torch.enable_grad(), comm.rec.span(f"experts bwd chunk {j}", "expert"):
                    torch.autograd.backward(ctx.outs[j], gy)
                gr = ctx.recvs[j].grad.view(El, N, c, d).transpose(0, 1).contiguous()
                disp.append(_a2a(comm, gr, {**tags, "chunk": j}))
        parts = [h.wait().view(N, El, b - a, d) for h, (a, b) in zip(disp, bounds)]
        ctx.recvs = ctx.outs = None
        return torch.cat(parts, dim=2).reshape(N * El, C, d), None, None, None, None
