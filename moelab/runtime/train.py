"""The training loop: one process = one rank; the same code runs under torchrun, spawned test
ranks, or a single process.

Per iteration: batch (rank-disjoint windows of the corpus) -> forward -> loss/N -> backward ->
gradient sync -> Adam step, the sync and step being the run's :class:`~moelab.runtime.update.Update`
(``parallel.grad_sync``, or a strategy's own). Metrics per iteration: global mean loss, step time,
``cpu_main_s`` (the main thread's CPU seconds in the step: on a CPU rank its compute, waits excluded),
per-layer global expert loads, bytes by link class (from the comm door's records), and memory by
category (:mod:`moelab.runtime.memory`): ``mem_params_bytes`` / ``mem_optim_bytes`` after the step,
``mem_grads_bytes`` after the sync, ``mem_activations_bytes`` the bytes autograd holds for backward
at the end of the forward (distinct storages, parameters excluded; before Core v2 it summed every
saved tensor, parameters and shared storages included), and each category's peak over the
iteration, ``mem_<cat>_peak_bytes``, plus ``mem_total_peak_bytes``.

Every ``train.eval_every`` iterations: ``eval_loss`` and ``eval_ppl`` on ``train.eval_batches``
held-out batches (global over ranks, no grad, no traffic recorded, the MoE layers' per-forward
state restored so evaluating does not change training). Every ``train.checkpoint_every``
iterations: a checkpoint (:mod:`moelab.runtime.checkpoint`); ``train.resume_from`` continues one.
``plans.jsonl``: each MoE layer's plan of each iteration (counts, placement, shadow set).
``layer_metrics_rank{r}.csv``: what a layer reports of each call in ``layer.last_metrics`` (a strategy's
own measurements, e.g. LSH-MoE's compression rate), one file per rank, absent when no layer reports.
"""
from __future__ import annotations

import copy
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from moelab.comm.cpu_priority import compute_yields
from moelab.comm.door import Communicator, Recorder
from moelab.comm.record import sampled_iters
from moelab.comm.topology import LINK_CLASSES, Topology
from moelab.config import RunConfig
from moelab.models.data import IGNORE_INDEX
from moelab.models.tasks import CLASSIFICATION, build_model, make_batch, make_eval_batch
from moelab.models.transformer import lm_loss
from moelab.placement import Placement
from moelab.registry import get, get_groups, get_strategy, get_update, known_strategies
from moelab.runtime.checkpoint import init_from_checkpoint, load, save
from moelab.runtime.update import GRAD_SYNCS, Update

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def placement_for(cfg: RunConfig, world: int) -> Placement:
    E = cfg.model.moe.num_experts
    if cfg.parallel.placement is None:
        return Placement.expert_parallel(E, world)
    return Placement.from_mapping(cfg.parallel.placement, E, world)


def placement_errors(cfg: RunConfig) -> list:
    """What :func:`placement_for` needs: plain expert parallelism puts the same number of experts on every rank
    (unless the strategy checks the count against its own layout: Parm's N_EP | E); a declared placement is a
    valid mapping of the experts onto the ranks."""
    moe, p = cfg.model.moe, cfg.parallel
    if p.placement is not None:
        try:
            Placement.from_mapping(p.placement, moe.num_experts, p.nproc)
        except ValueError as e:
            return [f"parallel.placement: {e}"]
        return []
    own_layout = p.strategy in known_strategies() and get(p.strategy).own_expert_layout
    if moe.num_experts % p.nproc != 0 and not own_layout:
        return [f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.nproc={p.nproc}: "
                "expert parallelism needs the same number of experts on every rank"]
    return []


def topology_for(cfg: RunConfig, world: int) -> Topology:
    t = cfg.parallel.topology
    return Topology.from_config(world, t.nodes, t.ranks_per_node)


def _jsonable(x):
    if torch.is_tensor(x):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in (sorted(x) if isinstance(x, (set, frozenset)) else x)]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return x.item()
    return x


def _layer_state(layer) -> dict:
    """A MoE layer's plain attributes (RNG counter, last loads, shadow hint and log), lists copied,
    so an evaluation forward can be undone."""
    return {k: copy.copy(v) if isinstance(v, (list, dict, set)) else v
            for k, v in vars(layer).items() if not k.startswith("_")}


