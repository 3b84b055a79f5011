"""Lina's training policies on real gloo ranks (spec §5 I1, I4, I5, I7): every policy trains the
same model as the baseline (bitwise on 2 ranks, 1e-12 on 4, fp64), micro-ops partition each
gradient exactly, the scheduler's log obeys the priority rules, and every rank issues the same
collective sequence per group."""
from __future__ import annotations

import pytest
import torch

from moelab.runtime.ranks import run_ranks
from moelab.testing import TINY_TRAIN, peak_overlap

BASE = {"model.moe.dispatcher": "dense", "model.moe.capacity_factor": 2.0, "train.iters": 5,
        "parallel.strategy": "lina", "parallel.bucket_mb": 0.004}
S = 1024  # bytes: the largest fp64 gradient (32x16 weights = 4 KiB) splits into 4 micro-ops
POLICIES = ("after_backward", "ddp_overlap", "fixed", "priority", "lina")
COALESCED = ("lina_coalesce", "lina", {"coalesce_bytes": S})  # small gradients share micro-ops of <= S
DRAINED = ("lina_drain4", "lina", {"drain_inflight": 4})  # up to 4 micro-ops in flight after backward


def _train(rank, world, policies, opts, overrides=None):
    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer

    out = {}
    for entry in policies:  # a policy, or (name, policy, its own options)
        name, pol, own = (entry, entry, {}) if isinstance(entry, str) else entry
        cfg = RunConfig().with_overrides({**TINY_TRAIN, **BASE, **(overrides or {}), "parallel.nproc": world,
                                          "parallel.strategy_options":
                                          {"policy": pol, "partition_bytes": S, **opts, **own}}).validate()
        tr = Trainer.build(cfg)
        losses = [row["loss"] for row in tr.run()]
        upd = tr.update
        sched = getattr(upd, "sched", None)
        dp_seq = [(r.group, r.seq, r.op, r.tags.get("name")) for r in tr.comm.rec.comm if r.group == "dp"]
        out[name] = dict(
            losses=losses, params={n: p.detach().clone() for n, p in tr.model.named_parameters()},
            records=list(sched.records) if sched else [], marks=list(sched.marks) if sched else [],
            held=list(sched.held) if sched else [],
            stalls=sched.stalls if sched else 0, dp_seq=dp_seq, plans=list(sched.plans) if sched else [],
            micro_ops=list(getattr(upd, "last_micro_ops", [])),
            shapes=[(p.numel(), p.element_size()) for p in getattr(upd, "order", [])])
        tr.close()  # the communication thread, then the groups (handed on to the next run)
    return out


@pytest.fixture(scope="module")
def runs2():
    return run_ranks(_train, 2, POLICIES + (COALESCED, DRAINED), {}, timeout=300)


def test_every_policy_trains_the_baseline_model_bitwise_on_2_ranks(runs2):
    for r in range(2):
        ref = runs2[r]["ddp_overlap"]
        for pol in POLICIES + COALESCED[:1] + DRAINED[:1]:
            got = runs2[r][pol]
            assert got["losses"] == ref["losses"], pol
            for n, p in ref["params"].items():
                assert torch.equal(got["params"][n], p), (pol, n)


def test_micro_ops_partition_every_gradient_exactly(runs2):
    got = runs2[0]["lina"]
    shapes = got["shapes"]
    by_param: dict = {}
    for op in got["micro_ops"]:
        assert len(op) == 1  # one gradient per micro-op (no coalescing by default)
        i, a, b = op[0]
        assert (b - a) * shapes[i][1] <= S and b > a
        by_param.setdefault(i, []).append((a, b))
    assert sorted(by_param) == list(range(len(shapes)))  # every dense gradient, in readiness order
    for i, spans in by_param.items():
        assert spans[0][0] == 0 and spans[-1][1] == shapes[i][0]
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))  # disjoint, contiguous, exact cover
    assert max(len(v) for v in by_param.values()) >= 4
    # one all-reduce per micro-op per step, each reduced once
    names = [n for g, s, op, n in got["dp_seq"] if op == "all_reduce"]
    assert len(names) == 5 * len(got["micro_ops"]) and len(set(names)) == len(got["micro_ops"])


