"""Run a function on N real gloo ranks (spawned processes) with a hard timeout.

Used by the simulator's calibration, the reproductions, the benchmarks, the notebooks and the tests. Each rank sets
one thread,
joins a process group on a free localhost port, runs ``fn(rank, world_size, *args)`` and sends its
(picklable) result back. A failing rank is reported with its traceback; a hang is killed at the
timeout; no child process survives either way.

Ranks start from :func:`rank_context`: a fork server that imported torch once, so a rank costs a fork
instead of a fresh interpreter importing torch (measured here: 4 ranks 3.7 s → 0.11 s per call; the
tests and notebooks start hundreds). Each rank takes the caller's environment, working directory and
``sys.path`` as they are at the call, as a spawned process would.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import traceback
from datetime import timedelta

import torch


class RankError(RuntimeError):
    def __init__(self, rank: int, tb: str):
        super().__init__(f"rank {rank} failed:\n{tb}")
        self.rank, self.traceback = rank, tb


def free_port() -> int:
    """A port free now (for a server this process does not start itself: a torchrun rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hosted_store(timeout: float):
    """A TCPStore served by this process on a port the OS picks; spawned ranks join it with
    :func:`join_hosted`. The port stays held for the whole run, so no other process can take it between
    choosing and binding (the race that makes ``init_process_group`` fail with EADDRINUSE)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)


def join_hosted(rank: int, world: int, port: int, timeout: float) -> None:
    """``init_process_group("gloo")`` through the parent's :func:`hosted_store` on ``port``."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))


START_METHOD_ENV = "MOELAB_START_METHOD"
_PRELOAD = ["__main__", "torch", "torch.distributed", "moelab.runtime.ranks"]


def rank_context():
    """The multiprocessing context rank processes start from: ``forkserver`` with torch preloaded where the
    platform has it (POSIX), else ``spawn``; ``MOELAB_START_METHOD=spawn`` forces fresh interpreters.
    Start the target through :func:`caller_state` / :func:`take_caller_state` so that the child sees the
    caller's environment, directory and import path of now, not the fork server's of its start."""
    method = os.environ.get(START_METHOD_ENV) or ("forkserver" if "forkserver" in mp.get_all_start_methods()
                                                  else "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def caller_state() -> tuple:
    """What a child must take over from its caller (see :func:`rank_context`)."""
    return dict(os.environ), os.getcwd(), list(sys.path)


def take_caller_state(state: tuple) -> None:
    env, cwd, path = state
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path


def _entry(rank, world, port, state, call, q, timeout):
    import torch.distributed as dist

    try:
        take_caller_state(state)
        torch.set_num_threads(1)
        fn, args = pickle.loads(call)  # after the caller's sys.path is in place: fn's module may need it
        join_hosted(rank, world, port, timeout)
        res = fn(rank, world, *args)
        q.put((rank, True, pickle.dumps(res)))  # by value: the child may exit before the parent reads
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report, then die: the parent kills the others
        q.put((rank, False, traceback.format_exc()))


def run_ranks(fn, nproc: int, *args, timeout: float = 120.0):
    """Return ``[fn(0, nproc, *args), ..., fn(nproc-1, nproc, *args)]`` computed on real ranks."""
    ctx = rank_context()
    q = ctx.Queue()
    call, state = pickle.dumps((fn, args)), caller_state()
    store = hosted_store(timeout)  # held until the ranks are done
    procs = [ctx.Process(target=_entry, args=(r, nproc, store.port, state, call, q, timeout), daemon=True)
             for r in range(nproc)]
    for p in procs:
        p.start()
    results, err = {}, None
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) < nproc and err is None:
            left = deadline - time.monotonic()
            if left <= 0:
                err = TimeoutError(f"ranks {sorted(set(range(nproc)) - set(results))} did not finish "
                                   f"within {timeout:.0f}s")
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
