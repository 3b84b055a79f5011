"""``emulation.compute_yields`` (moelab.comm.cpu_priority): the compute thread runs its block at
SCHED_IDLE and gets its policy back after, communication threads started inside leave the inherited
SCHED_IDLE, a host that cannot is refused before launch, and a run computes the same model either way."""
from __future__ import annotations

import os
import threading

import pytest

from moelab.comm import cpu_priority
from moelab.comm.cpu_priority import compute_yields
from moelab.comm.stream import CommStream
from moelab.config import ConfigError, RunConfig

needs_sched = pytest.mark.skipif(not cpu_priority.available(), reason=cpu_priority.UNAVAILABLE)


def policy_of_new_thread(start=None) -> int:
    """The policy a thread started now runs under (after ``start()`` on it, if given)."""
    got = []

    def run():
        if start is not None:
            start()
        got.append(os.sched_getscheduler(0))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return got[0]


@needs_sched
def test_the_block_runs_at_sched_idle_and_the_policy_comes_back_also_on_error():
    before = os.sched_getscheduler(0)
    assert before != os.SCHED_IDLE
    with compute_yields():
        assert os.sched_getscheduler(0) == os.SCHED_IDLE
        assert policy_of_new_thread() == os.SCHED_IDLE  # inherited: why comm threads call as_comm_thread
        assert policy_of_new_thread(cpu_priority.as_comm_thread) == os.SCHED_OTHER
    assert os.sched_getscheduler(0) == before
    with pytest.raises(RuntimeError, match="inside"):
        with compute_yields():
            raise RuntimeError("inside")
    assert os.sched_getscheduler(0) == before
    with compute_yields(False):
        assert os.sched_getscheduler(0) == before


@needs_sched
def test_comm_threads_started_by_a_yielding_thread_run_at_normal_priority():
    """A comm stream, the priority scheduler's launcher and waiter, and serving's phase-1 loader."""
    from moelab.strategies.lina.priority import LowOp, PriorityScheduler
    from tests.strategies.lina.test_priority import FakeComm

    class Done:
        def wait(self):
            seen["waiter"] = os.sched_getscheduler(0)

    seen = {}

    def issue():
        seen["launcher"] = os.sched_getscheduler(0)
        return Done()

    from moelab.strategies.lina.infer import ServeContext
    from moelab.strategies.lina.options import LinaServeOptions

    with compute_yields():
        serving = ServeContext(LinaServeOptions(), num_experts=2, num_layers=1, comm=None)
        assert serving.loader().submit(os.sched_getscheduler, 0).result() == os.SCHED_OTHER  # phase 1's loader
        serving.close()
        stream = CommStream(name="test-stream")
        assert stream.submit(lambda: os.sched_getscheduler(0)).wait() == os.SCHED_OTHER
        stream.close()
        for inflight in (1, 2):  # one in flight: the launcher waits itself; more: a waiter thread
            s = PriorityScheduler(FakeComm(), max_inflight=inflight)
            s.submit(LowOp(issue, 8, "dp", "op"))
            s.drain(timeout=10)
            s.close()
            assert seen.pop("launcher") == seen.pop("waiter") == os.SCHED_OTHER


def test_a_host_that_cannot_is_refused_before_launch(monkeypatch):
    monkeypatch.setattr(cpu_priority, "available", lambda: False)
    cfg = RunConfig().with_overrides({"emulation.compute_yields": True})
    with pytest.raises(ConfigError, match="emulation.compute_yields needs Linux's SCHED_IDLE"):
        cfg.validate()
    with pytest.raises(RuntimeError, match="compute_yields needs"):
        with compute_yields():
            pass
    RunConfig().validate()  # off: nothing asked of the host


def test_a_command_lines_mode_resolves_to_the_configs_bool():
    assert cpu_priority.resolve("on") is True and cpu_priority.resolve("off") is False
    assert cpu_priority.resolve("auto") == cpu_priority.available()
    with pytest.raises(ValueError, match="on, off or auto"):
        cpu_priority.resolve("yes")


def test_off_keeps_the_run_ids_of_before():
    """The option joins the config hash only when on (runs made before it keep their ids)."""
    off, on = RunConfig(), RunConfig().with_overrides({"emulation.compute_yields": True})
    d = off.to_dict()
    del d["emulation"]["compute_yields"]
    assert off.short_hash() == RunConfig.from_dict(d).short_hash() and on.short_hash() != off.short_hash()


@needs_sched
def test_a_run_computes_the_same_model_whether_compute_yields_or_not():
    """Two 2-rank Lina runs (comm thread, micro-ops during backward) in one spawn: losses equal bitwise."""
    from moelab.measure.realruns import run_real_many

    base = RunConfig().with_overrides({
        "model.d_model": 32, "model.d_ff": 64, "model.n_layers": 2, "model.n_heads": 2, "model.seq_len": 16,
        "model.moe.num_experts": 2, "model.moe.dispatcher": "dense", "model.moe.capacity_factor": 1.0,
        "train.iters": 3, "train.batch_size": 2,
        "train.trace": False, "parallel.nproc": 2, "parallel.strategy": "lina",
        "parallel.strategy_options": {"policy": "lina", "partition_bytes": 1024}})
    cfgs = [base.with_overrides({"emulation.compute_yields": y}).validate() for y in (False, True)]
    off, on = run_real_many(cfgs, timeout=120)
    losses = [[m["loss"] for m in r.metrics] for r in (off, on)]
    assert losses[0] == losses[1] and len(losses[0]) == 3
