"""EP MoE layer forward+backward on real gloo ranks: moelab sparse / dense vs DeepSpeed-MoE vs the floor.

One run, same routing everywhere (moelab's gshard gate weights are copied into DeepSpeed's; DeepSpeed's
2nd expert is deterministic), fp32, one thread per rank:

  sparse    moelab MoELayer, SparseDispatcher (count exchange + uneven all-to-all)
  dense     moelab MoELayer, DenseDispatcher (capacity-padded equal-split all-to-all, DeepSpeed style)
  deepspeed deepspeed.moe.layer.MoE (k=2, same capacity factor, min_capacity=0, no RTS, no sampling)
  floor     the bytes the sparse dispatcher really moves, through 4 raw all_to_all_single calls
            (dispatch + combine, forward + backward, the sparse plan's split sizes), plus the same expert
            GEMMs alone (fwd + bwd, per-expert weights as leaves, the sparse plan's rows per expert)

Each iteration starts after a barrier; a method's time for the iteration is the slowest rank's; the
table shows the median over ``--iters`` iterations after ``--warmup``, methods interleaved round-robin.
Targets (issue): sparse <= 1.3x floor and <= 0.7x DeepSpeed.

``--profile`` then profiles the sparse layer on rank 0 (all ranks run it): a per-stage forward
timing (gate / plan / dispatch / experts / combine / backward), torch.profiler's top ops (self CPU
time, backward included) and cProfile's top Python functions.

Usage: python benchmarks/ep_layer.py [--nproc 4] [--tokens 1024] [--d 256] [--f 512] [--experts 8]
                                     [--cf 1.25] [--iters 10] [--warmup 3] [--profile]
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time

import torch

from moelab.comm.door import Communicator
from moelab.comm.topology import Topology
from moelab.config import MoEConfig
from moelab.moe.layer import MoELayer
from moelab.runtime.ranks import run_ranks


def _setup_deepspeed():
    """DeepSpeed on the already-initialised gloo group; None if deepspeed is not installed."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    try:
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401
    except ImportError:
        return None
    # skip the JIT build of DeepSpeed's CPU shared-memory all-reduce (only inference_all_reduce uses it)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    return deepspeed


def _ds_layer(a, world, src: MoELayer):
    from deepspeed.moe.layer import MoE

    expert = torch.nn.Sequential(torch.nn.Linear(a.d, a.f), torch.nn.GELU(), torch.nn.Linear(a.f, a.d))
    ds = MoE(hidden_size=a.d, expert=expert, num_experts=a.experts, ep_size=world, k=2, capacity_factor=a.cf,
             eval_capacity_factor=a.cf, min_capacity=0, drop_tokens=True, use_rts=False,
             top2_2nd_expert_sampling=False, noisy_gate_policy=None)
    ds.set_deepspeed_parallelism()
    ex = src.experts
    with torch.no_grad():
        ds.deepspeed_moe.gate.wg.weight.copy_(src.gate.wg.weight)
        for s, mod in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
            mod[0].weight.copy_(ex.w1[s].t())
            mod[0].bias.copy_(ex.b1[s])
            mod[2].weight.copy_(ex.w2[s].t())
            mod[2].bias.copy_(ex.b2[s])
    return ds


class Floor:
    """Raw all_to_all_single with the sparse plan's splits + the same expert GEMMs, nothing else."""

    def __init__(self, plan, experts, d):
        import torch.distributed as dist

        self.dist = dist
        self.in_rows, self.out_rows = list(plan.in_rows), list(plan.out_rows)
        self.rows = [int(n) for n in plan.rows_per_slot]
        self.send = torch.randn(sum(self.in_rows), d)
        self.w = [[p[s].detach().clone().requires_grad_() for p in (experts.w1, experts.b1, experts.w2, experts.b2)]
                  for s in range(len(self.rows))]
        self.act = experts.act

    def a2a(self, x, out_rows, in_rows):
        out = x.new_empty(sum(out_rows), x.shape[1])
        self.dist.all_to_all_single(out, x, out_rows, in_rows)
        return out

    def step(self):
        recv = self.a2a(self.send, self.out_rows, self.in_rows)  # dispatch
        xin = recv.requires_grad_()
        outs, start = [], 0
        for (w1, b1, w2, b2), n in zip(self.w, self.rows):
            if n:
                outs.append(self.act(xin[start:start + n] @ w1 + b1) @ w2 + b2)
            start += n
        y = torch.cat(outs) if outs else xin * 1
        back = self.a2a(y.detach(), self.in_rows, self.out_rows)  # combine
        gback = self.a2a(torch.randn_like(back), self.out_rows, self.in_rows)  # combine backward
        y.backward(gback)  # expert GEMMs backward
        self.a2a(xin.grad, self.in_rows, self.out_rows)  # dispatch backward
        for ws in self.w:
            for p in ws:
                p.grad = None


