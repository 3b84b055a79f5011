"""The launcher end to end: real torchrun, real gloo ranks (a fake worker until the real one exists)."""
import importlib.util
import json
import time
from pathlib import Path

import pytest

import moelab
from moelab.config import ConfigError, RunConfig
from moelab.runtime.launch import RunFailed, RunTimeout, launch, resolve_config
from moelab.runtime.results import RunResult
from tests.fake_worker import leftover_processes, timeout_from_the_ranks_start, use_fake_worker

pytest.importorskip("psutil")  # leftover_processes
QUICKSTART = Path(__file__).resolve().parents[2] / "experiments" / "core" / "quickstart.yaml"
TINY = {"train": {"iters": 4}}


def _tmp_dirs(root: Path) -> list:
    return sorted(root.glob(".*")) if root.exists() else []


@pytest.mark.timeout(120)
def test_two_rank_run_end_to_end(tmp_path, monkeypatch, capsys):
    worker = use_fake_worker(monkeypatch)
    monkeypatch.setenv("MOELAB_FAKE_PRINT", "1")
    t = time.monotonic()
    run = moelab.launch(TINY, nproc=2, out_root=tmp_path, worker=worker, progress=True, train__seed=1)
    elapsed = time.monotonic() - t
    assert run.path == tmp_path / run.run_id and run.path.is_dir()
    for f in ("config.json", "summary.json", "metrics.csv", "loads.csv", "comm_rank0.csv", "comm_rank1.csv",
              "trace_rank0.json", "trace_rank1.json", "logs/rank0.stderr", "logs/rank1.stderr", "logs/stdout.log"):
        assert (run.path / f).is_file(), f
    assert not (run.path / ".launch").exists() and _tmp_dirs(tmp_path) == []
    s = run.summary
    assert s["run_id"] == run.run_id and s["nproc"] == 2 and s["iters"] == 4
    assert s["kind"] == "REAL" and s["backend"] == "gloo" and s["label"] == "REAL: 2 ranks, gloo"
    assert s["final_loss"] == pytest.approx(run.metrics["loss"].iloc[-1])
    assert s["mean_step_time_s"] == pytest.approx(run.metrics["step_time_s"].iloc[1:].mean())
    assert s["bytes_intra"] == run.comm["bytes_intra"].sum() > 0 and s["bytes_inter"] == 0
    assert 0 < s["wall_time_s"] <= elapsed
    assert json.loads((run.path / "config.json").read_text())["train"]["seed"] == 1
    assert sorted(run.comm["rank"].unique()) == [0, 1] and list(run.metrics["iter"]) == [0, 1, 2, 3]
    assert "MOELAB_PROGRESS iter=3 total=4" in (run.path / "logs" / "stdout.log").read_text()
    out, err = capsys.readouterr()
    assert "hello from the fake worker" in out  # ordinary worker output is passed through
    assert "4/4" in err  # the progress bar reached the end
    assert leftover_processes(str(tmp_path)) == []


@pytest.mark.timeout(120)
def test_failing_rank_is_named_and_everything_is_cleaned_up(tmp_path, monkeypatch):
    worker = use_fake_worker(monkeypatch)
    cfg = RunConfig.from_dict(TINY).with_overrides({"train.fault_rank": 1, "train.fault_iter": 1})
    t = time.monotonic()
    with pytest.raises(RunFailed) as info:
        launch(cfg, 2, out_root=tmp_path, worker=worker, progress=False, timeout=60)
    assert time.monotonic() - t < 30
    e = info.value
    assert type(e) is RunFailed and e.rank == 1 and e.run_id == cfg.with_overrides({"parallel.nproc": 2}).run_id()
    assert "RuntimeError: injected fault on rank 1 at iteration 1" in e.traceback_tail
    assert "rank 1" in str(e) and "injected fault on rank 1" in str(e)
    assert "_rank_main" not in e.traceback_tail  # the launcher's own frames are not the user's problem
    assert list(tmp_path.iterdir()) == []  # temp dir gone, no half-written run
    assert leftover_processes(str(tmp_path)) == []


@pytest.mark.timeout(360)
def test_hanging_rank_is_killed_at_the_timeout(tmp_path, monkeypatch):
    worker = use_fake_worker(monkeypatch)
    monkeypatch.setenv("MOELAB_FAKE_HANG_RANK", "1")
    when = timeout_from_the_ranks_start(monkeypatch, tmp_path)  # a loaded host's start-up is not the run's hang
    with pytest.raises(RunTimeout) as info:
        launch(TINY, 2, out_root=tmp_path, worker=worker, progress=False, timeout=10)
    late = time.monotonic() - when["deadline"]
    assert 0 <= late < 15  # killed at the timeout, not before it, and soon after it
    assert "timed out after 10s" in str(info.value) and info.value.rank is None
    sections = info.value.traceback_tail.split("--- rank")[1:]
    assert [s[0] for s in sections] == ["0", "1"] and all("fake_worker.py" in s for s in sections), \
        info.value.traceback_tail  # each rank's stack at the timeout
    assert list(tmp_path.iterdir()) == []
    assert leftover_processes(str(tmp_path)) == []


