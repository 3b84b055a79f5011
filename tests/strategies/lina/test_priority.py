"""The priority scheduler alone (threads, no processes): the launch rules, the bounded wait, fixed
mode's release points, work conservation (spec §5 I5, I6) and error surfacing."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from moelab.comm.scheduler import Call
from moelab.strategies.lina.priority import LowOp, PriorityScheduler
from moelab.testing import peak_overlap

pytestmark = pytest.mark.timing  # wall-clock assertions: run alone (scripts/test.sh)


class FakeRec:
    tags: dict = {}

    @contextlib.contextmanager
    def tagged(self, **tags):
        yield


class FakeComm:
    """One rank's door; ``peer`` maps what this rank all-gathers to what a second rank would (None: one rank)."""
    rec = FakeRec()

    def __init__(self, peer=None):
        self.peer = peer or (lambda x: None)

    def all_gather(self, x, group="world"):
        other = self.peer(x)
        return torch.stack([x] if other is None else [x, other])


class Sleep:
    """A handle whose wait takes ``s`` seconds from the issue (an all-reduce in flight)."""

    def __init__(self, s):
        self.until = time.perf_counter() + s

    def wait(self):
        time.sleep(max(0.0, self.until - time.perf_counter()))


def high(sched, seconds, phase="fwd"):
    call = Call("all_to_all", "ep", (0, 1), {}, {}, {"phase": phase})
    sched.admit(call)
    time.sleep(seconds)
    sched.done(call)
    return call.priority_record


def low(seconds, name=""):
    return LowOp(lambda: Sleep(seconds), 8, "dp", name)


def in_flight(sched, timeout=5.0):
    """Wait until the launcher thread has a low op in flight (a fixed sleep races on a loaded machine)."""
    end = time.perf_counter() + timeout
    while sched.inflight < 1:
        assert time.perf_counter() < end, "no low op was launched"
        time.sleep(0.0005)


def test_high_call_overtakes_queued_low_ops_and_waits_for_the_one_in_flight():
    s = PriorityScheduler(FakeComm(), stall_s=5.0)
    for i in range(4):
        s.submit(low(0.03, f"op{i}"))
    in_flight(s)  # op0
    h = high(s, 0.02)
    s.drain()
    lows = [r for r in s.records if r["kind"] == "low"]
    assert not h["released"] and h["start"] >= lows[0]["end"] - 1e-4  # waited for op0 only
    assert all(lo["start"] >= h["end"] for lo in lows[1:])  # op1..3 held behind the call
    s.close()


def test_without_waiting_the_call_starts_at_once():
    s = PriorityScheduler(FakeComm(), waits_for_inflight=False)
    s.submit(low(0.5))
    in_flight(s)
    h = high(s, 0.0)
    assert h["start"] - h["wait"] < 0.2  # waiting for the op in flight would take ~0.5 s
    s.drain()
    s.close()


def test_wait_is_bounded_and_the_release_counted():
    s = PriorityScheduler(FakeComm(), stall_s=0.01)
    s.submit(low(1.0))  # stalled on a peer, say
    in_flight(s)
    h = high(s, 0.0)
    assert h["released"] and s.stalls == 1 and h["start"] - h["wait"] < 0.5
    s.drain()
    s.close()


def test_an_op_a_release_gave_up_on_is_not_waited_for_again():
    """A pipelined layer's chunks arrive one after another while the same stalled op is in flight: one
    bounded wait, not one per chunk; an op launched after it is waited for again."""
    s = PriorityScheduler(FakeComm(), stall_s=0.2)
    s.submit(low(0.6))  # stalled on a peer, say
    in_flight(s)
    first, second = high(s, 0.0), high(s, 0.0)
    assert first["released"] and first["start"] - first["wait"] >= 0.2
    assert second["released"] and second["start"] - second["wait"] < 0.1 and s.stalls == 1
    s.drain()
    s.submit(low(0.1))
    in_flight(s)
    third = high(s, 0.0)  # a new op: waited for (it ends within the bound)
    assert not third["released"] and third["start"] - third["wait"] >= 0.02 and s.stalls == 1
    s.drain()
    s.close()


