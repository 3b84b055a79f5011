"""The training loop: one process = one rank; the same code runs under torchrun, spawned test
ranks, or a single process.

Per iteration: batch (rank-disjoint windows of the corpus) -> forward -> loss/N -> backward ->
dense grads all-reduced (SUM) over ``dp``, replica grads summed over holders -> Adam step. Metrics
per iteration: global mean loss, step time, per-layer global expert loads, bytes by link class
(from the comm door's records), and memory by category (params, grads, optimizer state, and
activations as the bytes autograd saved for backward).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch

from moelab.comm.door import Communicator, Recorder
from moelab.comm.topology import LINK_CLASSES, Topology
from moelab.config import RunConfig
from moelab.placement import Placement

if TYPE_CHECKING:
    from moelab.runtime.update import Update

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def placement_for(cfg: RunConfig, world: int) -> Placement:
    E = cfg.model.moe.num_experts
    if cfg.parallel.placement is None:
        return Placement.expert_parallel(E, world)
    return Placement.from_mapping(cfg.parallel.placement, E, world)


def topology_for(cfg: RunConfig, world: int) -> Topology:
    t = cfg.parallel.topology
    return Topology.from_config(world, t.nodes, t.ranks_per_node)


@dataclass
class Trainer:
    cfg: RunConfig
    model: torch.nn.Module
    comm: Communicator
    update: "Update"  # moelab.runtime.update: grad sync + optimizer (a strategy may supply its own)
    device: torch.device
    metrics: list = field(default_factory=list)
    loads: list = field(default_factory=list)

    @classmethod
    def build(cls, cfg: RunConfig, device: Optional[torch.device] = None) -> "Trainer":
        import torch.distributed as dist

        from moelab.models.transformer import MoETransformer

        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        from moelab.strategies import get_groups
        comm = Communicator(topology_for(cfg, world), cfg.emulation, Recorder(rank), groups=get_groups(cfg))
        dtype = DTYPES[cfg.train.dtype]
        from moelab.strategies import get_strategy

        factory = get_strategy(cfg.parallel.strategy)
        model = MoETransformer(cfg.model, seed=cfg.train.seed, comm=comm, placement=placement_for(cfg, world),
                               dtype=dtype, moe_layer_cls=factory(cfg) if factory else None)
        device = device or torch.device("cpu")
        model.to(device)
        from moelab.runtime.update import DataParallelUpdate
        from moelab.strategies import get_update

        update_cls = get_update(cfg.parallel.strategy) or DataParallelUpdate
        return cls(cfg, model, comm, update_cls(model, comm, cfg), device)

    @property
    def rank(self) -> int:
        return self.comm.rank

    def step(self, it: int) -> dict:
        from moelab.models.data import make_batch
        from moelab.models.transformer import lm_loss

        cfg, comm, model = self.cfg, self.comm, self.model
        world = comm.world_size
        if cfg.train.fault_rank == self.rank and it == cfg.train.fault_iter:
            raise RuntimeError(f"injected fault on rank {self.rank} at iteration {it} (train.fault_rank)")
        batch = {k: v.to(self.device) for k, v in make_batch(cfg, self.rank, world, it).items() if torch.is_tensor(v)}
        n_rec = len(comm.rec.comm)
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        t0 = time.time()
        with comm.rec.tagged(iter=it), comm.rec.span(f"iter {it}", "iteration"):
            self.update.before_forward()
            with comm.rec.span("forward", "forward"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                lm = lm_loss(model, batch)
                loss = lm + model.aux_loss()
            with comm.rec.span("backward", "backward"):
                (loss / world).backward()
            with comm.rec.span("grad_sync", "comm"):
                self.update.sync()
            mem_grads = self.update.grad_bytes()
            with comm.rec.span("optimizer", "optimizer"):
                self.update.step()
                self.update.zero_grad()
        step_time = time.time() - t0

        stats = torch.tensor([lm.detach().double().item()], dtype=torch.float64, device=self.device)
        comm.rec.enabled = False  # metric traffic is not training traffic
        comm.all_reduce_(stats)
        comm.rec.enabled = True
        bytes_cls = comm.rec.bytes_by_class(n_rec)
        row = dict(iter=it, loss=float(stats[0]) / world, step_time_s=step_time,
                   **{f"bytes_{c}": bytes_cls[c] for c in LINK_CLASSES},
                   mem_params_bytes=self.update.param_bytes(),
                   mem_grads_bytes=mem_grads,
                   mem_optim_bytes=self.update.optimizer_state_bytes(),
                   mem_activations_bytes=saved[0])
        self.metrics.append(row)
        for li, layer in enumerate(model.moe_layers()):
            for e, n in enumerate(layer.last_global_counts.sum(0).tolist()):
                self.loads.append(dict(iter=it, layer=li, expert=e, tokens=int(n)))
        return row

    def run(self, on_iter: Optional[Callable[[dict], None]] = None) -> list:
        for it in range(self.cfg.train.iters):
            row = self.step(it)
            if on_iter is not None:
                on_iter(row)
        return self.metrics

    def write_outputs(self, out_dir: str) -> None:
        """Rank 0: metrics.csv, loads.csv; every rank: trace_rank{r}.json, comm_rank{r}.csv."""
        import csv

        os.makedirs(out_dir, exist_ok=True)

        def write_csv(name, rows):
            with open(os.path.join(out_dir, name), "w", newline="") as f:
                if rows:
                    w = csv.DictWriter(f, fieldnames=list(rows[0]))
                    w.writeheader()
                    w.writerows(rows)

        if self.rank == 0:
            write_csv("metrics.csv", self.metrics)
            write_csv("loads.csv", self.loads)
        if self.cfg.train.trace:
            self.comm.rec.write_chrome_trace(os.path.join(out_dir, f"trace_rank{self.rank}.json"))
        write_csv(f"comm_rank{self.rank}.csv", self.comm.rec.comm_rows())
