"""Expert FFNs stored stacked per rank: one slot per expert this rank holds (owned or replica).

The stack is the rank's parameter store. A call may also compute with *materialized* slots:
experts this call's placement puts here although the rank does not hold them, as parameter views
brought by :mod:`moelab.moe.materialize` for that call only. A materialized slot computes exactly
like an owned one (same FFN code); ``forward(..., experts=, materialized=)`` takes both.

Each expert's weights are initialised from a generator seeded by (seed, layer, global expert id),
so every holder of an expert - and the single-process reference - starts with identical weights.
Compute runs per expert on a contiguous block of rows (no Python loop over tokens).
"""
from __future__ import annotations

import hashlib
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moelab.kernels import impl_for
from moelab.kernels.grouped_gemm import grouped_mm

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


def seeded_generator(*key) -> torch.Generator:
    """A CPU generator whose seed is a stable hash of ``key`` (same on every rank and run)."""
    h = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") & ((1 << 63) - 1)
    g = torch.Generator()
    g.manual_seed(h)
    return g


def init_expert(d_model: int, d_ff: int, seed: int, layer_id: int, expert: int, dtype=torch.float32):
    """Weights of one global expert: (w1 [d,f], b1 [f], w2 [f,d], b2 [d]); nn.Linear-like uniform init."""
    g = seeded_generator("expert", seed, layer_id, expert)
    b1_bound, b2_bound = 1 / math.sqrt(d_model), 1 / math.sqrt(d_ff)
    w1 = (torch.rand(d_model, d_ff, generator=g, dtype=torch.float64) * 2 - 1) * b1_bound
    b1 = (torch.rand(d_ff, generator=g, dtype=torch.float64) * 2 - 1) * b1_bound
    w2 = (torch.rand(d_ff, d_model, generator=g, dtype=torch.float64) * 2 - 1) * b2_bound
    b2 = (torch.rand(d_model, generator=g, dtype=torch.float64) * 2 - 1) * b2_bound
    return tuple(t.to(dtype) for t in (w1, b1, w2, b2))


# ---- one expert's FFN on explicit tensors, and its parameters as one flat buffer -----------------
# Used where an expert runs outside its stack: on broadcast copies (FasterMoE's shadows) and on the
# private per-chunk graphs of the smart schedule. Matmul + add, not Experts' fused addmm: the same
# math, kept bit-for-bit as those paths have always computed it.
def ffn(x: torch.Tensor, w1, b1, w2, b2, act) -> torch.Tensor:
    h = x @ w1
    if b1 is not None:
        h = h + b1
    y = act(h) @ w2
    if b2 is not None:
        y = y + b2
    return y


def expert_param_shapes(experts: "Experts") -> list:
    """Shapes of one expert's tensors (w1, b1, w2, b2; None where there is no bias)."""
    return [None if p is None else tuple(p.shape[1:]) for p in experts.stacked()]


def expert_numel(experts: "Experts") -> int:
    """Elements of one expert's parameters (w1, b1, w2, b2): the length of its flat buffer."""
    return sum(math.prod(s) for s in expert_param_shapes(experts) if s is not None)


def flatten_slot(params: Sequence[Optional[torch.Tensor]], slot: int) -> torch.Tensor:
    """One slot of stacked ``(w1, b1, w2, b2)`` as a flat detached buffer (broadcast/reduce unit)."""
    return torch.cat([p[slot].detach().reshape(-1) for p in params if p is not None])


def unflatten(buf: torch.Tensor, shapes) -> list:
    """Inverse of :func:`flatten_slot` for one expert: views of ``buf`` (None kept as None)."""
    out, off = [], 0
    for shp in shapes:
        if shp is None:
            out.append(None)
            continue
        n = math.prod(shp)
        out.append(buf[off:off + n].view(shp))
        off += n
    return out