def test_coalesced_micro_ops_carry_runs_of_small_gradients_and_fewer_calls(runs2):
    got, per_grad = runs2[0]["lina_coalesce"], runs2[0]["lina"]
    shapes = got["shapes"]
    covered = [(i, a, b) for op in got["micro_ops"] for i, a, b in op]
    assert covered == [m for op in per_grad["micro_ops"] for m in op]  # the same spans, in the same order
    packs = [op for op in got["micro_ops"] if len(op) > 1]
    assert packs, "no micro-op carried two gradients"
    for op in packs:
        idx = [i for i, _, _ in op]
        assert idx == list(range(idx[0], idx[-1] + 1))  # consecutive in queue order
        assert sum((b - a) * shapes[i][1] for i, a, b in op) <= S
        assert all(a == 0 and b == shapes[i][0] for i, a, b in op)  # whole gradients
    calls = [n for g, s, op, n in got["dp_seq"] if op == "all_reduce"]
    assert len(calls) == 5 * len(got["micro_ops"]) < 5 * len(per_grad["micro_ops"])


def _intervals(records, kind):
    return [r for r in records if r["kind"] == kind and "end" in r]


@pytest.mark.parametrize("pol", ["priority", "lina"])
def test_priority_rules_hold_in_the_scheduler_log(runs2, pol):
    for r in range(2):
        got = runs2[r][pol]
        high, low = _intervals(got["records"], "high"), _intervals(got["records"], "low")
        assert high and low
        for lo in low:  # no low op starts while a high call waits or runs
            for h in high:
                assert not (h["wait"] < lo["start"] < h["end"]), (pol, r, lo, h)
        for h in high:  # with waiting on, no high interval intersects a low one (unless released, counted)
            if h["released"]:
                continue
            for lo in low:
                assert lo["end"] <= h["start"] or lo["start"] >= h["end"], (pol, r, lo, h)
        assert peak_overlap([(lo["start"], lo["end"]) for lo in low]) <= 1
        assert got["marks"], "the combine marker never fired"


def test_same_collective_sequence_on_every_rank(runs2):
    for pol in POLICIES + COALESCED[:1]:
        seqs = [runs2[r][pol]["dp_seq"] for r in range(2)]
        assert seqs[0] == seqs[1], pol


def test_four_ranks_match_the_baseline_with_random_launch_delays():
    """allclose 1e-12 on 4 ranks (ring sums change order), and per-rank random delays before every
    micro-op launch neither hang nor change the result (I7)."""
    res = run_ranks(_train, 4, ("ddp_overlap", "priority", "lina", COALESCED, DRAINED), {"launch_jitter_ms": 2.0},
                    timeout=300)
    checked = ("priority", "lina", COALESCED[0], DRAINED[0])
    for r in range(4):
        ref = res[r]["ddp_overlap"]
        for pol in checked:
            got = res[r][pol]
            assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-12, atol=0)
            for n, p in ref["params"].items():
                assert torch.allclose(got["params"][n], p, rtol=1e-12, atol=1e-12), (pol, n)  # key bias: zero true grad
    for pol in checked:
        assert all(res[r][pol]["dp_seq"] == res[0][pol]["dp_seq"] for r in range(4))


@pytest.mark.parametrize("opts,over,msg", [
    ({"policy": "oracle"}, {}, "policy must be one of"),
    ({"bogus": 1}, {}, "unknown lina option"),
    ({"partition_bytes": 4}, {}, "below one float64 element"),
    ({"max_inflight": 0}, {}, "max_inflight must be >= 1"),
    ({"drain_inflight": -1}, {}, "drain_inflight must be >= 0"),
    ({"max_inflight": 2, "drain_inflight": 1}, {}, "drain_inflight lifts the in-flight bound"),
    ({"policy": "lina_pipe", "a2a_chunks": 1000}, {}, "a2a_chunks=1000 must lie in 1..C"),
    ({"policy": "lina_pipe"}, {"model.moe.dispatcher": "sparse"}, "set model.moe.dispatcher='dense'"),
    ({}, {"parallel.nproc": 1}, "parallel.nproc must be >= 2"),
    ({"experts_per_device": 3}, {}, "must be a power of two dividing"),
    ({"experts_per_device": 2}, {"model.moe.dispatcher": "sparse"}, "expert packing runs the dense dispatcher"),
    ({"experts_per_device": 2}, {"model.moe.num_experts": 8, "parallel.nproc": 3},
     "ranks per expert block must divide"),
    ({"launch_jitter_ms": -1}, {}, "launch_jitter_ms must be >= 0"),
    ({"partition_bytes": 1024, "coalesce_bytes": 2048}, {}, "coalesce_bytes must lie in 0..partition_bytes"),
    ({"policy": "priority", "coalesce_bytes": 8}, {}, "coalesce_bytes packs the micro-ops of the partitioned"),
    ({"policy": "fixed", "launch_agreement": "plan"}, {}, "launch_agreement='plan' plans the priority scheduler"),
    ({"policy": "ddp_overlap", "launch_agreement": "plan"}, {}, "has none to plan"),
])
def test_bad_input_is_a_config_error_before_launch(opts, over, msg):
    from moelab.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=msg):
        RunConfig().with_overrides({**TINY_TRAIN, **BASE, "parallel.nproc": 2, "parallel.strategy_options": opts,
                                    **over}).validate()


