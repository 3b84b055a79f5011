"""Smart fine-grained schedule (FasterMoE §4.2, spec §2.5) on torch.distributed/gloo.

The dispatch all-to-all, the expert compute and the combine all-to-all of one MoE layer become
``G = N / Gs`` group-wise pairwise steps (plan: :mod:`.schedule`), pipelined on two "streams":

- **comm stream**: one Python thread per rank with an in-order task queue (:class:`CommStream`);
  every message of the pipeline - and, with shadowing, the materializer's parameter broadcasts
  and gradient reduces (:class:`~moelab.moe.materialize.Materializer`'s ``fetch`` / ``give_back``)
  - is issued from it, in the same order on every rank:
  forward ``S_0 .. S_{G-1}, bcast(S), R_0 .. R_{G-1}``; backward ``S_0 .. S_{G-1}, reduce(S), R_0 .. R_{G-1}``;
- **compute stream**: the main thread, ``C_0 .. C_{G-1}`` (then the shadowed experts in forward).
  ``C_s`` waits for ``S_s`` (a ``threading.Event``); ``R_s`` is queued when ``C_s`` is done.

``S_s``: send my tokens to the members of group ``(g+s) % G`` and receive tokens for my experts from
group ``(g-s) % G``; ``C_s``: run each local expert on what arrived in step s (one GeMM per
(step, expert)); ``R_s``: return those outputs, receive my own tokens' outputs from ``(g+s)``. Each
task posts all of its step's isend/irecv at once (``Communicator.exchange``: batched p2p, a
self-exchange is a local copy) and waits before the next task, so nothing can deadlock. Messages
are tagged ``base(layer, fwd/bwd, S/R) + step``. Empty messages are not sent (both sides know every
count from the all-gathered count matrix).

The whole layer is one autograd Function ``(y_back, ys) = SmartMoE(x_send, x_shadow, *expert params)``.
Forward builds a private graph per (step, expert) chunk on detached inputs and detached parameter
leaves; backward runs the same pipeline on the gradients (S-steps on ``grad_out``, shadow backward
+ reduces, C-steps = per-chunk ``autograd.grad``, R-steps return ``grad_x``) and *returns* the
parameter grads, so autograd does the accumulation (no side-effect backward, no stashing of shadow
params into expert 0 as FastMoE does).

gloo p2p from the second thread works here (torch 2.13 CPU, see the tests). ``threaded=False``
runs the same tasks in the same order on the main thread (no overlap) - a fallback and a
reference. On a 2-core CPU box the threads compete with gloo's own; speedups need emulated links
(the comm door sleeps on the comm thread, so emulated transfers do overlap with compute).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from moelab.comm.stream import CommStream, Task, comm_stream  # noqa: F401 - moved to moelab.comm
from moelab.moe.experts import ffn
from moelab.moe.materialize import Materializer
from moelab.strategies.fastermoe.schedule import check_group_size, recv_peers, send_peers

TAG_STRIDE = 4096


# ---- the plan -----------------------------------------------------------------------------------
@dataclass
class SmartPlan:
    """Counts of one layer call (all from the all-gathered count matrix, shadowed experts removed).

    ``send_counts[d][s]``: rows this rank sends to rank d for d's local slot s (the layout of
    ``x_send``: dest-major, then slot); ``recv_counts[j][s]``: rows from rank j for my slot s."""

    rank: int
    world_size: int
    group_size: int
    send_counts: torch.Tensor  # [N, E_local]
    recv_counts: torch.Tensor  # [N, E_local]
    tag_base: int = 0

    def __post_init__(self):
        self.G = check_group_size(self.world_size, self.group_size)
        self.in_rows = self.send_counts.sum(1).tolist()
        self.out_rows = self.recv_counts.sum(1).tolist()
        self.send_off = [0]
        for n in self.in_rows:
            self.send_off.append(self.send_off[-1] + n)
        # offsets of each slot inside one source's received block
        self.slot_off = (torch.cumsum(self.recv_counts, 1) - self.recv_counts).tolist()

    def send_peers(self, step: int) -> List[int]:
        return send_peers(self.rank, step, self.world_size, self.group_size)

    def recv_peers(self, step: int) -> List[int]:
        return recv_peers(self.rank, step, self.world_size, self.group_size)

    def tag(self, backward: bool, phase_r: bool, step: int) -> int:
        return self.tag_base + ((2 * int(backward) + int(phase_r)) * TAG_STRIDE) + step


def _exchange(comm, sends: dict, recvs: dict, tag: int) -> None:
    if sends or recvs:
        comm.exchange(sends, recvs, tag=tag)


class SmartPipeline:
    """Runs the S / C / R steps of one layer call, forward and backward (see module doc)."""

    def __init__(self, comm, stream: CommStream, plan: SmartPlan, experts_act, mat: Optional[Materializer] = None,
                 shadow_counts: Sequence[int] = ()):
        self.comm, self.stream, self.plan = comm, stream, plan
        self.act = experts_act
        self.mat = mat  # the shadowed experts' materializer (their params in, their grads back), or None
        self.shadow_counts = tuple(shadow_counts)  # this rank's rows of each shadowed expert (mat's order)
        self.chunks: list = []  # (step, slot, x_leaf, y, [(src, start, n), ...])
        self.shadow_graphs: list = []  # (x_leaf, param leaves, y) per shadowed expert
        self.p_leaves: list = []

    # -- the shadowed experts: private graphs on fetched copies ------------------------------------
    def _shadow_compute(self, x_rows: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        leaves = [None if t is None else t.detach().requires_grad_() for t in self.mat.views(buf)]
        xe = x_rows.detach().requires_grad_()
        with torch.enable_grad():
            ye = ffn(xe, *leaves, act=self.act)
        self.shadow_graphs.append((xe, leaves, ye))
        return ye.detach()

    def _shadow_backward(self, i: int, g_rows: torch.Tensor):
        """Private backward of shadowed expert ``i``: ``(grad_x_rows, flat param grad)``."""
        xe, leaves, ye = self.shadow_graphs[i]
        real = [t for t in leaves if t is not None]
        grads = torch.autograd.grad(ye, [xe] + real, g_rows, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, [xe] + real)]
        return grads[0], torch.cat([g.reshape(-1) for g in grads[1:]])

    # -- helpers ---------------------------------------------------------------------------------
    def _s_task(self, src_rows: torch.Tensor, bufs: dict, step: int, backward: bool) -> "Task":
        """Rows for rank p (``src_rows``, dest-major by ``plan.send_off``) go to the step's send group;
        blocks from the step's receive group land in ``bufs``."""
        pl = self.plan
        sends = {p: src_rows[pl.send_off[p]:pl.send_off[p + 1]] for p in pl.send_peers(step) if pl.in_rows[p]}
        recvs = {q: bufs[q] for q in pl.recv_peers(step) if pl.out_rows[q]}
        return self.stream.submit(_exchange, self.comm, sends, recvs, pl.tag(backward, False, step),
                                  name=f"{'bwd' if backward else 'fwd'} S{step}")

    def _r_task(self, out_bufs: dict, back_rows: torch.Tensor, step: int, backward: bool) -> "Task":
        pl = self.plan
        sends = {q: out_bufs[q] for q in pl.recv_peers(step) if pl.out_rows[q]}
        recvs = {p: back_rows[pl.send_off[p]:pl.send_off[p + 1]] for p in pl.send_peers(step) if pl.in_rows[p]}
        return self.stream.submit(_exchange, self.comm, sends, recvs, pl.tag(backward, True, step),
                                  name=f"{'bwd' if backward else 'fwd'} R{step}")

    def _step_pieces(self, step: int, slot: int):
        pl = self.plan
        return [(q, pl.slot_off[q][slot], int(pl.recv_counts[q, slot])) for q in pl.recv_peers(step)
                if int(pl.recv_counts[q, slot])]

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, x_send: torch.Tensor, xs: torch.Tensor, params: Sequence[Optional[torch.Tensor]]):
        pl, d = self.plan, x_send.shape[1]
        rec = self.comm.rec
        self.p_leaves = [None if p is None else p.detach().requires_grad_() for p in params]
        recv = {q: x_send.new_empty(pl.out_rows[q], d) for q in range(pl.world_size)}
        outb = {q: x_send.new_empty(pl.out_rows[q], d) for q in range(pl.world_size)}
        y_back = x_send.new_empty(x_send.shape[0], d)
        s_tasks = [self._s_task(x_send, recv, s, False) for s in range(pl.G)]
        b_tasks = []
        if self.mat is not None:
            for i in range(len(self.mat.plan.experts)):
                b_tasks.append(self.stream.submit(self.mat.fetch, params, i, name=f"bcast {i}"))
        r_tasks = []
        E_local = pl.recv_counts.shape[1]
        for s in range(pl.G):
            s_tasks[s].wait()
            with rec.span(f"C{s}", "expert"):
                for slot in range(E_local):
                    pieces = self._step_pieces(s, slot)
                    if not pieces:
                        continue
                    xin = torch.cat([recv[q][a:a + n] for q, a, n in pieces]).detach().requires_grad_()
                    with torch.enable_grad():  # slices of the leaves too: they must be in the graph
                        w1, b1, w2, b2 = (None if t is None else t[slot] for t in self.p_leaves)
                        y = ffn(xin, w1, b1, w2, b2, act=self.act)
                    self.chunks.append((s, slot, xin, y, pieces))
                    off = 0
                    for q, a, n in pieces:
                        outb[q][a:a + n] = y.detach()[off:off + n]
                        off += n
            r_tasks.append(self._r_task(outb, y_back, s, False))
        ys = xs.new_zeros(0, d)
        if self.mat is not None:
            outs, off = [], 0
            with rec.span("shadow", "expert"):
                for i, n in enumerate(self.shadow_counts):
                    outs.append(self._shadow_compute(xs[off:off + n], b_tasks[i].wait()))
                    off += n
            if outs:
                ys = torch.cat(outs, 0)
        for t in r_tasks:
            t.wait()
        return y_back, ys

    # -- backward --------------------------------------------------------------------------------
    def backward(self, g_back: torch.Tensor, g_ys: torch.Tensor, params):
        pl, d = self.plan, g_back.shape[1]
        rec = self.comm.rec
        gin = {q: g_back.new_empty(pl.out_rows[q], d) for q in range(pl.world_size)}
        gxo = {q: g_back.new_zeros(pl.out_rows[q], d) for q in range(pl.world_size)}
        gx_send = g_back.new_empty(g_back.shape[0], d)
        s_tasks = [self._s_task(g_back, gin, s, True) for s in range(pl.G)]
        acc = [None if p is None else torch.zeros_like(p) for p in params]
        sh_acc = [None if p is None else torch.zeros_like(p) for p in params]  # written by the comm thread
        touched = False
        gxs = g_ys.new_zeros(0, d)
        red_tasks = []
        if self.mat is not None:
            parts, off = [], 0
            with rec.span("shadow bwd", "expert"):
                for i, n in enumerate(self.shadow_counts):
                    g_rows, flat = self._shadow_backward(i, g_ys[off:off + n])
                    parts.append(g_rows)
                    off += n
                    red_tasks.append(self.stream.submit(self.mat.give_back, i, flat, sh_acc, name=f"reduce {i}"))
            touched |= self.mat.owner_gets_grads()
            if parts:
                gxs = torch.cat(parts, 0)
        by_step = {}
        for c in self.chunks:
            by_step.setdefault(c[0], []).append(c)
        r_tasks = []
        real = [t for t in self.p_leaves if t is not None]
        for s in range(pl.G):
            s_tasks[s].wait()
            with rec.span(f"C{s} bwd", "expert"):
                for _, slot, xin, y, pieces in by_step.get(s, []):
                    g = torch.cat([gin[q][a:a + n] for q, a, n in pieces])
                    grads = torch.autograd.grad(y, [xin] + real, g, allow_unused=True)
                    off = 0
                    for q, a, n in pieces:
                        gxo[q][a:a + n] = grads[0][off:off + n]
                        off += n
                    j = 1
                    for k, leaf in enumerate(self.p_leaves):
                        if leaf is None:
                            continue
                        if grads[j] is not None:
                            acc[k] += grads[j]
                        j += 1
                    touched = True
            r_tasks.append(self._r_task(gxo, gx_send, s, True))
        for t in red_tasks:  # the owner adds the reduced shadow grads once these finish
            t.wait()
        if red_tasks:
            for a, b in zip(acc, sh_acc):
                if a is not None:
                    a += b
        for t in r_tasks:
            t.wait()
        self.chunks, self.p_leaves, self.shadow_graphs = [], [], []
        return gx_send, gxs, [a if touched else None for a in acc]


class SmartMoE(torch.autograd.Function):
    """``(y_back, ys) = SmartMoE.apply(x_send, xs, pipeline, *params)``."""

    @staticmethod
    def forward(ctx, x_send, xs, pipe: SmartPipeline, *params):
        ctx.pipe = pipe
        ctx.tags = dict(pipe.comm.rec.tags)  # the layer's tags, for the backward's records
        ctx.save_for_backward(*params)
        return pipe.forward(x_send.detach(), xs.detach(), params)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_back, g_ys):
        pipe = ctx.pipe
        with pipe.comm.rec.tagged(**{**ctx.tags, "phase": "bwd"}):
            gx, gxs, gp = pipe.backward(g_back.contiguous(), g_ys.contiguous(), ctx.saved_tensors)
        ctx.pipe = None
        return (gx, gxs, None, *gp)
