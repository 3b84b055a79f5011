"""What Lina's benchmark and figures read from a run's call records (:mod:`moelab.papers.lina.runs`):
busy times from issue to finish, and the all-to-all time an all-reduce moved beside."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from moelab.papers.lina.runs import a2a_beside_allreduce, a2a_times


def _calls(rows):
    return pd.DataFrame(rows, columns=["rank", "iter", "op", "phase", "t_start", "t_done", "t_end"])


def test_busy_time_runs_from_issue_to_finish_not_to_the_wait():
    # rank 0: two chunk calls overlapping, the second waited long after it finished; rank 1: one call
    c = _calls([(0, 0, "all_to_all", "bwd", 0.0, 2.0, 2.0), (0, 0, "all_to_all", "bwd", 1.0, 3.0, 9.0),
                (1, 0, "all_to_all", "bwd", 0.0, 1.0, 1.0), (1, 0, "all_to_all", "fwd", 5.0, 6.0, 6.0)])
    assert a2a_times(c, "bwd") == pytest.approx((3.0 + 1.0) / 2)
    assert a2a_times(c) == pytest.approx((3.0 + 2.0) / 2)


def test_the_share_of_all_to_all_time_an_all_reduce_of_the_same_rank_moved_beside():
    c = _calls([(0, 0, "all_to_all", "bwd", 0.0, 4.0, 4.0), (0, 0, "all_reduce", "grad_sync", 3.0, 6.0, 6.0),
                (1, 0, "all_to_all", "bwd", 0.0, 4.0, 4.0), (0, 1, "all_reduce", "grad_sync", 0.0, 4.0, 4.0),
                (1, 1, "all_to_all", "bwd", 10.0, 12.0, 12.0), (1, 1, "all_reduce", "grad_sync", 9.0, 13.0, 13.0)])
    # rank 0 iter 0: 1 of 4 s; rank 1 iter 0: 0 of 4 (rank 0's all-reduce of iter 1 is another iteration);
    # rank 1 iter 1: 2 of 2
    assert a2a_beside_allreduce(c) == pytest.approx((1.0 + 0.0 + 2.0) / (4 + 4 + 2))
    assert a2a_beside_allreduce(c[c.op == "all_to_all"]) == 0.0
    assert math.isnan(a2a_beside_allreduce(c[c.op == "all_reduce"]))


def test_the_packing_controller_times_a_dispatch_micro_op_from_issue_to_finish():
    from types import SimpleNamespace

    from moelab.comm.record import CommRecord
    from moelab.strategies.lina.packing import micro_op_times

    tags = {"iter": 3, "chunk": 0, "a2a": "dispatch"}
    rec = SimpleNamespace(
        spans=[("experts chunk 0", "expert", 1.0, 1.5, {"iter": 3}),
               ("experts chunk 0", "expert", 0.0, 9.0, {"iter": 1})],
        comm=[CommRecord("all_to_all", "ep", 0.0, 2.0, dict(tags), t_done=0.25),  # waited late: done at 0.25
              CommRecord("all_to_all", "ep", 0.0, 1.0, {**tags, "chunk": 1}),
              CommRecord("all_to_all", "ep", 0.0, 0.75, {**tags, "iter": 4})])
    assert micro_op_times(rec, [3]) == (0.5, 0.25)


def test_fig1_names_each_layers_all_to_alls_by_their_place_and_counts_a_layer_that_makes_more():
    from moelab.papers.lina.layer_views import dp_ep_step, layer_routing

    rows = [(0, 0, 0, "fwd", "all_gather", 0.0, 0.1), (0, 0, 0, "fwd", "all_to_all", 0.3, 0.4),
            (0, 0, 0, "fwd", "all_to_all", 0.1, 0.2),  # recorded out of order: named by start time
            (0, 0, 0, "bwd", "all_to_all", 1.0, 1.1), (0, 0, 0, "bwd", "all_to_all", 1.2, 1.3),
            (0, 0, 0, "bwd", "all_to_all", 1.4, 1.5),  # a third backward all-to-all in layer 0
            (0, 0, -1, "grad_sync", "all_reduce", 1.6, 1.9)]
    comm = pd.DataFrame(rows, columns=["rank", "iter", "layer", "phase", "op", "t_start", "t_done"])
    spans = pd.DataFrame([(0, "forward", "forward", -0.5, 0.5, 0, -1), (0, "experts", "expert", 0.25, 0.3, 0, 0),
                          (0, "attention", "attention", 0.0, 0.1, 0, 0)],
                         columns=["rank", "name", "cat", "t_start", "t_end", "iter", "layer"])
    tl, counts = dp_ep_step(comm, spans)
    a2a = tl[tl.name.str.contains("a2a|all-to-all")].sort_values("start")
    assert list(a2a.name) == ["a2a dispatch", "a2a combine", "a2a combine (grad)", "a2a dispatch (grad)",
                              "all-to-all #2"]
    assert set(tl.name) >= {"count exchange", "all-reduce", "forward", "experts"} and "attention" not in set(tl.name)
    assert tl.start.min() == 0.0 and tl.loc[tl.name == "a2a dispatch", "start"].item() == pytest.approx(0.6)
    assert counts[["fwd", "bwd"]].values.tolist() == [[2, 3]]

    loads = pd.DataFrame({"src": [0, 0, 1, 1], "expert": [0, 3, 1, 2], "tokens": [5, 7, 2, 0]})
    r = layer_routing(loads, experts_per_rank=2)
    assert r.holder.tolist() == [0, 1, 0, 1] and r.moves.tolist() == [False, True, True, False]


def test_a_layers_pass_is_read_from_its_gate_and_all_to_alls_and_the_busiest_layer_is_the_one_beside_an_all_reduce():
    from moelab.papers.lina.layer_views import layer_pass, layer_windows

    rows = []
    for layer, (g, f1, f2, b1, b2) in enumerate([(0.0, 1.0, 3.0, 10.0, 12.0), (4.0, 5.0, 6.0, 7.0, 9.0)]):
        rows += [(0, 0, layer, "fwd", "all_to_all", f1, f1 + 0.5), (0, 0, layer, "fwd", "all_to_all", f2, f2 + 0.5),
                 (0, 0, layer, "bwd", "all_to_all", b1, b1 + 0.5), (0, 0, layer, "bwd", "all_to_all", b2, b2 + 0.5)]
    rows += [(0, 0, -1, "grad_sync", "all_reduce", 10.5, 11.5)]  # beside layer 0's backward only
    comm = pd.DataFrame(rows, columns=["rank", "iter", "layer", "phase", "op", "t_start", "t_done"])
    spans = pd.DataFrame([(0, "gate", "gate", 0.2, 0.4, 0, 0), (0, "gate", "gate", 4.2, 4.4, 0, 1),
                          (0, "experts", "expert", 1.6, 2.6, 0, 0)],
                         columns=["rank", "name", "cat", "t_start", "t_end", "iter", "layer"])
    f = layer_windows(comm, spans, "fwd").set_index("layer")
    b = layer_windows(comm, spans, "bwd").set_index("layer")
    assert f.start.tolist() == [0.2, 4.2] and f.end.tolist() == [3.5, 6.5] and b.start.tolist() == [10.0, 7.0]
    assert b.end.tolist() == [12.5, 9.5] and b.a2a_calls.tolist() == [2, 2]
    fwd = layer_pass(comm, spans, "fwd")  # the middle of two layers: layer 1
    assert fwd.attrs["layer"] == 1 and fwd.attrs["span_s"] == pytest.approx(2.3)
    assert fwd.attrs["a2a_share"] == pytest.approx(1.0 / 2.3)
    busy = layer_pass(comm, spans, "bwd", busiest=True)
    assert busy.attrs["layer"] == 0 and busy.attrs["allreduce_s"] == pytest.approx(1.0)
    assert busy.start.min() == 0.0 and busy.end.max() == pytest.approx(2.5) and (busy.name == "allreduce").sum() == 1
    assert layer_pass(comm, spans, "bwd").attrs["layer"] == 1


def test_the_gpu_item_times_every_row_it_names_on_any_device():
    """§4(c)'s measurement code runs on the CPU too (tiny shapes), so a lent GPU meets tested code; the stream and
    host-to-device rows are CUDA-only."""
    from moelab.papers.lina.gpu import gpu_timings

    df = gpu_timings("cpu", d=16, f=32, heads=2, seq=8, experts=4, tokens=(4, 16), partition_MB=0.25, reps=2)
    assert set(df.what) == {"expert FFN fwd+bwd", "gate fwd (softmax, top-2)", "attention fwd",
                            *(f"cut 0.25 MB into {n} micro-ops and join" for n in (4, 16, 64))}
    assert (df.ms > 0).all() and df[df.what == "attention fwd"].tokens.tolist() == [16]
    assert df.attrs["label"].startswith("REAL: one CPU")
