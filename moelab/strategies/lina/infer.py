"""Lina at inference: popularity-scheduled experts in the serving path (spec §2.3).

:class:`LinaServeLayer` replaces a model's MoE layer when serving. It holds the gate (seeded as in
training, top-1, no capacity) and the full expert bank (every expert on every rank: the host copy).
Per call it picks this batch's placement by the variant, then runs
:func:`moelab.strategies.lina.dispatch.serve_forward`:

- ``baseline``: the static placement (expert block of rank r on rank r);
- ``ideal``: the gate's choice replaced by a perfectly balanced one (timing only: other outputs);
- ``lina``: phase 1 - right after layer l's gate, every rank sums ``pop_hat`` for layer l+1 over its
  tokens' paths (:class:`moelab.strategies.lina.popularity.PathTable`) and sends the sums with layer l's count
  exchange (piggybacked, as the spec piggybacks them on the dispatch: no call of their own,
  :func:`piggyback_bytes`); a loader thread plans ``allocate(N * pop_hat)`` from the same numbers on
  every rank (no scheduler rank: the same plan everywhere without a broadcast) and loads layer l+1's
  newly placed experts from the bank, while layer l dispatches and computes (the paper's
  prefetch; on a CPU the load is a memory copy). Phase 2 - after layer l+1's gate the
  count exchange gives the actual popularity; if its top-``k_cmp`` set differs from the estimate's
  (``serve.strategy_options.replan_test: load``: if phase 1's plan carries more of the actual load on its busiest device
  than the estimate promised, by over ``replan_tol``), every rank re-plans from it and loads what the
  new plan adds on the critical path (blocking);
- ``lina_no_estimation``: no phase 1; every layer, from the first, plans from the actual counts (blocking);
- ``lina_no_finetune``: phase 1 only.

Which layers get a plan: :func:`schedules`. ``lina`` and ``lina_no_finetune`` keep the static placement in
the layers before MoE layer ``path_len`` (no full path to estimate from yet);
``serve.strategy_options.first_layers: actual`` lets ``lina`` plan those from the actual counts (phase 2 without an
estimate). Experts a plan puts
on a rank are copied from the bank into its working slots: by phase 1's loader during the previous
layer (``prefetched``, ``prefetch_s``), or before the dispatch (``swapped``, ``swap_s``: the critical
path); ``p1_wait_s``: how long layer l+1 waited for phase 1 (planning that outlasted layer l); ``counts``: the
all-gathered ``[N, E]`` token counts, ``p1_devs``: phase 1's placement (the simulator prices a served run's
own decisions from them, :func:`.sim_infer.recorded_plans`).
:class:`ServeContext` is shared by one model's serve layers: the batch's paths, the pending phase-1
work, and one record per (batch, layer).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from moelab.comm.cpu_priority import as_comm_thread
from moelab.moe.experts import Experts
from moelab.moe.gates import Gate
from moelab.moe.layer import init_gate_
from moelab.strategies.lina.dispatch import serve_forward
from moelab.strategies.lina.placement import allocate, load_off, needs_replan


def static_placement(N: int, E: int) -> list:
    """The baseline's placement: device d holds the expert block ``[d E/N, (d+1) E/N)``."""
    per = E // N
    return [list(range(d * per, (d + 1) * per)) for d in range(N)]


def estimates(sv, j: int) -> bool:
    """Whether phase 1 estimates MoE layer ``j``: ``lina`` and ``lina_no_finetune``, from layer ``path_len``, the
    first with a full path of earlier choices (the paper's "slower start" for longer paths)."""
    return sv.variant in ("lina", "lina_no_finetune") and j >= sv.path_len


def schedules(sv, j: int) -> bool:
    """Whether MoE layer ``j`` gets a plan under ``sv.variant``: where phase 1 estimates it; every layer for
    ``lina_no_estimation`` (spec §2.3: from layer 1); with ``serve.strategy_options.first_layers: actual``
    every layer for ``lina`` (those without an estimate planned by phase 2 from the actual counts, blocking)."""
    return (estimates(sv, j) or sv.variant == "lina_no_estimation"
            or (sv.variant == "lina" and sv.first_layers == "actual"))


def piggyback_bytes(E: int) -> int:
    """Bytes phase 1 adds to a rank's block of the count exchange before the layer it estimates: its ``E``
    estimate sums and its token count (float64; the counts go as float64 too, exact). The spec piggybacks the
    estimates on the dispatch all-to-all; here every rank plans from all of them, so they ride the
    all-gather of the counts instead: no call of their own."""
    return 8 * (E + 1)