def test_imminent_blocks_launches_until_the_next_high_call_ends():
    s = PriorityScheduler(FakeComm())
    s.imminent()
    s.submit(low(0.0))
    time.sleep(0.05)
    assert not [r for r in s.records if r["kind"] == "low"]  # held
    h = high(s, 0.01)
    s.drain()
    lo = [r for r in s.records if r["kind"] == "low"][0]
    assert lo["start"] >= h["end"]
    s.close()


def test_a_hold_keeps_low_ops_back_between_high_calls_until_it_ends():
    """A pipelined backward: two high calls with a gap between them; imminent alone lets a low op into the
    gap (the first call's end clears it), a hold does not."""
    for held in (False, True):
        s = PriorityScheduler(FakeComm())
        s.imminent()
        s.submit(low(0.0))
        with s.hold() if held else contextlib.nullcontext():
            h1 = high(s, 0.01)
            time.sleep(0.1)  # compute between two chunks
            high(s, 0.01)
            time.sleep(0.05)
            end = time.perf_counter()
        s.drain()
        lo = [r for r in s.records if r["kind"] == "low"][0]
        if held:
            assert lo["start"] >= end and s.held and s.held[0][1] <= lo["start"]
        else:
            assert h1["end"] <= lo["start"] < end and not s.held
        s.close()
    s = PriorityScheduler(FakeComm(), block_on_imminent=False)  # the block switched off: no hold either
    with s.hold():
        s.submit(low(0.0))
        deadline = time.perf_counter() + 5
        while not [r for r in s.records if r["kind"] == "low"] and time.perf_counter() < deadline:
            time.sleep(0.001)
        assert [r for r in s.records if r["kind"] == "low"]
    s.drain()
    s.close()


def test_max_inflight_bounds_concurrent_low_ops():
    s = PriorityScheduler(FakeComm(), max_inflight=2)
    for _ in range(6):
        s.submit(low(0.02))
    s.drain()
    assert peak_inflight(s.records) == 2
    s.close()


def peak_inflight(records, since=float("-inf")) -> int:
    """The most low ops in flight at once among those launched at or after ``since`` (one still in
    flight ends at infinity)."""
    return peak_overlap([(r["start"], r.get("end", float("inf"))) for r in records
                         if r["kind"] == "low" and r["start"] >= since])


def test_the_drain_lifts_the_in_flight_bound_to_drain_inflight():
    """While an all-to-all can still arrive one op is in flight at most; once the drain starts (after
    backward: none can), up to ``drain_inflight``."""
    for drain, want in ((3, 3), (None, 1)):
        s = PriorityScheduler(FakeComm(), drain_inflight=drain)
        for _ in range(3):
            s.submit(low(0.05))
        in_flight(s)
        end = time.perf_counter() + 5.0
        while len([r for r in s.records if "end" in r]) < 2:  # two ops done under the backward's bound
            assert time.perf_counter() < end
            time.sleep(0.001)
        before = peak_inflight(s.records)
        t = time.perf_counter()
        for _ in range(6):
            s.submit(low(0.05))
        s.drain()
        assert before == 1 and peak_inflight(s.records, since=t) == want, (drain, before)
        s.close()
    with pytest.raises(ValueError, match="drain_inflight"):
        PriorityScheduler(FakeComm(), drain_inflight=0)


def test_work_conservation_within_a_wakeup_tolerance():
    """Whenever the queue is non-empty and the gate open, a low op is in flight (I6)."""
    s = PriorityScheduler(FakeComm(), stall_s=5.0)
    t = threading.Thread(target=lambda: [s.submit(low(0.004, str(i))) or time.sleep(0.001) for i in range(20)])
    t.start()
    for _ in range(4):
        time.sleep(0.01)
        high(s, 0.01)
    t.join()
    s.drain()
    highs = [r for r in s.records if r["kind"] == "high"]
    lows = [r for r in s.records if r["kind"] == "low"]
    prev_end = 0.0
    for lo in lows:
        ready = max(lo["enqueue"], prev_end)
        for h in highs:  # the gate is closed while a high call waits or runs
            if h["wait"] <= ready < h["end"]:
                ready = h["end"]
        assert lo["start"] - ready < 0.05, lo
        prev_end = lo["end"]
    s.close()


