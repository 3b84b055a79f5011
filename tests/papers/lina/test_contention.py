"""The baseline's contention at paper scale (moelab.papers.lina.contention): the SIMULATED ddp_overlap step forms
PyTorch DDP's own buckets and launches each when its last gradient is ready, and the contention table counts what
the step does (its figures move with the bucket size, its bounds are what any schedule could win)."""
import pytest

from moelab.papers.lina import contention
from moelab.papers.lina import paper_scale as ps
from moelab.papers.lina.common import overriding, paper


def _captured_graph(monkeypatch, cfg):
    """The baseline's graph and the gradient-ready points the skeleton handed its dense sync."""
    from moelab.sim.graphs import synthetic_loads
    from moelab.strategies.lina import sim_graph

    seen = {}
    real = sim_graph._units

    def spy(ready, *a, **kw):
        seen["ready"] = ready
        return real(ready, *a, **kw)

    monkeypatch.setattr(sim_graph, "_units", spy)
    g = sim_graph.lina_iteration_graph(cfg, ps.calibrated_profile(), synthetic_loads(cfg), elem_bytes=2)
    return g, seen["ready"]


@pytest.mark.parametrize("bucket_mb", [25.0, 5.0])
def test_the_baselines_buckets_are_the_pytorch_reducers_and_launch_when_their_last_gradient_is_ready(
        monkeypatch, bucket_mb):
    """PyTorch's own assignment (torch.distributed._compute_bucket_assignment_by_size, as the reducer rebuilds
    its buckets after the first step: gradient-ready order, a first bucket of 1 MiB, then the cap in MiB) on the
    gradients in the order the simulated backward produces them gives the simulated all-reduces' sizes."""
    import torch
    import torch.distributed as dist

    from moelab.sim import simulate

    cfg = ps.paper_config(12, 4, "ddp_overlap").with_overrides({"parallel.bucket_mb": bucket_mb})
    g, ready = _captured_graph(monkeypatch, cfg)
    params = [(k, n) for k, (_, _, sizes) in enumerate(ready) for n in sizes]
    tensors = [torch.empty(n, dtype=torch.float16) for _, n in params]
    groups, _ = dist._compute_bucket_assignment_by_size(tensors, [2**20, int(bucket_mb * 2**20)],
                                                         [False] * len(tensors), list(range(len(tensors))))
    ids = [i for i, o in enumerate(g.ops) if o.category == "allreduce"]
    assert [g.ops[i].comm["nbytes"] for i in ids] == [2 * sum(params[i][1] for i in b) for b in groups]
    res = simulate(g)
    for i, b in zip(ids, groups):  # launched once the last of its gradients is ready, not before
        assert res.start[i] >= max(res.end[d] for d in ready[params[b[-1]][0]][1]) - 1e-12


def test_the_contention_table_counts_the_baselines_step():
    df = contention.baseline_contention()
    models, experts = ps.PAPER_GRID
    assert sorted(zip(df.layers, df.experts)) == sorted((n, E) for n in models for E in experts)
    assert ((df.a2a_share_moe_fwd > 0) & (df.a2a_share_moe_fwd < 1)).all()
    assert (df.overlapped_bwd_a2a <= df.bwd_a2a).all() and (df.bwd_a2a == 2 * df.layers).all()
    assert (df.buckets_launched_in_backward < df.buckets).all()  # the embeddings' bucket: when backward ends
    assert (df.bwd_a2a_ms >= df.bwd_a2a_alone_ms).all() and (df.bound_bwd_a2a_speedup >= 1).all()
    assert (df.bound_bwd_a2a_slowdown_all_overlapped >= 1).all() and (df.bound_step_speedup >= 1).all()
    # overlapped ops slow down, and no more than every dense byte beside them could make them
    over = df.dropna(subset=["slowdown_median"])
    assert len(over) and (over.slowdown_median > 1).all()
    assert (df.paper_a2a_share_moe_fwd == paper("layer_a2a_share")).all()
    assert "SIMULATED" in df.attrs["label"] and len(contention.notes(df)) == 3


def test_smaller_buckets_put_more_all_reduce_beside_the_backward_all_to_alls():
    """The figures follow the mechanism: at 5 MiB buckets (bucket_MB's range) more buckets launch during
    backward and more backward all-to-alls are overlapped than at DDP's 25 MiB."""
    at25 = contention._row(12, 4)
    with overriding((("bucket_MB", 5.0),)):
        at5 = contention._row(12, 4)
    assert at5["buckets_launched_in_backward"] > at25["buckets_launched_in_backward"]
    assert at5["overlapped_bwd_a2a"] > at25["overlapped_bwd_a2a"]
    assert at5["dense_allreduce_alone_ms"] == pytest.approx(at25["dense_allreduce_alone_ms"], rel=0.05)


def test_overrides_are_checked_and_keep_cached_results_apart():
    from moelab.papers.kit.assumptions import AssumptionError

    with pytest.raises(AssumptionError):
        with overriding((("vocab", 1),)):  # below the stated range
            pass
    base = ps.calibration()
    with overriding((("vocab", 256),)):
        assert ps.paper_config(12, 4).model.vocab_size == 256
        other = ps.calibration()
    assert ps.paper_config(12, 4).model.vocab_size == ps.assumed("vocab") != 256 and ps.calibration() == base
    assert other["achieved_flops"] != base["achieved_flops"]  # refitted with the smaller head
