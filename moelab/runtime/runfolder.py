"""A run folder completed by the ranks themselves, on one machine or on many.

Every worker (training, serving) opens a :class:`RunFolder` right after joining the process group
and calls :meth:`RunFolder.finish` after writing its outputs, so a run started by
``moelab.launch``, ``moelab run`` or a bare ``torchrun`` on many nodes ends the same way:

- **start**: all ranks exchange their config hash, moelab version, host name and whether they can
  write where they must (one object all-gather); any mismatch stops every rank with the same
  message. Then the *writer* writes ``config.json``: rank 0, or under ``moelab run --nnodes`` the
  first rank of the node started as ``--node-rank 0`` (:func:`writer_rank`).
- each rank writes its outputs into :attr:`RunFolder.dir`: ``--out`` for the writer, and for the
  other ranks a private temp folder on their own disk, so a cluster needs no shared filesystem
  (``shared_fs=True``: every rank writes into ``--out`` directly);
- **finish**: the other ranks send their files to the writer over the process group in chunks
  (object gather: gloo or NCCL) and delete their temp folder; after everyone is done, the writer
  writes ``summary.json`` last, atomically. Until then the folder is not a completed run
  (:class:`~moelab.runtime.results.RunResult` refuses it, ``moelab runs`` skips it).

Checkpoints (``train.checkpoint_every``) are written by every rank into ``--out/checkpoints``:
across nodes they need a shared filesystem.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from moelab import __version__
from moelab.config import RunConfig
from moelab.runtime.results import atomic_write_bytes, atomic_write_json, summarize

CHUNK_BYTES = 4 << 20  # one gather round moves at most this much per rank
NODE_RANK_ENV = "MOELAB_NODE_RANK"  # set by moelab's launcher: the node's --node-rank


def writer_rank(node_ranks: list) -> int:
    """The rank that completes the folder: the first rank on the node started as ``--node-rank 0``
    (torchrun's c10d rendezvous orders nodes by host name, so that node need not hold rank 0);
    rank 0 where the nodes are not known (a bare torchrun)."""
    return next((r for r, n in enumerate(node_ranks) if n is not None and str(n) == "0"), 0)


class RunMismatch(RuntimeError):
    """The ranks of one run disagree (config, version, world size) or cannot write their results."""


def agreement_errors(facts: list[dict], nproc: int) -> list[str]:
    """What stops a run before it starts, from every rank's facts (``hash``, ``version``, ``host``,
    ``error``): the same config and moelab version everywhere, ``parallel.nproc`` ranks, and every
    rank able to write where it must. Pure, so it is tested without processes."""
    errs = []
    ref = facts[0]
    if len(facts) != nproc:
        errs.append(f"the process group has {len(facts)} ranks but the config says parallel.nproc={nproc}")
    for key, what in (("hash", "config (hash)"), ("version", "moelab version")):
        odd = [r for r, f in enumerate(facts) if f[key] != ref[key]]
        if odd:
            where = ", ".join(f"rank {r} on {facts[r]['host']}: {facts[r][key]}" for r in odd[:4])
            errs.append(f"ranks disagree on the {what}: rank 0 on {ref['host']} has {ref[key]}, {where}"
                        + (" — start every node with the same config and --set options" if key == "hash" else ""))
    errs += [f"rank {r} on {f['host']}: {f['error']}" for r, f in enumerate(facts) if f.get("error")]
    return errs


def host_label(label: str, hosts: list) -> str:
    """A run's label with its hosts when it ran on more than one (``REAL: 16 ranks, 2 nodes x 8,
    nccl on gpu01, gpu02``); one machine keeps the label every figure already shows."""
    distinct = list(dict.fromkeys(hosts))
    if len(distinct) < 2:
        return label
    return f"{label} on {', '.join(distinct[:4])}" + (f" and {len(distinct) - 4} more" if len(distinct) > 4 else "")


def kernels() -> str:
    """This process's torch and the CPU kernels it dispatches to (``"2.13.0+cpu AVX2"``). A run repeats bit for
    bit on one machine, but the kernels' instruction set changes the float rounding (measured: Lina's smoke
    inference model, 20 steps on 4 gloo ranks, the same losses twice on AVX2; under ``ATEN_CPU_CAPABILITY=default``
    they differ from the second step on, by up to 2.4e-7), so a model trained on another CPU drifts apart
    over a long run; each summary records the kernels."""
    import torch

    return f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()}"


@dataclass
class RunFolder:
    """This rank's side of a run folder (see the module docstring)."""

    out: Path
    cfg: RunConfig
    worker: str
    rank: int
    hosts: list = field(default_factory=list)
    kernels: list = field(default_factory=list)  # the ranks' torch CPU kernels (see kernels())
    shared_fs: bool = False
    started: float = field(default_factory=time.monotonic)
    staging: Path | None = None  # a private temp folder (ranks > 0 without a shared filesystem)
    writer: int = 0  # the rank that completes the folder

    @classmethod
    def start(cls, cfg: RunConfig, out, worker: str, shared_fs: bool = False,
              started: float | None = None) -> "RunFolder":
        """Check that every rank agrees and can write, then (the writer) write ``config.json``. A
        collective: call it on every rank right after ``init_process_group``; use it as a context
        manager so the rank's temp folder goes whatever happens."""
        rank, world = dist.get_rank(), dist.get_world_size()
        folder = cls(Path(out), cfg, worker, rank, shared_fs=shared_fs,
                     started=time.monotonic() if started is None else started)
        mine = {"hash": cfg.short_hash(), "version": __version__, "host": socket.gethostname(),
                "node": os.environ.get(NODE_RANK_ENV), "kernels": kernels()}
        facts: list = [None] * world
        dist.all_gather_object(facts, mine)
        folder.hosts = [f["host"] for f in facts]
        folder.kernels = sorted({f["kernels"] for f in facts})
        folder.writer = writer_rank([f["node"] for f in facts])
        created = not folder.out.exists()
        errors: list = [None] * world
        dist.all_gather_object(errors, folder._prepare())
        errs = agreement_errors([{**f, "error": e} for f, e in zip(facts, errors)], cfg.parallel.nproc)
        if errs:
            folder.close()
            if created and folder.writes_out:  # leave no empty folder behind
                shutil.rmtree(folder.out, ignore_errors=True)
            raise RunMismatch("the ranks of this run cannot start together:\n  - " + "\n  - ".join(errs))
        if rank == folder.writer:
            atomic_write_json(folder.out / "config.json", cfg.to_dict())
        return folder

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def writes_out(self) -> bool:
        return self.rank == self.writer or self.shared_fs

    @property
    def dir(self) -> str:
        """Where this rank writes its outputs."""
        return str(self.out if self.staging is None else self.staging)

    def _prepare(self) -> str | None:
        """Make this rank's output place; an error message instead of an exception, so that every
        rank learns about it in the agreement exchange."""
        try:
            if self.writes_out:
                self.out.mkdir(parents=True, exist_ok=True)
                probe = self.out / f".probe-rank{self.rank}"
                probe.write_bytes(b"")
                probe.unlink()
            else:
                self.staging = Path(tempfile.mkdtemp(prefix=f"moelab-rank{self.rank}-"))
        except OSError as e:
            return f"cannot write its results to {self.out if self.writes_out else tempfile.gettempdir()}: {e}"
        return None

    def finish(self) -> dict | None:
        """Bring every rank's files to the writer, which then writes ``summary.json`` and returns it
        (None elsewhere). A collective."""
        self._gather_files()
        dist.barrier()  # with a shared filesystem: every rank's files are in place
        summary = None
        if self.rank == self.writer:
            summary = summarize(self.out, self.cfg, time.monotonic() - self.started, self.worker)
            summary["hosts"] = self.hosts
            summary["kernels"] = self.kernels
            summary["label"] = host_label(summary["label"], self.hosts)
            atomic_write_json(self.out / "summary.json", summary)
        self.close()
        return summary

    def close(self) -> None:
        """Remove this rank's temp folder (after a success or a failure)."""
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None

    def _gather_files(self) -> None:
        """Every file under a rank's temp folder arrives under the same relative name in the writer's
        ``--out``, in chunks of at most :data:`CHUNK_BYTES` per rank and round; each file is written
        atomically once whole, and a name the writer already has is an error (no silent overwrite)."""
        files = sorted(p for p in self.staging.rglob("*") if p.is_file()) if self.staging is not None else []
        counts: list = [None] * dist.get_world_size()
        dist.all_gather_object(counts, sum(max(-(-f.stat().st_size // CHUNK_BYTES), 1) for f in files))
        pieces = _pieces(self.staging, files)  # read one chunk per round, not every file at once
        parts: dict = {}
        for _ in range(max(counts)):
            got = [None] * len(counts) if self.rank == self.writer else None
            dist.gather_object(next(pieces, None), got, dst=self.writer)
            for src, piece in enumerate(got or []):
                if piece is None:
                    continue
                name, data, last = piece
                parts.setdefault((src, name), []).append(data)
                if last:
                    dest = self.out / name
                    if dest.exists():
                        raise RunMismatch(f"rank {src} wrote {name}, which rank {self.writer} has written too")
                    atomic_write_bytes(dest, b"".join(parts.pop((src, name))))


def _pieces(root: Path, files: list):
    """(name relative to ``root``, bytes, is-last-piece) of each file, at most CHUNK_BYTES each; an
    empty file is one empty piece."""
    for path in files:
        name, size = path.relative_to(root).as_posix(), path.stat().st_size
        with open(path, "rb") as f:
            for start in range(0, max(size, 1), CHUNK_BYTES):
                yield name, f.read(CHUNK_BYTES), start + CHUNK_BYTES >= size
