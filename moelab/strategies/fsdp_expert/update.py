"""The update of the ``fsdp_expert`` baseline: dense parameters data-parallel, experts FSDP-sharded.

Gradients. Dense (non-expert) gradients: the core's one flat all-reduce over ``dp``
(:func:`moelab.moe.sync.sync_dense_grads`; the loss is scaled by 1/N, so the SUM is the global
gradient). Expert gradients were reduce-scattered onto each layer's ``shard`` during backward (the
layer's ``_GatherFn``), so the shard's gradient is already EP's gradient of those elements; the
stacked parameters' local (unreduced) gradients are dropped in ``sync``.

Optimizer. One Adam over the dense parameters and every layer's shard: a rank owns its shard's
parameters and Adam moments and nothing else of the experts. Every owned element steps every
iteration (a zero gradient where no token reached it), so training equals EP and the
single-process run element for element (Adam is elementwise). The updated shards reach the other
ranks through the next forward's all-gather.

Memory (per rank, live storages, :mod:`moelab.runtime.memory`): ``params`` = dense + the shards, plus
a layer's gathered buffer while it is resident; ``grads`` = dense gradients + the shards' (the local
full-size expert gradients are transient, between a layer's backward and ``sync``); ``optim`` = Adam
over dense + shard elements.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from moelab.moe.sync import sync_dense_grads
from moelab.runtime.update import Update, fill_missing_grads
from moelab.strategies.fsdp_expert.options import FsdpExpertOptions


class FsdpExpertUpdate(Update):
    def __init__(self, model, comm, cfg, options: Optional[FsdpExpertOptions] = None):
        super().__init__(model, comm, cfg)
        if options is None:
            options = FsdpExpertOptions.from_dict(cfg.parallel.strategy_options)
            options.raise_if(options.run_errors(cfg))
        self.options = options
        self.layers = list(model.moe_layers())
        bad = [type(layer).__name__ for layer in self.layers if not hasattr(layer, "shard")]
        if bad:
            raise ValueError(f"fsdp_expert needs its own MoE layers (FsdpExpertMoELayer), got {bad}")
        self.dense = [p for p in model.dense_parameters() if p.requires_grad]
        self.shards = [layer.shard for layer in self.layers]
        self.optimizer = torch.optim.Adam(self.dense + self.shards, lr=cfg.train.lr)
        for layer in self.layers:
            layer.driver = self

    def gathered(self, layer) -> None:
        """A layer's buffer was (re)allocated (forward, or its backward with ``reshard_after_forward``):
        its storage is parameter memory, not a saved activation (the meter lists parameter storages when
        the forward starts), and the moment is a peak candidate, so the meter samples it."""
        self.memory._param_ptrs.add(layer.full.untyped_storage().data_ptr())
        self.memory.sample()

    def sync(self) -> None:
        sync_dense_grads(self.dense, self.comm)
        fill_missing_grads(self.dense)
        for layer in self.layers:
            if layer.shard.grad is None:  # no backward reached the layer: a zero step (one semantics)
                layer.shard.grad = torch.zeros_like(layer.shard)
            for p in layer.experts.stacked():
                if p is not None:
                    p.grad = None  # local gradients: their reduce-scattered sum is in the shard's

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.model.expert_parameters():
            p.grad = None

    @contextlib.contextmanager
    def full_params(self):
        """``with update.full_params(): ...`` - every layer's experts resident (a collective)."""
        with contextlib.ExitStack() as stack:
            for layer in self.layers:
                stack.enter_context(layer.gathered())
            yield self.model

    resident_params = full_params

    # ---- memory by category (live storages) ------------------------------------------------------------
    def param_tensors(self) -> list:
        return [*self._params, *self.shards]  # expert stacks: views of ``full`` (0 bytes while released)

    def grad_tensors(self) -> list:
        return [p.grad for p in [*self._params, *self.shards] if p.grad is not None]

    def expert_bytes_per_iteration(self) -> int:
        """Analytic expert-traffic bytes this rank sends per iteration (the dense all-reduce aside)."""
        return analytic_expert_bytes(self.options, self.comm.world_size, [layer.full_bytes for layer in self.layers])


def analytic_expert_bytes(options: FsdpExpertOptions, N: int, layer_bytes) -> int:
    """Per rank per iteration, summed over MoE layers: ``k (N-1)/N S`` (§5.5; pairwise rule of
    :mod:`moelab.comm.bytes`, own block local), ``k`` = one all-gather (two with
    ``reshard_after_forward``) + one reduce-scatter, ``S`` = the layer's padded bytes (divisible by N)."""
    k = 3 if options.reshard_after_forward else 2
    return sum(k * (N - 1) * (S // N) for S in layer_bytes)
