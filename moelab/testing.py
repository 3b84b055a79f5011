"""Run a function on N real gloo ranks (spawned processes) with a hard timeout.

Used by the tests and by notebooks for quick in-process experiments. Each rank sets one thread,
joins a process group on a free localhost port, runs ``fn(rank, world_size, *args)`` and sends its
(picklable) result back. A failing rank is reported with its traceback; a hang is killed at the
timeout; no child process survives either way.

Ranks start from :func:`rank_context`: a fork server that imported torch once, so a rank costs a fork
instead of a fresh interpreter importing torch (measured here: 4 ranks 3.7 s → 0.11 s per call; the
tests and notebooks start hundreds). Each rank takes the caller's environment, working directory and
``sys.path`` as they are at the call, as a spawned process would.
"""
from __future__ import annotations

import os
import queue
import socket
import sys
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
_PRELOAD = ["__main__", "torch", "torch.distributed", "moelab.testing"]


def rank_context():
    """The multiprocessing context rank processes start from: ``forkserver`` with torch preloaded where the
    platform has it (POSIX), else ``spawn``; ``MOELAB_START_METHOD=spawn`` forces fresh interpreters.
    Start the target through :func:`caller_state` / :func:`take_caller_state` so that the child sees the
    caller's environment, directory and import path of now, not the fork server's of its start."""
    method = os.environ.get(START_METHOD_ENV) or ("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
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


# A tiny fp64 model for training-equivalence tests: small enough for 4 ranks on 2 cores.
TINY_TRAIN = {
    "model.d_model": 16, "model.d_ff": 32, "model.n_layers": 2, "model.n_heads": 2, "model.seq_len": 16,
    "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.balance_loss_coef": 0.0,
    "model.moe.z_loss_coef": 0.001, "train.iters": 3, "train.batch_size": 2, "train.dtype": "float64",
    "train.lr": 1e-2, "train.trace": False,
}


def train_snapshot(rank: int, world: int, overrides: dict) -> dict:
    """Rank function for :func:`run_ranks`: train ``TINY_TRAIN`` + ``overrides`` and return what the
    equivalence tests compare: losses, each held expert's flat params by (moe layer, expert), the
    flat dense params, loads, each MoE layer's shadow log, collective counts by op, the layer class."""
    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer

    cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": world, **overrides}).validate()
    tr = Trainer.build(cfg)
    losses = [row["loss"] for row in tr.run()]
    ops: dict = {}
    for r in tr.comm.rec.comm:  # training traffic only: the inspection gather below comes after
        ops[r.op] = ops.get(r.op, 0) + 1
    experts = {}
    with tr.update.resident_params() as model:  # ZeRO-3 frees parameters between iterations
        for li, layer in enumerate(model.moe_layers()):
            ex = layer.experts
            for s, e in enumerate(ex.experts):
                experts[(li, e)] = torch.cat([p[s].detach().reshape(-1) for p in (ex.w1, ex.b1, ex.w2, ex.b2)]).clone()
        dense = torch.cat([p.detach().reshape(-1) for p in model.dense_parameters()]).clone()
    tr.close()  # callers train many configurations in one spawn
    return dict(losses=losses, experts=experts, loads=tr.loads, dense=dense,
                shadows=[list(getattr(layer, "shadow_log", [])) for layer in tr.model.moe_layers()],
                ops=ops, cls=type(tr.model.moe_layers()[0]).__name__)


def expert_grads(experts) -> dict:
    """``{global expert id: [grad of w1, b1, w2, b2 slice]}`` of the slots an ``Experts`` holds (no
    bias: w1, w2 only); a slot autograd never reached (no rows on this rank) has a zero gradient."""
    grad = lambda p: p.grad if p.grad is not None else torch.zeros_like(p)  # noqa: E731
    return {e: [grad(p)[s].clone() for p in experts.stacked() if p is not None] for s, e in enumerate(experts.experts)}


# ---- layer vs the fp64 reference ---------------------------------------------------------------
def rank_inputs(tokens, d: int, seed: int = 0, shift: float = 0.0):
    """Per-rank fp64 inputs ``xs`` and upstream grads ``gys`` (``tokens[r]`` rows each), seeded;
    ``shift`` moves every input (tests use it with a biased gate to make one expert hot)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, d, generator=g, dtype=torch.float64) for t in tokens]
    gys = [torch.randn(t, d, generator=g, dtype=torch.float64) for t in tokens]
    return [x + shift for x in xs] if shift else xs, gys


def reference_grads(ref, xs, gys) -> dict:
    """Run :class:`moelab.moe.reference.ReferenceMoE` on the per-rank chunks with the loss the
    distributed tests use, ``sum_r <y_r, gy_r> + aux``; return outputs and every gradient
    (an expert that got no token has a zero gradient)."""
    xs = [x.clone().requires_grad_() for x in xs]
    outs, aux, routes = ref(xs)
    (sum((y * g).sum() for y, g in zip(outs, gys)) + aux).backward()
    eg = {e: [p.grad if p.grad is not None else torch.zeros_like(p) for p in ref.expert(e)]
          for e in range(ref.cfg.num_experts)}
    return dict(y=[o.detach() for o in outs], gx=[x.grad for x in xs], gg=ref.gate.wg.weight.grad, eg=eg, routes=routes)


def assert_matches_reference(results, ref: dict, *, bias: bool = True, scale: float = 1, **tol) -> None:
    """Each rank's ``{y, gx, gg, eg}`` equals the reference; gradients times ``scale`` (e.g. the
    number of micro-batches a test accumulated). Without expert biases only w1, w2 are compared."""
    tol = tol or dict(rtol=1e-9, atol=1e-10)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["y"], ref["y"][rank], **tol)
        torch.testing.assert_close(res["gx"], scale * ref["gx"][rank], **tol)
        torch.testing.assert_close(res["gg"], scale * ref["gg"], **tol)
        for e, grads in res["eg"].items():
            want = ref["eg"][e] if bias else [ref["eg"][e][0], ref["eg"][e][2]]
            for got, w in zip(grads, want):
                torch.testing.assert_close(got, scale * w, **tol)


# ---- schedules ---------------------------------------------------------------------------------
def peak_overlap(intervals) -> int:
    """The most ``(start, end)`` intervals open at once (one ending where another starts does not
    overlap it): how many ops a scheduler's log or a simulated schedule had in flight at its peak."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    return peak