def _layer_step(layer, x, gy):
    x = x.detach().requires_grad_()
    y = layer(x)
    loss = (y * gy).sum() + layer.aux_loss
    loss.backward()
    layer.zero_grad(set_to_none=True)


def _ds_step(ds, x, gy, coef):
    x = x.detach().requires_grad_()
    y, l_aux, _ = ds(x)
    loss = (y * gy).sum() + coef * l_aux
    loss.backward()
    ds.zero_grad(set_to_none=True)


def _make_layer(a, world, dispatcher):
    cfg = MoEConfig(num_experts=a.experts, top_k=2, gate="gshard", capacity_factor=a.cf, dispatcher=dispatcher,
                    balance_loss_coef=0.01, z_loss_coef=0.0, min_capacity=0)
    layer = MoELayer(a.d, a.f, cfg, layer_id=0, seed=0, comm=Communicator(Topology(world, world)))
    layer.comm.rec.enabled = False  # no per-call records in the timed loop
    return layer


def _rank(rank, world, a):
    import torch.distributed as dist

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(a.tokens, a.d, generator=g)
    gy = torch.randn(a.tokens, a.d, generator=g)
    sparse, dense = _make_layer(a, world, "sparse"), _make_layer(a, world, "dense")
    with torch.no_grad():  # the sparse plan (same gate, same input) fixes the floor's split sizes
        routing = sparse.gate(x)
    plan = sparse.dispatcher.plan(routing)
    floor = Floor(plan, sparse.experts, a.d)
    methods = {"sparse": lambda: _layer_step(sparse, x, gy), "dense": lambda: _layer_step(dense, x, gy),
               "floor": floor.step}
    ds = _setup_deepspeed() and _ds_layer(a, world, sparse)
    if ds:
        methods["deepspeed"] = lambda: _ds_step(ds, x, gy, 0.01)

    times = {m: [] for m in methods}
    cpu = {m: [] for m in methods}
    for it in range(a.warmup + a.iters):
        for name, fn in methods.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            t1, c1 = time.perf_counter(), time.thread_time()
            dt = torch.tensor([t1 - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time
            dc = torch.tensor([c1 - c0], dtype=torch.float64)
            dist.all_reduce(dc)  # CPU time of the ranks' main threads, summed below into a mean
            if it >= a.warmup:
                times[name].append(float(dt))
                cpu[name].append(float(dc) / world)
    cap = routing.capacity
    info = dict(rows_sent=sum(plan.in_rows), rows_recv=sum(plan.out_rows), rows_per_slot=list(plan.rows_per_slot),
                dropped=int((routing.idx < 0).sum()), capacity=cap, dense_rows=a.experts * cap)
    prof = _profile(sparse, x, gy, a, rank) if a.profile else None
    return dict(times=times, cpu=cpu, info=info, profile=prof)


# ---- profiling ---------------------------------------------------------------------------------
def _stage_times(layer, x, gy):
    """One sparse-layer step with a wall clock around each forward stage (same calls as MoELayer.forward)."""
    disp, st = layer.dispatcher, {}
    t, c = time.perf_counter(), time.thread_time()
    x = x.detach().requires_grad_()

    def lap(name):  # (wall, main-thread CPU) seconds since the previous lap
        nonlocal t, c
        now, cnow = time.perf_counter(), time.thread_time()
        st[name] = (now - t, cnow - c)
        t, c = now, cnow

    routing = layer.gate(x)
    lap("gate (logits, softmax, top-2, capacity locations, aux)")
    plan = disp.plan(routing)
    lap("plan (argsort, count all_gather, Python block loops)")
    k = routing.idx.shape[1]
    send = x[plan.send_pos // k]
    lap("dispatch: gather rows to send")
    recv = layer.comm.all_to_all(send, plan.out_rows, plan.in_rows)
    lap("dispatch: all_to_all")
    xe = recv[plan.recv_perm]
    lap("dispatch: recv permutation")
    ye = layer.experts(xe, plan.rows_per_slot)
    lap("experts fwd")
    T = routing.idx.shape[0]
    back = torch.empty_like(ye).index_copy(0, plan.recv_perm, ye)
    lap("combine: index_copy to source-major")
    back = layer.comm.all_to_all(back, plan.in_rows, plan.out_rows)
    lap("combine: all_to_all")
    out_flat = ye.new_zeros(T * k, ye.shape[1]).index_copy(0, plan.send_pos, back)
    lap("combine: index_copy to token slots")
    y = torch.bmm(routing.weights.unsqueeze(1), out_flat.view(T, k, -1)).squeeze(1)
    lap("combine: weighted sum (bmm)")
    loss = (y * gy).sum() + routing.aux_loss
    loss.backward()
    lap("backward (all stages)")
    layer.zero_grad(set_to_none=True)
    return st


def _profile(layer, x, gy, a, rank):
    import cProfile
    import pstats

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    stages = []
    for _ in range(a.iters):
        dist.barrier()
        stages.append(_stage_times(layer, x, gy))
    med = {k: tuple(statistics.median(s[k][i] for s in stages) for i in (0, 1)) for k in stages[0]}
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(a.iters):
            _layer_step(layer, x, gy)
    ops = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.iters):
        _layer_step(layer, x, gy)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(22)
    return dict(stages=med, ops=ops, cprofile=buf.getvalue()) if rank == 0 else dict(stages=med)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--f", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--cf", type=float, default=1.25, help="capacity factor")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="then profile the sparse layer (rank 0)")
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args(argv)

    res = run_ranks(_rank, a.nproc, a, timeout=a.timeout)
    times = res[0]["times"]  # identical on every rank (max over ranks per iteration)
    med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    print(f"EP layer fwd+bwd: {a.nproc} gloo ranks x 1 thread, d={a.d} f={a.f} E={a.experts} top-2 gshard, "
          f"{a.tokens} tokens/rank, cf={a.cf}, fp32; median of {a.iters} after {a.warmup} warm-up")
    for r, out in enumerate(res):
        i = out["info"]
        print(f"  rank {r}: capacity {i['capacity']}, routes dropped {i['dropped']}, sparse rows sent {i['rows_sent']} "
              f"recv {i['rows_recv']} (per expert {i['rows_per_slot']}); dense/DeepSpeed rows sent {i['dense_rows']}")
    cpu = {m: statistics.median(v) * 1e3 for m, v in res[0]["cpu"].items()}
    print(f"\n{'method':<10} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'x floor':>8} {'CPU ms':>8} {'x floor':>8}")
    for m in ("floor", "sparse", "dense", "deepspeed"):
        if m in med:
            v = times[m]
            print(f"{m:<10} {med[m]:>10.2f} {min(v) * 1e3:>9.2f} {max(v) * 1e3:>9.2f} {med[m] / med['floor']:>8.2f}"
                  f" {cpu[m]:>8.2f} {cpu[m] / cpu['floor']:>8.2f}")
    print("(ms: wall time of the slowest rank; CPU ms: main-thread CPU time, mean over ranks - robust when ranks "
          f"outnumber cores: {os.cpu_count()} cores here)")
    if "deepspeed" not in med:
        print("deepspeed: not installed, skipped")
    print(f"\n{'ratio':<17}{'wall':>6}{'CPU':>7}")
    pairs = [("sparse", "floor", "<= 1.30"), ("dense", "floor", ""), ("deepspeed", "floor", ""),
             ("sparse", "deepspeed", "<= 0.70")]
    for num, den, target in pairs:
        if num in med and den in med:
            print(f"{num + '/' + den:<17}{med[num] / med[den]:>6.2f}{cpu[num] / cpu[den]:>7.2f}"
                  + (f"   (target {target})" if target else ""))
    if a.profile:
        print("\n== sparse layer per stage, ms (median; forward stages, then the whole backward): wall / CPU ==")
        stages = [out["profile"]["stages"] for out in res]
        print(f"{'stage':<56}" + "".join(f"{'rank ' + str(r):>14}" for r in range(len(res))))
        for k in stages[0]:
            print(f"{k:<56}" + "".join(f"{s[k][0] * 1e3:>7.2f}/{s[k][1] * 1e3:<6.2f}" for s in stages))
        tot = [(sum(v[0] for v in s.values()), sum(v[1] for v in s.values())) for s in stages]
        print(f"{'total':<56}" + "".join(f"{w * 1e3:>7.2f}/{c * 1e3:<6.2f}" for w, c in tot))
        print("\n== rank 0: torch.profiler, top ops by self CPU time ==")
        print(res[0]["profile"]["ops"])
        print("== rank 0: cProfile, top Python functions by own time ==")
        print(res[0]["profile"]["cprofile"])


if __name__ == "__main__":
    main()
