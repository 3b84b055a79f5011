"""Run a function on N real gloo ranks (spawned processes) with a hard timeout.

Used by the tests and by notebooks for quick in-process experiments. Each rank sets one thread,
joins a process group on a free localhost port, runs ``fn(rank, world_size, *args)`` and sends its
(picklable) result back. A failing rank is reported with its traceback; a hang is killed at the
timeout; no child process survives either way.
"""
from __future__ import annotations

import os
import queue
import socket
import traceback
from datetime import timedelta

import torch
import multiprocessing as mp
import pickle


class RankError(RuntimeError):
    def __init__(self, rank: int, tb: str):
        super().__init__(f"rank {rank} failed:\n{tb}")
        self.rank, self.traceback = rank, tb


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, q, timeout):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
        res = fn(rank, world, *args)
        q.put((rank, True, pickle.dumps(res)))  # by value: the child may exit before the parent reads
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report, then die: the parent kills the others
        q.put((rank, False, traceback.format_exc()))


def run_ranks(fn, nproc: int, *args, timeout: float = 120.0):
    """Return ``[fn(0, nproc, *args), ..., fn(nproc-1, nproc, *args)]`` computed on real ranks."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, nproc, port, fn, args, q, timeout), daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    results, err = {}, None
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) < nproc and err is None:
            left = deadline - time.monotonic()
            if left <= 0:
                err = TimeoutError(f"ranks {sorted(set(range(nproc)) - set(results))} did not finish within {timeout:.0f}s")
                break
            try:
                rank, ok, payload = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    err = RankError(dead[0], f"process exited with code {procs[dead[0]].exitcode}")
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                err = RankError(rank, payload)
        if err is None:
            for p in procs:
                p.join(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        q.close()
    if err is not None:
        raise err
    return [results[r] for r in range(nproc)]
