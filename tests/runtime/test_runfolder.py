"""The run folder completed by the ranks: agreement at start, files gathered to the writer, summary last."""
import json
import os
from pathlib import Path

import pytest

from moelab.config import RunConfig
from moelab.runtime.ranks import run_ranks
from moelab.runtime.runfolder import RunMismatch, agreement_errors, host_label, writer_rank

CFG = {"parallel": {"nproc": 3}, "train": {"iters": 2}}


def _facts(n=3, **change):
    facts = [{"hash": "aaaa", "version": "0.1.0", "host": f"h{r // 2}", "error": None} for r in range(n)]
    for key, (rank, value) in change.items():
        facts[rank][key] = value
    return facts


def test_agreement_errors_name_the_rank_and_what_differs():
    assert agreement_errors(_facts(), 3) == []
    (msg,) = agreement_errors(_facts(hash=(2, "bbbb")), 3)
    assert "config (hash)" in msg and "rank 2 on h1: bbbb" in msg and "same config" in msg
    (msg,) = agreement_errors(_facts(version=(1, "0.0.9")), 3)
    assert "moelab version" in msg and "rank 1 on h0: 0.0.9" in msg
    (msg,) = agreement_errors(_facts(), 4)
    assert "3 ranks" in msg and "parallel.nproc=4" in msg
    (msg,) = agreement_errors(_facts(error=(1, "cannot write its results to /x: denied")), 3)
    assert msg.startswith("rank 1 on h0: cannot write")


def test_writer_is_the_first_rank_of_node_zero():
    assert writer_rank([None, None]) == 0  # a bare torchrun: rank 0
    assert writer_rank(["1", "1", "0", "0"]) == 2  # c10d put node 0 second
    assert writer_rank(["0", "0", "1", "1"]) == 0


def test_a_run_on_several_hosts_names_them_in_its_label():
    assert host_label("REAL: 4 ranks, gloo", ["vm"] * 4) == "REAL: 4 ranks, gloo"
    assert host_label("REAL: 4 ranks, 2 nodes x 2, nccl", ["a", "a", "b", "b"]) == \
        "REAL: 4 ranks, 2 nodes x 2, nccl on a, b"
    assert host_label("L", [f"n{i}" for i in range(6)]) == "L on n0, n1, n2, n3 and 2 more"


def _write_and_finish(rank, world, out, chunk, big):
    import moelab.runtime.runfolder as rf

    rf.CHUNK_BYTES = chunk
    if rank < 2:
        os.environ[rf.NODE_RANK_ENV] = "1" if rank == 0 else "0"  # node 0 holds rank 1: the writer
    folder = rf.RunFolder.start(RunConfig.from_dict(CFG), out, "test")
    d = Path(folder.dir)
    (d / f"comm_rank{rank}.csv").write_text(f"x\n{rank}\n")
    (d / f"blob_rank{rank}.bin").write_bytes(bytes([rank]) * big)
    (d / "sub").mkdir(exist_ok=True)
    (d / "sub" / f"empty_rank{rank}").write_bytes(b"")
    if rank == folder.writer:
        (d / "metrics.csv").write_text("iter,loss\n0,1.5\n1,1.25\n")
    staging = folder.staging
    summary = folder.finish()
    return {"writer": folder.writer, "dir": str(d), "staging_left": staging is not None and staging.exists(),
            "summary": summary}


@pytest.mark.timeout(120)
def test_every_rank_s_files_reach_the_writer_in_chunks(tmp_path):
    out = tmp_path / "run"
    res = run_ranks(_write_and_finish, 3, str(out), 1000, 2500, timeout=90)
    assert [r["writer"] for r in res] == [1, 1, 1]
    assert res[1]["dir"] == str(out) and res[0]["dir"] != str(out)  # the others wrote elsewhere
    assert not any(r["staging_left"] for r in res)  # and cleaned up
    for r in range(3):
        assert (out / f"comm_rank{r}.csv").read_text() == f"x\n{r}\n"
        assert (out / f"blob_rank{r}.bin").read_bytes() == bytes([r]) * 2500  # 3 chunks of <= 1000 bytes
        assert (out / "sub" / f"empty_rank{r}").read_bytes() == b""
    summary = json.loads((out / "summary.json").read_text())
    assert summary == res[1]["summary"] and res[0]["summary"] is None
    assert summary["iters"] == 2 and summary["final_loss"] == 1.25 and len(summary["hosts"]) == 3
    import torch

    assert summary["kernels"] == [f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()}"]
    assert json.loads((out / "config.json").read_text()) == RunConfig.from_dict(CFG).to_dict()
    assert not list(out.glob(".*"))  # no temp files left


def _start_expecting_mismatch(rank, world, out, how):
    from moelab.runtime.runfolder import RunFolder

    cfg = RunConfig.from_dict(CFG)
    shared = False
    if how == "config" and rank == 2:
        cfg = cfg.with_overrides({"train.seed": 7})
    if how == "unwritable" and rank == 2:
        shared, out = True, os.path.join(os.path.dirname(out), "a-file", "run")  # under a regular file
    try:
        RunFolder.start(cfg, out, "test", shared_fs=shared)
    except RunMismatch as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, words", [("config", ["config (hash)", "rank 2"]),
                                        ("unwritable", ["rank 2", "cannot write its results"])])
def test_a_mismatch_stops_every_rank_before_anything_is_written(tmp_path, how, words):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "run"
    msgs = run_ranks(_start_expecting_mismatch, 3, str(out), how, timeout=90)
    assert all(m is not None and all(w in m for w in words) for m in msgs), msgs
    assert len(set(msgs)) == 1  # every rank says the same
    assert not out.exists()


def test_traces_keep_evenly_spaced_iterations_and_the_run_id_ignores_how_many():
    from moelab.comm.record import Recorder, sampled_iters

    assert sampled_iters(range(10), 0) is None and sampled_iters(range(10), 10) is None
    assert sampled_iters(range(100), 5) == {0, 25, 50, 74, 99}
    assert sampled_iters(range(3, 13), 2) == {3, 12} and sampled_iters(range(7), 1) == {6}
    rec = Recorder(0)
    for it in range(4):
        rec.tags["iter"] = it
        with rec.span("step"):
            pass
    rec.tags.pop("iter")
    with rec.span("setup"):
        pass
    kept = [e for e in rec.chrome_events({0, 3}) if e["ph"] == "X"]
    assert [e["args"].get("iter") for e in kept] == [0, 3, None]
    cfg = RunConfig()
    assert cfg.with_overrides({"train.trace_iters": 0}).run_id() == cfg.run_id()
    assert cfg.with_overrides({"train.trace": False}).run_id() != cfg.run_id()


def _shared(rank, world, out):
    from moelab.runtime.runfolder import RunFolder

    folder = RunFolder.start(RunConfig.from_dict(CFG), out, "test", shared_fs=True)
    (Path(folder.dir) / f"comm_rank{rank}.csv").write_text(f"x\n{rank}\n")
    folder.finish()
    return folder.dir, folder.staging


@pytest.mark.timeout(120)
def test_with_a_shared_filesystem_every_rank_writes_into_the_folder_itself(tmp_path):
    out = tmp_path / "run"
    res = run_ranks(_shared, 3, str(out), timeout=90)
    assert res == [(str(out), None)] * 3
    assert sorted(p.name for p in out.iterdir()) == ["comm_rank0.csv", "comm_rank1.csv", "comm_rank2.csv",
                                                     "config.json", "summary.json"]
