"""Iteration skeleton seams: side-stream ops beside attention, per-iteration plans in simulate_real,
stream priority through the skeleton, a host's shared cores and per-op overhead from the profile."""
import dataclasses

import numpy as np
import pytest

from moelab.config import RunConfig
from moelab.measure.validate import simulate_real
from moelab.placement import Placement
from moelab.sim import ClusterProfile, costs, simulate, synthetic_loads
from moelab.sim.graphs import ep_iteration_graph, graph_bytes, route_matrix, topology_of, transformer_iteration_graph

GB = 1e9


def prof(**kw):
    base = ClusterProfile(name="t", nodes=1, gpus_per_node=4, gpu="x", peak_flops=1e9, achieved_flops=1e9,
                          intra_bw_GBps=1.0, intra_latency_us=10.0, inter_bw_GBps=1.0, inter_latency_us=10.0,
                          mem_GB=1.0)
    return dataclasses.replace(base, **kw)


def cfg4(**kw):
    return RunConfig().with_overrides({"parallel.nproc": 4, "model.moe.num_experts": 4, "model.moe.top_k": 2,
                                       "model.n_layers": 2, "model.d_model": 16, "model.d_ff": 32,
                                       "model.seq_len": 8, "train.batch_size": 2, **kw})


def _ep_hooks():
    """The EP baseline's MoE stages, to build the skeleton with extra seams in a test."""
    def fwd(ctx, i, j, deps):
        return [ctx.experts(r, f"L{i}.experts.fwd", 1, deps, i, "fwd") for r in ctx.ranks]

    def bwd(ctx, i, j, deps):
        return [ctx.experts(r, f"L{i}.experts.bwd", 1, (deps[r],), i, "bwd") for r in ctx.ranks]

    return fwd, bwd


def _prefetch_graph(c, p, seconds):
    """A Hecate-like prefetch of ``seconds`` on its own stream beside every attention."""
    def beside(ctx, i, phase, deps):
        return [ctx.g.add(f"L{i}.prefetch.{phase}", r, stream="prefetch", duration=seconds, deps=(deps[r],),
                          category="prefetch", kind="comm", layer=i, phase=phase) for r in ctx.ranks]

    loads = synthetic_loads(c, seed=0)
    return transformer_iteration_graph(c, p, loads, Placement.expert_parallel(4, 4), *_ep_hooks(),
                                       beside_attention=beside)[0]


def test_side_stream_ops_run_beside_attention():
    c, p = cfg4(), prof()
    base = simulate(transformer_iteration_graph(c, p, synthetic_loads(c, seed=0), Placement.expert_parallel(4, 4),
                                                *_ep_hooks())[0])
    t_attn = costs.compute_time(costs.attention_flops(16, 16, 8), p)
    short = simulate(_prefetch_graph(c, p, 0.5 * t_attn))
    ops = short.ops_frame().set_index("name")
    for i in range(2):
        for ph in ("fwd", "bwd"):  # issued with the attention, on another stream, at the same instant
            pf, at = ops.loc[f"L{i}.prefetch.{ph}"], ops.loc[f"L{i}.attn.{ph}"]
            assert (pf.start.to_numpy() == at.start.to_numpy()).all()
    assert short.makespan == pytest.approx(base.makespan)  # hidden behind the attention
    extra = 3 * t_attn
    long = simulate(_prefetch_graph(c, p, t_attn + extra))
    ops = long.ops_frame().set_index("name")
    # what follows the attention waits for the side op: the gate starts when the prefetch ends
    assert (ops.loc["L0.gate.fwd"].start.to_numpy() == ops.loc["L0.prefetch.fwd"].end.to_numpy()).all()
    # exposed: all of it beside the forward attention, what exceeds the 2x longer backward one there
    assert long.makespan == pytest.approx(base.makespan + 2 * extra + 2 * (extra - t_attn))