@pytest.mark.timeout(120)
def test_rank_killed_by_a_signal_is_blamed_not_its_peer(tmp_path, monkeypatch):
    worker = use_fake_worker(monkeypatch)
    monkeypatch.setenv("MOELAB_FAKE_CRASH_RANK", "1")  # rank 0 then fails in its all_reduce
    with pytest.raises(RunFailed) as info:
        launch(TINY, 2, out_root=tmp_path, worker=worker, progress=False, timeout=60)
    assert info.value.rank == 1 and "killed by SIGKILL, no Python exception" in str(info.value)
    assert "about to crash" in info.value.traceback_tail  # the tail of that rank's stderr
    assert list(tmp_path.iterdir()) == [] and leftover_processes(str(tmp_path)) == []


@pytest.mark.timeout(360)
def test_rank_that_raises_then_hangs_is_named_at_the_timeout(tmp_path, monkeypatch):
    worker = use_fake_worker(monkeypatch)
    monkeypatch.setenv("MOELAB_FAKE_LINGER", "1")  # the failing rank never exits, so its peer waits
    timeout_from_the_ranks_start(monkeypatch, tmp_path)
    with pytest.raises(RunTimeout) as info:
        launch(TINY, 2, out_root=tmp_path, worker=worker, progress=False, timeout=8, train__fault_rank=1)
    assert info.value.rank == 1 and "after rank 1 raised" in str(info.value)
    assert "injected fault on rank 1" in info.value.traceback_tail and "--- rank0 ---" in info.value.traceback_tail
    assert list(tmp_path.iterdir()) == [] and leftover_processes(str(tmp_path)) == []


@pytest.mark.parametrize("overrides, message", [
    ({"model.moe.num_experts": 3}, "not divisible by parallel.nproc=2"),
    ({"model.moe.capacity_factor": 0}, "capacity_factor must be > 0"),
    ({"parallel.strategy": "nonesuch"}, "strategy 'nonesuch' is unknown"),
    ({"parallel.topology.nodes": 3}, "does not fit nproc=2"),
    ({"model.d_model": 0}, "model.d_model must be >= 1, got 0"),
    ({"train.eval_every": -1}, "train.eval_every must be >= 0"),
    ({"parallel.bucket_mb": 0}, "parallel.bucket_mb must be > 0"),
])
def test_invalid_config_fails_before_any_process(tmp_path, monkeypatch, overrides, message):
    def no_process(*a, **k):
        raise AssertionError("a process was started for an invalid config")

    monkeypatch.setattr("subprocess.Popen", no_process)
    with pytest.raises(ConfigError, match=message):
        launch(TINY, 2, overrides=overrides, out_root=tmp_path / "runs", progress=False)
    assert not (tmp_path / "runs").exists()


def test_quickstart_config_is_valid():
    cfg = RunConfig.load(QUICKSTART).validate()
    assert cfg.parallel.nproc == 4 and cfg.parallel.topology.nodes == 2 and cfg.train.iters == 30
    assert cfg.model.moe.num_experts == 8 and cfg.model.moe.top_k == 2 and cfg.model.moe.dispatcher == "sparse"


def test_config_sources_and_overrides_agree(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  iters: 4\n")
    a = resolve_config(path, 4, {"model.moe.top_k": 1}, train__lr=0.5)
    b = resolve_config(RunConfig.from_dict(TINY), 4, model__moe__top_k="1", **{"train.lr": "0.5"})
    assert a.to_dict() == b.to_dict() and a.parallel.nproc == 4 and a.model.moe.top_k == 1
    with pytest.raises(TypeError):
        resolve_config(42)


@pytest.mark.timeout(120)
def test_reuse_and_atomic_replace(tmp_path, monkeypatch):
    worker = use_fake_worker(monkeypatch)
    first = launch(TINY, 2, out_root=tmp_path, worker=worker, progress=False)
    (first.path / "marker").write_text("old run")
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: pytest.fail("reuse must not start processes"))
    again = launch(TINY, 2, out_root=tmp_path, worker=worker, progress=False, reuse=True)
    assert again.path == first.path and (again.path / "marker").exists()
    monkeypatch.undo()
    worker = use_fake_worker(monkeypatch)
    fresh = launch(TINY, 2, out_root=tmp_path, worker=worker, progress=False)
    assert fresh.path == first.path and not (fresh.path / "marker").exists()
    assert [p.name for p in tmp_path.iterdir()] == [first.run_id]  # no .old-* or .tmp-* left


