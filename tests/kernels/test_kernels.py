"""The Triton kernels against their torch references, on the CPU through Triton's interpreter (small
shapes; the GPU suite runs the same comparisons on large ones): the fused router for k in {1, 2, 4, 8},
permute / unpermute forward and backward, empty experts, one hot expert, dropped slots; the selector."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is built: the CPU runs them

import pytest
import torch

from moelab import kernels as K
from moelab.config import MoEConfig
from moelab.kernels import permute as P
from moelab.kernels.router import route_torch, route_triton
from moelab.moe.dispatch import combine_slots
from moelab.moe.routing import finish_routing

pytest.importorskip("triton")
torch.set_num_threads(1)


def _logits(T, E, seed=0, hot=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, E, generator=g, dtype=torch.float64)
    if hot is not None:
        x[:, hot] += 20.0  # every token's first choice
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("T, E", [(1, 8), (37, 8), (130, 12), (200, 64)])
def test_router_matches_the_reference(T, E, k, dtype):
    x = _logits(T, E, seed=T * E + k, dtype=dtype)
    idx, w, loc = route_triton(x, k, block_t=32)
    ridx, rw, rloc = route_torch(x, k)
    assert torch.equal(idx, ridx) and torch.equal(loc, rloc) and w.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(w, rw, rtol=tol, atol=tol)
    # the reference is what the topk gate computes (dropless): idx, renormalized weights, DeepSpeed positions
    cfg = MoEConfig(num_experts=E, top_k=k, capacity_factor=None)
    gate = finish_routing(x, ridx, torch.softmax(torch.topk(x, k, dim=-1).values, dim=-1), cfg)
    assert torch.equal(gate.idx, idx) and torch.equal(gate.loc, loc)


def test_router_hot_expert_and_empty_batch():
    x = _logits(100, 16, hot=5)
    idx, w, loc = route_triton(x, 4, block_t=16)
    assert (idx[:, 0] == 5).all() and torch.equal(loc[:, 0], torch.arange(100))  # first choices in token order
    assert torch.equal(loc, route_torch(x, 4)[2])
    for part in route_triton(torch.zeros(0, 8), 2):
        assert part.shape == (0, 2)


@pytest.mark.parametrize("k, E", [(9, 16), (5, 4), (0, 4)])
def test_router_rejects_a_top_k_it_cannot_do(k, E):
    with pytest.raises(ValueError, match="top_k must be in"):
        route_triton(_logits(4, E), k)


def _routing(T, E, k, seed, hot=None, drop_every=4):
    idx = torch.topk(_logits(T, E, seed, hot), k, dim=-1).indices
    if drop_every:
        idx[::drop_every, -1] = -1  # dropped slots (over capacity)
    return idx


CASES = [(20, 4, 2, 8, None), (33, 16, 3, 70, None), (40, 32, 2, 16, None),  # E=32 > slots: empty experts
         (25, 8, 4, 12, 3), (6, 4, 1, 5, None), (0, 4, 2, 8, None)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T, E, k, D, hot", CASES)
def test_permute_unpermute_forward_and_backward(T, E, k, D, hot, dtype):
    idx = _routing(T, E, k, seed=T + D, hot=hot)
    plan = P.plan(idx, E)
    assert plan.counts.sum() == (idx >= 0).sum() and int(plan.counts.sum()) == plan.src.numel()
    out = {}
    for impl in ("torch", "triton"):
        g = torch.Generator().manual_seed(7)
        x = torch.randn(T, D, generator=g, dtype=dtype).requires_grad_()
        w = torch.rand(T, k, generator=g, dtype=dtype).requires_grad_()
        rows = P.permute(x, plan, impl)
        y = P.unpermute(torch.tanh(rows), w, plan, impl)
        (y * torch.linspace(-1, 1, D, dtype=dtype)).sum().backward()
        out[impl] = (rows.detach(), y.detach(), x.grad, w.grad)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(out["torch"], out["triton"]):
        torch.testing.assert_close(a, b, **tol)
    # the layout: expert-contiguous, token order inside; and the combine the dispatchers use
    x = torch.randn(T, D, dtype=dtype)
    rows = P.permute(x, plan)
    experts = idx.reshape(-1)[plan.slot]
    assert torch.equal(experts, torch.sort(experts, stable=True).values) and torch.equal(rows, x[plan.src])
    slots = torch.zeros(T * k, D, dtype=dtype)
    keep = idx.reshape(-1) >= 0
    slots[keep] = x.repeat_interleave(k, 0)[keep]
    w = torch.rand(T, k, dtype=dtype)
    torch.testing.assert_close(P.unpermute(rows, w, plan, "triton"), combine_slots(slots, w * keep.view(T, k)), **tol)


def test_permute_unpermute_gradients_are_the_true_ones():
    idx = _routing(9, 5, 2, seed=3)
    plan = P.plan(idx, 5)
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    w = torch.rand(9, 2, dtype=torch.float64, requires_grad=True)
    for impl in ("torch", "triton"):
        assert torch.autograd.gradcheck(lambda a, b: P.unpermute(P.permute(a, plan, impl) ** 2, b, plan, impl), (x, w))


# ---- the selector --------------------------------------------------------------------------------------
def test_selector_picks_and_explains(monkeypatch):
    assert K.select("torch", "cpu") == "torch" and K.select("auto", "cpu") == "torch"
    assert K.select("triton", "cpu") == "triton"  # the interpreter is on in this file
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(K.KernelUnavailable, match="runs on CUDA devices.*TRITON_INTERPRET=1"):
        K.select("triton", "cpu")
    monkeypatch.setattr(K, "triton_installed", lambda: False)
    with pytest.raises(K.KernelUnavailable, match="pip install triton"):
        K.select("triton", "cuda")
    assert K.select("auto", "cuda") == "torch"
    with pytest.raises(ValueError, match="must be one of"):
        K.select("cuda", "cpu")


# ---- grouped GEMM --------------------------------------------------------------------------------------
GEMM_CASES = [([5, 0, 40, 3], 24, 40), ([70], 16, 8), ([0, 0, 9, 0], 33, 17), ([1, 1, 1, 1, 1, 1, 1, 90], 20, 12)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts, d, f", GEMM_CASES)
def test_grouped_gemm_forward_and_both_backward_gemms(counts, d, f, dtype):
    from moelab.kernels.grouped_gemm import grouped_mm

    g = torch.Generator().manual_seed(sum(counts) + d)
    x = torch.randn(sum(counts), d, generator=g).to(dtype)
    w = (torch.randn(len(counts), d, f, generator=g) / d ** 0.5).to(dtype)
    dy = torch.randn(sum(counts), f, generator=g).to(dtype)
    got = {}
    for impl in ("triton", "torch"):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_mm(xi, wi, counts, impl)
        y.backward(dy)
        got[impl] = (y, xi.grad, wi.grad)
    # the truth: an fp64 per-expert loop on the same (rounded) inputs
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
    xd, wd, dyd = x.double(), w.double(), dy.double()
    truth = (torch.cat([xd[starts[e]:starts[e + 1]] @ wd[e] for e in range(len(counts))]),
             torch.cat([dyd[starts[e]:starts[e + 1]] @ wd[e].T for e in range(len(counts))]),
             torch.stack([xd[starts[e]:starts[e + 1]].T @ dyd[starts[e]:starts[e + 1]] for e in range(len(counts))]))
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]  # bf16: the output rounding
    for name, a, b in zip(("y", "dx", "dw"), got["triton"], truth):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol, msg=name)
    for a, b in zip(got["triton"], got["torch"]):  # and the per-expert-loop reference the selector falls back to
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def test_grouped_gemm_rejects_counts_that_do_not_cover_the_rows():
    from moelab.kernels.grouped_gemm import grouped_mm

    with pytest.raises(ValueError, match="one block per expert"):
        grouped_mm(torch.zeros(5, 4), torch.zeros(2, 4, 3), [2, 2])
    with pytest.raises(ValueError, match="one block per expert"):
        grouped_mm(torch.zeros(5, 4), torch.zeros(2, 4, 3), [5])


# ---- cross-polytope LSH hashing -----------------------------------------------------------------------------
@pytest.mark.parametrize("A, d, r, L, dtype", [(50, 16, 2, 6, torch.float64), (70, 40, 3, 4, torch.float32),
                                               (33, 8, 1, 3, torch.float64), (0, 8, 2, 2, torch.float32)])
def test_lsh_hash_matches_the_strategy_s_hash_and_key(A, d, r, L, dtype):
    from moelab.kernels.lsh import hash_torch, hash_triton, key_fits
    from moelab.strategies.lsh_moe.buckets import mixed_radix_keys
    from moelab.strategies.lsh_moe.hashing import cross_polytope, rotations

    g = torch.Generator().manual_seed(A + d)
    x = torch.randn(A, d, generator=g, dtype=torch.float64).to(dtype)
    x[: min(A, 3)] = 0  # all projections 0: a tie, which goes to the first vertex as in torch's argmax
    R = rotations(d, r, L, seed=0, layer=1)
    expert = torch.randint(0, 8, (A,), generator=g)
    codes, key = hash_triton(x, R, expert)
    assert torch.equal(codes, cross_polytope(x, R)) and torch.equal((codes, key)[1], hash_torch(x, R, expert)[1])
    assert key_fits(8, r, L)
    ref = mixed_radix_keys(torch.cat([expert.unsqueeze(1), codes], 1), [8] + [2 * r] * L)
    assert torch.equal(key, ref)
    assert not key_fits(64, 8, 16)  # (2r)^L past int64: the bucketing's unique-rows path


# ---- in the model: model.moe.kernels ---------------------------------------------------------------------------
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_moe_layer_with_triton_kernels_equals_torch(capacity_factor):
    from moelab.moe.layer import MoELayer

    got = {}
    for kernels in ("torch", "triton"):
        layer = MoELayer(16, 32, MoEConfig(num_experts=4, top_k=2, kernels=kernels, capacity_factor=capacity_factor),
                         dtype=torch.float64)
        x = torch.randn(30, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        y = layer(x)
        (y.sum() + layer.aux_loss).backward()
        got[kernels] = (y, x.grad, layer.gate.wg.weight.grad, layer.experts.w1.grad, layer.experts.b2.grad)
    for a, b in zip(*got.values()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_on_two_gloo_ranks_with_triton_kernels_equals_torch():
    from moelab.runtime.ranks import run_ranks
    from moelab.testing import train_snapshot

    triton_run = run_ranks(train_snapshot, 2, {"model.moe.kernels": "triton"}, timeout=240)
    torch_run = run_ranks(train_snapshot, 2, {}, timeout=240)
    for a, b in zip(triton_run, torch_run):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-10)
        assert a["experts"].keys() == b["experts"].keys()
        for key in a["experts"]:
            torch.testing.assert_close(a["experts"][key], b["experts"][key], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a["dense"], b["dense"], rtol=1e-10, atol=1e-12)


def test_config_refuses_kernels_that_cannot_run(monkeypatch):
    from moelab.config import ConfigError, RunConfig

    cfg = RunConfig()
    assert cfg.short_hash() == cfg.with_overrides({"model.moe.kernels": "torch"}).short_hash()
    assert cfg.short_hash() != cfg.with_overrides({"model.moe.kernels": "triton"}).short_hash()
    with pytest.raises(ConfigError, match="model.moe.kernels must be one of"):
        cfg.with_overrides({"model.moe.kernels": "cuda"}).validate()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="runs on CUDA devices"):
        cfg.with_overrides({"model.moe.kernels": "triton", "parallel.backend": "gloo"}).validate()
    cfg.with_overrides({"model.moe.kernels": "auto", "parallel.backend": "gloo"}).validate()  # falls back to torch