def test_stream_priority_through_the_skeleton():
    """Two side transfers on one rank's port, beside attention: the prioritised stream finishes first."""
    c, p = cfg4(), prof()
    port = ("intra_out", 0)

    def beside(ctx, i, phase, deps):
        if i or phase != "fwd":
            return None
        a = ctx.g.add("grads", 0, stream="grad", links={port: 1e6}, deps=(deps[0],), kind="comm")
        b = ctx.g.add("a2a", 0, stream="a2a", links={port: 1e6}, deps=(deps[0],), kind="comm")
        return [b, None, None, None] if a < b else None

    def run(priority):
        g = transformer_iteration_graph(c, p, synthetic_loads(c), Placement.expert_parallel(4, 4), *_ep_hooks(),
                                        beside_attention=beside, stream_priority=priority)[0]
        o = simulate(g).ops_frame().set_index("name")
        return o.loc["a2a"].end - o.loc["a2a"].start, o.loc["grads"].end - o.loc["grads"].start

    a2a, grads = run(None)
    assert a2a == pytest.approx(2e-3) and grads == pytest.approx(2e-3)  # fair: each at half of 1 GB/s
    a2a, grads = run({"a2a": 1})
    assert a2a == pytest.approx(1e-3)  # alone on the port: the gradients wait
    assert grads >= 2e-3 - 1e-12  # then 1 ms alone (later shared with the layer's small count exchange)


def test_simulate_real_prices_each_iteration_with_its_own_placement_and_loads():
    c = cfg4(**{"parallel.topology.nodes": 2})
    loads = np.stack([synthetic_loads(c, seed=s, skew=2.0) for s in range(3)])
    pls = [Placement.expert_parallel(4, 4), Placement.from_mapping({0: [0, 1], 1: [1], 2: [2], 3: [3]}, 4, 4),
           Placement.from_mapping({0: [0], 1: [1], 2: [2, 0], 3: [3]}, 4, 4)]
    run = simulate_real(c, loads, prof(nodes=2, gpus_per_node=2), placement=pls)
    topo = topology_of(c)
    for it in range(3):
        want = graph_bytes(ep_iteration_graph(c, prof(nodes=2, gpus_per_node=2), loads[it], pls[it]), topo)
        got = run.bytes[run.bytes.iter == it].groupby("rank")[["bytes_local", "bytes_intra", "bytes_inter"]].sum()
        for r in range(4):
            assert [int(got.loc[r, f"bytes_{k}"]) for k in ("local", "intra", "inter")] == \
                [want[r][k] for k in ("local", "intra", "inter")]
        # the all-to-all of this iteration moves exactly its own route matrix (not an average's)
        a2a = run.bytes[(run.bytes.iter == it) & (run.bytes.op == "all_to_all")]
        mat = sum(route_matrix(pls[it], L) for L in loads[it])
        off = (mat.sum() - np.trace(mat)) * c.model.d_model * 4 * 4  # 4 all-to-alls per layer, fp32
        assert int(a2a.bytes_intra.sum() + a2a.bytes_inter.sum()) == off
    one = simulate_real(c, loads, prof(nodes=2, gpus_per_node=2), placement=pls[1])
    assert not one.bytes[one.bytes.iter == 0].equals(run.bytes[run.bytes.iter == 0])
    with pytest.raises(ValueError, match="placements"):
        simulate_real(c, loads, prof(nodes=2, gpus_per_node=2), placement=pls[:2])


def test_shared_cores_and_op_overhead_from_the_profile():
    """4 ranks computing together on 2 shared cores take twice as long as on their own devices; the
    per-op overhead adds its seconds to every compute op."""
    c = cfg4()
    loads = synthetic_loads(c, seed=0)
    free = simulate(ep_iteration_graph(c, prof(intra_latency_us=0.0), loads))
    shared = simulate(ep_iteration_graph(c, prof(intra_latency_us=0.0, shared_cores=2), loads))
    comp = lambda r: r.ops_frame().query("kind == 'compute'").groupby("name").duration.max()  # noqa: E731
    ratio = comp(shared) / comp(free)
    assert ratio["L0.attn.fwd"] == pytest.approx(2.0) and ratio["head.bwd"] == pytest.approx(2.0)
    g = ep_iteration_graph(c, prof(op_overhead_s=1e-3), loads)
    g0 = ep_iteration_graph(c, prof(), loads)
    n_comp = sum(1 for o in g0.ops if o.kind == "compute" and o.duration > 0)
    extra = sum(o.duration for o in g.ops) - sum(o.duration for o in g0.ops)
    assert extra == pytest.approx(1e-3 * n_comp)