def _plan(sv, pop, N: int, seed: int) -> list:
    """``allocate(N * pop)`` with the serve config's packing limit and replica rounding."""
    return allocate(N * np.asarray(pop), N, sv.max_pack, seed, rounding=sv.replica_rounding)


def phase1_plan(sv, pop_hat, N: int, seed: int) -> list:
    """Phase 1's placement from the estimate alone (what can be loaded before the gate has run)."""
    return _plan(sv, pop_hat, N, seed)


def choose_plan(sv, scheduled: bool, pop, pop_hat, N: int, static, seed: int, planned=None) -> tuple:
    """This (batch, layer)'s placement by the variant: ``(devs, planned_from, replanned)``. ``pop``: the
    actual popularity (after the gate), ``pop_hat``: phase 1's estimate (None where there is none);
    ``planned``: phase 1's placement if it was already made (:func:`phase1_plan` of ``pop_hat``).
    A scheduled layer without an estimate plans from the actual counts.
    Pure: the runtime's serve layer and the simulator (:mod:`.sim_infer`) both call it."""
    if not scheduled:
        return static, "static", False
    if pop_hat is None:
        return _plan(sv, pop, N, seed), "actual", False
    kept = planned if planned is not None else phase1_plan(sv, pop_hat, N, seed)
    if sv.variant == "lina" and (load_off(kept, pop_hat, pop, sv.replan_tol) if sv.replan_test == "load"
                                 else needs_replan(pop_hat, pop, sv.k_cmp)):
        return _plan(sv, pop, N, seed + 1), "estimate", True
    return kept, "estimate", False