def test_pipelined_all_to_all_chunks_m1_bitwise_m3_allclose():
    """``lina_pipe``: a2a_chunks=1 is the unchunked path bit for bit, 3 chunks allclose (I3), and the
    scheduler saw every chunk's all-to-all (3 per direction per layer)."""
    res1 = run_ranks(_train, 2, ("ddp_overlap", "lina_pipe"), {"a2a_chunks": 1}, timeout=300)
    res3 = run_ranks(_train, 2, ("lina_pipe",), {"a2a_chunks": 3}, timeout=300)
    for r in range(2):
        ref, one, three = res1[r]["ddp_overlap"], res1[r]["lina_pipe"], res3[r]["lina_pipe"]
        assert one["losses"] == ref["losses"]
        for n, p in ref["params"].items():
            assert torch.equal(one["params"][n], p), n
            assert torch.allclose(three["params"][n], p, rtol=1e-10, atol=1e-12), n
        a2a = [h for h in three["records"] if h["kind"] == "high" and h["op"] == "all_to_all"]
        a2a1 = [h for h in one["records"] if h["kind"] == "high" and h["op"] == "all_to_all"]
        assert len(a2a) == 3 * len(a2a1)
        # each pipelined backward holds the scheduler: no micro-op starts between its chunks
        lows = [lo["start"] for lo in _intervals(three["records"], "low")]
        assert len(three["held"]) == len([h for h in a2a1 if h["phase"] == "bwd"]) // 2 and lows
        assert not [t for t in lows for a, b in three["held"] if a < t < b]


def _packed(rank, world, runs):
    """Train each (policy, q) and return the losses and every expert's parameters by global id."""
    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer

    out = {}
    for key, opts in runs.items():
        cfg = RunConfig().with_overrides({**TINY_TRAIN, **BASE, "parallel.nproc": world,
                                          "parallel.strategy_options": {"partition_bytes": S, **opts}}).validate()
        tr = Trainer.build(cfg)
        losses = [row["loss"] for row in tr.run()]
        experts = {}
        for li, layer in enumerate(tr.model.moe_layers()):
            ex = layer.experts
            for s, e in enumerate(ex.experts):
                experts[(li, e)] = torch.cat([p[s].detach().reshape(-1) for p in (ex.w1, ex.b1, ex.w2, ex.b2)]).clone()
        dense = torch.cat([p.detach().reshape(-1) for p in tr.model.dense_parameters()]).clone()
        out[key] = dict(losses=losses, experts=experts, dense=dense)
        tr.close()  # the communication thread, then the groups (handed on to the next run)
    return out


def test_packing_trains_the_unpacked_model_and_keeps_replicas_identical():
    """q in {1, 2, 4} on 4 ranks, E = 4 (q = 4: every rank holds every expert, pure data parallelism)
    train the q = 1 model (I2); the copies of an expert are identical after every run; the EP
    baseline at Lina's EP degree (``ddp_overlap`` with q = 2) too."""
    runs = {"q1": {"policy": "ddp_overlap"}, "q2": {"policy": "lina", "experts_per_device": 2},
            "q4": {"policy": "lina", "experts_per_device": 4}, "full": {"policy": "lina_full", "a2a_chunks": 2},
            "base_q2": {"policy": "ddp_overlap", "experts_per_device": 2}}
    res = run_ranks(_packed, 4, runs, timeout=300)
    ref = res[0]["q1"]
    ref_experts = {k: v for r in range(4) for k, v in res[r]["q1"]["experts"].items()}
    for key in runs:
        for r in range(4):
            got = res[r][key]
            assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-10), key
            assert torch.allclose(got["dense"], ref["dense"], rtol=1e-9, atol=1e-12), key
            for k, v in got["experts"].items():
                assert torch.allclose(v, ref_experts[k], rtol=1e-9, atol=1e-12), (key, k)
                for r2 in range(4):  # every other copy of this expert is the same tensor, bit for bit
                    other = res[r2][key]["experts"].get(k)
                    assert other is None or torch.equal(other, v), (key, k, r, r2)
    assert len(res[0]["q4"]["experts"]) == 2 * 4 and len(res[0]["q2"]["experts"]) == 2 * 2


