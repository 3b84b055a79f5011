"""``moelab run`` / ``moelab runs`` as a user types them, in a subprocess."""
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_worker import leftover_processes, use_fake_worker

pytest.importorskip("psutil")


def moelab(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "moelab.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text("name: tiny\ntrain:\n  iters: 5\n")
    return path


@pytest.mark.timeout(150)
def test_run_then_runs(tmp_path, monkeypatch, cfg):
    worker = use_fake_worker(monkeypatch)
    root = tmp_path / "runs"
    r = moelab("run", cfg, "--nproc", 2, "--set", "train.iters=3", "--worker", worker, "--out-root", root)
    assert r.returncode == 0, r.stderr
    run_dir = Path(r.stdout.strip().splitlines()[-1])
    assert run_dir.parent == root and (run_dir / "summary.json").is_file() and "tiny" in run_dir.name
    assert "3/3" in r.stderr  # the progress bar goes to stderr, the run folder to stdout
    listing = moelab("runs", "--root", root)
    assert listing.returncode == 0 and run_dir.name in listing.stdout and "REAL: 2 ranks, gloo" in listing.stdout
    assert "no completed runs" in moelab("runs", "--root", tmp_path / "empty").stdout


@pytest.mark.timeout(150)
def test_failing_rank_exits_1_with_its_traceback(tmp_path, monkeypatch, cfg):
    worker = use_fake_worker(monkeypatch)
    r = moelab("run", cfg, "--nproc", 2, "--set", "train.fault_rank=1", "--set", "train.fault_iter=2",
               "--worker", worker, "--out-root", tmp_path / "runs", "--no-progress")
    assert r.returncode == 1 and r.stdout == ""
    assert "failed on rank 1" in r.stderr and "RuntimeError: injected fault on rank 1 at iteration 2" in r.stderr
    assert list((tmp_path / "runs").iterdir()) == []
    assert leftover_processes(str(tmp_path)) == []


@pytest.mark.parametrize("args, message", [
    (["--set", "model.moe.num_experts=3"], "not divisible by parallel.nproc=2"),
    (["--set", "model.moe.capacity_factor=-1"], "capacity_factor must be > 0"),
    (["--set", "model.nonesuch=1"], "unknown config key"),
    (["--set", "train.iters"], "--set expects KEY=VALUE"),
    (["--set", "model.d_model=0"], "model.d_model must be >= 1, got 0"),
    (["--set", "parallel.grad_sync=ddp_overlap", "--set", "parallel.bucket_mb=-1"], "parallel.bucket_mb must be > 0"),
])
def test_invalid_config_exits_2_before_launching(tmp_path, cfg, args, message):
    r = moelab("run", cfg, "--nproc", 2, *args, "--out-root", tmp_path / "runs")
    assert r.returncode == 2 and message in r.stderr
    assert not (tmp_path / "runs").exists()


def test_missing_config_file_exits_2(tmp_path):
    r = moelab("run", tmp_path / "nope.yaml", "--out-root", tmp_path / "runs")
    assert r.returncode == 2 and "nope.yaml" in r.stderr


@pytest.mark.parametrize("text, where, what", [("model:\n  d_model: 64\n   n_layers: 2\n", ":3:12:", "mapping values"),
                                               ("model: [1, 2\n", ":2:1:", "flow sequence"),
                                               ("- 1\n- 2\n", "", "a YAML mapping, got a list")])
def test_malformed_yaml_is_one_line_with_its_line_and_column(tmp_path, text, where, what):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    r = moelab("run", bad, "--out-root", tmp_path / "runs")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"{bad}{where}" in r.stderr and what in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()


def test_resume_needs_a_checkpoint_and_run_needs_a_config(tmp_path):
    r = moelab("run", "--out-root", tmp_path / "runs")
    assert r.returncode == 2 and "run needs a config (or --resume RUN, or --preset NAME)" in r.stderr
    (tmp_path / "old").mkdir()
    r = moelab("run", "--resume", tmp_path / "old", "--out-root", tmp_path / "runs")
    assert r.returncode == 2 and "no checkpoint in" in r.stderr and "train.checkpoint_every" in r.stderr
    assert not (tmp_path / "runs").exists()
