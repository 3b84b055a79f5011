"""The MoE hot path on one device: grouped GEMM, permute/unpermute and the whole layer, measured in one run.

    python benchmarks/gpu_layer.py                      # GPU: both shapes, Triton kernels vs torch
    python benchmarks/gpu_layer.py --device cpu         # CPU mode: shapes / 8, torch implementations only
    python benchmarks/gpu_layer.py --out rows.json      # the measured rows and the fitted local_gpu profile

Shapes (issue #14): Mixtral-like d=4096 f=14336 E=8 top-2, DeepSeek-like d=2048 f=1408 E=64 top-6, 16k
tokens, bf16 on a GPU (fp32 on the CPU). For each shape it prints

- grouped GEMM TFLOP/s (forward) of the Triton kernel, the per-expert loop and ``torch._grouped_mm``
  where it exists, as a fraction of the device's dense bf16 peak (a table of data-sheet numbers below;
  unknown devices: a dense matmul of the same FLOPs measured here stands in, and the row says so);
- permute + unpermute GB/s (bytes read + written) as a fraction of the HBM bandwidth (same table);
- the layer (route, permute, two grouped GEMMs, activation, unpermute) forward+backward against its floor
  (the two grouped GEMMs forward + both backward GEMMs alone) and against a per-expert-loop torch layer;
- megablocks' dMoE (grouped MLP) on the same tokens and shape when ``megablocks`` imports on a GPU (it
  says so when it does not, or when it fails on the shape).

Targets (checked on the GPU only): GEMM >= 60 % of peak (Mixtral), >= 40 % (DeepSeek); permute/unpermute
>= 60 % of HBM; layer <= 1.25x its floor; >= 2x ahead of the per-expert loop (DeepSeek).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

# dense bf16 tensor-core peak (TFLOP/s, no sparsity) and HBM bandwidth (GB/s): vendor data sheets
DEVICES = {"H100 80GB HBM3": (989.0, 3350.0), "H100 SXM": (989.0, 3350.0), "H100 PCIe": (756.0, 2000.0),
           "H200": (989.0, 4800.0), "A100-SXM4-80GB": (312.0, 2039.0), "A100-SXM4-40GB": (312.0, 1555.0)}
SHAPES = {"mixtral": dict(d=4096, f=14336, E=8, k=2), "deepseek": dict(d=2048, f=1408, E=64, k=6)}
TARGETS = {"mixtral": dict(gemm=0.60), "deepseek": dict(gemm=0.40, vs_loop=2.0)}


def timer(device: str, fn, iters: int, warmup: int) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def peak(device: str, dtype, iters: int) -> tuple:
    """(TFLOP/s, GB/s, where from) of this device."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, (tf, gb) in DEVICES.items():
            if key in name:
                return tf, gb, f"data sheet of {key}"
    n = 4096 if device == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    s = timer(device, lambda: a @ b, iters, 2)
    x = torch.empty(64 << 20 if device == "cuda" else 8 << 20, device=device, dtype=torch.uint8)
    c = timer(device, lambda: x.clone(), iters, 2)
    return 2 * n ** 3 / s / 1e12, 2 * x.numel() / c / 1e9, "measured here (dense matmul, copy): no data sheet"


