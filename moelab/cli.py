"""``moelab`` command line: run a config on local ranks, serve requests, list stored runs, reproduce notebooks.

Exit codes: 0 success (``run`` prints the run folder), 1 a rank failed or the run timed out
(the rank and its traceback tail go to stderr), 2 an invalid config or command line.
"""
from __future__ import annotations

import argparse
import sys

from moelab.config import ConfigError


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

    srv = sub.add_parser("serve", help="serve requests with a (trained) model on local ranks and store the records")
    srv.add_argument("config", help="YAML config with a serve section, e.g. experiments/lina/serve.yaml")
    srv.add_argument("--nproc", type=int, help="ranks (default: parallel.nproc of the config)")
    srv.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                     help="dotted override, repeatable: --set serve.variant=lina")
    srv.add_argument("--timeout", type=float, help="seconds (default: train.timeout_s)")
    srv.add_argument("--out-root", default="runs", help="results root (default: runs)")
    srv.add_argument("--no-progress", action="store_true", help="no progress bar")

    runs = sub.add_parser("runs", help="list completed runs")
    runs.add_argument("--root", default="runs", help="results root (default: runs)")

    from moelab import reproduce  # light: papermill is imported only when notebooks run

    rep = sub.add_parser("reproduce", help="execute notebooks at a scale with papermill and write an HTML report")
    reproduce.add_arguments(rep)

    args = ap.parse_args(argv)
    if args.cmd == "reproduce":
        return reproduce.main(args)
    if args.cmd == "serve":
        from moelab.runtime.launch import SERVE_WORKER

        args.worker, args.reuse, args.resume = SERVE_WORKER, False, None
        return _run(ap, args)
    return _run(ap, args) if args.cmd == "run" else _runs(args)


def _run(ap: argparse.ArgumentParser, args) -> int:
    from moelab.runtime.launch import DEFAULT_WORKER, RunFailed, launch

    overrides = {}
    for item in args.sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            ap.error(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value
    if args.config is None and args.resume is None:
        ap.error("run needs a config (or --resume RUN)")
    try:
        result = launch(args.config, args.nproc, overrides=overrides, out_root=args.out_root,
                        timeout=args.timeout, progress=not args.no_progress,
                        worker=args.worker or DEFAULT_WORKER, reuse=args.reuse, resume=args.resume)
    except (ConfigError, FileNotFoundError) as e:
        print(f"moelab: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"moelab: {e}", file=sys.stderr)
        return 1
    print(result.path)
    return 0


def _runs(args) -> int:
    from moelab.runtime.results import list_runs

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
