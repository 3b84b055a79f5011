"""Parm on real gloo ranks: one spawn per world size runs every schedule of one MoE layer per cell.

Per rank and cell (N_MP, N_ESP), E = P / N_ESP, ranks per node 4 (P = 8) or 2 (P = 4):

- REAL (loopback): one traced forward + backward per schedule after a warm-up call: the door's
  records (op, group, phase, start, end, bytes per peer) and the compute spans (Figs. 3, 4, 5);
- EMULATED (declared links): the schedules round-robin, a world barrier before each call, the
  slowest rank's time, medians after warm-up (Table IV and Fig. 1 analogs); ``auto`` = Alg. 1 on
  fits taken on the live emulated groups, evaluated per shape (Fig. 7 analog over a small sweep);
- the alpha-beta sweep of every collective of the layout on loopback and on the emulated links (Fig. 6).

Results are cached per (world, scale) for every product that reads them.
"""
from __future__ import annotations

import statistics
import time

import torch

from moelab.comm.door import Communicator
from moelab.comm.topology import Topology
from moelab.config import RunConfig
from moelab.papers.kit.cache import cached
from moelab.runtime.ranks import run_ranks
from moelab.runtime.timing import timed
from moelab.runtime.train import Trainer
from moelab.strategies.parm import fits as F
from moelab.strategies.parm.layer import ParmMoE
from moelab.strategies.parm.layout import ParmLayout
from moelab.strategies.parm.perf_model import ParmShape, from_dicts, select
from moelab.strategies.parm.select import live_fits

from .common import SCHEDULES, emulation, scale_spec

CELLS = {4: ((2, 2), (1, 2), (2, 1)), 8: ((2, 2), (2, 4), (4, 2), (4, 4))}


def _records(comm, n0, s0):
    recs = [dict(op=r.op, group=r.group, phase=r.tags.get("phase", "fwd"), t0=r.t_start, t1=r.t_done,
                 sent=dict(r.sent_to), seq=r.seq) for r in comm.rec.comm[n0:]]
    spans = [dict(name=sp[0], cat=sp[1], t0=sp[2], t1=sp[3]) for sp in comm.rec.spans[s0:]]
    return recs, spans


def time_round_robin(comm, layers: dict, x, iters: int, warmup: int) -> dict:
    """``{method: [slowest rank's seconds per call]}``: one forward + backward of each layer in turn, a
    barrier before each (:func:`moelab.runtime.timing.timed`), ``warmup`` rounds dropped."""
    times = {m: [] for m in layers}
    for it in range(warmup + iters):
        for m, layer in layers.items():
            _, t = timed(comm, lambda: layer(x.clone().requires_grad_()).sum().backward())
            if it >= warmup:
                times[m].append(t.slowest_s)
        comm.rec.comm.clear()
        comm.rec.spans.clear()
    return times


