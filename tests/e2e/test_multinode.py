"""Multi-node runs on one machine: two torchrun "nodes" on 127.0.0.1 (2 x 2 gloo ranks, c10d
rendezvous), each with its own results directory standing for its own disk."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moelab
from moelab.runtime.ranks import free_port
from moelab.runtime.results import list_runs, load_run
from tests.fake_worker import leftover_processes, use_fake_worker

pytest.importorskip("psutil")
ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "core" / "quickstart.yaml"
FP64 = ["train.iters=3", "train.dtype=float64", "train.trace=true"]


def _sets(items):
    return [a for kv in items for a in ("--set", kv)]


def _start_nodes(make_cmd, envs=(None, None)):
    return [subprocess.Popen(make_cmd(k), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **(envs[k] or {})}, cwd=ROOT) for k in (0, 1)]


def _finish(procs, timeout=150):
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    return outs


def _files(d: Path) -> list:
    return sorted(p for p in d.rglob("*") if p.is_file()) if d.exists() else []


def _cli_node(tmp_path, port, sets, worker=None, timeout=120):
    def cmd(k):
        return [sys.executable, "-m", "moelab.cli", "run", str(QUICKSTART), *_sets(sets), "--nnodes", "2",
                "--node-rank", str(k), "--rdzv", f"127.0.0.1:{port}", "--out-root", str(tmp_path / f"node{k}"),
                "--no-progress", "--timeout", str(timeout), *(["--worker", worker] if worker else [])]
    return cmd


@pytest.mark.timeout(300)
def test_two_nodes_without_a_shared_disk_leave_one_complete_run_on_node_0(tmp_path):
    (rc0, out0, err0), (rc1, out1, err1) = _finish(_start_nodes(_cli_node(tmp_path, free_port(), FP64)))
    assert rc0 == 0 and rc1 == 0, (err0, err1)
    run = load_run(out0.strip())
    assert run.path.parent == tmp_path / "node0" and "node 0 holds the run folder" in err1
    assert _files(tmp_path / "node1") == []  # the other node keeps nothing
    assert list(list_runs(tmp_path / "node0")["run_id"]) == [run.run_id]
    s = run.summary
    assert s["label"] == "REAL: 4 ranks, 2 nodes x 2, gloo" and s["nproc"] == 4 and len(s["hosts"]) == 4
    assert sorted(run.comm["rank"].unique()) == [0, 1, 2, 3] and sorted(run.trace()["rank"].unique()) == [0, 1, 2, 3]
    assert s["bytes_inter"] > 0 and s["bytes_inter"] == run.comm["bytes_inter"].sum()
    single = moelab.launch(QUICKSTART, overrides=dict(kv.split("=") for kv in FP64), out_root=tmp_path / "single",
                           progress=False)
    assert single.run_id == run.run_id  # the same resolved config
    assert list(run.metrics["loss"]) == list(single.metrics["loss"])  # fp64, every digit
    assert leftover_processes(str(tmp_path)) == []


@pytest.mark.timeout(300)
def test_bare_torchrun_nodes_complete_the_folder_of_rank_0(tmp_path):
    """The README's bare torchrun command: the ranks complete the folder on whichever node holds rank 0."""
    port = free_port()

    def cmd(k):
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k),
                "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--max-restarts", "0", "-m", "moelab.runtime.worker", "--config", str(QUICKSTART),
                *_sets(["train.iters=2", "train.timeout_s=120"]), "--out", str(tmp_path / f"out{k}")]

    results = _finish(_start_nodes(cmd))
    assert all(rc == 0 for rc, _, _ in results), [err[-2000:] for _, _, err in results]
    done = [k for k in (0, 1) if (tmp_path / f"out{k}" / "summary.json").is_file()]
    assert len(done) == 1
    run = load_run(tmp_path / f"out{done[0]}")
    assert run.summary["iters"] == 2 and sorted(run.comm["rank"].unique()) == [0, 1, 2, 3]
    assert not (tmp_path / f"out{1 - done[0]}").exists()


@pytest.mark.timeout(300)
def test_a_rank_killed_on_node_1_stops_both_nodes_and_leaves_no_summary(tmp_path, monkeypatch):
    worker = use_fake_worker(monkeypatch)
    procs = _start_nodes(_cli_node(tmp_path, free_port(), ["train.iters=50"], worker, timeout=240),
                         envs=(None, {"MOELAB_FAKE_CRASH_LOCAL_RANK": "0"}))
    (rc0, _, err0), (rc1, _, err1) = _finish(procs, timeout=280)
    assert rc0 == 1 and rc1 == 1, (err0, err1)
    assert "timed out" not in err0 + err1  # stopped by the crash, not by the run's timeout (a clock bound counted
    # the CLI's and torchrun's start-up, which a loaded host stretches past it)
    assert "killed by SIGKILL" in err1 and "failed on rank" in err1
    assert "failed on rank" in err0 and "another node" in err0
    assert list(tmp_path.rglob("summary.json")) == []
    assert leftover_processes(str(tmp_path)) == []


