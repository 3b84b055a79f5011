"""Launch a real multi-process run: validate, start torchrun, show progress, supervise, store.

On one machine ``launch(cfg, nproc=4)`` validates the config (a ConfigError leaves no trace),
writes it to ``runs/.tmp-<id>-<pid>/config.json`` and starts, in a session of its own::

    python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 4 --max-restarts 0 \\
        -m moelab.runtime.launch <worker> --config <tmp>/config.json --out <tmp>

``--standalone`` lets torchrun's c10d store bind a free port itself, so two runs never race for
a port. ``python -m moelab.runtime.launch`` is the per-rank entry: it runs the worker module
unchanged and adds what supervision needs, because torchrun alone cannot provide it:

- torchrun starts every rank in a session of its own, so killing torchrun's process group misses
  them: each rank records its pid, and dies with torchrun (Linux ``PR_SET_PDEATHSIG``);
- when one rank raises, the others then fail inside their collectives; torchrun's error files
  have one-second timestamps and need the worker to use ``@record``, so each rank records its
  exception with a precise time, and the earliest one names the rank that really failed (a rank
  that dies without an exception, by a signal, is found in torchrun's failure report instead);
- each rank's stderr goes to ``logs/rank{r}.stderr`` (kept in the run folder), and SIGUSR1
  dumps every thread's stack there, which is what a timeout reports.

Success: the worker's writer rank has completed the folder (``summary.json`` last, every rank's files
gathered: :mod:`moelab.runtime.runfolder`), and the temp folder is renamed to ``runs/<run_id>/``.
Failure, timeout or Ctrl-C: every process is killed (SIGTERM, then SIGKILL), the temp folder is
deleted, and :class:`RunFailed` (or :class:`RunTimeout`) names the rank and its traceback tail;
Ctrl-C (a notebook's stop button) raises :class:`RunInterrupted`, one line. If the launching process
itself dies mid-run (a restarted kernel), :mod:`moelab.runtime.guard` stops everything and deletes the
temp folder. A failed or interrupted run that had written checkpoints (``train.checkpoint_every``)
keeps them in ``runs/<run_id>.partial/`` (with its config), and the message says how to continue it
(``launch(resume=...)`` / ``moelab run --resume``).

On a cluster, ``launch(..., nodes=Nodes(nnodes, node_rank, "HOST:PORT"))`` (``moelab run CONFIG
--nnodes N --node-rank K --rdzv HOST:PORT``) on every node runs the same supervision around
torchrun's c10d rendezvous; ``moelab slurm`` writes the sbatch script that does it per node. A bare
``torchrun ... -m moelab.runtime.worker --config C --out DIR`` on each node works too: the ranks
complete the folder themselves, on the node that holds rank 0.
"""
from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from moelab.config import ConfigError, RunConfig
from moelab.runtime.checkpoint import latest_checkpoint, read_meta
from moelab.runtime.failures import (
    RunFailed,
    RunInterrupted,
    RunTimeout,  # noqa: F401 - raised here, importable from here as before
    failure,
    read_text,
    tail,
    timed_out,
)
from moelab.runtime.memory import fits_memory
from moelab.runtime.preflight import serve_errors
from moelab.runtime.processes import dump_stacks, kill, rank_pids
from moelab.runtime.progress import Progress, parse_progress
from moelab.runtime.results import RunResult, atomic_write_json, atomic_write_text, backend_of, stale_version
from moelab.runtime.runfolder import NODE_RANK_ENV

DEFAULT_WORKER = "moelab.runtime.worker"
SERVE_WORKER = "moelab.runtime.serve"  # ``moelab serve``: the serving path instead of training
_ENTRY = "moelab.runtime.launch"
_GUARD = "moelab.runtime.guard"  # stops everything if this process dies mid-run (a restarted kernel)
_SIDE_ENV = "MOELAB_LAUNCH_SIDE"  # the per-rank entry writes pids and failure records here


# ---- the launcher ------------------------------------------------------------------------------
def resolve_config(config, nproc: int | None = None, overrides: dict | None = None, **kw) -> RunConfig:
    """RunConfig / dict / YAML path + dotted overrides + nproc -> a validated RunConfig."""
    if isinstance(config, RunConfig):
        cfg = config
    elif isinstance(config, dict):
        cfg = RunConfig.from_dict(config)
    elif isinstance(config, (str, os.PathLike)):
        cfg = RunConfig.load(config)
    else:
        raise TypeError(f"config must be a RunConfig, a dict or a YAML path, got {type(config).__name__}")
    items = dict(overrides or {})
    items.update({k.replace("__", "."): v for k, v in kw.items()})
    if nproc is not None:
        items["parallel.nproc"] = nproc
    return cfg.with_overrides(items).validate()