def _rank(rank, world, scale, seed=0):
    s = scale_spec(scale)
    rpn = 4 if world == 8 else 2
    topo = Topology(world, rpn)
    out = {"traces": {}, "times": {}, "auto": {}, "f7": [], "fits": {}}
    for cell in CELLS[world]:
        n_mp, n_esp = cell
        lay = ParmLayout(world, n_mp, n_esp, world // n_esp, rpn)
        x = torch.randn(s.S, s.M, generator=torch.Generator().manual_seed(1000 * seed + lay.coords(rank)["dp"]))
        comm = Communicator(topo, groups=lay.groups())
        for m in SCHEDULES:  # REAL traces
            layer = ParmMoE(comm, lay, s.M, s.h * n_esp, schedule=m, capacity_factor=s.f, seed=seed)
            layer(x.clone().requires_grad_()).sum().backward()  # warm-up
            n0, s0 = len(comm.rec.comm), len(comm.rec.spans)
            t0 = time.time()
            layer(x.clone().requires_grad_()).sum().backward()
            recs, spans = _records(comm, n0, s0)
            out["traces"][(cell, m)] = dict(recs=recs, spans=spans, t0=t0, t1=time.time(), last=dict(layer.last))
        if cell == (2, 2):
            out["fits"]["REAL"] = F.measure_fits(comm, lay, sizes=tuple(2 ** e for e in s.fit_exps),
                                                 reps=s.fit_reps, warmup=1)
        comm.close()  # every cell builds two communicators: hand their groups on to the next
        emu = Communicator(topo, emulation=emulation(s), groups=lay.groups())
        layers = {m: ParmMoE(emu, lay, s.M, s.h * n_esp, schedule=m, capacity_factor=s.f, seed=seed) for m in SCHEDULES}
        times = time_round_robin(emu, layers, x, s.iters, s.warmup)
        out["times"][cell] = {m: statistics.median(v) for m, v in times.items()}
        fits = live_fits(emu, lay, sizes=tuple(2 ** e for e in s.fit_exps), reps=s.fit_reps, warmup=1)
        ab = from_dicts(fits)
        pick, tD1, tD2 = select(ParmShape(B=1, L=s.S, M=s.M, E=lay.num_experts, k=1, f=s.f, n_mp=n_mp, n_esp=n_esp), ab)
        out["auto"][cell] = dict(schedule=pick, tD1_s=tD1, tD2_s=tD2, fits=fits)
        if cell == (2, 2):
            out["fits"]["EMULATED"] = F.measure_fits(emu, lay, sizes=tuple(2 ** e for e in s.fit_exps),
                                                     reps=s.fit_reps, warmup=1)
        if world == 8 and cell == (4, 4):  # Fig. 7 analog: a sweep of shapes, Parm = Alg. 1's pick per shape
            for S_, M_, f_ in ((a, b, c) for a in s.f7_S for b in s.f7_M for c in s.f7_f):
                xs = torch.randn(S_, M_, generator=torch.Generator().manual_seed(1000 * seed + lay.coords(rank)["dp"]))
                ls = {m: ParmMoE(emu, lay, M_, 2 * M_ * n_esp, schedule=m, capacity_factor=f_, seed=seed)
                      for m in ("baseline", "s1", "s2")}
                t = time_round_robin(emu, ls, xs, max(2, s.iters // 2), 1)
                med = {m: statistics.median(v) for m, v in t.items()}
                pick, _, _ = select(ParmShape(B=1, L=S_, M=M_, E=lay.num_experts, k=1, f=f_, n_mp=4, n_esp=4), ab)
                out["f7"].append(dict(S=S_, M=M_, f=f_, **{f"{m}_s": v for m, v in med.items()}, pick=pick))
        emu.close()
    return out


@cached
def layer_suite(world: int, scale, seed: int = 0) -> dict:
    """Rank 0's view of the suite on ``world`` ranks, plus every rank's traces (for the timelines)."""
    res = run_ranks(_rank, world, scale_spec(scale).name, seed, timeout=1500)
    out = dict(res[0])
    out["rank_traces"] = [r["traces"] for r in res]
    return out


TV_SYSTEMS = {"DeepSpeed-MoE (baseline, Fig. 3a)": {"schedule": "baseline"}, "Parm (auto)": {"schedule": "auto"}}


def tv_overrides(s, arch: str, schedule_opts: dict, seed: int = 0) -> dict:
    """Table V's tiny stand-ins: MoE every other layer, E=2, top-1 switch, f=1.2, P=8 with N_MP=N_ESP=4
    (testbed A's degrees), 2 nodes x 4 with EMULATED links."""
    return {"model.arch": arch, "model.d_model": s.tv_d, "model.d_ff": 4 * s.tv_d, "model.n_layers": s.tv_layers,
            "model.n_heads": s.tv_heads, "model.seq_len": s.tv_seq, "model.moe_every": 2,
            "model.moe.num_experts": 2, "model.moe.top_k": 1, "model.moe.gate": "switch",
            "model.moe.capacity_factor": 1.2, "model.moe.dispatcher": "dense", "model.moe.expert_bias": False,
            "train.batch_size": s.tv_batch, "train.iters": s.tv_iters + 1, "train.seed": seed, "train.trace": False,
            "parallel.nproc": 8, "parallel.topology.nodes": 2, "parallel.strategy": "parm",
            "parallel.strategy_options": {"mp": 4, "esp": 4, **schedule_opts},
            "emulation.enabled": True, "emulation.intra_bw_GBps": s.intra_GBps, "emulation.inter_bw_GBps": s.inter_GBps,
            "emulation.intra_latency_us": s.intra_lat_us, "emulation.inter_latency_us": s.inter_lat_us}


def _tv_rank(rank, world, scale, seed=0):
    s = scale_spec(scale)
    out = []
    for arch in ("bert", "gpt"):
        for system, opts in TV_SYSTEMS.items():
            tr = Trainer.build(RunConfig().with_overrides(tv_overrides(s, arch, opts, seed)).validate())
            rows = tr.run()
            steps = torch.tensor([r["step_time_s"] for r in rows[1:]], dtype=torch.float64)
            worst = tr.comm.all_gather(steps, group="world").max(0).values  # the slowest rank per iteration
            pick = tr.model.moe_layers()[0].schedule
            out.append(dict(model={"bert": "MoE-BERT (tiny)", "gpt": "MoE-GPT (tiny)"}[arch], system=system,
                            iter_ms=float(worst.mean()) * 1e3,
                            std_ms=float(worst.std()) * 1e3 if len(worst) > 1 else 0.0,
                            schedule=pick, loss_first=rows[0]["loss"], loss_last=rows[-1]["loss"]))
            tr.close()  # the next system's timings beside none of this one's process groups
    return out


@cached
def table5_real(scale, seed: int = 0) -> list:
    return run_ranks(_tv_rank, 8, scale_spec(scale).name, seed, timeout=1500)[0]