@pytest.mark.timeout(300)
def test_nodes_started_with_different_configs_stop_with_one_message(tmp_path, monkeypatch):
    worker = use_fake_worker(monkeypatch)
    port = free_port()
    base = _cli_node(tmp_path, port, ["train.iters=3"], worker, timeout=60)

    def cmd(k):
        return base(k) + (["--set", "train.seed=5"] if k else [])

    results = _finish(_start_nodes(cmd), timeout=120)
    for rc, _, err in results:
        assert rc == 1 and "disagree on the config (hash)" in err, err
    assert list(tmp_path.rglob("summary.json")) == [] and list(tmp_path.rglob("config.json")) == []


@pytest.mark.timeout(300)
def test_an_unwritable_node_and_a_rendezvous_that_never_completes_are_clear_errors(tmp_path, monkeypatch):
    worker = use_fake_worker(monkeypatch)
    (tmp_path / "a-file").write_text("")
    base = _cli_node(tmp_path, free_port(), ["train.iters=3"], worker, timeout=10)

    def cmd(k):  # node 1's results root lies under a regular file: it cannot even start
        return base(k) + (["--out-root", str(tmp_path / "a-file" / "runs")] if k else [])

    t = time.monotonic()
    (rc0, _, err0), (rc1, _, err1) = _finish(_start_nodes(cmd), timeout=120)
    assert rc1 == 2 and "is not writable here" in err1 and str(tmp_path / "a-file") in err1
    assert rc0 == 1 and "did not gather 2 nodes within 10s" in err0
    assert time.monotonic() - t < 40
    assert list(tmp_path.rglob("summary.json")) == [] and list(tmp_path.rglob("config.json")) == []
    assert leftover_processes(str(tmp_path)) == []


def test_bad_node_options_exit_2_before_anything_starts(tmp_path):
    from moelab.cli import main

    cfg = str(QUICKSTART)
    assert main(["run", cfg, "--nnodes", "2", "--node-rank", "2", "--rdzv", "h:1", "--out-root", str(tmp_path)]) == 2
    assert main(["run", cfg, "--nnodes", "2", "--rdzv", "nohostport", "--out-root", str(tmp_path)]) == 2
    assert main(["run", cfg, "--nnodes", "3", "--rdzv", "h:1", "--out-root", str(tmp_path)]) == 2  # 4 ranks / 3
    assert main(["run", cfg, "--nnodes", "4", "--rdzv", "h:1", "--out-root", str(tmp_path)]) == 2  # topology says 2
    with pytest.raises(SystemExit):
        main(["run", cfg, "--nnodes", "2", "--out-root", str(tmp_path)])  # no --rdzv
    assert _files(tmp_path) == []


SRUN = """#!/bin/bash
# a stand-in for SLURM's srun on one machine: --nodes=N tasks, each with its SLURM_NODEID
n=1
while [[ "$1" == --* ]]; do [[ "$1" == --nodes=* ]] && n="${1#--nodes=}"; shift; done
pids=()
for ((i = 0; i < n; i++)); do SLURM_NODEID=$i SLURM_NNODES=$n "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
"""


@pytest.mark.timeout(300)
def test_the_sbatch_script_runs_one_task_per_node_with_the_rendezvous_on_the_first(tmp_path):
    from moelab.cli import main

    job = tmp_path / "job.sh"
    port = free_port()
    assert main(["slurm", str(QUICKSTART), "--nodes", "2", "--gpus-per-node", "2", "--partition", "gpu",
                 "--time", "00:30:00", "--set", "train.iters=2", "--port", str(port), "--write", str(job)]) == 0
    text = job.read_text()
    subprocess.run(["bash", "-n", str(job)], check=True)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --partition=gpu", "#SBATCH --time=00:30:00", "scontrol show hostnames",
                 "srun --nodes=2 --ntasks-per-node=1", '--node-rank "$SLURM_NODEID"',
                 '--rdzv "$head_node:$rdzv_port"', "--set parallel.nproc=4", "--nnodes 2", "CUDA build"):
        assert line in text, line
    # run it on this machine: srun and scontrol stand-ins, `python` = this interpreter
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, body in (("srun", SRUN), ("scontrol", "#!/bin/bash\necho 127.0.0.1\n"),
                       ("python", f'#!/bin/bash\nexec {sys.executable} "$@"\n')):
        (bin_ / name).write_text(body)
        (bin_ / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[0-1]"}
    done = subprocess.run(["bash", str(job)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = [load_run(p) for p in (tmp_path / "runs").iterdir()]
    assert run.summary["label"] == "REAL: 4 ranks, 2 nodes x 2, gloo" and run.summary["iters"] == 2
    assert "node 0 holds the run folder" in done.stderr


@pytest.mark.parametrize("kw, word", [({"nodes": 0}, "--nodes"), ({"gpus_per_node": 0}, "--gpus-per-node"),
                                      ({"time": "soon"}, "--time"), ({"port": 0}, "port")])
def test_bad_sbatch_options_are_named(kw, word):
    from moelab.config import ConfigError
    from moelab.runtime.slurm import sbatch_script

    args = {"nodes": 2, "gpus_per_node": 4, **kw}
    with pytest.raises(ConfigError, match=word):
        sbatch_script("c.yaml", args.pop("nodes"), args.pop("gpus_per_node"), **args)
