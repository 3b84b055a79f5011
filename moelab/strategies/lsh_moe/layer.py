"""The LSH-MoE layer (spec §2.5-§2.8): only centroids cross the wire.

After the gate (routing untouched), each rank hashes its dispatched rows per destination expert
(:mod:`.hashing`), averages each bucket into a centroid (:mod:`.buckets`), and plans the sparse
dispatch over the centroid rows with the core's pure :func:`moelab.moe.dispatch.plan_from_counts`.
One count exchange carries the token and the centroid counts per expert; the door's autograd
all-to-all moves ``[M, d]`` centroid rows out and their expert outputs back; each row is rebuilt
as ``E(c) + ec_scale·(x - c)`` and the gate weights are applied after, through ``combine_slots``.
The backward runs the same autograd all-to-alls, so all four carry centroid rows only (§6.7).

Stages changed, nothing else: ``route`` adds the bucketing, ``exchange_counts`` the centroid counts,
``plan`` plans centroid rows, ``dispatch_compute_combine`` compresses and decompresses. With
``hash_family: none`` every stage is the core's (plain EP). ``last_metrics`` holds this rank's
A, M, rho, rho_remote, groups, singleton share, stage times and the sampled compression error.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from moelab.moe.dispatch import CountExchange, DispatchPlan, combine_slots, local_counts, plan_from_counts
from moelab.moe.experts import seeded_generator
from moelab.moe.layer import MoELayer
from moelab.moe.routing import Routing
from moelab.placement import Placement
from moelab.strategies.lsh_moe import buckets as bk
from moelab.strategies.lsh_moe.hashing import PROJECTED, hash_rows, rotations
from moelab.strategies.lsh_moe.options import LSHMoEOptions


@dataclass
class LSHCounts(CountExchange):
    """The count exchange of a compressed layer: tokens (``counts``) and centroids per (source, expert)."""

    centroids: Optional[torch.Tensor] = None  # [N, E]


@dataclass
class _Call:
    """One forward call's bucketing (lives from ``route`` to the end of the call)."""

    pos: torch.Tensor  # [A] flat slot (t*k + j) of each row, expert-major, slot order inside
    buckets: bk.Buckets
    times: dict  # stage -> (wall s, this thread's CPU s)


class _Stage:
    """``with _Stage(rec, times, "hash"):`` a recorder span plus the stage's wall and thread-CPU seconds
    (CPU time excludes waiting: for the hashing overhead on oversubscribed cores)."""

    def __init__(self, rec, times: dict, name: str):
        self.span, self.times, self.name = rec.span(f"lsh.{name}", "lsh"), times, name

    def __enter__(self):
        self.span.__enter__()
        self.t0, self.c0 = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc):
        self.times[self.name] = (time.perf_counter() - self.t0, time.thread_time() - self.c0)
        return self.span.__exit__(*exc)


