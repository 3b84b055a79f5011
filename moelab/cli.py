"""``moelab`` command line: run, serve, list and reproduce on local ranks or cluster nodes.

``run``/``serve`` on this machine or, with ``--nnodes/--node-rank/--rdzv``, as one node of a cluster
run; ``slurm`` writes the sbatch script for that; ``runs`` lists stored runs; ``reproduce`` executes
notebooks; ``report`` rebuilds their report or writes one paper's section as one file; ``plan`` ranks the
compatible technique combinations for a model preset on a cluster profile (SIMULATED, :mod:`moelab.sim.plan`).

Exit codes: 0 success (``run`` prints the run folder), 1 a rank failed or the run timed out
(the rank and its traceback tail go to stderr), 2 an invalid config or command line.
"""
from __future__ import annotations

import argparse
import sys

from moelab.config import ConfigError, RunConfig
from moelab.models.presets import preset as get_preset
from moelab.runtime.results import atomic_write_text, list_runs
from moelab.runtime.slurm import sbatch_script


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moelab", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="run a config on local ranks (torchrun) and store the results")
    run.add_argument("config", nargs="?", help="YAML config, e.g. experiments/core/quickstart.yaml "
                     "(default with --resume: the resumed run's config)")
    run.add_argument("--nproc", type=int, help="ranks (default: parallel.nproc of the config)")
    run.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                     help="dotted override, repeatable: --set model.moe.top_k=1")
    run.add_argument("--timeout", type=float, help="seconds (default: train.timeout_s)")
    run.add_argument("--out-root", default="runs", help="results root (default: runs)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--reuse", action="store_true", help="return a completed run with the same id")
    run.add_argument("--worker", default=None, help="worker module (default: moelab.runtime.worker)")
    run.add_argument("--resume", metavar="RUN", help="continue RUN (a run folder or id) from its latest checkpoint")
    run.add_argument("--preset", help="a real MoE model's shape (moelab.models.presets: switch_base_128, "
                     "mixtral_8x7b, deepseek_v3, qwen3_30b_a3b) on top of the config (or the defaults)")
    run.add_argument("--scale", type=float, default=1.0,
                     help="with --preset: widths, heads and layers times this (e.g. 0.01); experts and top-k kept")
    _node_arguments(run)

    srv = sub.add_parser("serve", help="serve requests with a (trained) model on local ranks and store the records")
    srv.add_argument("config", help="YAML config with a serve section, e.g. experiments/lina/serve.yaml")
    srv.add_argument("--nproc", type=int, help="ranks (default: parallel.nproc of the config)")
    srv.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                     help="dotted override, repeatable: --set serve.strategy_options.variant=lina")
    srv.add_argument("--timeout", type=float, help="seconds (default: train.timeout_s)")
    srv.add_argument("--out-root", default="runs", help="results root (default: runs)")
    srv.add_argument("--no-progress", action="store_true", help="no progress bar")
    _node_arguments(srv)

    slurm = sub.add_parser("slurm", help="write an sbatch script that runs a config on N GPU nodes")
    slurm.add_argument("config", help="YAML config (a path the nodes can read)")
    slurm.add_argument("--nodes", type=int, required=True, help="nodes of the allocation")
    slurm.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (ranks) per node")
    slurm.add_argument("--partition", help="SLURM partition")
    slurm.add_argument("--time", help="SLURM time limit, e.g. 02:00:00")
    slurm.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                       help="dotted override, repeatable")
    slurm.add_argument("--out-root", default="runs", help="results root on the node that holds rank 0")
    slurm.add_argument("--job-name", default="moelab")
    slurm.add_argument("--port", type=int, default=29500, help="rendezvous port on the first node")
    slurm.add_argument("--write", metavar="FILE", help="write the script here (default: standard output)")

    runs = sub.add_parser("runs", help="list completed runs")
    runs.add_argument("--root", default="runs", help="results root (default: runs)")

    pl = sub.add_parser("plan", help="rank the compatible technique combinations for a model on a cluster (SIMULATED)")
    pl.add_argument("--model", required=True, help="a preset (moelab.models.presets), e.g. mixtral_8x7b")
    pl.add_argument("--profile", required=True, help="a cluster profile (moelab.sim.profiles), e.g. hecate_B")
    pl.add_argument("--nodes", type=int, help="nodes of the profile's cluster (default: the profile's)")
    pl.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the synthetic expert loads")
    pl.add_argument("--layers", type=int, help="Transformer layers priced (default: the preset's)")
    pl.add_argument("--tokens-per-gpu", type=int, default=4096, help="tokens per GPU per step (default 4096)")
    pl.add_argument("--experts-per-gpu", type=int, help="experts = this x GPUs (default: the preset's count "
                    "where it divides over the GPUs)")
    pl.add_argument("--top", type=int, help="print the best K only")
    pl.add_argument("--json", metavar="FILE", help="also write the plan (every row, refused ones too) as JSON")

    # here, not at the top: the reproduction kit loads plotly (papermill only when notebooks run)
    from moelab.papers.kit import publish, reproduce

    rep = sub.add_parser("reproduce", help="execute notebooks at a scale with papermill and write an HTML report")
    reproduce.add_arguments(rep)
    rpt = sub.add_parser("report", help="rebuild the HTML report, or write a paper's section as one file or a zip")
    publish.add_arguments(rpt)

    args = ap.parse_args(argv)
    if args.cmd == "slurm":
        return _slurm(ap, args)
    if args.cmd == "reproduce":
        return reproduce.main(args)
    if args.cmd == "report":
        return publish.main(args)
    if args.cmd == "plan":
        return _plan(args)
    if args.cmd == "serve":
        from moelab.runtime.launch import SERVE_WORKER  # here: the launcher imports torch; --help, runs do not

        args.worker, args.reuse, args.resume = SERVE_WORKER, False, None
        return _run(ap, args)
    return _run(ap, args) if args.cmd == "run" else _runs(args)


