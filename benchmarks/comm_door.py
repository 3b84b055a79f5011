"""The comm door's overhead per call (recording on) vs a raw ``dist.all_to_all_single``.

Two gloo ranks (``moelab.runtime.ranks.run_ranks``, one thread each) exchange a 64 KB tensor (32 KB to each
rank) in blocks of ``--calls`` back-to-back calls; the methods alternate block by block, ``--blocks``
times, so machine noise hits them alike. Per method: the median over blocks of the slowest rank's
time per call. Methods:

  raw        dist.all_to_all_single on the same process group (output allocated per call, as the door does)
  door       Communicator.all_to_all_raw, recording on (the record: bytes sent/received per peer, seq, tags)
  door_async Communicator.all_to_all_raw(async_op=True).wait()

Per method also the main thread's CPU time per call (mean over ranks, median over blocks): with more
busy threads than cores, wall time amplifies every microsecond of CPU work, so read both. Also
printed: the door's pure Python cost per call (single process, no network), and the cost of the
emulator's finish-time agreement, paid per collective only with emulation: a float64 MAX all-reduce
(``finish_reduce``, members on several hosts) or the shared-memory board (``finish_board``, one host).
Target (issue #8): door / raw <= 1.05.

Usage: python benchmarks/comm_door.py [--kb 64] [--calls 200] [--blocks 15] [--timeout 300]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _rank(rank, world, a):
    import torch.distributed as dist

    from moelab.comm.board import Boards
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology

    comm = Communicator(Topology(world, world))
    pg, ranks = comm.group("ep")
    n = a.kb * 1024 // 4
    x = torch.randn(n)
    splits = [n // world] * world
    rows_out = rows_in = splits
    red = torch.zeros(1, dtype=torch.float64)
    boards = Boards.setup(dist, world)  # the shared-memory board the emulator uses for members on one host
    board = boards.open("bench", ranks, rank)
    boards.mapped(dist)

    def raw():
        out = torch.empty(sum(rows_out))
        dist.all_to_all_single(out, x, rows_out, rows_in, group=pg)

    def door():
        comm.all_to_all_raw(x, rows_out, rows_in)

    def door_async():
        comm.all_to_all_raw(x, rows_out, rows_in, async_op=True).wait()

    def finish_reduce():
        dist.all_reduce(red, op=dist.ReduceOp.MAX, group=pg)

    def finish_board():
        board.agree(time.time())

    methods = {"raw": raw, "door": door, "door_async": door_async, "finish_reduce": finish_reduce,
               "finish_board": finish_board}
    for f in methods.values():  # warm up
        for _ in range(20):
            f()
    times = {k: [] for k in methods}
    cpu = {k: [] for k in methods}
    for _ in range(a.blocks):
        for k, f in methods.items():
            dist.barrier(group=pg)
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(a.calls):
                f()
            times[k].append((time.perf_counter() - t0) / a.calls)
            cpu[k].append((time.thread_time() - c0) / a.calls)
            comm.rec.comm.clear()
    return times, cpu


def _python_cost(a) -> float:
    """Seconds per call of the door's own work: a single-process door (no network) minus a bare copy."""
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology

    comm = Communicator(Topology(1, 1))
    n = a.kb * 1024 // 4
    x = torch.randn(n, 1)
    best = {}
    for name, f in (("door", lambda: comm.all_to_all_raw(x, [n], [n])),
                    ("copy", lambda: torch.empty(n, 1).copy_(x))):
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(2000):
                f()
            runs.append((time.perf_counter() - t0) / 2000)
            comm.rec.comm.clear()
        best[name] = min(runs)
    return best["door"] - best["copy"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kb", type=int, default=64)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    if a.kb <= 0 or a.calls <= 0 or a.blocks <= 0:
        ap.error("--kb, --calls and --blocks must be > 0")
    from moelab.runtime.ranks import run_ranks

    torch.set_num_threads(1)
    res = run_ranks(_rank, 2, a, timeout=a.timeout)
    wall = {k: [max(r[0][k][b] for r in res) for b in range(a.blocks)] for k in res[0][0]}  # slowest rank
    med = {k: statistics.median(v) for k, v in wall.items()}
    cpu = {k: statistics.median([statistics.mean(r[1][k][b] for r in res) for b in range(a.blocks)]) for k in wall}
    print(f"2 gloo ranks, {a.kb} KB all-to-all, {a.blocks} blocks x {a.calls} calls, methods interleaved")
    print(f"{'method':<14}{'median us/call':>16}{'min':>10}{'max':>10}{'/ raw':>8}"
          f"{'main-thread CPU us':>20}{'/ raw':>8}")
    for k, v in wall.items():
        print(f"{k:<14}{med[k] * 1e6:>16.1f}{min(v) * 1e6:>10.1f}{max(v) * 1e6:>10.1f}{med[k] / med['raw']:>8.3f}"
              f"{cpu[k] * 1e6:>20.1f}{cpu[k] / cpu['raw']:>8.3f}")
    py = _python_cost(a)
    ratio = med["door"] / med["raw"]
    print(f"door's own Python work per call (1 process, no network): {py * 1e6:.1f} us "
          f"= {py / med['raw'] * 100:.1f} % of a raw call")
    print("emulation's finish-time agreement per collective: MAX all-reduce of one float64 "
          f"{med['finish_reduce'] * 1e6:.1f} us/call"
          f" (members on several hosts), shared-memory board {med['finish_board'] * 1e6:.1f} us/call (one host)")
    print(f"door / raw = {ratio:.3f}  (target <= 1.05: {'OK' if ratio <= 1.05 else 'MISSED'})")


if __name__ == "__main__":
    main()