def resume_config(resume, config=None, out_root="runs") -> tuple:
    """(config, checkpoint folder) to continue ``resume``: a checkpoint folder, a run folder or a run
    id under ``out_root`` (its latest checkpoint). Without ``config`` the checkpoint's own config is
    the base; overrides then change what may change (iters, nproc with the global batch kept, ...)."""
    p = Path(resume)
    if not p.exists() and (Path(out_root) / str(resume)).exists():
        p = Path(out_root) / str(resume)
    ckpt = latest_checkpoint(p)
    if ckpt is None:
        raise ConfigError(f"resume: no checkpoint in {resume} (run with train.checkpoint_every > 0 to write them)")
    if config is None:
        config = read_meta(ckpt)["config"]
        config["train"]["resume_from"] = None
    return config, ckpt.resolve()


def launch(config=None, nproc: int | None = None, *, overrides: dict | None = None, out_root="runs",
           timeout: float | None = None, progress: bool = True, worker: str = DEFAULT_WORKER,
           reuse: bool = False, resume=None, nodes: Nodes | None = None, shared_fs: bool = False,
           **kw_overrides) -> RunResult | None:
    """Run ``config`` on ``nproc`` local ranks and return the stored run.

    ``overrides`` (``{"model.moe.top_k": 1}``) and keyword overrides (``train__iters=5``) are
    applied before validation. ``timeout`` defaults to ``train.timeout_s``. ``reuse=True``
    returns an existing completed run with the same id without running anything, unless an older
    moelab version made it (then it says so and runs again). ``resume``
    (a run folder, run id or checkpoint folder) continues that run's latest checkpoint, at this
    ``nproc`` if given (keep ``nproc x train.batch_size``); ``config`` then defaults to its config.

    ``nodes`` (:class:`Nodes`) makes this machine one node of a multi-node run: call ``launch`` on
    every node with the same config; ``nproc`` ranks in all, ``nproc / nodes.nnodes`` here. The
    run folder is completed on node 0 (the others return None). ``shared_fs=True``: every
    rank writes into the run folder itself instead of sending its files to rank 0.
    """
    if resume is not None:
        config, ckpt = resume_config(resume, config, out_root)
        overrides = {**(overrides or {}), "train.resume_from": str(ckpt)}
    elif config is None:
        raise TypeError("launch needs a config (or resume=RUN)")
    cfg = resolve_config(config, nproc, overrides, **kw_overrides)
    if nodes is not None:
        cfg = nodes.config(cfg)
    if backend_of(cfg) == "gloo":  # CPU ranks share this machine's memory: refuse what cannot fit
        fits_memory(cfg, cfg.parallel.nproc // (nodes.nnodes if nodes is not None else 1))
    if worker == SERVE_WORKER:
        errs = serve_errors(cfg)
        if errs:
            raise ConfigError("invalid serve config:\n  - " + "\n  - ".join(errs))
        cfg = cfg.with_overrides({"name": cfg.name if cfg.name.startswith("serve") else f"serve-{cfg.name}"})
    run_id = cfg.run_id()
    final = Path(out_root) / run_id
    if reuse and (final / "summary.json").is_file():
        stored = RunResult(final)
        stale = stale_version(stored.summary.get("moelab_version"))
        if stale is None:
            return stored
        print(f"moelab: not re-using the stored run {run_id}: {stale}; running it again", file=sys.stderr, flush=True)
    tmp = (Path(out_root) / f".tmp-{run_id}-{os.getpid()}").resolve()
    shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier, killed launcher with our pid
    side = tmp / ".launch"
    try:
        side.mkdir(parents=True)
    except OSError as e:
        raise ConfigError(f"the results root {out_root} is not writable here: {e}") from None
    try:
        atomic_write_json(tmp / "config.json", cfg.to_dict())
        timeout = cfg.train.timeout_s if timeout is None else timeout
        command = torchrun_command(cfg.parallel.nproc, worker, tmp / "config.json", tmp, nodes, timeout)
        command += ["--shared-fs"] if shared_fs else []
        _run(cfg, run_id, tmp, side, command, timeout, progress, nodes)
        shutil.rmtree(side)
        if not (tmp / "summary.json").is_file():  # the worker completes the folder on node 0
            if nodes is not None:
                return None
            raise RunFailed(run_id, None, "", f"finished without a summary.json: {worker} does not complete "
                            "its run folder (moelab.runtime.runfolder.RunFolder)")
        _swap_in(tmp, final)
    except RunFailed as e:
        kept = _keep_checkpoints(tmp, Path(out_root) / f"{run_id}.partial")
        if kept is not None:
            e.args = (f"{e.args[0]}\ncheckpoints kept in {kept}: continue with `moelab run --resume {kept}`",)
        raise
    except KeyboardInterrupt:  # _run has stopped every process already
        kept = _keep_checkpoints(tmp, Path(out_root) / f"{run_id}.partial")
        raise RunInterrupted(run_id, cfg.parallel.nproc, kept) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a success
    return RunResult(final)


def _keep_checkpoints(tmp: Path, dest: Path) -> Path | None:
    """A failed run's checkpoints (and config) survive in ``dest`` (not a completed run: never listed)."""
    if latest_checkpoint(tmp) is None:
        return None
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    shutil.copy2(tmp / "config.json", dest / "config.json")
    os.replace(tmp / "checkpoints", dest / "checkpoints")
    return dest


@dataclass(frozen=True)
class Nodes:
    """This machine as node ``node_rank`` of ``nnodes``, meeting the others at the c10d rendezvous
    ``rdzv`` (``HOST:PORT`` of the first node). torchrun's c10d rendezvous orders the nodes itself
    (by host name), so rank 0 may be on any node; the run folder is completed on node 0 all the same
    (:func:`moelab.runtime.runfolder.writer_rank`)."""

    nnodes: int
    node_rank: int
    rdzv: str

    def __post_init__(self):
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in [0, {self.nnodes}) for --nnodes {self.nnodes}, "
                              f"got {self.node_rank}")
        host, _, port = self.rdzv.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--rdzv must be HOST:PORT (the first node and a free port), got {self.rdzv!r}")

    def not_met(self, run_id: str, timeout: float, torchrun_stderr: str) -> RunFailed:
        """The nodes never met: no rank started on this node."""
        return RunFailed(run_id, None, tail(torchrun_stderr, 8),
                         f"did not start: the c10d rendezvous at {self.rdzv} did not gather {self.nnodes} nodes within "
                         f"{timeout:g}s (start the same command on every node, with the same --nnodes and --rdzv; "
                         "the first node must be reachable on that port)")

    def config(self, cfg: RunConfig) -> RunConfig:
        """The config on a cluster: ``parallel.topology.nodes`` is the node count (set when left at 1)."""
        p = cfg.parallel
        if p.nproc % self.nnodes:
            raise ConfigError(f"parallel.nproc={p.nproc} ranks do not split evenly over --nnodes {self.nnodes}")
        if p.topology.nodes not in (1, self.nnodes):
            raise ConfigError(f"parallel.topology.nodes={p.topology.nodes} but --nnodes {self.nnodes}: "
                              "the topology must be the real one on a cluster")
        return cfg.with_overrides({"parallel.topology.nodes": self.nnodes}).validate()

    def torchrun_args(self, timeout: float) -> list[str]:
        return ["--nnodes", str(self.nnodes), "--rdzv-backend", "c10d",  # c10d ignores --node-rank
                "--rdzv-endpoint", self.rdzv, "--rdzv-id", "moelab", "--rdzv-conf", f"join_timeout={int(timeout)}"]