def _packed_timing(rank, world):
    """Per iteration: when this rank's backward all-to-alls started, and when its packed experts' gradients
    were queued (the scheduler's perf_counter stamps, moved onto the records' time.time clock)."""
    import time

    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer

    cfg = RunConfig().with_overrides({**TINY_TRAIN, **BASE, "parallel.nproc": world, "train.iters": 3,
                                      "parallel.strategy_options": {"policy": "lina", "partition_bytes": S,
                                                                    "experts_per_device": 2}}).validate()
    tr = Trainer.build(cfg)
    tr.run()
    shift = time.time() - time.perf_counter()
    expert_groups = {layer.expert_dp_group for layer in tr.model.moe_layers()}
    out: dict = {}
    for r in tr.comm.rec.comm:
        if r.op == "all_to_all" and r.tags.get("phase") == "bwd":
            out.setdefault(r.tags.get("iter"), {"a2a": [], "experts": []})["a2a"].append(r.t_start)
    for rec in tr.update.sched.records:
        if rec["kind"] == "low" and rec["group"] in expert_groups:
            out.setdefault(rec["iter"], {"a2a": [], "experts": []})["experts"].append(rec["enqueue"] + shift)
    tr.close()
    return out


def test_packed_expert_gradients_are_queued_during_backward():
    """Spec §2.5 item 1: packed experts' gradients join the queue from the gradient-ready hook, so their
    micro-ops may launch between a layer's backward all-to-alls (before, they were queued after backward,
    behind the step's last all-to-all). With two MoE layers the second layer's expert gradients are ready
    before the first layer's all-to-alls by causality, so this holds on every rank in every iteration.
    Whether a queued op then launches in the gap is the scheduler's rule, tested on its own."""
    res = run_ranks(_packed_timing, 4, timeout=300)
    for rank, per in enumerate(res):
        assert sorted(per) == [0, 1, 2], (rank, sorted(per))
        for it, t in per.items():
            assert len(t["a2a"]) == 4 and t["experts"], (rank, it)
            assert min(t["experts"]) < max(t["a2a"]), (rank, it)


def test_leader_agreement_trains_the_same_model_and_keeps_the_leaders_rules():
    """``launch_agreement: leader``: the first rank decides every micro-op's launch (followers are told by
    a broadcast and launch at once): same parameters as the baseline, bit for bit on 2 ranks (pipelined
    in 4 chunks: allclose); the leader's launches obey the priority rules; followers' are marked forced."""
    res = run_ranks(_train, 2, ("ddp_overlap", "lina", "lina_pipe"), {"launch_agreement": "leader"}, timeout=300)
    for r in range(2):
        ref = res[r]["ddp_overlap"]
        for pol in ("lina", "lina_pipe"):
            got = res[r][pol]
            for n, p in ref["params"].items():
                same = torch.equal(got["params"][n], p) if pol == "lina" else \
                    torch.allclose(got["params"][n], p, rtol=1e-10, atol=1e-12)
                assert same, (pol, n)
            low = _intervals(got["records"], "low")
            assert low and all(lo.get("forced", False) == (r == 1) for lo in low)
            if r == 0:
                high = _intervals(got["records"], "high")
                assert not any(h["wait"] < lo["start"] < h["end"] for lo in low for h in high)


def _train_planned(rank, world, policies, opts, overrides=None):
    """:func:`_train` with a planner that ignores durations: a window with free time takes the next op queued by
    its call, one per window (so ops reach every window that has free time, not only the first), and the
    cross-rank launch plan is exercised alike on a loaded host and an idle one."""
    import moelab.strategies.lina.priority as priority

    def one_per_window(free, queued, durations):
        out, k = [], 0
        for f, q in zip(free, queued):
            k = max(k, min(k + 1, int(q), len(durations))) if f > 0 else k
            out.append(k)
        return out

    priority.plan_windows = one_per_window
    return _train(rank, world, policies, opts, overrides)


