"""Expert FFNs stored stacked per rank: one slot per expert this rank holds (owned or replica).

Each expert's weights are initialised from a generator seeded by (seed, layer, global expert id),
so every holder of an expert - and the single-process reference - starts with identical weights.
Compute runs per expert on a contiguous block of rows (no Python loop over tokens).
"""
from __future__ import annotations

import hashlib
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

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

    def _unbound(self):
        """Per-slot views made by one ``unbind`` per parameter: indexing ``w1[s]`` per slot would make
        each slot's backward write a gradient the size of the whole stack (cost ~ slots^2)."""
        return [p.unbind(0) if p is not None else None for p in (self.w1, self.b1, self.w2, self.b2)]

    @staticmethod
    def _ffn(act, x, w1, b1, w2, b2):
        h = x @ w1 if b1 is None else torch.addmm(b1, x, w1)
        return act(h) @ w2 if b2 is None else torch.addmm(b2, act(h), w2)

    def forward_slot(self, s: int, x: torch.Tensor) -> torch.Tensor:
        p = [q[s] if q is not None else None for q in (self.w1, self.b1, self.w2, self.b2)]
        return self._ffn(self.act, x, *p)

    def forward(self, x: torch.Tensor, rows_per_slot: Sequence[int]) -> torch.Tensor:
        """``x`` holds slot 0's rows, then slot 1's, ...; returns the outputs in the same layout."""
        outs, start = [], 0
        w1, b1, w2, b2 = self._unbound()
        for s, n in enumerate(rows_per_slot):
            n = int(n)
            if n:
                outs.append(self._ffn(self.act, x[start:start + n], w1[s], b1[s] if b1 is not None else None,
                                      w2[s], b2[s] if b2 is not None else None))
            start += n
        if not outs:  # keep the graph connected: every rank must run the same backward collectives
            return x * 1
        return torch.cat(outs, 0)

    def slot_parameters(self, s: int) -> list:
        return [p[s] for p in (self.w1, self.b1, self.w2, self.b2) if p is not None]
