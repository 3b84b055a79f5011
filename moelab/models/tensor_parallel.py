"""Megatron-style tensor parallelism of the dense parts, as far as model parallelism (MP) needs it.

:func:`shard_dense` turns a built :class:`~moelab.models.transformer.MoETransformer` into this rank's
MP shard in place: attention's QKV is column-parallel (whole heads per rank) and its output
projection row-parallel; a dense FFN's fc1 is column-parallel and fc2 row-parallel; embeddings,
LayerNorms, the tied head and the MoE layers stay as they are. The shards are *sliced from the full
seeded parameters* the model was built with, so any MP degree computes the 1-degree model exactly
(up to summation order). The conjugate operators are the comm door's autograd blocks on the MP
group: ``f`` = :func:`~moelab.comm.autograd.reduce_bwd` before a column-parallel layer, ``g`` =
:func:`~moelab.comm.autograd.reduce_fwd` after a row-parallel one (Megatron's two all-reduces per
block per pass). Sharded parameters carry ``moelab_tp = True``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelab.comm import autograd as ag
from moelab.models.transformer import DenseFFN, SelfAttention, attend, is_moe_block


def _param(t: torch.Tensor, sharded: bool) -> nn.Parameter:
    p = nn.Parameter(t.detach().clone().contiguous())
    p.moelab_tp = sharded
    return p


class _TPBase(nn.Module):
    def __init__(self, comm, group: str):
        super().__init__()
        self.comm, self.group = comm, group
        ranks = comm.group_ranks(group)
        self.n, self.me = len(ranks), ranks.index(comm.rank)

    def f(self, x):
        return x if self.n == 1 else ag.reduce_bwd(self.comm, x, self.group)

    def g(self, x):
        return x if self.n == 1 else ag.reduce_fwd(self.comm, x, self.group)


class TPSelfAttention(_TPBase):
    """Heads ``[me*H/n, (me+1)*H/n)`` of a :class:`SelfAttention`; output summed over the group."""

    def __init__(self, attn: SelfAttention, comm, group: str):
        super().__init__(comm, group)
        H = attn.n_heads
        if H % self.n:
            raise ValueError(f"model.n_heads={H} does not split over an MP group of {self.n}")
        D = attn.out.weight.shape[0]
        dh, hn = D // H, H // self.n
        h0, h1 = self.me * hn, (self.me + 1) * hn
        self.n_heads, self.causal = hn, attn.causal
        self.slopes = None if attn.slopes is None else attn.slopes[h0:h1]
        self.qkv_w = _param(attn.qkv.weight.view(3, H, dh, D)[:, h0:h1].reshape(3 * hn * dh, D), True)
        self.qkv_b = _param(attn.qkv.bias.view(3, H, dh)[:, h0:h1].reshape(-1), True)
        self.out_w = _param(attn.out.weight[:, h0 * dh:h1 * dh], True)
        self.out_b = _param(attn.out.bias, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = F.linear(self.f(x), self.qkv_w, self.qkv_b).view(B, S, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        y = attend(q, k, v, self.causal, self.slopes)
        return self.g(F.linear(y.transpose(1, 2).reshape(B, S, -1), self.out_w)) + self.out_b


class TPDenseFFN(_TPBase):
    """Hidden units ``[me*F/n, (me+1)*F/n)`` of a :class:`DenseFFN`; output summed over the group."""

    def __init__(self, ffn: DenseFFN, comm, group: str):
        super().__init__(comm, group)
        F_ = ffn.fc1.weight.shape[0]
        if F_ % self.n:
            raise ValueError(f"dense d_ff={F_} does not split over an MP group of {self.n}")
        f0, f1 = self.me * F_ // self.n, (self.me + 1) * F_ // self.n
        self.fc1_w = _param(ffn.fc1.weight[f0:f1], True)
        self.fc1_b = _param(ffn.fc1.bias[f0:f1], True)
        self.fc2_w = _param(ffn.fc2.weight[:, f0:f1], True)
        self.fc2_b = _param(ffn.fc2.bias, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g(F.linear(F.gelu(F.linear(self.f(x), self.fc1_w, self.fc1_b)), self.fc2_w)) + self.fc2_b


def sharded_param_count(cfg) -> int:
    """Parameters :func:`shard_dense` splits over the MP group (the rest stay replicated): per block the
    QKV weight and bias (3d² + 3d) and the attention output weight (d²); per dense FFN fc1's weight and
    bias (d·f + f) and fc2's weight (f·d). ``cfg``: a model config (d_model, d_ff, n_layers, moe_every)."""
    d, f = cfg.d_model, cfg.d_ff
    n_dense = sum(not is_moe_block(cfg, i) for i in range(cfg.n_layers))
    return cfg.n_layers * (4 * d * d + 3 * d) + n_dense * (2 * d * f + f)


def shard_dense(model: nn.Module, comm, group: str = "mp") -> nn.Module:
    """Replace every block's attention and dense FFN by this rank's shard over ``group`` (in place)."""
    for block in model.blocks:
        block.attn = TPSelfAttention(block.attn, comm, group)
        if isinstance(block.ffn, DenseFFN):
            block.ffn = TPDenseFFN(block.ffn, comm, group)
    return model