def test_fixed_mode_releases_between_moe_layers_only():
    s = PriorityScheduler(FakeComm(), mode="fixed")
    s.new_step()
    s.submit(low(0.0, "a"))
    high(s, 0.0, phase="bwd")  # first backward all-to-all of a layer: nothing released
    time.sleep(0.03)
    assert not [r for r in s.records if r["kind"] == "low"]
    high(s, 0.0, phase="bwd")  # second: between two MoE layers
    time.sleep(0.03)
    assert [r["name"] for r in s.records if r["kind"] == "low"] == ["a"]
    s.drain()
    s.close()


def test_a_failing_low_op_surfaces_at_drain():
    def boom():
        raise OSError("link down")

    s = PriorityScheduler(FakeComm())
    s.submit(LowOp(boom, 8, "dp"))
    with pytest.raises(RuntimeError, match="link down"):
        s.drain(timeout=5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_inflight"):
        PriorityScheduler(FakeComm(), max_inflight=0)
    with pytest.raises(ValueError, match="mode"):
        PriorityScheduler(FakeComm(), mode="oracle")


def test_the_default_stall_bound_follows_the_typical_micro_op_not_the_stalled_ones():
    """Three times the median of the last 16 completed low ops (at least 5 ms): three stalled 80 ms ops
    among 4 ms ones leave it at 12 ms (a mean would make it 56 ms, and every stall would lengthen the next)."""
    s = PriorityScheduler(FakeComm())
    assert s._stall_bound() == pytest.approx(0.005)  # nothing completed yet
    s._low_s = [0.004] * 13 + [0.08] * 3
    assert s._stall_bound() == pytest.approx(0.012)
    s._low_s = [0.001] * 16
    assert s._stall_bound() == pytest.approx(0.005)
    s._low_s = [0.5] * 20 + [0.01] * 16  # only the last 16 count
    assert s._stall_bound() == pytest.approx(0.03)
    s.close()


def test_plan_launches_each_windows_ops_before_its_call_and_the_rest_after_the_last():
    """The scheduler alone (threads, a fake door): with a plan of 2, 2 and 4 ops by the end of windows 0-2,
    the first call waits for ops 0-1, the second for none, the third for ops 2-3; op 4 goes after the last
    planned window, before the drain. The drain then agrees on this step's windows and plans the next."""
    class Done:
        def wait(self):
            pass

    s = PriorityScheduler(FakeComm(), plan=True)
    s.planned = [2, 2, 4]
    s.new_step()
    for i in range(5):
        s.submit(LowOp(Done, 8, "dp", f"op{i}"))
    for w in range(3):
        call = Call("all_to_all", "ep", (0, 1), {}, {}, {"phase": "bwd"})
        s.admit(call)
        assert s._step_launched == [2, 2, 4][w] and not s.inflight, w
        s.done(call)
    end = time.perf_counter() + 10.0  # op 4: after the last planned window, without the drain
    while s._step_launched < 5:
        assert time.perf_counter() < end, "the op after the last window was not launched before the drain"
        time.sleep(0.001)
    s.drain()
    lows = [r for r in s.records if r["kind"] == "low"]
    assert [lo["window"] for lo in lows] == [0, 0, 2, 2, 3]
    assert len(s.plans) == 1 and len(s.planned) == 3  # the next step's plan: one count per window
    with pytest.raises(ValueError, match="plan applies"):
        PriorityScheduler(FakeComm(), mode="fixed", plan=True)
    # pipelined chunks: a call that arrives while the one before is in flight closes a window that never
    # opened, yet it waits for every op planned up to it (the same target on every rank): the launcher starts
    # them for it - they would otherwise wait for a window that never opens, and the call for them
    s.planned = [1, 3]
    s.new_step()
    for i in range(3):
        s.submit(LowOp(Done, 8, "dp", f"op{i}"))
    first, second = (Call("all_to_all", "ep", (0, 1), {}, {}, {"phase": "bwd"}) for _ in range(2))
    s.admit(first)
    assert s._step_launched == 1
    t = threading.Thread(target=s.admit, args=(second,), daemon=True)
    t.start()
    t.join(timeout=10.0)
    assert not t.is_alive(), "the second chunk's call waited for ops nobody launched"
    assert s._win_free[1] == 0.0 and s._step_launched == 3 and not s.inflight  # launched for it, done before it
    arrived = second.priority_record["wait"]
    assert all(lo["start"] >= arrived for lo in s._step_low[1:])  # not before: no window opened
    s.done(first)
    s.done(second)
    s.drain()
    s.close()


def test_under_a_plan_a_window_opens_only_while_no_high_call_is_in_flight():
    """With ``plan`` a hold holds nothing (every rank launches the same ops in the same window, so there is
    no stall to avoid). The compute after a call ended is the next call's window; the compute while another
    call is in flight (a pipelined layer's chunks, waited after its last chunk) is none: an op launched there
    would share the links with that call. Without the plan the hold spans both."""
    s = PriorityScheduler(FakeComm(), plan=True)
    s.new_step()
    with s.hold():
        high(s, 0.01, "bwd")
        time.sleep(0.1)  # the experts' backward of a chunk, after the call ended
        high(s, 0.01, "bwd")
        waited, moving = (Call("all_to_all", "ep", (0, 1), {}, {}, {"phase": "bwd"}) for _ in range(2))
        s.admit(waited)
        s.admit(moving)  # issued async before the one before is waited
        s.done(waited)  # that one ends; this one is still in flight ...
        time.sleep(0.1)  # ... while the next chunk computes
        high(s, 0.01, "bwd")
        s.done(moving)
        time.sleep(0.05)  # nothing in flight: a window again
        high(s, 0.01, "bwd")
    assert not s.held and s._win_free[1] >= 0.09 and s._win_free[4] == 0.0 and s._win_free[5] >= 0.04
    s.drain()
    s.close()
    s = PriorityScheduler(FakeComm())
    with s.hold():
        high(s, 0.01, "bwd")
    assert len(s.held) == 1
    s.close()


def test_plan_agrees_on_the_least_free_time_and_the_longest_op_over_ranks():
    """The plan is made from every rank's values: each window's least free time and each op's longest
    duration (a rank's own values alone would plan more ops than its slower peer can fit: a stall)."""
    s = PriorityScheduler(FakeComm(peer=lambda x: x if len(x) == 2 else
                                   torch.tensor([0.5, 1.0, 2, 3, 0.5, 0.25, 0.25], dtype=torch.float64)), plan=True)
    s._win_free, s._win_queued = [1.0, 0.25], [2, 3]
    s._step_low = [{"start": 0.0, "end": d} for d in (0.25, 0.5, 0.25)]
    s._agree()
    assert s.planned == [1, 1]  # free (0.5, 0.25), ops (0.5, 0.5, 0.25); this rank's own values plan [2, 3]
    alone = PriorityScheduler(FakeComm(), plan=True)
    alone._win_free, alone._win_queued, alone._step_low = s._win_free, s._win_queued, s._step_low
    alone._agree()
    assert alone.planned == [2, 3]
    odd = PriorityScheduler(FakeComm(peer=lambda x: x + 1 if len(x) == 2 else x), plan=True)
    odd._win_free, odd._win_queued, odd._step_low = s._win_free, s._win_queued, s._step_low
    with pytest.raises(RuntimeError, match="different"):
        odd._agree()
    for x in (s, alone, odd):
        x.close()
