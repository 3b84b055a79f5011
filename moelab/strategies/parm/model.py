"""How Parm plugs into the trainer: its MoE layer in the core layer's constructor shape, the
tensor-parallel model preparation, the data shard of a rank and the layout of a run.

- The layer sees ``[B, S, M]`` of its MP group's micro-batch (replicated on the group) and runs the
  chosen schedule; ``auto`` picks S1 or S2 at the first forward with Alg. 1 on alpha-beta fits taken
  on the live groups (:mod:`.fits`), the same choice on every rank (max-reduced timings).
- Data: one micro-batch per MP group, drawn by dp index over N_DP = P / N_MP; the loss is averaged
  over the N_DP micro-batches.
"""
from __future__ import annotations

import torch

from moelab.models.tensor_parallel import shard_dense
from moelab.runtime.checkpoint import CheckpointError
from moelab.strategies.parm import gating
from moelab.strategies.parm.layer import ParmMoE
from moelab.strategies.parm.layout import DENSE_DP, MP
from moelab.strategies.parm.options import ParmOptions, layout_of
from moelab.strategies.parm.select import choose

__all__ = ["ParmMoELayer", "layout_of", "data_shard", "prepare_model", "DENSE_DP"]


def data_shard(run_cfg, rank: int, world: int) -> tuple:
    mp = ParmOptions.from_dict(run_cfg.parallel.strategy_options).mp
    return rank // mp, world // mp


def prepare_model(run_cfg, model, comm) -> None:
    shard_dense(model, comm, MP)


class ParmMoELayer(ParmMoE):
    """:class:`~.layer.ParmMoE` with the core MoE layer's constructor and the trainer's hooks
    (``aux_loss``, ``last_global_counts``, ``plan_record``, ``last_metrics``)."""

    def __init__(self, d_model, d_ff, cfg, *, layer_id=0, seed=0, comm=None, placement=None, dtype=torch.float32,
                 options: ParmOptions, run_cfg=None):
        layout = layout_of(run_cfg, options)
        schedule = "s1" if options.schedule == "auto" else options.schedule  # auto: resolved at the first forward
        super().__init__(comm, layout, d_model, d_ff, schedule=schedule, gate=cfg.gate,
                         capacity_factor=cfg.capacity_factor, dispatcher=options.dispatcher,
                         baseline_variant=options.baseline_variant, saa_backward=options.saa_backward,
                         saa_mode=options.saa_mode, activation=cfg.activation, expert_bias=cfg.expert_bias,
                         seed=seed, layer_id=layer_id,
                         dtype=dtype)
        self.options, self.auto = options, options.schedule == "auto"
        self.choice: dict = {}
        self.balance_coef = cfg.balance_loss_coef
        for p in (self.w1, self.w2, self.b2):
            if p is not None:
                p.moelab_expert = True
        self.wg.moelab_gate = True
        self.aux_loss = None
        self.last_global_counts = torch.zeros(1, layout.num_experts, dtype=torch.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.auto and not self.choice:
            self.choice = choose(self, x.reshape(-1, shape[-1]).shape[0])
            self.schedule = self.choice["schedule"]
        y = super().forward(x.reshape(-1, shape[-1]))
        self.aux_loss = self.balance_coef * self.aux
        return y.reshape(shape)

    @torch.no_grad()
    def load_full(self, own: dict, experts: dict) -> int:
        """This rank's shard from a full model's checkpoint (``train.init_from``,
        :func:`moelab.runtime.checkpoint.init_from_checkpoint`): the gate's weight, and per local expert the
        ESP slice of w1's columns and of w2's rows. Parm's experts carry no b1, so a checkpoint with
        expert biases is refused rather than half loaded."""
        w = own.get("gate.wg.weight")
        if w is None or w.shape != self.wg.shape:
            raise CheckpointError(f"parm's gate is {tuple(self.wg.shape)}; the checkpoint's layer has "
                                  f"{None if w is None else tuple(w.shape)} (gate.wg.weight)")
        if self.b2 is not None:
            raise CheckpointError("parm's experts have a b2 here (model.moe.expert_bias): a full checkpoint's experts "
                                  "come with b1 as well, which parm's experts lack; fine-tune without expert biases")
        self.wg.copy_(w)
        full = (self.w1.shape[1], self.w1.shape[2] * self.layout.n_esp)
        mine = self.layout.experts_of(self.comm.rank)
        for e in mine:
            p = experts[e]
            if p.get("b1") is not None or p.get("b2") is not None:
                raise CheckpointError(f"expert {e} has biases: parm's experts have no b1 (set model.moe.expert_bias "
                                      "false in the run the checkpoint comes from)")
            if tuple(p["w1"].shape) != full:
                raise CheckpointError(f"expert {e}'s w1 is {tuple(p['w1'].shape)}, parm's layer needs {full}")
        w1, w2 = gating.expert_shards(torch.stack([experts[e]["w1"] for e in mine]),
                                      torch.stack([experts[e]["w2"] for e in mine]), self.layout.n_esp, self.esp_index)
        self.w1.copy_(w1)
        self.w2.copy_(w2)
        return 1 + 2 * self.w1.shape[0]

    def _gate(self, pool, cap):
        r = super()._gate(pool, cap)
        idx = r.idx[r.idx >= 0]
        self.last_global_counts = torch.bincount(idx, minlength=self.layout.num_experts).view(1, -1)
        return r

    def plan_record(self) -> dict:
        """The layer's plan of the last call; ``counts_scope`` says the loads are this rank's gating
        pool (Parm exchanges no counts)."""
        return {**self.last, "counts_scope": "rank gating pool", **({"auto": self.choice} if self.choice else {})}

    @property
    def last_metrics(self) -> dict:
        return dict(self.last)
