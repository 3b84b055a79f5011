"""Parm's update (spec §2.9): the gradient semantics of a model whose dense parts are tensor-parallel
over MP and whose MoE layers run one of four schedules; then Adam on every local parameter.

The trainer divides the loss by N_DP (one micro-batch per MP group). Then, exactly:

- dense parameters (MP-sharded or MP-replicated): sum over the dense-DP group ``{mp + N_MP*i}``;
- each MoE layer's gate (replicated everywhere): sum over the world, divided by ``c_gate`` (how
  many ranks gated each token: N_MP*N_ESP for the Fig. 3a baseline, 1 for S1, N_MP for S2);
- expert shards: divided by ``c_exp`` (N_MP for the baseline with ``baseline_dedup_grad``, which
  processes every MP copy of a token; 1 otherwise); each shard lives on one rank, nothing moves.
"""
from __future__ import annotations

import torch

from moelab.moe.sync import sync_dense_grads
from moelab.runtime.update import Update, fill_missing_grads
from moelab.strategies.parm.layer import grad_factors
from moelab.strategies.parm.layout import DENSE_DP


class ParmUpdate(Update):
    checkpoint_ready = True  # its state: every local parameter (TP and ESP shards) with Adam's, and auto's choice
    saves_params = True

    def __init__(self, model, comm, cfg):
        super().__init__(model, comm, cfg)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr)

    def sync(self) -> None:
        params = list(self.model.parameters())
        fill_missing_grads(params)
        gates = [p for p in params if getattr(p, "moelab_gate", False)]
        skip = {id(p) for p in gates} | {id(p) for p in self.model.expert_parameters()}
        sync_dense_grads([p for p in params if id(p) not in skip], self.comm, group=DENSE_DP)
        for layer in self.model.moe_layers():
            c_gate, c_exp = grad_factors(layer.layout, layer.schedule, layer.variant)
            with self.comm.rec.tagged(phase="grad_sync"):
                self.comm.all_reduce_(layer.wg.grad, group="world")
            layer.wg.grad.div_(c_gate)
            if layer.schedule == "baseline" and not layer.options.baseline_dedup_grad:
                c_exp = 1  # the paper's baseline as DeepSpeed runs it: expert grads N_MP times too large
            for p in (layer.w1, layer.w2, layer.b2):
                if p is not None and c_exp != 1:
                    p.grad.div_(c_exp)

    def checkpoint_state(self) -> dict:
        """This rank's parameters and Adam state by name (its shards), and each MoE layer's schedule choice
        (``auto`` decided from timings: a resumed run keeps the choice instead of measuring again)."""
        state = {}
        for n, p in self.model.named_parameters():
            st = self.optimizer.state.get(p, {})
            state[n] = {"param": p.detach().clone(),
                        "adam": {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}}
        return {"params": state, "choices": [(layer.schedule, layer.choice) for layer in self.model.moe_layers()]}

    @torch.no_grad()
    def restore_state(self, state: dict) -> None:
        named = dict(self.model.named_parameters())
        if set(named) != set(state["params"]):
            raise ValueError("the checkpoint holds other parameters than this parm model (another layout?)")
        for n, p in named.items():
            p.copy_(state["params"][n]["param"])
            if state["params"][n]["adam"]:
                self.optimizer.state[p] = {k: v.clone() for k, v in state["params"][n]["adam"].items()}
        for layer, (schedule, choice) in zip(self.model.moe_layers(), state["choices"]):
            layer.schedule, layer.choice = schedule, choice

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