def _run(ap: argparse.ArgumentParser, args) -> int:
    from moelab.runtime.launch import DEFAULT_WORKER, RunFailed, launch  # here: it imports torch; --help, runs do not

    overrides = {}
    for item in args.sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            ap.error(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value
    preset = getattr(args, "preset", None)
    if args.config is None and args.resume is None and preset is None:
        ap.error("run needs a config (or --resume RUN, or --preset NAME)")
    try:
        if preset is not None:
            args.config = get_preset(preset).config(RunConfig.load(args.config) if args.config else None, args.scale)
        nodes = _nodes(ap, args)
        result = launch(args.config, args.nproc, overrides=overrides, out_root=args.out_root,
                        timeout=args.timeout, progress=not args.no_progress,
                        worker=args.worker or DEFAULT_WORKER, reuse=args.reuse, resume=args.resume,
                        nodes=nodes, shared_fs=args.shared_fs)
    except (ConfigError, FileNotFoundError) as e:
        print(f"moelab: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"moelab: {e}", file=sys.stderr)
        return 1
    if result is None:
        print(f"moelab: node {args.node_rank} finished; node 0 holds the run folder (under its {args.out_root}/)",
              file=sys.stderr)
        return 0
    print(result.path)
    return 0


def _plan(args) -> int:
    import json

    from moelab.sim.plan import format_table, plan

    try:
        p = plan(args.model, args.profile, args.nodes, skew=args.skew, layers=args.layers,
                 tokens_per_gpu=args.tokens_per_gpu, experts_per_gpu=args.experts_per_gpu, progress=True)
    except ConfigError as e:
        print(f"moelab: {e}", file=sys.stderr)
        return 2
    print(format_table(p, args.top))
    if args.json:
        atomic_write_text(args.json, json.dumps(p.to_json(), indent=1))
    if not p.ranked():
        print(f"moelab: {args.model} fits no combination on {p.profile} x{p.nodes} in memory", file=sys.stderr)
        return 2
    return 0


def _node_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-node (run the same command on every node)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes in the run (default 1: this machine only)")
    g.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1")
    g.add_argument("--rdzv", metavar="HOST:PORT", help="c10d rendezvous on the first node (needed with --nnodes > 1)")
    g.add_argument("--shared-fs", action="store_true",
                   help="every rank writes into the run folder itself (a shared filesystem); default: "
                        "rank 0 gathers every rank's files over the process group")


def _nodes(ap: argparse.ArgumentParser, args):
    from moelab.runtime.launch import Nodes  # here: it imports torch; --help, runs do not

    if args.nnodes == 1 and args.node_rank == 0 and args.rdzv is None:
        return None
    if args.rdzv is None:
        ap.error("--nnodes/--node-rank need --rdzv HOST:PORT (the first node's address and a free port)")
    return Nodes(args.nnodes, args.node_rank, args.rdzv)


def _slurm(ap: argparse.ArgumentParser, args) -> int:
    try:
        text = sbatch_script(args.config, args.nodes, args.gpus_per_node, sets=args.sets, partition=args.partition,
                             time=args.time, out_root=args.out_root, job_name=args.job_name, port=args.port)
    except ConfigError as e:
        print(f"moelab: {e}", file=sys.stderr)
        return 2
    if args.write:
        atomic_write_text(args.write, text)
        print(args.write)
    else:
        print(text, end="")
    return 0


def _runs(args) -> int:
    frame = list_runs(args.root)
    if frame.empty:
        print(f"no completed runs under {args.root}")
        return 0
    cols = [c for c in ("run_id", "label", "iters", "final_loss", "mean_step_time_s", "wall_time_s", "created")
            if c in frame]
    print(frame[cols].to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
