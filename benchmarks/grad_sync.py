"""Gradient sync on real gloo ranks: today's all-reduce after backward vs DDP-style buckets during backward.

One run, two trainers per rank (same model, data and seed), steps interleaved round-robin:

  after_backward  one flat all-reduce of the dense grads after backward (``parallel.grad_sync``)
  ddp_overlap     DDP buckets of ``--bucket-mb`` MiB, reverse parameter order, all-reduced from the
                  gradient-ready hooks during backward

Per mode: the median step time of the slowest rank, the all-reduces per iteration, and the gradient
and total memory peaks (rank 0, ``mem_grads_peak_bytes`` / ``mem_total_peak_bytes``). While the door's
collectives are synchronous (``moelab.runtime.update.ASYNC_BUCKETS = False``) a bucket blocks
backward, so ddp_overlap cannot be faster yet; the script shows what flipping it changes.
``--emulate`` adds link emulation (2 nodes; 10/1 GB/s intra/inter) so communication has a cost.

Usage: python benchmarks/grad_sync.py [--nproc 4] [--iters 20] [--bucket-mb 0.25] [--d 128] [--emulate]
"""
from __future__ import annotations

import argparse
import statistics

from moelab.runtime.ranks import run_ranks


def _rank(rank, world, args):
    import time

    import torch.distributed as dist

    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer

    base = RunConfig.load("experiments/core/quickstart.yaml").with_overrides({
        "parallel.nproc": world, "parallel.topology.nodes": 2 if args.emulate else 1, "train.iters": args.iters,
        "model.d_model": args.d, "model.d_ff": 2 * args.d, "emulation.enabled": args.emulate,
        "parallel.bucket_mb": args.bucket_mb, "train.trace": False})
    trainers = {m: Trainer.build(base.with_overrides({"parallel.grad_sync": m}).validate())
                for m in ("after_backward", "ddp_overlap")}
    out = {m: dict(t=[], rows=[]) for m in trainers}
    for it in range(args.iters):
        for m, tr in trainers.items():
            dist.barrier()
            t0 = time.perf_counter()
            row = tr.step(it)
            out[m]["t"].append(time.perf_counter() - t0)
            out[m]["rows"].append(row)
    for m, tr in trainers.items():
        out[m]["all_reduces"] = sum(1 for r in tr.comm.rec.comm if r.op == "all_reduce") / args.iters
        out[m]["buckets"] = len(getattr(tr.update, "buckets", [None]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=0.25)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--emulate", action="store_true")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    res = run_ranks(_rank, args.nproc, args, timeout=args.timeout)
    print(f"{args.nproc} gloo ranks, d={args.d}, bucket {args.bucket_mb} MiB, "
          f"emulation {'on' if args.emulate else 'off'}")
    print(f"{'mode':<16}{'step ms (median, slowest rank)':>32}{'all-reduces/iter':>18}{'grads peak KiB':>16}"
          f"{'total peak KiB':>16}")
    for m in ("after_backward", "ddp_overlap"):
        slowest = [max(r[m]["t"][i] for r in res) for i in range(args.warmup, args.iters)]
        rows = res[0][m]["rows"][args.warmup:]
        print(f"{m:<16}{1e3 * statistics.median(slowest):>32.2f}{res[0][m]['all_reduces']:>18.1f}"
              f"{max(r['mem_grads_peak_bytes'] for r in rows) / 1024:>16.1f}"
              f"{max(r['mem_total_peak_bytes'] for r in rows) / 1024:>16.1f}")


if __name__ == "__main__":
    main()