def test_plan_agreement_launches_the_same_micro_ops_in_the_same_window_on_every_rank():
    """``launch_agreement: plan``: every rank launches each micro-op in the same backward window, so no
    all-to-all ever waits on a peer's op: no release of the bounded wait, the same parameters as the
    baseline (bitwise; pipelined: allclose), and, from the second step on, ops launched in the windows the
    plan gave them. With 0.5 ms of random delay before each launch, so that ranks drift apart."""
    plan = {"launch_agreement": "plan"}
    pols = ("ddp_overlap", ("priority", "priority", plan), ("lina", "lina", plan), ("lina_pipe", "lina_pipe", plan),
            ("lina_drain4", "lina", {**plan, "drain_inflight": 4}))  # the plan beside a wider drain
    res = run_ranks(_train_planned, 2, pols, {"launch_jitter_ms": 0.5}, {"model.n_layers": 3}, timeout=300)
    for pol in ("priority", "lina", "lina_pipe", "lina_drain4"):
        windows = []
        for r in range(2):
            ref, got = res[r]["ddp_overlap"], res[r][pol]
            for n, p in ref["params"].items():
                same = torch.equal(got["params"][n], p) if pol != "lina_pipe" else \
                    torch.allclose(got["params"][n], p, rtol=1e-10, atol=1e-12)
                assert same, (pol, n)
            assert got["stalls"] == 0 and len(got["plans"]) == 5, (pol, r)
            low = _intervals(got["records"], "low")
            windows.append({(lo["iter"], lo["name"]): lo["window"] for lo in low})
            last = {it: max(w for (i, _), w in windows[-1].items() if i == it) for it in range(5)}
            assert all(w == last[0] for (i, _), w in windows[-1].items() if i == 0)  # step 0: all at the drain
            early = [k for k, w in windows[-1].items() if k[0] >= 1 and w < last[k[0]]]
            assert early, (pol, r, got["plans"])  # later steps: ops launched in backward's windows
            high = [h for h in _intervals(got["records"], "high") if h.get("window") is not None]
            # a planned op never runs beside a backward all-to-all of its own rank (from its start to its wait;
            # a pipelined layer's chunk calls are waited after its last chunk: no window inside the layer)
            assert not [lo for lo in low for h in high if lo["start"] < h["end"] and h["start"] < lo["end"]], (pol, r)
        assert windows[0] == windows[1], pol


def test_plan_windows_fills_each_window_in_fifo_order_within_its_free_time_and_queue():
    from moelab.strategies.lina.priority import plan_windows

    # windows of 5, 0 and 4 s; ops of 2, 2, 2, 3, 1 s, all queued
    assert plan_windows([5, 0, 4], [5, 5, 5], [2, 2, 2, 3, 1]) == [2, 2, 3]
    # an op not queued by its window's call waits, and the ops behind it
    assert plan_windows([5, 0, 4], [1, 5, 5], [2, 2, 2, 3, 1]) == [1, 1, 3]
    # an op longer than every window holds the FIFO: the rest go at the drain
    assert plan_windows([5, 5], [3, 3], [1, 9, 1]) == [1, 1]
    assert plan_windows([], [], [1.0]) == []


def test_micro_op_plan_packs_only_consecutive_small_gradients_of_one_group():
    from moelab.strategies.lina.update import micro_op_plan

    sizes = [(4, 4), (2, 4), (100, 4), (1, 4), (3, 4), (2, 4), (2, 4), (50, 4), (2, 4)]  # (numel, bytes each)
    groups = ["dp"] * 5 + ["edp"] * 2 + ["dp"] * 2
    per_grad = micro_op_plan(sizes, groups, 64)
    assert all(len(op) == 1 for op in per_grad)  # coalesce_bytes 0: the spec's one gradient per micro-op
    plan = micro_op_plan(sizes, groups, 64, 16)
    assert [[i for i, _, _ in op] for op in plan] == [
        [0, 1], [2], [2], [2], [2], [2], [2], [2], [3, 4], [5, 6], [7], [7], [7], [7], [8]]
    assert [m for op in plan for m in op] == [m for op in per_grad for m in op]  # the same spans, same order
    assert all(sum((b - a) * sizes[i][1] for i, a, b in op) <= 64 for op in plan)
    # a run breaks where the next would pass S: 5 gradients of 16 bytes under S = 40 -> 2 + 2 + 1
    assert [len(op) for op in micro_op_plan([(4, 4)] * 5, ["dp"] * 5, 40, 16)] == [2, 2, 1]