class ServeContext:
    def __init__(self, sv, num_experts: int, num_layers: int, comm, table=None, seed: int = 0):
        self.sv, self.E, self.L, self.comm, self.table, self.seed = sv, num_experts, num_layers, comm, table, seed
        self.capture = False  # profiling: record routing only, static placement
        self.layers: dict = {}  # MoE layer index -> its serve layer (phase 1 loads the next layer's experts)
        self._loader = None
        self.new_batch(-1)

    def new_batch(self, batch: int) -> None:
        self.batch, self.paths, self.pending, self.records = batch, [], {}, []

    def loader(self) -> ThreadPoolExecutor:
        """One worker: phase 1's jobs run in layer order, beside the serving thread."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lina-phase1",
                                              initializer=as_comm_thread)  # it plans and loads
        return self._loader

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None

    def static(self) -> list:
        return static_placement(self.comm.world_size, self.E)

    def scheduled(self, j: int) -> bool:
        return not self.capture and self.table is not None and schedules(self.sv, j)

    def plan_seed(self, j: int) -> int:
        return hash((self.seed, self.batch, j)) & 0x7FFFFFFF


class LinaServeLayer(nn.Module):
    def __init__(self, d_model, d_ff, moe_cfg, layer_id=0, seed=0, comm=None, placement=None, dtype=torch.float32,
                 context: ServeContext = None):
        super().__init__()
        self.cfg, self.layer_id, self.comm, self.ctx = moe_cfg, layer_id, comm, context
        self.gate = Gate(d_model, moe_cfg, dtype=dtype)
        init_gate_(self.gate, seed, layer_id)
        E = moe_cfg.num_experts
        self.experts = Experts(d_model, d_ff, tuple(range(E)), seed=seed, layer_id=layer_id,
                               activation=moe_cfg.activation, bias=moe_cfg.expert_bias, dtype=dtype)
        self.aux_loss = torch.zeros(())
        self._loaded: set = set()  # experts in this rank's working slots (the last plan's)
        if context is not None:
            context.layers[layer_id] = self

    @torch.no_grad()
    def forward(self, x):
        ctx, comm, E, j = self.ctx, self.comm, self.cfg.num_experts, self.layer_id
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        t0 = time.perf_counter()
        probs = torch.softmax(self.gate.wg(x).double(), dim=-1)
        idx = probs.argmax(-1)
        w = probs.gather(1, idx[:, None]).reshape(-1).to(x.dtype)
        if ctx.sv.variant == "ideal" and not ctx.capture:  # balanced: token i of rank r -> expert (i + r*T) mod E
            idx = (torch.arange(len(idx)) + comm.rank * len(idx)) % E
        ctx.paths.append(idx.clone())
        mine = torch.bincount(idx, minlength=E).to(torch.int64)
        est = self._estimate(j + 1)  # phase 1 of the next layer: its estimate rides this count exchange
        if est is None:
            counts = comm.all_gather(mine, group="world")
        else:
            every = comm.all_gather(torch.cat([mine.double(), torch.as_tensor(est, dtype=torch.float64)]),
                                    group="world")
            counts = every[:, :E].to(torch.int64)
            pop_next = (every[:, E:-1].sum(0) / max(float(every[:, -1].sum()), 1.0)).numpy()
        t_gate = time.perf_counter()
        pop = counts.sum(0).double() / max(1, int(counts.sum()))
        rec = {"batch": ctx.batch, "layer": j, "variant": ctx.sv.variant, "tokens": int(counts.sum()),
               "pop": pop.tolist(), "counts": counts.tolist(), "replanned": False, "planned_from": "static"}
        t = time.perf_counter()
        phase1 = ctx.pending.pop(j, None)
        pop_hat, planned, prefetched, prefetch_s = phase1.result() if phase1 is not None else (None, None, 0, 0.0)
        t_p1 = time.perf_counter() - t
        t = time.perf_counter()
        devs, how, replanned = choose_plan(ctx.sv, ctx.scheduled(j), pop.numpy(), pop_hat, comm.world_size,
                                           ctx.static(), ctx.plan_seed(j), planned)
        t_p2 = time.perf_counter() - t
        rec.update(planned_from=how, replanned=replanned, p1_wait_s=t_p1, prefetched=prefetched, prefetch_s=prefetch_s)
        if planned is not None:
            rec["p1_devs"] = planned  # what phase 1 loaded (replaced where phase 2 re-planned)
        if pop_hat is not None:
            rec["pop_hat"] = pop_hat.tolist()
        if est is not None:
            self._phase1_issue(j + 1, pop_next)
        t = time.perf_counter()
        swapped = self._swap(devs[comm.rank])  # nothing when phase 1's plan stands: its experts are loaded
        t_swap = time.perf_counter() - t
        t = time.perf_counter()
        parts: dict = {}
        y = serve_forward(x, idx, w, devs, self.experts, comm, counts=counts, group="world", times=parts)
        t_moe = time.perf_counter() - t
        rec.update(devs=devs, swapped=swapped, gate_s=t_gate - t0, plan_s=t_p2, swap_s=t_swap, dispatch_ffn_s=t_moe,
                   a2a_s=parts["dispatch_s"] + parts["combine_s"], experts_s=parts["experts_s"],
                   layer_s=time.perf_counter() - t0)
        ctx.records.append(rec)
        return y.reshape(shape)

    def _swap(self, mine) -> int:
        """Copy the experts this plan newly puts here from the bank into working slots (the host-to-device
        load of the paper; on CPU a memory copy). Returns how many were loaded."""
        new = [e for e in mine if e not in self._loaded]
        ex = self.experts
        for e in new:
            s = ex.experts.index(e)
            for p in (ex.w1, ex.b1, ex.w2, ex.b2):
                if p is not None:
                    p[s].detach().clone()
        self._loaded = set(mine)
        return len(new)

    def _estimate(self, nxt: int):
        """This rank's phase-1 estimate for MoE layer ``nxt`` from its tokens' paths so far: the ``E`` sums of
        their kept entries and the token count (None where phase 1 does not estimate ``nxt``)."""
        ctx = self.ctx
        if nxt >= ctx.L or not ctx.scheduled(nxt) or not estimates(ctx.sv, nxt):
            return None
        paths = torch.stack(ctx.paths[nxt - ctx.sv.path_len:nxt], dim=1).numpy()
        est = ctx.table.estimate(paths, nxt, ctx.sv.k_est) * len(paths) if len(paths) else np.zeros(ctx.E)
        return list(est) + [len(paths)]

    def _phase1_issue(self, nxt: int, pop_hat) -> None:
        """Phase 1 for layer ``nxt`` from the exchanged estimate, handed to the loader thread while this layer
        dispatches and computes: plan (the same on every rank) and load ``nxt``'s newly placed experts."""
        ctx, comm = self.ctx, self.comm
        N, rank, seed, layer = comm.world_size, comm.rank, ctx.plan_seed(nxt), ctx.layers[nxt]

        def phase1():  # on the loader thread, in layer order
            devs = phase1_plan(ctx.sv, pop_hat, N, seed)
            t = time.perf_counter()
            loaded = layer._swap(devs[rank])
            return pop_hat, devs, loaded, time.perf_counter() - t

        ctx.pending[nxt] = ctx.loader().submit(phase1)