def run_shape(name: str, sh: dict, tokens: int, args, device: str, dtype, impls: list, rows: list) -> None:
    from moelab.kernels import permute as P
    from moelab.kernels.grouped_gemm import grouped_mm
    from moelab.sim.gpu_profile import permute_bytes

    scale = 1 if device == "cuda" else 8
    d, f, E, k, T = sh["d"] // scale, sh["f"] // scale, sh["E"], sh["k"], tokens // scale
    g = torch.Generator(device).manual_seed(0)
    idx = torch.topk(torch.randn(T, E, device=device, generator=g), k).indices
    plan = P.plan(idx, E)
    x = torch.randn(T, d, device=device, dtype=dtype, generator=g)
    w1 = (torch.randn(E, d, f, device=device, generator=g) / d ** 0.5).to(dtype)
    w2 = (torch.randn(E, f, d, device=device, generator=g) / f ** 0.5).to(dtype)
    weights = torch.rand(T, k, device=device, generator=g).to(dtype)
    rows_x = P.permute(x, plan)
    flops = 2 * rows_x.shape[0] * d * f
    tf_peak, gb_peak, src = peak(device, dtype, args.iters)
    print(f"\n== {name}: d={d} f={f} E={E} top-{k} T={T} {str(dtype).replace('torch.', '')} on {device}"
          f" (peak {tf_peak:.3g} TFLOP/s, {gb_peak:.3g} GB/s: {src})")
    res = {}
    for impl in impls:
        s = timer(device, lambda: grouped_mm(rows_x, w1, plan.counts, impl), args.iters, args.warmup)
        res[f"gemm_{impl}"] = s
        print(f"grouped GEMM {impl:7s} {s * 1e3:9.3f} ms  {flops / s / 1e12:8.2f} TFLOP/s  "
              f"{flops / s / 1e12 / tf_peak:6.1%} of peak")
    if hasattr(torch, "_grouped_mm") and device == "cuda":
        offs = torch.cumsum(plan.counts, 0).to(torch.int32)
        s = timer(device, lambda: torch._grouped_mm(rows_x, w1, offs=offs), args.iters, args.warmup)
        print(f"grouped GEMM torch._grouped_mm {s * 1e3:9.3f} ms  {flops / s / 1e12:8.2f} TFLOP/s")
    moved = permute_bytes(T, rows_x.shape[0], d, x.element_size())
    for impl in impls:
        s = timer(device, lambda: P.unpermute(P.permute(x, plan, impl), weights, plan, impl), args.iters, args.warmup)
        res[f"perm_{impl}"] = s
        print(f"permute+unpermute {impl:7s} {s * 1e3:9.3f} ms  {moved / s / 1e9:8.1f} GB/s  "
              f"{moved / s / 1e9 / gb_peak:6.1%} of HBM")

    def layer(impl, loop=False):
        xi = x.detach().requires_grad_()
        a, b = w1.detach().requires_grad_(), w2.detach().requires_grad_()
        rows = P.permute(xi, plan, impl)
        mm = ((lambda r, w: grouped_mm(r, w, plan.counts, "torch")) if loop
              else (lambda r, w: grouped_mm(r, w, plan.counts, impl)))
        y = P.unpermute(mm(torch.nn.functional.gelu(mm(rows, a)), b), weights, plan, impl)
        y.backward(torch.ones_like(y))

    def floor(impl):
        a, b = w1.detach().requires_grad_(), w2.detach().requires_grad_()
        r = rows_x.detach().requires_grad_()
        h = grouped_mm(r, a, plan.counts, impl)
        y = grouped_mm(h.detach().requires_grad_(), b, plan.counts, impl)
        (h.sum() + y.sum()).backward()

    for impl in impls:
        lt = timer(device, lambda: layer(impl), args.iters, args.warmup)
        ft = timer(device, lambda: floor(impl), args.iters, args.warmup)
        res[f"layer_{impl}"], res[f"floor_{impl}"] = lt, ft
        print(f"layer fwd+bwd {impl:7s} {lt * 1e3:9.3f} ms = {lt / ft:5.2f}x its floor ({ft * 1e3:.3f} ms)")
    loop = timer(device, lambda: layer("torch", loop=True), args.iters, args.warmup)
    best = min(res[f"layer_{i}"] for i in impls)
    print(f"per-expert-loop torch layer {loop * 1e3:9.3f} ms: the best layer is {loop / best:.2f}x ahead")
    peer = megablocks_dmoe_s(device, x, d, f, E, k, args)
    if isinstance(peer, str):
        print(f"megablocks dMoE: {peer}")
    else:
        res["megablocks_s"] = peer
        print(f"megablocks dMoE fwd+bwd {peer * 1e3:9.3f} ms = {peer / min(res[f'layer_{i}'] for i in impls):.2f}x "
              "the best moelab layer (its own top-k router and permutation, dropless grouped GEMMs)")
    if device == "cuda" and "triton" in impls:
        t = TARGETS[name]
        print(f"targets: GEMM {flops / res['gemm_triton'] / 1e12 / tf_peak:.1%} (>= {t['gemm']:.0%}), "
              f"permute {moved / res['perm_triton'] / 1e9 / gb_peak:.1%} (>= 60%), "
              f"layer/floor {res['layer_triton'] / res['floor_triton']:.2f} (<= 1.25)"
              + (f", vs loop {loop / res['layer_triton']:.2f}x (>= {t['vs_loop']}x)" if "vs_loop" in t else ""))
    rows.append(dict(shape=name, device=torch.cuda.get_device_name() if device == "cuda" else "cpu", d=d, f=f, E=E,
                     k=k, T=T, dtype=str(dtype), peak_tflops=tf_peak, hbm_GBps=gb_peak, loop_s=loop, **res))


