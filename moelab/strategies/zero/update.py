"""ZeRO-1/2/3 as an :class:`~moelab.runtime.update.Update`: data parallelism of the whole MoE model
with optimizer state, gradients and parameters sharded over ``dp`` (FasterMoE §3's baseline).

Layout. Every trainable parameter of the model (dense and expert: with the full-replication
placement every rank holds all of them) is a view into one flat buffer ``full`` of ``P`` elements,
padded with zeros to ``Pp = ceil(P / N) * N``. Rank r owns the shard ``[r*Pp/N, (r+1)*Pp/N)``;
padding elements have zero gradient, so Adam leaves them at zero. ``S = Pp * element size``.

Per iteration (every collective through the communicator, so bytes are recorded):

| stage | before forward | after backward (``sync``) | ``step`` | bytes sent per rank over the network |
|---|---|---|---|---|
| 0 | - | ``all_reduce`` (full flat grad) | Adam on all of ``full`` | ``2(N-1)/N S`` |
| 1 | - | ``reduce_scatter`` (or ``all_reduce`` + keep own shard) | Adam on own shard, ``all_gather`` shards into
  ``full`` | ``2(N-1)/N S`` (``3(N-1)/N S``) |
| 2 | - | ``reduce_scatter``; full grads freed | same as 1 | ``2(N-1)/N S`` |
| 3 | ``all_gather`` into ``full`` | ``reduce_scatter``; full grads and ``full`` freed | Adam on own shard only |
  ``3(N-1)/N S`` (``2(N-1)/N S`` without ``regather_backward``) |

(By the pairwise rule of :mod:`moelab.comm.bytes`: an all-gather of a ``S/N`` block sends it to
each of the ``N-1`` peers, a reduce-scatter of ``S`` sends each peer its ``S/N`` block, an
all-reduce ``2 S/N`` to each peer; the rank's own block counts as ``local``.)

Stage 3 and "re-gather before backward". DeepSpeed gathers each layer's parameters before its
forward, releases them after it, and gathers them again before the layer's backward. This CPU
implementation gathers the *whole* model at once (one flat all-gather in ``before_forward``); with
``regather_backward`` (default) it releases the buffer's storage right after the model's forward
(a forward hook; the parameters keep their shapes, their storage is resized to 0, as FSDP does) and
all-gathers it again from a gradient hook on the model's output, i.e. when backward starts, before
any node that reads a parameter runs (every parameter-reading node of the graph lies behind the
output). Bytes are DeepSpeed's ``3(N-1)/N S``; the memory saving is between forward and backward
only, not per layer (peak = the full parameters, as with one layer of DeepSpeed's granularity
equal to the whole model). Saved activations are never touched, so the arithmetic is exact.

Gradients. Backward writes full-size ``p.grad`` on every rank in every stage (there are no
per-bucket backward hooks here, so the transient peak is full size); ``sync`` flattens them into
one buffer and drops ``p.grad``. What each stage keeps afterwards (``grad_bytes``): 0: the full
all-reduced buffer; 1: the full buffer with its own shard replaced by the reduced shard (ZeRO-1
keeps a full gradient buffer); 2-3: only the reduced shard. ``p.grad`` is None after ``sync``.

Memory metrics (per rank, from the live storages, each counted once): ``param_bytes`` = ``S`` (stages 0-2),
``S/N`` between iterations in stage 3 (its shard; the full buffer is freed); ``optimizer_state_bytes``
= Adam's ``exp_avg`` + ``exp_avg_sq`` over the rank's elements (``2 S`` for stage 0, ``2 S/N``
for stages 1-3) plus the 4-byte ``step`` tensor. The iteration's peaks (``mem_*_peak_bytes``) see
the transients: stage 3's parameter peak is ``S + S/N`` (the gathered buffer beside the shard).

Equivalence with the EP baseline. With the loss scaled by 1/N on every rank, summing gradients over
ranks gives exactly EP's dense and expert gradients, and Adam is elementwise, so a rank updating its
slice performs the same arithmetic as EP's Adam on those elements. An expert that received no token
in an iteration takes an Adam step with a zero gradient here (its moments still move it), as it does
in EP and in the single-process run (one optimizer semantics, :mod:`moelab.runtime.update`).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from moelab.runtime.update import Update
from moelab.strategies.zero.options import ZeroOptions


class ZeroUpdate(Update):
    group = "dp"

    def __init__(self, model, comm, cfg, options: Optional[ZeroOptions] = None):
        super().__init__(model, comm, cfg)
        if options is None:
            options = ZeroOptions.from_dict(cfg.parallel.strategy_options)
            options.check_against(cfg.model.moe.dispatcher, has_placement=cfg.parallel.placement is not None)
        self.options = options
        self.stage = self.options.stage
        ranks = comm.group_ranks(self.group)
        self.N, self.rank = len(ranks), ranks.index(comm.rank)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("zero: the model has no trainable parameters")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"zero flattens every parameter into one buffer: one dtype needed, got {dtypes}")
        dtype, device = self.params[0].dtype, self.params[0].device
        self.numel = sum(p.numel() for p in self.params)
        self.padded = -(-self.numel // self.N) * self.N
        self.shard_numel = self.padded // self.N
        self.lo, self.hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        self.full = torch.zeros(self.padded, dtype=dtype, device=device)
        self._offsets = []
        off = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self.full[off:off + n].copy_(p.detach().reshape(-1))
                p.data = self.full[off:off + n].view_as(p)  # p keeps its own autograd version counter
                self._offsets.append(off)
                off += n
        self.elem = self.full.element_size()
        self.full_bytes = self.padded * self.elem  # S
        if self.stage == 0:
            self.master = nn.Parameter(self.full)  # shares full's storage: Adam updates the model in place
        elif self.stage in (1, 2):
            self.master = nn.Parameter(self.full[self.lo:self.hi])  # own slice of full, in place
        else:
            self.master = nn.Parameter(self.full[self.lo:self.hi].clone())  # own storage; full is freed
        self.optimizer = torch.optim.Adam([self.master], lr=cfg.train.lr)
        self._full_grad: Optional[torch.Tensor] = None  # stage 0/1: the full flat gradient buffer
        self._materialized = True
        self._armed = False  # stage 3: a training forward is in flight (set by before_forward)
        self._hooks = [model.register_forward_pre_hook(self._check_materialized)]
        if self.stage == 3:
            if self.options.regather_backward:
                self._hooks.append(model.register_forward_hook(self._after_forward))
            self.release_params()

    # ---- stage-3 parameter lifecycle ---------------------------------------------------------------
    @property
    def materialized(self) -> bool:
        """Whether the full parameters are resident (always, except stage 3 between uses)."""
        return self._materialized

    def release_params(self) -> None:
        """Stage 3: free the full buffer's storage (parameters keep their shapes, no data)."""
        if self.stage == 3 and self._materialized:
            self.full.untyped_storage().resize_(0)
            self._materialized = False

    def gather_params(self, phase: str = "param_gather") -> None:
        """Stage 3: all-gather every rank's shard into the full buffer. A collective: call it on every
        rank (the Trainer does, through ``before_forward``; call it yourself before reading or
        evaluating the model of a stage-3 run)."""
        if self.stage != 3 or self._materialized:
            return
        self.full.untyped_storage().resize_(self.full_bytes)
        with self.comm.rec.tagged(phase=phase), torch.no_grad():
            g = self.comm.all_gather(self.master.detach(), group=self.group)
            self.full.copy_(g.reshape(-1))  # writes full's storage; p's version counters are untouched
        self._materialized = True

    @contextlib.contextmanager
    def full_params(self):
        """``with update.full_params(): ...`` - the model's full parameters inside (collective in stage 3)."""
        was = self._materialized
        self.gather_params("param_gather_inspect")
        try:
            yield self.model
        finally:
            if not was:
                self.release_params()

    resident_params = full_params  # the Update seam evaluation uses

    def _check_materialized(self, module, args):
        if not self._materialized:
            raise RuntimeError("zero stage 3: the model's parameters are sharded (released). Use the Trainer, "
                               "or gather them on every rank first: `with trainer.update.full_params(): ...`")

    def _after_forward(self, module, args, output):
        if not self._armed:
            return None
        self._armed = False
        if torch.is_tensor(output) and output.requires_grad:
            self.release_params()
            output.register_hook(self._before_backward)
        return None

    def _before_backward(self, grad):
        self.gather_params("param_gather_bwd")
        return None

    # ---- the Update interface ----------------------------------------------------------------------
    def before_forward(self) -> None:
        if self.stage == 3:
            self.gather_params("param_gather")
            self._armed = self.options.regather_backward

    def _flat_grad(self) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=self.full.dtype, device=self.full.device)
        for p, off in zip(self.params, self._offsets):
            if p.grad is not None:
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
            p.grad = None
        return flat

    def sync(self) -> None:
        flat = self._flat_grad()
        op = self.options.grad_op
        with self.comm.rec.tagged(phase="grad_sync"):
            if op == "all_reduce":
                self.comm.all_reduce_(flat, group=self.group)
            else:
                shard = self.comm.reduce_scatter(flat, group=self.group)
        if self.stage == 0:
            self._full_grad = flat
            self.master.grad = flat
        elif self.stage == 1:
            if op == "reduce_scatter":
                flat[self.lo:self.hi].copy_(shard)  # the full local buffer stays (ZeRO-1 memory)
            self._full_grad = flat
            self.master.grad = flat[self.lo:self.hi]
        else:
            self._full_grad = None  # stage 2/3: only the reduced shard is kept
            self.master.grad = shard
        if self.stage == 3:
            self._armed = False
            self.release_params()

    def step(self) -> None:
        self.optimizer.step()
        if self.stage in (1, 2):
            with self.comm.rec.tagged(phase="param_gather"), torch.no_grad():
                g = self.comm.all_gather(self.master.detach(), group=self.group)
                self.full.copy_(g.reshape(-1))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._full_grad = None
        for p in self.params:
            p.grad = None

    # ---- memory by category (per rank, live storages: see moelab.runtime.memory) -------------------
    def param_tensors(self) -> list:
        return [*self.params, self.master]  # views into ``full`` (0 bytes while released) + the shard

    def grad_tensors(self) -> list:
        return [self._full_grad, self.master.grad, *(p.grad for p in self.params)]

    # ---- helpers -------------------------------------------------------------------------------------
    def bytes_per_iteration(self) -> int:
        """Analytic bytes this rank sends to other ranks per iteration (pairwise rule)."""
        return analytic_bytes(self.options, self.N, self.full_bytes)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def padded_numel(numel: int, world: int) -> int:
    return -(-numel // world) * world


def analytic_bytes(options: ZeroOptions, N: int, S: int) -> int:
    """Network bytes per rank per iteration, ``k (N-1)/N S`` by the pairwise rule of
    :mod:`moelab.comm.bytes` (``S`` = padded flat parameter bytes, divisible by N):
    gradient all-reduce ``2``, reduce-scatter ``1``; parameter all-gathers ``1`` each."""
    unit = (N - 1) * (S // N)
    k = 2 if options.grad_op == "all_reduce" else 1
    if options.stage in (1, 2):
        k += 1
    elif options.stage == 3:
        k += 2 if options.regather_backward else 1
    return k * unit