class LSHMoELayer(MoELayer):
    def __init__(self, d_model: int, d_ff: int, moe_cfg, layer_id: int = 0, seed: int = 0, comm=None,
                 placement: Optional[Placement] = None, dtype=torch.float32, options: Optional[LSHMoEOptions] = None):
        super().__init__(d_model, d_ff, moe_cfg, layer_id=layer_id, seed=seed, comm=comm, placement=placement,
                         dtype=dtype)
        self.options = options or LSHMoEOptions()
        self.options.raise_if(self.options.shape_errors(d_model, moe_cfg.dispatcher,
                                                        has_placement=not self.placement.is_trivial))
        self._rotations: Optional[torch.Tensor] = None
        self._call: Optional[_Call] = None
        self.last_metrics: dict = {}
        self.last_centroid_counts: Optional[torch.Tensor] = None

    @property
    def compresses(self) -> bool:
        """False for ``hash_family: none``, and in evaluation (``model.eval()``) unless ``eval_mode: compressed``."""
        if self.options.hash_family == "none":
            return False
        return self.training or self.options.eval_mode == "compressed"

    def rotations(self) -> Optional[torch.Tensor]:
        """``[L, d, r]`` of this call (fixed per layer unless ``resample_each_step``)."""
        o = self.options
        if o.hash_family not in PROJECTED:
            return None
        r = 1 if o.hash_family == "hyperplane" else o.cp_dim
        d = self.gate.wg.in_features
        if o.resample_each_step:
            return rotations(d, r, o.num_hashes, self.seed, self.layer_id, step=self.forward_calls)
        if self._rotations is None:
            self._rotations = rotations(d, r, o.num_hashes, self.seed, self.layer_id)
        return self._rotations

    # ---- the stages LSH-MoE changes --------------------------------------------------------------
    def route(self, x: torch.Tensor) -> Routing:
        routing = super().route(x)
        self._call = self.bucketize(x, routing) if self.compresses else None
        return routing

    def bucketize(self, x: torch.Tensor, routing: Routing, codes: Optional[torch.Tensor] = None) -> _Call:
        """This rank's buckets: rows = valid slots sorted by expert (stable); ``codes`` freezes them (tests)."""
        o, k = self.options, routing.idx.shape[1]
        dest = routing.idx.reshape(-1).cpu()
        valid = (dest >= 0).nonzero().squeeze(1)
        pos = valid[torch.argsort(dest[valid], stable=True)]
        expert = dest[pos]
        times: dict = {}
        with _Stage(self.comm.rec, times, "hash"), torch.no_grad():
            if codes is None and o.hash_family == "identity":  # every row alone: the partition is known
                A = int(pos.numel())
                return _Call(pos, bk.Buckets(torch.arange(A), expert, torch.ones(A, dtype=torch.int64)), times)
            xa = x.detach().index_select(0, (pos // k).to(x.device)).cpu()
            finite = torch.isfinite(xa).all(1)
            if codes is None:
                gen = seeded_generator("lsh_sp", self.seed, self.layer_id, self.forward_calls, self.comm.rank) \
                    if o.hash_family == "spherical" else None
                codes = hash_rows(o.hash_family, torch.where(finite.unsqueeze(1), xa, torch.zeros_like(xa)), expert,
                                  R=self.rotations(), L=o.num_hashes, gen=gen, refine_iters=o.sp_refine_iters,
                                  center=o.center_before_hash)
            b = bk.make_buckets(expert, codes, self.cfg.num_experts, finite=finite)
        return _Call(pos, b, times)

    def exchange_counts(self, routing: Routing) -> CountExchange:
        """One all-gather of ``[tokens per expert, centroids per expert]`` (int64, ``2E``)."""
        if self._call is None:
            return super().exchange_counts(routing)
        E = self.cfg.num_experts
        mine = torch.cat([local_counts(routing.idx, E), torch.bincount(self._call.buckets.expert, minlength=E)])
        g = self.comm.all_gather(mine, group="ep")
        return LSHCounts(g[:, :E].contiguous(), centroids=g[:, E:].contiguous())

    def plan(self, routing: Routing, counts: CountExchange, placement: Placement,
             shadowed: Sequence[int] = ()) -> DispatchPlan:
        """The sparse plan of the centroid rows; ``global_counts`` stays the token counts (the loads)."""
        if self._call is None:
            return super().plan(routing, counts, placement, shadowed)
        plan = plan_from_counts(counts.centroids, placement, self._call.buckets.expert, self.comm.rank, shadowed)
        self.last_centroid_counts = counts.centroids
        return dataclasses.replace(plan, global_counts=counts.counts)

    def dispatch_compute_combine(self, x: torch.Tensor, plan: DispatchPlan, routing: Routing) -> torch.Tensor:
        if self._call is None:
            return super().dispatch_compute_combine(x, plan, routing)
        call, self._call = self._call, None
        b, (T, k), d, rec = call.buckets, routing.idx.shape, x.shape[1], self.comm.rec
        pos = call.pos.to(x.device)
        xa = x.index_select(0, torch.div(pos, k, rounding_mode="floor"))
        alone = b.M == b.A  # every bucket a single row: centroids are the rows, outputs come back as they are
        # send_pos = arange: centroids are expert-major
        in_order = plan.placement is None or plan.placement.is_expert_parallel
        with _Stage(rec, call.times, "centroid"):
            C = xa if alone else bk.centroids(xa, b)
        send_pos = plan.send_pos.to(x.device)
        xe = self.dispatch_postprocess(self.token_dispatch(C if in_order else C.index_select(0, send_pos), plan), plan)
        with rec.span("experts", "expert"):
            ye = self.compute_experts(xe, plan)
        back = self.token_combine(self.combine_preprocess(ye, plan), plan)
        with _Stage(rec, call.times, "decompress"):
            ec_out = back if in_order else back.new_zeros(b.M, d).index_copy(0, send_pos, back)
            ya = ec_out if alone else bk.decompress(ec_out, xa, C, b, self.options.ec)
            out_flat = ya.new_zeros(T * k, d).index_copy(0, pos, ya)
        self.last_metrics = self._metrics(call, plan, xa, C, ec_out)
        return combine_slots(out_flat, routing.weights)

    # ---- what the call did -----------------------------------------------------------------------
    def _metrics(self, call: _Call, plan: DispatchPlan, xa, C, ec_out) -> dict:
        b, rank = call.buckets, self.comm.rank
        owners = torch.from_numpy(plan.placement.owners if plan.placement is not None else self.placement.owners)
        remote_rows = owners[b.expert[b.inv]] != rank if b.A else torch.zeros(0, dtype=torch.bool)
        remote_cen = owners[b.expert] != rank if b.M else torch.zeros(0, dtype=torch.bool)
        A_rem, M_rem = int(remote_rows.sum()), int(remote_cen.sum())
        m = dict(A=b.A, M=b.M, rho=b.M / b.A if b.A else None, A_remote=A_rem, M_remote=M_rem,
                 rho_remote=M_rem / A_rem if A_rem else None, groups=b.groups,
                 singleton_share=b.singletons / b.M if b.M else None, nonfinite=b.nonfinite)
        for stage in ("hash", "centroid", "decompress"):
            wall, cpu = call.times.get(stage, (0.0, 0.0))
            m[f"{stage}_s"], m[f"{stage}_cpu_s"] = wall, cpu
        m.update(self._compression_error(b, xa, C, ec_out, ~remote_rows))
        return m

    @torch.no_grad()
    def _compression_error(self, b: bk.Buckets, xa, C, ec_out, local_rows: torch.Tensor) -> dict:
        """``‖E(x) - ya‖ / ‖E(x)‖`` with and without EC on up to ``error_sample`` rows routed to this
        rank's own experts (their exact output needs no communication). EC can raise it (§2.6)."""
        n = self.options.error_sample
        rows = local_rows.nonzero().squeeze(1)
        if n == 0 or rows.numel() == 0:
            return dict(err_sample=0, err_ec=None, err_noec=None)
        rows = rows[torch.linspace(0, rows.numel() - 1, min(n, rows.numel())).round().long().unique()]
        exp = b.expert[b.inv[rows]]
        held = list(self.experts.experts)
        per_slot = [int((exp == e).sum()) for e in held]  # rows are expert-sorted, held ascending
        dev = xa.device
        exact = self.experts(xa[rows.to(dev)], per_slot)
        cen = b.inv[rows].to(dev)
        no_ec = ec_out[cen]
        with_ec = no_ec + self.options.ec_scale * (xa[rows.to(dev)] - C[cen])
        norm = exact.norm()
        err = (lambda approx: float((exact - approx).norm() / norm) if norm > 0 else None)
        return dict(err_sample=int(rows.numel()), err_ec=err(with_ec), err_noec=err(no_ec))

    def plan_record(self) -> dict:
        """The core's record plus ``lsh``: centroid counts ``[N, E]`` (what the all-to-alls moved) and
        the layer's global rate ``rho = Σ centroids / Σ tokens`` (identical on every rank)."""
        rec = super().plan_record()
        if self.compresses and self.last_centroid_counts is not None:
            cen, tok = self.last_centroid_counts, self.last_global_counts
            total = int(tok.sum())
            rec["lsh"] = {"family": self.options.hash_family, "centroids": cen.tolist(),
                          "rho": int(cen.sum()) / total if total else None}
        return rec

