"""Spec §4(c): what one lent GPU can time for Lina's cost model - a layer's compute at the paper's assumed shapes
against the tokens it gets (expert FFN forward + backward, attention, gate), cutting a 30 MB gradient into micro-ops
and joining them again, two packed experts on two CUDA streams against one after the other, and the host-to-device
bandwidth of an expert swap. One GPU cannot show all-to-all / all-reduce contention; that stays EMULATED and
SIMULATED. The rows are reported, not fed into the ``lina`` profile (calibrated to Table 1, a FITTED constant)."""
from __future__ import annotations

import time

import pandas as pd
import torch
import torch.nn.functional as Fn


def _time_ms(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after one warm-up (CUDA events on a GPU)."""
    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(device)
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - t0))
    return float(sorted(out)[len(out) // 2])


def _expert(d: int, f: int, device, dtype):
    return [(torch.randn(d, f, device=device, dtype=dtype) / d ** 0.5).requires_grad_(),
            (torch.randn(f, d, device=device, dtype=dtype) / f ** 0.5).requires_grad_()]


def _ffn(x, w):
    return Fn.gelu(x @ w[0]) @ w[1]


def gpu_timings(device="cuda", d: int = 512, f: int = 2048, heads: int = 8, seq: int = 512, experts: int = 16,
                tokens=(512, 2048, 8192, 32768), partition_MB: float = 30.0, reps: int = 5,
                dtype=torch.float32) -> pd.DataFrame:
    """Rows ``{what, tokens, ms, GBps}``; the stream and host-to-device rows only on a CUDA device."""
    dev = torch.device(device)
    rows = []
    w, wg = _expert(d, f, dev, dtype), torch.randn(d, experts, device=dev, dtype=dtype)
    for T in tokens:
        x = torch.randn(T, d, device=dev, dtype=dtype, requires_grad=True)
        rows.append({"what": "expert FFN fwd+bwd", "tokens": T,
                     "ms": _time_ms(lambda: _ffn(x, w).sum().backward(), dev, reps)})
        rows.append({"what": "gate fwd (softmax, top-2)", "tokens": T,
                     "ms": _time_ms(lambda: torch.topk(torch.softmax(x.detach() @ wg, -1), 2), dev, reps)})
        if T >= seq:
            q = torch.randn(T // seq, heads, seq, d // heads, device=dev, dtype=dtype)
            rows.append({"what": "attention fwd", "tokens": T,
                         "ms": _time_ms(lambda: Fn.scaled_dot_product_attention(q, q, q, is_causal=True), dev, reps)})
    flat = torch.randn(int(partition_MB * 2 ** 20) // 4, device=dev)
    for n in (4, 16, 64):
        ms = _time_ms(lambda: torch.cat([c.clone() for c in flat.chunk(n)]), dev, reps)
        rows.append({"what": f"cut {partition_MB:g} MB into {n} micro-ops and join", "tokens": 0, "ms": ms})
    if dev.type == "cuda":
        T = tokens[-1]
        xs = [torch.randn(T, d, device=dev, dtype=dtype) for _ in range(2)]
        ws = [[p.detach() for p in _expert(d, f, dev, dtype)] for _ in range(2)]  # forward only: no graph kept
        streams = [torch.cuda.Stream(dev) for _ in range(2)]

        def concurrent():
            for s, x, ew in zip(streams, xs, ws):
                s.wait_stream(torch.cuda.current_stream(dev))  # after the start event
                with torch.cuda.stream(s):
                    _ffn(x, ew)
            torch.cuda.current_stream(dev).wait_stream(streams[0])
            torch.cuda.current_stream(dev).wait_stream(streams[1])

        rows.append({"what": "2 packed experts fwd, one after the other", "tokens": T,
                     "ms": _time_ms(lambda: [_ffn(x, ew) for x, ew in zip(xs, ws)], dev, reps)})
        rows.append({"what": "2 packed experts fwd, two streams", "tokens": T, "ms": _time_ms(concurrent, dev, reps)})
        host = [p.detach().cpu().pin_memory() for p in w]
        nbytes = sum(p.numel() * p.element_size() for p in host)
        ms = _time_ms(lambda: [p.to(dev, non_blocking=True) for p in host], dev, reps)
        rows.append({"what": "expert swap host -> device (pinned)", "tokens": 0, "ms": ms, "GBps": nbytes / ms / 1e6})
    out = pd.DataFrame(rows)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    out.attrs["label"] = (f"REAL: one {name}, {dtype}, median of {reps}; the paper's assumed shapes (d {d}, d_ff {f}, "
                          f"{heads} heads, sequences of {seq}); not scaled to the paper's A100s")
    return out
