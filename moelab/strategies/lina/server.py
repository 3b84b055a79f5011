"""Lina's inference server (spec §2.3), what ``moelab serve`` runs with ``serve.strategy: lina``.

:func:`build` makes the serving model - every MoE layer a :class:`.infer.LinaServeLayer` sharing one
:class:`.infer.ServeContext` - from ``train.init_from`` when given (parameters only), else the seeded init.
:meth:`LinaServer.prepare` fits the path table on routing traces of ``profile_batches`` training-split
batches per rank (all-gathered, so every rank fits the same table) before the serving clock starts.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from moelab.models.tasks import build_model, make_batch
from moelab.runtime.checkpoint import init_from_checkpoint
from moelab.runtime.train import DTYPES
from moelab.strategies.lina.infer import LinaServeLayer, ServeContext
from moelab.strategies.lina.options import LinaServeOptions
from moelab.strategies.lina.popularity import PathTable


class LinaServer:
    """The serving model and its context, as :mod:`moelab.runtime.serve` drives a server."""

    def __init__(self, cfg, comm, opts: LinaServeOptions):
        self.cfg, self.comm, self.opts = cfg, comm, opts
        n_moe = cfg.model.n_layers if cfg.model.moe_every == 1 else cfg.model.n_layers // 2
        self.ctx = ServeContext(opts, cfg.model.moe.num_experts, n_moe, comm, seed=cfg.train.seed)
        self.model = build_model(cfg, seed=cfg.train.seed, comm=comm, placement=None, dtype=DTYPES[cfg.train.dtype],
                                 moe_layer_cls=functools.partial(LinaServeLayer, context=self.ctx))
        if cfg.train.init_from is not None:
            init_from_checkpoint(self.model, cfg.train.init_from)
        self.model.eval()

    @torch.no_grad()
    def prepare(self) -> np.ndarray:
        """Fit the path table; return the routing traces it was fitted on (every rank's, ``[tokens, layers]``)."""
        ctx, cfg, comm = self.ctx, self.cfg, self.comm
        ctx.capture = True
        traces = []
        for b in range(self.opts.profile_batches):
            ctx.new_batch(-1 - b)
            self.model(make_batch(cfg, comm.rank, comm.world_size, b)["inputs"])
            traces.append(torch.stack(ctx.paths, dim=1))
        ctx.capture = False
        mine = torch.cat(traces)
        every = comm.all_gather(mine, group="world").reshape(-1, mine.shape[1])  # same shape on every rank
        ctx.table = PathTable.fit(every.numpy(), cfg.model.moe.num_experts, self.opts.path_len)
        return every.numpy()

    def new_batch(self, b: int) -> None:
        self.ctx.new_batch(b)

    @property
    def records(self) -> list:
        return self.ctx.records

    def close(self) -> None:
        self.ctx.close()


def build(cfg, comm, opts: LinaServeOptions) -> LinaServer:
    """The registered ``serve`` of strategy ``lina``: ``opts`` are its bound serving options."""
    return LinaServer(cfg, comm, opts)