def torchrun_command(nproc: int, worker: str, config_path: Path, out_dir: Path, nodes: Nodes | None = None,
                     join_timeout: float = 300) -> list[str]:
    where = ["--standalone", "--nnodes", "1"] if nodes is None else nodes.torchrun_args(join_timeout)
    per_node = nproc if nodes is None else nproc // nodes.nnodes
    return [sys.executable, "-m", "torch.distributed.run", *where, "--nproc-per-node", str(per_node),
            "--max-restarts", "0", "-m", _ENTRY, worker, "--config", str(config_path), "--out", str(out_dir)]


def _run(cfg: RunConfig, run_id: str, tmp: Path, side: Path, command: list[str], timeout: float,
         show: bool, nodes: Nodes | None = None) -> None:
    """Start torchrun, stream the writer's progress, enforce the deadline; raise unless it succeeded
    (the run's wall time is the worker's, in its summary)."""
    extra_env = None if nodes is None else {NODE_RANK_ENV: str(nodes.node_rank)}
    logs = tmp / "logs"
    logs.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.train.threads_per_rank),
           "PYTHONUNBUFFERED": "1", _SIDE_ENV: str(side), **(extra_env or {})}
    bar = Progress(f"{cfg.paper}/{cfg.name} x{cfg.parallel.nproc}", enabled=show)
    deadline = time.monotonic() + timeout
    with open(logs / "torchrun.stderr", "wb") as err, open(logs / "stdout.log", "w") as out:
        guarded = [sys.executable, "-m", _GUARD, str(os.getpid()), str(side), str(tmp), "--", *command]
        proc = subprocess.Popen(guarded, stdout=subprocess.PIPE, stderr=err, env=env, text=True, bufsize=1,
                                start_new_session=True)
        try:
            finished = _pump(_lines(proc.stdout), deadline, bar, out)
            rc = proc.wait(timeout=max(deadline - time.monotonic(), 0)) if finished else None
        except subprocess.TimeoutExpired:
            rc = None
        except BaseException:  # Ctrl-C in a notebook: leave nothing running
            kill(proc, side)
            raise
        finally:
            bar.close()
        if rc == 0:
            return
        if rc is None:
            dump_stacks(side)
        kill(proc, side)  # after a failure torchrun stopped the ranks already; make sure
        if nodes is not None and not rank_pids(side):
            raise nodes.not_met(run_id, timeout, read_text(logs / "torchrun.stderr"))
        if rc is None:
            here = cfg.parallel.nproc // (nodes.nnodes if nodes is not None else 1)
            raise timed_out(run_id, timeout, logs, side, here)
        e = failure(run_id, rc, logs, side)
        if nodes is not None and e.rank is not None and "no Python exception" not in str(e):
            e.args = (f"{e.args[0]}\n(in a multi-node run this often follows a failure on another node: "
                      "see that node's output)",)
        raise e