def megablocks_dmoe_s(device: str, x, d: int, f: int, E: int, k: int, args):
    """Forward+backward seconds of megablocks' dMoE on the same tokens and shape, or why there is none."""
    if device != "cuda":
        return "needs a GPU (skipped in the CPU mode)"
    try:
        from functools import partial

        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import dMoE
    except ImportError as e:
        return f"not installed here ({e}); pip install megablocks on the GPU machine gives the peer row"
    try:
        margs = Arguments(hidden_size=d, ffn_hidden_size=f, moe_num_experts=E, moe_top_k=k, mlp_impl="grouped",
                          bf16=x.dtype == torch.bfloat16, fp16=False, device=torch.cuda.current_device(),
                          init_method=partial(torch.nn.init.normal_, mean=0.0, std=0.02))
        layer = dMoE(margs)
        inp = x.detach().view(x.shape[0], 1, d)  # (sequence, batch, hidden)

        def step():
            xi = inp.detach().requires_grad_()
            out = layer(xi)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()

        return timer(device, step, args.iters, args.warmup)
    except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the benchmark goes on
        return f"failed on this shape: {type(e).__name__}: {e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--shape", default="all", choices=("all", *SHAPES))
    ap.add_argument("--tokens", default="2048,4096,8192,16384",
                    help="token counts of the sweep (comma-separated; the CPU mode divides them by 8)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", help="write the measured rows as JSON here")
    args = ap.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    impls = ["triton", "torch"] if device == "cuda" else ["torch"]
    if device == "cpu":
        torch.set_num_threads(max(torch.get_num_threads(), 1))
        print("CPU mode: shapes / 8, torch implementations only (Triton's interpreter is not a benchmark); "
              "the issue's GPU numbers are owed until this runs on a GPU")
    rows: list = []
    for name in (SHAPES if args.shape == "all" else [args.shape]):
        for tokens in (int(t) for t in str(args.tokens).split(",")):
            run_shape(name, SHAPES[name], tokens, args, device, dtype, impls, rows)
    from moelab.sim.gpu_profile import fit_gpu

    fit = fit_gpu(rows)
    print(f"\nlocal_gpu profile fit over {fit['n']} rows: {fit['flops_per_s'] / 1e12:.3g} TFLOP/s achieved, "
          f"{fit['hbm_bytes_per_s'] / 1e9:.3g} GB/s HBM, {fit['launch_s'] * 1e6:.3g} us per kernel; "
          f"R^2 of the predicted layer times {fit['r2']:.3f} (target >= 0.95 on a GPU)"
          + ("" if fit["n"] > 3 else " -- fewer than 4 rows: this R^2 says nothing"))
    if device == "cuda":  # what the paper profiles assume, beside what this GPU reached
        from moelab.sim.gpu_profile import assumed_vs_measured

        for r in assumed_vs_measured(fit):
            print(f"  {r['profile']:18s} {r['gpu']:18s} assumes {r['assumed']:.0%} of peak; "
                  f"measured here ({r['measured_on']}): {r['measured']:.0%}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"rows": rows, "fit": fit}, fh, indent=1)
        print(f"rows and fit written to {args.out} (moelab.sim.gpu_profile.local_gpu_profile(fit) is the profile)")


if __name__ == "__main__":
    main()