@dataclass
class Trainer:
    cfg: RunConfig
    model: torch.nn.Module
    comm: Communicator
    update: "Update"  # moelab.runtime.update: grad sync + optimizer (a strategy may supply its own)
    device: torch.device
    metrics: list = field(default_factory=list)
    loads: list = field(default_factory=list)
    plans: list = field(default_factory=list)
    layer_metrics: list = field(default_factory=list)  # this rank's per-(iteration, MoE layer) metrics
    out_dir: Optional[str] = None  # where checkpoints go (the run folder); None: no checkpoints
    start_iter: int = 0  # > 0 after resuming from a checkpoint
    eval_accuracy: Optional[tuple] = None  # classification tasks: (top-1, top-2) of the last evaluation
    shard: tuple = (0, 1)  # (data shard this rank reads, distinct shards): the strategy's, (rank, world) for most

    @classmethod
    def build(cls, cfg: RunConfig, device: Optional[torch.device] = None) -> "Trainer":
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        comm = Communicator(topology_for(cfg, world), cfg.emulation, Recorder(rank), groups=get_groups(cfg))
        dtype = DTYPES[cfg.train.dtype]
        factory = get_strategy(cfg.parallel.strategy)
        strategy = get(cfg.parallel.strategy)
        placement = None if strategy.own_expert_layout else placement_for(cfg, world)  # Parm places by its layout
        model = build_model(cfg, seed=cfg.train.seed, comm=comm, placement=placement,
                            dtype=dtype, moe_layer_cls=factory(cfg) if factory else None)
        device = device or torch.device("cpu")
        model.to(device)
        if cfg.train.init_from is not None:  # fine-tune: parameters only, before any update shards them
            init_from_checkpoint(model, cfg.train.init_from)

        if strategy.prepare_model is not None:  # e.g. Parm's tensor-parallel dense parts
            strategy.prepare_model(cfg, model, comm)
        update_cls = get_update(cfg.parallel.strategy) or GRAD_SYNCS[cfg.parallel.grad_sync]
        trainer = cls(cfg, model, comm, update_cls(model, comm, cfg), device)
        trainer.shard = strategy.shard_of(cfg, rank, world)
        if cfg.train.resume_from is not None:
            trainer.start_iter = load(trainer, cfg.train.resume_from)
        return trainer

    @property
    def rank(self) -> int:
        return self.comm.rank

    def step(self, it: int) -> dict:
        cfg, comm, model = self.cfg, self.comm, self.model
        world = comm.world_size
        if cfg.train.fault_rank == self.rank and it == cfg.train.fault_iter:
            raise RuntimeError(f"injected fault on rank {self.rank} at iteration {it} (train.fault_rank)")
        index, shards = self.shard
        batch = {k: v.to(self.device) for k, v in make_batch(cfg, index, shards, it).items() if torch.is_tensor(v)}
        n_rec = len(comm.rec.comm)
        update, mem = self.update, self.update.memory
        mem.reset()
        t0, cpu0 = time.time(), time.thread_time()
        with comm.rec.tagged(iter=it), comm.rec.span(f"iter {it}", "iteration"):
            update.before_forward()
            with comm.rec.span("forward", "forward"), mem.saving():
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cfg.train.autocast == "bf16"):
                    lm = lm_loss(model, batch)
                loss = lm + model.aux_loss()
            mem_acts = mem.sample()["activations"]
            update.before_backward()
            with comm.rec.span("backward", "backward"):
                (loss / shards).backward()
            with comm.rec.span("grad_sync", "comm"):
                update.sync()
            mem_grads = mem.sample()["grads"]
            with comm.rec.span("optimizer", "optimizer"):
                update.step()
                update.zero_grad()
            after = mem.sample(optim=True)
        step_time, cpu_main = time.time() - t0, time.thread_time() - cpu0

        stats = lm.detach().double().reshape(1).clone()  # no .item() before the reduce: one host sync below
        with comm.rec.paused():  # metric traffic is not training traffic
            comm.all_reduce_(stats)
        bytes_cls = comm.rec.bytes_by_class(n_rec)
        row = dict(iter=it, loss=float(stats[0]) / world, step_time_s=step_time, cpu_main_s=cpu_main,
                   **{f"bytes_{c}": bytes_cls[c] for c in LINK_CLASSES},
                   mem_params_bytes=after["params"], mem_grads_bytes=mem_grads, mem_optim_bytes=after["optim"],
                   mem_activations_bytes=mem_acts,
                   **{f"mem_{c}_peak_bytes": v for c, v in mem.peaks.items()},
                   mem_total_peak_bytes=mem.peak_total)
        for li, layer in enumerate(model.moe_layers()):
            for e, n in enumerate(layer.last_global_counts.sum(0).tolist()):
                self.loads.append(dict(iter=it, layer=li, expert=e, tokens=int(n)))
            self.plans.append({"iter": it, "layer": li, **_jsonable(layer.plan_record())})
            lm = getattr(layer, "last_metrics", None)  # the per-layer metrics hook (LSH-MoE's rho, ...)
            if lm:
                self.layer_metrics.append({"iter": it, "layer": li, **_jsonable(lm)})
        t = cfg.train
        if t.eval_every:
            done = (it + 1) % t.eval_every == 0
            row["eval_loss"], row["eval_ppl"] = self.evaluate() if done else (None, None)
            if t.task in CLASSIFICATION:  # every row has the columns (the CSV header is the first row's)
                row["eval_acc"], row["eval_top2_acc"] = self.eval_accuracy if done else (None, None)
        self.metrics.append(row)
        if t.checkpoint_every and self.out_dir is not None and (it + 1) % t.checkpoint_every == 0:
            save(self, self.out_dir, it + 1)
        return row

    @torch.no_grad()
    def evaluate(self) -> tuple:
        """(loss, perplexity) on ``train.eval_batches`` held-out batches, token-weighted over ranks;
        classification tasks also set ``eval_accuracy`` (top-1, top-2 over the held-out samples)."""
        import torch.nn.functional as F

        cfg, comm = self.cfg, self.comm
        layers = self.model.moe_layers()
        saved = [_layer_state(layer) for layer in layers]
        classify = cfg.train.task in CLASSIFICATION
        total = torch.zeros(4, dtype=torch.float64, device=self.device)  # token loss, tokens, top-1, top-2 hits
        with comm.rec.paused(), self.update.resident_params() as model:
            model.eval()  # layers that compute differently in evaluation see it (LSH-MoE's exact forward)
            for i in range(cfg.train.eval_batches):
                b = make_eval_batch(cfg, *self.shard, i)
                logits = model(b["inputs"].to(self.device))
                targets = b["targets"].to(self.device).reshape(-1)
                total[0] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), targets,
                                            ignore_index=IGNORE_INDEX, reduction="sum")
                total[1] += (targets != IGNORE_INDEX).sum()
                if classify:  # logits [B, 1, C], one label per sample
                    top = logits[:, 0].topk(min(2, logits.shape[-1]), dim=-1).indices
                    total[2] += (top[:, 0] == targets).sum()
                    total[3] += (top == targets[:, None]).any(1).sum()
            comm.all_reduce_(total)
            model.train()
        for layer, state in zip(layers, saved):
            layer.__dict__.update(state)
        loss = float(total[0] / total[1]) if total[1] > 0 else float("nan")
        if classify:
            self.eval_accuracy = (float(total[2] / total[1]), float(total[3] / total[1]))
        return loss, math.exp(loss) if loss == loss else float("nan")

    def run(self, on_iter: Optional[Callable[[dict], None]] = None) -> list:
        with compute_yields(self.cfg.emulation.compute_yields):
            for it in range(self.start_iter, self.cfg.train.iters):
                row = self.step(it)
                if on_iter is not None:
                    on_iter(row)
        return self.metrics

    def close(self) -> None:
        """The end of this trainer in a process that goes on (a benchmark's or a suite's next configuration):
        the update's hooks and threads, then the communicator's process groups (collective: every rank)."""
        close = getattr(self.update, "close", None)
        if close is not None:
            close()
        self.comm.close()

    def write_outputs(self, out_dir: str) -> None:
        """Rank 0: metrics.csv, loads.csv; every rank: trace_rank{r}.json (at most ``train.trace_iters``
        iterations), comm_rank{r}.csv (every record)."""
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
            with open(os.path.join(out_dir, "plans.jsonl"), "w") as f:
                f.writelines(json.dumps(p) + "\n" for p in self.plans)
        if self.cfg.train.trace:
            iters = sampled_iters([row["iter"] for row in self.metrics], self.cfg.train.trace_iters)
            self.comm.rec.write_chrome_trace(os.path.join(out_dir, f"trace_rank{self.rank}.json"), iters)
        write_csv(f"comm_rank{self.rank}.csv", self.comm.rec.comm_rows())
        if self.layer_metrics:
            write_csv(f"layer_metrics_rank{self.rank}.csv", self.layer_metrics)