def _lines(stream) -> queue.Queue:
    """Read a pipe on a thread, so the main loop can watch the clock; None marks the end."""
    q: queue.Queue = queue.Queue()

    def read():
        with stream:
            for line in stream:
                q.put(line)
        q.put(None)

    threading.Thread(target=read, daemon=True).start()
    return q


def _pump(lines: queue.Queue, deadline: float, bar: Progress, out) -> bool:
    """Feed stdout to the bar and the log until it closes (True) or the deadline passes (False)."""
    while True:
        try:
            line = lines.get(timeout=max(min(0.2, deadline - time.monotonic()), 0.001))
        except queue.Empty:
            if time.monotonic() >= deadline:
                return False
            continue
        if line is None:
            return True
        out.write(line)
        rec = parse_progress(line)
        if rec is not None:
            bar.update(rec)
        else:
            bar.write(line.rstrip("\n"))


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename the finished folder into place; an older run with the same id is replaced whole."""
    old = final.with_name(f".old-{final.name}-{os.getpid()}") if final.exists() else None
    if old is not None:
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- the per-rank entry (python -m moelab.runtime.launch <worker> args...) ----------------------
def _rank_main(argv: list[str]) -> None:
    """Run the worker module as ``__main__`` with the launcher's hooks (see the module docstring)."""
    import faulthandler
    import runpy

    worker, args = argv[0], argv[1:]
    rank = int(os.environ.get("RANK", "0"))
    side = Path(os.environ[_SIDE_ENV]) if os.environ.get(_SIDE_ENV) else None
    if side is not None:
        _die_with_parent()
        err = open(side.parent / "logs" / f"rank{rank}.stderr", "w", buffering=1)
        os.dup2(err.fileno(), 2)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # before the pid is known: SIGUSR1 would kill
        atomic_write_text(side / f"pid_rank{rank}", str(os.getpid()))
    sys.argv = [worker, *args]
    try:
        runpy.run_module(worker, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (None, 0):
            _record_failure(side, rank, e)
        raise
    except BaseException as e:
        _record_failure(side, rank, e)
        raise


def _record_failure(side: Path | None, rank: int, exc: BaseException) -> None:
    """Write the rank's traceback, without this entry's and runpy's frames, with a precise time."""
    import traceback

    if side is None:
        return
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    atomic_write_json(side / f"failure_rank{rank}.json", {"rank": rank, "time": time.time(), "traceback": text})


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when torchrun dies, so a killed launch leaves no orphans."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
