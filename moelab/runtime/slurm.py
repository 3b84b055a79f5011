"""``moelab slurm``: an sbatch script that runs one config on a SLURM allocation of N GPU nodes.

The pattern the large training frameworks document: one ``srun`` task per node, each running
torchrun (here through ``moelab run``, so every node gets moelab's supervision) with the c10d
rendezvous on the allocation's first node. The ranks complete the run folder themselves and gather
every rank's files to rank 0 (:mod:`moelab.runtime.runfolder`), so no shared filesystem is needed
for the results; checkpoints need one. moelab's tests have no SLURM: the script is checked by
``bash -n`` and by its lines, not by a scheduler.
"""
from __future__ import annotations

import re
import shlex

from moelab.config import ConfigError

RDZV_PORT = 29500
CUDA_NOTE = ("# torch must be a CUDA build on the nodes: `pip install torch` (the CUDA wheels), not the CPU\n"
             "# build moelab's CI pins; NCCL is chosen by parallel.backend=auto when CUDA is present.")


def sbatch_script(config: str, nodes: int, gpus_per_node: int, *, sets=(), partition: str | None = None,
                  time: str | None = None, out_root: str = "runs", job_name: str = "moelab",
                  cpus_per_task: int | None = None, python: str = "python", port: int = RDZV_PORT) -> str:
    """The sbatch script's text. ``sets`` are ``KEY=VALUE`` overrides; ``parallel.nproc`` and
    ``parallel.topology.nodes`` are set from ``nodes x gpus_per_node``."""
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes and --gpus-per-node must be >= 1, got {nodes} and {gpus_per_node}")
    if time is not None and not re.fullmatch(r"(\d+-)?\d+(:\d\d){0,2}", time):
        raise ConfigError(f"--time must be SLURM's [D-]HH[:MM[:SS]] or minutes, got {time!r}")
    if not 0 < port < 65536:
        raise ConfigError(f"rendezvous port must be in 1..65535, got {port}")
    sets = [*sets, f"parallel.nproc={nodes * gpus_per_node}", f"parallel.topology.nodes={nodes}"]
    head = [f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --gpus-per-node={gpus_per_node}", "#SBATCH --output=%x-%j.out"]
    if cpus_per_task:
        head.append(f"#SBATCH --cpus-per-task={cpus_per_task}")
    if partition:
        head.append(f"#SBATCH --partition={partition}")
    if time:
        head.append(f"#SBATCH --time={time}")
    run = [python, "-m", "moelab.cli", "run", config, "--out-root", out_root, "--no-progress",
           *[a for kv in sets for a in ("--set", kv)], "--nnodes", str(nodes)]
    return "\n".join([
        "#!/bin/bash", *head, "", CUDA_NOTE, "set -euo pipefail", "",
        "# the rendezvous: the allocation's first node hosts torchrun's c10d store",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"rdzv_port={port}", "",
        "# one task per node; each runs torchrun (through moelab's launcher) with its node rank",
        f"srun --nodes={nodes} --ntasks-per-node=1 bash -c 'exec \"$@\" --node-rank \"$SLURM_NODEID\"' moelab-node \\",
        f"  {shlex.join(run)} --rdzv \"$head_node:$rdzv_port\"",
        "",
    ])
