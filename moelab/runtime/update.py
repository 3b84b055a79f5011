"""The update step of an iteration as a swappable object: gradient synchronisation + optimizer.

The EP baseline's rule (:class:`DataParallelUpdate`): dense grads all-reduced (SUM, the loss
being scaled by 1/N) over ``dp``, replicated experts' grads summed over their holders, then Adam on
every local parameter. Strategies that change *how parameters and their optimizer state live*
(ZeRO-1/2/3, FSSDP, Lina's gradient scheduling) provide another ``Update`` through the strategy
registry (``register_update``) instead of editing the training loop.
"""
from __future__ import annotations

import torch

from moelab.moe.sync import sync_dense_grads, sync_replica_grads


class Update:
    """Interface: ``sync()`` after backward, ``step()``, ``zero_grad()``, and memory by category."""

    def __init__(self, model, comm, cfg):
        self.model, self.comm, self.cfg = model, comm, cfg

    def before_forward(self) -> None:
        """Hook for strategies that gather parameters before the forward pass (ZeRO-3)."""

    def sync(self) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def optimizer_state_bytes(self) -> int:
        raise NotImplementedError

    def grad_bytes(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self.model.parameters() if p.grad is not None)

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


class DataParallelUpdate(Update):
    def __init__(self, model, comm, cfg):
        super().__init__(model, comm, cfg)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr)

    def sync(self) -> None:
        sync_dense_grads(self.model.dense_parameters(), self.comm)
        for layer in self.model.moe_layers():
            sync_replica_grads(layer, self.comm)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                   for t in s.values() if torch.is_tensor(t))