@pytest.mark.timeout(120)
def test_reuse_runs_again_what_an_older_moelab_made(tmp_path, monkeypatch, capsys):
    worker = use_fake_worker(monkeypatch)
    first = launch(TINY, 2, out_root=tmp_path, worker=worker, progress=False)
    assert first.summary["moelab_version"] == moelab.__version__
    summary = json.loads((first.path / "summary.json").read_text())
    (first.path / "summary.json").write_text(json.dumps({**summary, "moelab_version": "0.0.1"}))
    again = launch(TINY, 2, out_root=tmp_path, worker=worker, progress=False, reuse=True)
    assert again.summary["moelab_version"] == moelab.__version__  # made again, by this version
    assert (f"not re-using the stored run {first.run_id}: made by moelab 0.0.1, this is moelab"
            in capsys.readouterr().err)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(importlib.util.find_spec("moelab.runtime.worker") is None,
                    reason="moelab.runtime.worker does not exist yet")
def test_real_worker_quickstart(tmp_path):
    t = time.monotonic()
    run = launch(QUICKSTART, out_root=tmp_path, progress=False)
    elapsed = time.monotonic() - t
    assert elapsed < 90, f"quickstart took {elapsed:.1f}s"
    assert run.summary["nproc"] == 4 and run.summary["iters"] == 30
    assert {"iter", "loss", "step_time_s", "bytes_local", "bytes_intra", "bytes_inter", "mem_params_bytes",
            "mem_grads_bytes", "mem_optim_bytes", "mem_activations_bytes"} <= set(run.metrics)
    assert {"iter", "layer", "expert", "tokens"} <= set(run.loads)
    assert {"op", "group", "bytes_local", "bytes_intra", "bytes_inter", "t_start", "t_end", "iter",
            "layer"} <= set(run.comm) and sorted(run.comm["rank"].unique()) == [0, 1, 2, 3]
    assert run.summary["bytes_inter"] > 0  # 2 nodes x 2: all-to-all crosses the node boundary
    trace = run.trace()
    assert {"name", "cat", "ph", "ts", "dur", "pid", "tid"} <= set(trace) and set(trace["pid"]) == {0, 1, 2, 3}
    assert leftover_processes(str(tmp_path)) == []


REAL_TINY = {"model": {"d_model": 16, "d_ff": 32, "n_heads": 2, "seq_len": 16, "moe": {"num_experts": 4}},
             "train": {"iters": 6, "batch_size": 2, "dtype": "float64", "trace": False, "checkpoint_every": 2}}


@pytest.mark.timeout(300)
def test_crashed_run_keeps_its_checkpoint_and_resumes_from_the_cli(tmp_path):
    """The real worker: a rank fails at iteration 3; the checkpoint of step 2 survives, and
    ``moelab run --resume`` continues it on 4 ranks (global batch kept) to the end."""
    import subprocess
    import sys

    cfg = resolve_config(REAL_TINY, 2, train__fault_rank=1, train__fault_iter=3)
    with pytest.raises(RunFailed) as info:
        launch(cfg, out_root=tmp_path, progress=False, timeout=120)
    kept = tmp_path / f"{cfg.run_id()}.partial"
    assert info.value.rank == 1 and f"moelab run --resume {kept}" in str(info.value)
    assert sorted(p.name for p in (kept / "checkpoints").iterdir()) == ["step_000002"]
    assert [p.name for p in tmp_path.iterdir()] == [kept.name]  # nothing else left behind
    r = subprocess.run([sys.executable, "-m", "moelab.cli", "run", "--resume", str(kept), "--nproc", "4",
                        "--set", "train.batch_size=1", "--set", "train.fault_rank=null", "--out-root", str(tmp_path),
                        "--no-progress"], capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr
    run = RunResult(r.stdout.strip().splitlines()[-1])
    assert list(run.metrics["iter"]) == [2, 3, 4, 5] and run.config.parallel.nproc == 4
    assert run.config.train.resume_from == str((kept / "checkpoints" / "step_000002").resolve())
    assert len(run.plans) == 4 * 2 and run.checkpoint().name == "step_000006"
    with pytest.raises(ConfigError, match="is of another model"):
        moelab.launch(resume=run.path, out_root=tmp_path, progress=False, model__d_model=32)
    assert leftover_processes(str(tmp_path)) == []
