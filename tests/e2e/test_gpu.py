"""The GPU suite (``-m gpu``): the CUDA path against the CPU reference, on one GPU. Skipped, with the
reason, where no CUDA device exists (CI); ``pytest -m gpu`` on a GPU machine runs it.

- the kernels on large shapes (compiled Triton, not the interpreter) against their torch references;
- the tiny GPT-MoE trained on one rank with NCCL on the GPU equals the same run on gloo/CPU (fp64 and
  fp32), with the Triton kernels and without;
- one training step's device syncs, counted by CUDA's own detector, are the ones tests/runtime/test_device_syncs.py
  lists: 2 per MoE layer and 1 per step.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests.strategies.test_conformance import CASES as CONFORMANCE
from tests.strategies.test_conformance import IDS as CONFORMANCE_IDS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="no CUDA device: the GPU suite runs on a GPU machine only")]


@pytest.fixture(scope="module", autouse=True)
def compiled_triton():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU suite runs the compiled kernels")
    pytest.importorskip("triton")


@pytest.mark.parametrize("T, E, k", [(16384, 8, 2), (16384, 64, 6), (4096, 128, 8)])
def test_router_on_gpu(T, E, k):
    from moelab.kernels.router import route_torch, route_triton

    x = torch.randn(T, E, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    a, b = route_triton(x, k), route_torch(x, k)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("d, f, E, k, dtype", [(4096, 14336, 8, 2, torch.bfloat16), (2048, 1408, 64, 6, torch.bfloat16),
                                              (512, 1024, 16, 2, torch.float32)])
def test_permute_grouped_gemm_unpermute_on_gpu(d, f, E, k, dtype):
    from moelab.kernels import permute as P
    from moelab.kernels.grouped_gemm import grouped_mm

    T = 4096
    g = torch.Generator("cuda").manual_seed(1)
    idx = torch.topk(torch.randn(T, E, device="cuda", generator=g), k).indices
    plan = P.plan(idx, E)
    x = torch.randn(T, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    w = (torch.randn(E, d, f, device="cuda", generator=g) / d ** 0.5).to(dtype).requires_grad_()
    weights = torch.rand(T, k, device="cuda", generator=g).to(dtype)
    outs = {}
    for impl in ("triton", "torch"):
        x.grad = w.grad = None
        rows = P.permute(x, plan, impl)
        y = P.unpermute(grouped_mm(rows, w, plan.counts, impl), weights, plan, impl)
        y.float().square().mean().backward()
        outs[impl] = (y.detach().float(), x.grad.float(), w.grad.float())
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    for a, b in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _train(device: str, overrides: dict) -> list:
    import torch.distributed as dist

    from moelab.config import RunConfig
    from moelab.runtime.ranks import hosted_store
    from moelab.runtime.train import Trainer
    from moelab.testing import TINY_TRAIN

    store = hosted_store(60)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1)
    try:
        backend = "nccl" if device == "cuda" else "gloo"
        cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": 1, "parallel.backend": backend,
                                          **overrides}).validate()
        tr = Trainer.build(cfg, torch.device(device))
        return [row["loss"] for row in tr.run()]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("overrides", [{}, {"model.moe.kernels": "triton"}, {"train.dtype": "float32"}])
def test_tiny_gpt_moe_on_one_gpu_equals_the_cpu_run(overrides):
    cpu = _train("cpu", {k: v for k, v in overrides.items() if k != "model.moe.kernels"})
    gpu = _train("cuda", overrides)
    rel = 1e-9 if overrides.get("train.dtype", "float64") == "float64" else 1e-4
    assert gpu == pytest.approx(cpu, rel=rel)


def test_device_syncs_of_one_step_on_gpu():
    import torch.distributed as dist

    from moelab.config import RunConfig
    from moelab.runtime.ranks import hosted_store
    from moelab.runtime.train import Trainer
    from moelab.testing import TINY_TRAIN

    store = hosted_store(60)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": 1, "parallel.backend": "nccl"}).validate()
        tr = Trainer.build(cfg, torch.device("cuda"))
        tr.step(0)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                tr.step(1)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        assert len(syncs) <= 2 * len(tr.model.moe_layers()) + 1, syncs
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", range(len(CONFORMANCE)), ids=CONFORMANCE_IDS)
def test_every_strategy_layer_on_one_gpu_matches_the_cpu_reference(case):
    """The conformance suite's layer cases (every strategy and option set, every edge load) at world size 1
    on CUDA in fp64, against the single-process fp64 reference computed on the CPU."""
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.config import ConfigError, MoEConfig
    from moelab.moe.layer import MoELayer
    from moelab.registry import get
    from tests.strategies.test_conformance import CASES, LOADS, MOE, D, F, _reference, bias_gate, make_inputs, run_cfg

    name, opts, changes_model = CASES[case]
    if changes_model:
        pytest.skip(f"{name} {opts} routes differently on purpose")
    try:
        cfg = run_cfg(name, opts, 1)
    except ConfigError as e:
        pytest.skip(f"{name} rejects one rank: {str(e).splitlines()[-1]}")
    cls = get(name).layer_class(cfg) or MoELayer
    for load, (t2, _, hot) in LOADS.items():
        tokens = [sum(t2)]
        ref = _reference(tokens, hot)
        xs, gys = make_inputs(tokens, hot)
        layer = cls(D, F, MoEConfig(**MOE), layer_id=3, seed=7, comm=Communicator(Topology(1, 1)),
                    dtype=torch.float64).cuda()
        bias_gate(layer.gate, hot)
        x = xs[0].cuda().requires_grad_()
        y = layer(x)
        ((y * gys[0].cuda()).sum() + layer.aux_loss).backward()
        torch.testing.assert_close(y.cpu(), ref["y"][0], rtol=1e-9, atol=1e-10, msg=f"{load}: outputs")
        torch.testing.assert_close(x.grad.cpu(), ref["gx"][0], rtol=1e-9, atol=1e-10, msg=f"{load}: input grads")
        torch.testing.assert_close(layer.gate.wg.weight.grad.cpu(), ref["gg"], rtol=1e-9, atol=1e-10,
                                   msg=f"{load}: gate grads")