class Experts(nn.Module):
    """The expert slots of one rank: ``experts`` lists the global ids held, ascending."""

    def __init__(self, d_model: int, d_ff: int, experts: Sequence[int], *, seed: int, layer_id: int,
                 activation: str = "gelu", bias: bool = True, dtype=torch.float32):
        super().__init__()
        self.experts = tuple(experts)
        self.act = ACTIVATIONS[activation]
        n = len(self.experts)
        params = [init_expert(d_model, d_ff, seed, layer_id, e, dtype) for e in self.experts]
        stack = lambda i, shape: torch.stack([p[i] for p in params]) if n else torch.empty(shape, dtype=dtype)
        self.w1 = nn.Parameter(stack(0, (0, d_model, d_ff)))
        self.w2 = nn.Parameter(stack(2, (0, d_ff, d_model)))
        if bias:
            self.b1 = nn.Parameter(stack(1, (0, d_ff)))
            self.b2 = nn.Parameter(stack(3, (0, d_model)))
        else:
            self.b1 = self.b2 = None
        for p in self.parameters():
            p.moelab_expert = True
        self.kernels = "torch"  # model.moe.kernels (set by the layer): torch | triton | auto

    def _unbound(self):
        """Per-slot views made by one ``unbind`` per parameter: indexing ``w1[s]`` per slot would make
        each slot's backward write a gradient the size of the whole stack (cost ~ slots^2)."""
        return [p.unbind(0) if p is not None else None for p in self.stacked()]

    @staticmethod
    def _ffn(act, x, w1, b1, w2, b2):
        h = x @ w1 if b1 is None else torch.addmm(b1, x, w1)
        return act(h) @ w2 if b2 is None else torch.addmm(b2, act(h), w2)

    def forward(self, x: torch.Tensor, rows_per_slot: Sequence[int], experts: Optional[Sequence[int]] = None,
                materialized: Optional[dict] = None) -> torch.Tensor:
        """``x`` holds slot 0's rows, then slot 1's, ...; returns the outputs in the same layout.

        Slots are the held experts by default; ``experts`` lists other global ids instead (a call's
        slots), each held here or in ``materialized`` (``{e: [w1, b1, w2, b2]}`` for this call)."""
        if experts is None and materialized is None and impl_for(self.kernels, x) == "triton":
            return self._grouped(x, rows_per_slot)
        outs, start = [], 0
        w1, b1, w2, b2 = self._unbound()
        held = {e: s for s, e in enumerate(self.experts)} if experts is not None else None
        if experts is not None and len(experts) != len(rows_per_slot):
            raise ValueError(f"{len(rows_per_slot)} row counts for {len(experts)} experts")
        for i, n in enumerate(rows_per_slot):
            n = int(n)
            if n:
                s = i if experts is None else held.get(int(experts[i]))
                if s is not None:
                    p = (w1[s], b1[s] if b1 is not None else None, w2[s], b2[s] if b2 is not None else None)
                elif materialized is not None and int(experts[i]) in materialized:
                    p = materialized[int(experts[i])]
                else:
                    raise ValueError(f"expert {experts[i]} is neither held here {self.experts} nor materialized")
                outs.append(self._ffn(self.act, x[start:start + n], *p))
            start += n
        if not outs:  # keep the graph connected: every rank must run the same backward collectives
            return x * 1
        return torch.cat(outs, 0)

    def _grouped(self, x: torch.Tensor, rows_per_slot: Sequence[int]) -> torch.Tensor:
        """Every held slot's FFN in two grouped GEMMs (:mod:`moelab.kernels.grouped_gemm`), one launch each."""
        counts = [int(n) for n in rows_per_slot]
        slot = torch.repeat_interleave(torch.arange(len(counts), device=x.device),
                                       torch.tensor(counts, device=x.device))
        h = grouped_mm(x, self.w1, counts)
        h = h if self.b1 is None else h + self.b1.index_select(0, slot)
        y = grouped_mm(self.act(h), self.w2, counts)
        return y if self.b2 is None else y + self.b2.index_select(0, slot)

    def stacked(self) -> list:
        """The stacked parameters ``[w1, b1, w2, b2]`` (None where there is no bias)."""
        return [self.w1, self.b1, self.w2, self.b2]
