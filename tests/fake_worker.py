"""A tiny stand-in for moelab.runtime.worker that speaks the same contract (files, progress lines,
fault injection, the run folder completed by the ranks), so the launcher is tested without the MoE
model. One gloo all_reduce per iteration.

Test-only knobs come from the environment:
- MOELAB_FAKE_HANG_RANK: that rank sleeps forever at iteration 1;
- MOELAB_FAKE_CRASH_RANK: that rank dies by SIGKILL at iteration 1 (no Python exception);
- MOELAB_FAKE_CRASH_LOCAL_RANK: the same for that local rank (a rank of one node);
- MOELAB_FAKE_LINGER: every rank stays alive after an exception (a stuck non-daemon thread);
- MOELAB_FAKE_PRINT: rank 0 prints an ordinary line.
The helpers at the end are shared by the launcher's tests.
"""
import argparse
import csv
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moelab.comm.bytes import by_link_class, peer_bytes
from moelab.comm.topology import Topology
from moelab.config import RunConfig
from moelab.runtime.runfolder import RunFolder


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    out = Path(args.out)
    train, par = cfg["train"], cfg["parallel"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = RunFolder.start(RunConfig.from_dict(cfg), out, "fake_worker")
    out = Path(folder.dir)
    topo = Topology.from_config(world, par["topology"]["nodes"], par["topology"]["ranks_per_node"])
    hang = os.environ.get("MOELAB_FAKE_HANG_RANK")
    crash = os.environ.get("MOELAB_FAKE_CRASH_RANK")
    if os.environ.get("MOELAB_FAKE_CRASH_LOCAL_RANK") == os.environ.get("LOCAL_RANK"):
        crash = str(rank)
    if os.environ.get("MOELAB_FAKE_LINGER"):
        threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
    n_experts = cfg["model"]["moe"]["num_experts"]
    metrics, loads, comm, events = [], [], [], []
    t0 = time.perf_counter()
    x = torch.ones(256)
    for it in range(train["iters"]):
        start = time.perf_counter()
        if train.get("fault_rank") == rank and it == train.get("fault_iter", 0):
            raise RuntimeError(f"injected fault on rank {rank} at iteration {it}")
        if hang is not None and int(hang) == rank and it == 1:
            time.sleep(3600)
        if crash is not None and int(crash) == rank and it == 1:
            print("about to crash", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        c0 = time.perf_counter()
        dist.all_reduce(x)
        x /= world
        c1 = time.perf_counter()
        nbytes = x.numel() * x.element_size()
        b = by_link_class(topo, rank, peer_bytes("all_reduce", list(range(world)), rank, nbytes))
        comm.append(dict(op="all_reduce", group="world", **{f"bytes_{k}": v for k, v in b.items()},
                         t_start=c0 - t0, t_end=c1 - t0, iter=it, layer=0))
        end = time.perf_counter()
        us = lambda t: (t - t0) * 1e6  # noqa: E731
        events += [
            dict(name="step", cat="step", ph="X", ts=us(start), dur=us(end) - us(start), pid=rank, tid=0,
                 args={"iter": it}),
            dict(name="all_reduce", cat="comm", ph="X", ts=us(c0), dur=us(c1) - us(c0), pid=rank, tid=0,
                 args={"iter": it}),
        ]
        if rank == 0:
            loss = 5.0 / (it + 1)
            metrics.append(dict(iter=it, loss=loss, step_time_s=end - start,
                                **{f"bytes_{k}": v for k, v in b.items()}, mem_params_bytes=1000,
                                mem_grads_bytes=1000, mem_optim_bytes=2000, mem_activations_bytes=500))
            loads += [dict(iter=it, layer=0, expert=e, tokens=(e + it) % n_experts + 1) for e in range(n_experts)]
            if os.environ.get("MOELAB_FAKE_PRINT") and it == 0:
                print("hello from the fake worker", flush=True)
            print(f"MOELAB_PROGRESS iter={it} total={train['iters']} loss={loss:.4f} "
                  f"step_time={end - start:.6f}", flush=True)
    _csv(out / f"comm_rank{rank}.csv", comm)
    (out / f"trace_rank{rank}.json").write_text(json.dumps({"traceEvents": events}))
    if rank == 0:
        _csv(out / "metrics.csv", metrics)
        _csv(out / "loads.csv", loads)
    folder.finish()
    dist.destroy_process_group()


def _csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


# ---- helpers for the tests ---------------------------------------------------------------------
def use_fake_worker(monkeypatch) -> str:
    """Make this module importable by the ranks (the repository root on their path, so ``tests`` is a package
    there: the test folders' names, such as ``comm``, never shadow a library's); return the name to pass as
    ``worker=``."""
    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    return "tests.fake_worker"


def leftover_processes(marker: str) -> list:
    """Live children of this process, and any process whose command line mentions ``marker``.

    The interpreter's own helpers (multiprocessing's resource tracker / forkserver, started by
    earlier spawn-based tests in the same session) are not run processes and are ignored."""
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if p.status() != psutil.STATUS_ZOMBIE and "multiprocessing." not in cmd:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


def ranks_started(runs_root: Path, n: int = 2) -> bool:
    """``n`` ranks of a launch under ``runs_root`` have recorded their pids (the run is going)."""
    return len(list(Path(runs_root).glob(".tmp-*/.launch/pid_rank*"))) >= n


def timeout_from_the_ranks_start(monkeypatch, runs_root: Path, n: int = 2, start_s: float = 240) -> dict:
    """Count a launch's timeout from when its ``n`` ranks have started (their pid files), not from the launch:
    on a loaded host torchrun's and the ranks' start-up (importing torch) alone outlasts a test's timeout of a
    few seconds, and the timeout then finds no rank in the worker. The launcher's deadline moves by the time
    spent waiting (at most ``start_s``) for the start; the returned dict gets that ``deadline``
    (``time.monotonic()`` clock)."""
    import moelab.runtime.launch as launch_module

    pump, when = launch_module._pump, {}

    def pump_after_the_start(lines, deadline, bar, out):
        t = time.monotonic()
        wait_for(lambda: ranks_started(runs_root, n), start_s, f"{n} ranks to start")
        when["deadline"] = deadline + time.monotonic() - t
        return pump(lines, when["deadline"], bar, out)

    monkeypatch.setattr(launch_module, "_pump", pump_after_the_start)
    return when


def wait_for(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


if __name__ == "__main__":
    main()
