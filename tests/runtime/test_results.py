"""The results store: atomic writes, run folders read back as frames, listing, one real round trip."""
import json
import os
import stat

import pandas as pd
import pytest

from moelab.runtime.launch import launch
from moelab.runtime.results import (
    RunResult,
    atomic_write_bytes,
    atomic_write_csv,
    atomic_write_json,
    atomic_write_text,
    list_runs,
    load_run,
)
from tests.fake_worker import use_fake_worker


def test_atomic_writes_replace_whole_files_and_leave_no_temp(tmp_path):
    p = tmp_path / "sub" / "a.txt"
    atomic_write_text(p, "one")
    atomic_write_text(p, "two")
    atomic_write_json(tmp_path / "b.json", {"x": [1, 2]})
    atomic_write_csv(tmp_path / "c.csv", pd.DataFrame({"a": [1, 2]}))
    assert p.read_text() == "two" and json.loads((tmp_path / "b.json").read_text()) == {"x": [1, 2]}
    assert pd.read_csv(tmp_path / "c.csv")["a"].tolist() == [1, 2]
    assert sorted(f.name for f in tmp_path.rglob("*")) == ["a.txt", "b.json", "c.csv", "sub"]
    assert stat.S_IMODE(p.stat().st_mode) == 0o644


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "a.bin"
    atomic_write_bytes(p, b"old")

    def crash(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(p, b"new")
    assert p.read_bytes() == b"old" and [f.name for f in tmp_path.iterdir()] == ["a.bin"]


def _fake_run(root, run_id, created, loss=1.0):
    d = root / run_id
    atomic_write_csv(d / "metrics.csv", pd.DataFrame({"iter": [0, 1], "loss": [2.0, loss]}))
    atomic_write_csv(d / "loads.csv", pd.DataFrame({"iter": [0, 0], "layer": [0, 0], "expert": [0, 1],
                                                    "tokens": [3, 5]}))
    for r in (0, 1):
        atomic_write_csv(d / f"comm_rank{r}.csv", pd.DataFrame({"op": ["all_to_all"], "bytes_intra": [10 * r]}))
    ev = {"name": "fwd", "cat": "compute", "ph": "X", "ts": 0.0, "dur": 5.0, "pid": 0, "tid": 0, "args": {"iter": 1}}
    atomic_write_json(d / "trace_rank0.json", {"traceEvents": [ev, {"name": "process_name", "ph": "M"}]})
    atomic_write_json(d / "trace_rank1.json", [dict(ev, pid=1)])  # the bare-list Chrome layout
    atomic_write_json(d / "config.json", {"name": run_id})
    atomic_write_json(d / "summary.json", {"run_id": run_id, "created": created, "label": "REAL: 2 ranks, gloo",
                                           "final_loss": loss})
    return d


def test_run_folder_reads_back_as_frames(tmp_path):
    d = _fake_run(tmp_path, "r1", "2026-01-01T00:00:00+00:00")
    run = load_run(d)
    assert run.run_id == "r1" and run.label == "REAL: 2 ranks, gloo" and run.config.name == "r1"
    assert run.metrics["loss"].tolist() == [2.0, 1.0] and run.loads["tokens"].sum() == 8
    assert run.comm["rank"].tolist() == [0, 1] and run.comm["bytes_intra"].tolist() == [0, 10]
    tr = run.trace()
    assert tr["rank"].tolist() == [0, 1] and tr["iter"].tolist() == [1, 1]  # metadata events dropped
    assert run.trace(rank=1)["pid"].tolist() == [1]
    assert run.plans.empty and run.checkpoint() is None  # a run from before plans and checkpoints


def test_summary_of_an_evaluated_resumed_run(tmp_path):
    from moelab.config import RunConfig
    from moelab.runtime.results import summarize

    atomic_write_csv(tmp_path / "metrics.csv", pd.DataFrame({"iter": [4, 5, 6], "loss": [2.0, 1.5, 1.2],
                                                             "step_time_s": [1, 1, 1],
                                                             "eval_loss": [None, 1.7, None]}))
    (tmp_path / "plans.jsonl").write_text('{"iter": 4, "layer": 0, "counts": [[1, 2]]}\n'
                                          '{"iter": 5, "layer": 0, "counts": [[3, 0]]}\n')
    s = summarize(tmp_path, RunConfig(), 1.0)
    assert s["final_eval_loss"] == 1.7 and s["first_iter"] == 4 and s["final_loss"] == 1.2
    atomic_write_json(tmp_path / "summary.json", s)
    assert load_run(tmp_path).plans["counts"].tolist() == [[[1, 2]], [[3, 0]]]


def test_list_runs_shows_only_completed_runs_oldest_first(tmp_path):
    _fake_run(tmp_path, "b", "2026-01-02T00:00:00+00:00", loss=0.5)
    _fake_run(tmp_path, "a", "2026-01-03T00:00:00+00:00")
    _fake_run(tmp_path, ".tmp-c-123", "2026-01-01T00:00:00+00:00")  # a launch in progress
    (tmp_path / "half").mkdir()  # no summary.json: not a completed run
    (tmp_path / "half" / "metrics.csv").write_text("iter,loss\n")
    runs = list_runs(tmp_path)
    assert runs["run_id"].tolist() == ["b", "a"] and runs["final_loss"].tolist() == [0.5, 1.0]
    assert runs["path"].tolist() == [str(tmp_path / "b"), str(tmp_path / "a")]
    assert load_run("a", root=tmp_path).path == tmp_path / "a"
    with pytest.raises(FileNotFoundError, match="not a completed run"):
        load_run("half", root=tmp_path)
    assert list_runs(tmp_path / "nothing").empty


@pytest.mark.timeout(120)
def test_launched_run_round_trips_through_the_store(tmp_path, monkeypatch):
    run = launch({"train": {"iters": 3}}, 2, out_root=tmp_path, worker=use_fake_worker(monkeypatch),
                 progress=False)
    runs = list_runs(tmp_path)
    assert runs["run_id"].tolist() == [run.run_id] and runs["nproc"].tolist() == [2]
    again = load_run(run.run_id, root=tmp_path)
    assert isinstance(again, RunResult) and again.summary == run.summary
    pd.testing.assert_frame_equal(again.metrics, run.metrics)
    pd.testing.assert_frame_equal(again.comm, run.comm)
    assert again.config.to_dict() == run.config.to_dict() and again.config.run_id() == run.run_id
