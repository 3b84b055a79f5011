"""Kernels for the MoE hot path: each a Triton kernel beside the torch reference it must match, behind one
selector (``model.moe.kernels: torch | triton | auto``).

- :mod:`.router` - fused router: logits -> softmax -> top-k (k <= 8) -> renormalized weights -> capacity
  positions in DeepSpeed order (every first choice before any second choice);
- :mod:`.permute` - rows into expert-contiguous order by a dispatch plan and back, the weighted combine
  fused into the way back; both differentiable, their backwards gathers too (no atomics: deterministic).

Triton runs on CUDA devices, or anywhere under ``TRITON_INTERPRET=1`` (its interpreter, on the CPU: how CI
tests every kernel on small shapes). ``auto`` picks Triton for CUDA tensors when it is installed, torch
otherwise; ``triton`` where it cannot run is a clear error naming the fix, raised before any work starts.
"""
from __future__ import annotations

import functools
import importlib.util
import os

KINDS = ("torch", "triton", "auto")
MAX_TOP_K = 8


class KernelUnavailable(RuntimeError):
    """``kernels: triton`` asked for where Triton cannot run."""


def acc_dtype(dtype):
    """Accumulate in fp32 for 16/32-bit inputs, in fp64 for fp64 ones (the references stay exact)."""
    import torch

    return torch.promote_types(dtype, torch.float32)


def tl_acc(dtype):
    """:func:`acc_dtype` as a Triton type (a kernel's ``ACC`` constexpr)."""
    import torch
    import triton.language as tl

    return tl.float64 if acc_dtype(dtype) == torch.float64 else tl.float32


@functools.lru_cache(maxsize=None)
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Triton's interpreter is on: kernels run on CPU tensors (slowly; for tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_error(device: str = "cuda") -> str | None:
    """Why Triton kernels cannot run on ``device`` here, or None when they can."""
    if not triton_installed():
        return "model.moe.kernels=triton needs Triton: pip install triton (Linux; it ships with CUDA builds of torch)"
    if not str(device).startswith("cuda") and not interpreted():
        return (f"model.moe.kernels=triton runs on CUDA devices, not on {device}: use kernels=torch or auto, "
                "or set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter on the CPU (slow; for tests)")
    return None


def kernel_errors(moe, device: str) -> list:
    """``model.moe.kernels`` (of a :class:`moelab.config.MoEConfig`) names a selector, and Triton can run on the
    ranks' ``device`` and route the config's top-k (checked before any process starts)."""
    if moe.kernels not in KINDS:
        return [f"model.moe.kernels must be one of {KINDS}, got {moe.kernels!r}"]
    if moe.kernels != "triton":
        return []
    errs = [f"model.moe.kernels=triton routes top-k up to {MAX_TOP_K}, got model.moe.top_k={moe.top_k}"] \
        if moe.top_k > MAX_TOP_K else []
    why = triton_error(device)
    return errs + ([why] if why else [])


def select(kind: str, device: str = "cpu") -> str:
    """``torch`` or ``triton`` for ``kind`` on ``device``; KernelUnavailable / ValueError when it cannot be."""
    if kind not in KINDS:
        raise ValueError(f"model.moe.kernels must be one of {KINDS}, got {kind!r}")
    if kind == "torch":  # the default, on every layer call: nothing to look up
        return "torch"
    why = triton_error(device)
    if kind == "triton":
        if why:
            raise KernelUnavailable(why)
        return "triton"
    return "triton" if kind == "auto" and why is None and str(device).startswith("cuda") else "torch"


def impl_for(kind: str, tensor) -> str:
    """:func:`select` for the device ``tensor`` lives on: what a layer calls on its hot path."""
    return select(kind, tensor.device.type)
