"""torchrun entry point of one rank: ``python -m moelab.runtime.worker --config C --out DIR [--set k=v]``.

``C`` is a resolved JSON config (what the launcher writes) or an experiment YAML; ``--set``
applies dotted overrides. On a GPU cluster this is the whole entry point: on every node run
``torchrun --nnodes N --node-rank K --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT
-m moelab.runtime.worker --config experiments/core/quickstart.yaml --set parallel.nproc=N*G
--set parallel.topology.nodes=N --out runs/NAME``.

Joins the process group from torchrun's environment (NCCL when CUDA is there and the backend is
``auto``, else gloo), trains, writes its outputs into ``--out`` and prints progress lines from rank
0 (``MOELAB_PROGRESS iter=.. total=.. loss=.. step_time=..``) that the launcher turns into a
progress bar. The run folder is completed here, by the ranks (:mod:`moelab.runtime.runfolder`):
the writer (rank 0, or node 0's first rank under ``moelab run --nnodes``) writes ``config.json`` at
start and ``summary.json`` last, after every rank's files have reached it over the process group.
Any exception propagates: torchrun reports the failing rank and the launcher stops the others.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from moelab.config import RunConfig
from moelab.runtime.results import backend_of
from moelab.runtime.runfolder import RunFolder
from moelab.runtime.train import Trainer

WORKER = "moelab.runtime.worker"


def load_config(path: str, sets=()) -> RunConfig:
    """A worker's config: the launcher's resolved JSON or an experiment YAML, ``--set`` overrides applied."""
    if path.endswith(".json"):
        with open(path) as f:
            cfg = RunConfig.from_dict(json.load(f))
    else:
        cfg = RunConfig.load(path)
    return cfg.with_overrides(dict(kv.split("=", 1) for kv in sets)).validate()


def main(argv=None) -> None:
    started = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted config override")
    ap.add_argument("--shared-fs", action="store_true",
                    help="every rank writes into --out itself (no gathering to rank 0)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.set)
    torch.set_num_threads(cfg.train.threads_per_rank)
    backend = backend_of(cfg)
    device = torch.device("cpu")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    dist.init_process_group(backend, timeout=timedelta(seconds=max(60.0, cfg.train.timeout_s)))
    try:
        with RunFolder.start(cfg, args.out, WORKER, shared_fs=args.shared_fs, started=started) as folder:
            trainer = Trainer.build(cfg, device)
            trainer.out_dir = args.out  # checkpoints go into the run folder
            total = cfg.train.iters

            def progress(row):
                if folder.rank == folder.writer:  # node 0 shows the progress bar
                    print(f"MOELAB_PROGRESS iter={row['iter']} total={total} loss={row['loss']:.6f} "
                          f"step_time={row['step_time_s']:.6f}", flush=True)

            trainer.run(progress)
            trainer.write_outputs(folder.dir)
            folder.finish()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
