"""Tiny Transformer-MoE language models (GPT: causal LM, BERT: masked LM) built from a ModelConfig.

Why this shape: the systems under study only change the MoE layer, so the rest of the model is a
plain pre-LayerNorm Transformer whose dense parameters are initialised from ``seed`` alone (a
``torch.Generator`` per parameter, keyed by its name). Every data-parallel rank therefore starts
with identical dense weights without a broadcast, and building a model never touches (or depends
on) the global RNG state.

Batch format (one for both archs, produced by :mod:`moelab.models.data`)::

    {"inputs": LongTensor[B, S], "targets": LongTensor[B, S]}

GPT: ``targets[:, t]`` is the token after ``inputs[:, t]``. BERT: ``targets`` holds the original
token at masked positions and ``-100`` elsewhere. :func:`lm_loss` is cross entropy with
``ignore_index=-100`` in both cases.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from moelab.config import ModelConfig
from moelab.moe.layer import MoELayer, global_aux_losses

IGNORE_INDEX = -100
INIT_STD = 0.02  # GPT-2 style normal init for embeddings and linear weights


def is_moe_block(cfg: ModelConfig, i: int) -> bool:
    """Block ``i`` holds an MoE layer: every block (moe_every=1) or the odd ones (moe_every=2)."""
    return cfg.moe_every == 1 or i % 2 == 1


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes 2^(-8(h+1)/H), h = 0..H-1 (Press et al.'s geometric sequence; used for any H)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)], dtype=torch.float64)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, slopes=None) -> torch.Tensor:
    """Scaled dot-product attention over [B, H, S, dh]; with ``slopes`` ([H], ALiBi) every score (i, j) gets
    ``-slope_h * |i - j|`` added (and -inf above the diagonal when causal)."""
    if slopes is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    S = q.shape[-2]
    pos = torch.arange(S, device=q.device)
    dist = (pos[:, None] - pos[None, :]).abs().to(torch.float64)
    bias = -slopes.to(q.device)[:, None, None] * dist
    if causal:
        bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))


class SelfAttention(nn.Module):
    """Multi-head self-attention through ``scaled_dot_product_attention`` (fused where available);
    ``alibi``: position enters as ALiBi's distance bias instead of an embedding."""

    def __init__(self, d_model: int, n_heads: int, causal: bool, dtype=torch.float32, alibi: bool = False):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads, self.causal = n_heads, causal
        self.slopes = alibi_slopes(n_heads) if alibi else None  # a constant, not state: checkpoints keep their keys
        self.qkv = nn.Linear(d_model, 3 * d_model, dtype=dtype)
        self.out = nn.Linear(d_model, d_model, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        y = attend(q, k, v, self.causal, self.slopes)
        return self.out(y.transpose(1, 2).reshape(B, S, D))


class DenseFFN(nn.Module):
    """The non-MoE feed-forward block: Linear d->d_ff, GELU, Linear d_ff->d."""

    def __init__(self, d_model: int, d_ff: int, dtype=torch.float32):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff, dtype=dtype)
        self.fc2 = nn.Linear(d_ff, d_model, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LN block: x + attn(ln1(x)), then x + ffn(ln2(x)); ffn is dense or an MoE layer."""

    def __init__(self, d_model: int, n_heads: int, causal: bool, ffn: nn.Module, dtype=torch.float32,
                 alibi: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, dtype=dtype)
        self.attn = SelfAttention(d_model, n_heads, causal, dtype=dtype, alibi=alibi)
        self.ln2 = nn.LayerNorm(d_model, dtype=dtype)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


def _param_seed(seed: int, name: str) -> int:
    """Stable per-parameter seed (crc32, not ``hash``, which is salted per process)."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


class MoETransformer(nn.Module):
    """Token + learned position embedding, ``n_layers`` pre-LN blocks, final LN, tied LM head.

    ``moe_layer_cls`` lets tests (or a strategy) swap the MoE layer class; it must take the
    arguments of :class:`moelab.moe.layer.MoELayer`. MoE layers get ``layer_id`` = their ordinal
    among MoE layers (0, 1, ...), the index traces and per-layer placements use, and own their
    initialisation (from ``seed``); this class re-initialises only its own dense parameters.
    """

    def __init__(self, cfg: ModelConfig, *, seed: int = 0, comm=None, placement=None,
                 dtype=torch.float32, moe_layer_cls=None):
        super().__init__()
        if cfg.arch not in ("gpt", "bert"):
            raise ValueError(f"arch must be 'gpt' or 'bert', got {cfg.arch!r}")
        if cfg.moe_every not in (1, 2):
            raise ValueError(f"moe_every must be 1 or 2, got {cfg.moe_every}")
        moe_layer_cls = moe_layer_cls or MoELayer
        self.cfg, self.seed = cfg, seed
        causal = cfg.arch == "gpt"
        d = cfg.d_model
        # Module constructors draw their default init from the global RNG; fork it so building a
        # model leaves the caller's RNG stream untouched. The real init happens in _init_dense.
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(cfg.vocab_size, d, dtype=dtype)
            # ALiBi models carry no position embedding (config.ModelConfig.positions)
            self.pos_emb = nn.Embedding(cfg.seq_len, d, dtype=dtype) if cfg.positions == "learned" else None
            blocks, moe_id = [], 0
            for i in range(cfg.n_layers):
                if is_moe_block(cfg, i):
                    ffn = moe_layer_cls(d, cfg.d_ff, cfg.moe, layer_id=moe_id, seed=seed, comm=comm,
                                        placement=placement, dtype=dtype)
                    moe_id += 1
                else:
                    ffn = DenseFFN(d, cfg.d_ff, dtype=dtype)
                blocks.append(Block(d, cfg.n_heads, causal, ffn, dtype=dtype, alibi=cfg.positions == "alibi"))
            self.blocks = nn.ModuleList(blocks)
            self.ln_f = nn.LayerNorm(d, dtype=dtype)
        self._moe = [b.ffn for b in self.blocks if not isinstance(b.ffn, DenseFFN)]
        self._init_dense()

    @torch.no_grad()
    def _init_dense(self) -> None:
        """Seeded init of the dense params this class owns: N(0, 0.02) weights, zero biases, unit LN."""
        moe_ids = {id(p) for m in self._moe for p in m.parameters()}
        for name, p in self.named_parameters():
            if id(p) in moe_ids:
                continue
            leaf = name.rsplit(".", 1)[-1]
            if ".ln" in "." + name or name.startswith("ln_f"):
                p.fill_(1.0 if leaf == "weight" else 0.0)
            elif leaf == "bias":
                p.zero_()
            else:
                g = torch.Generator().manual_seed(_param_seed(self.seed, name))
                std = INIT_STD
                if name.endswith("attn.out.weight") or name.endswith("ffn.fc2.weight"):
                    std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)  # GPT-2 residual scaling
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).mul_(std).to(p.dtype))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] long -> logits [B, S, vocab]."""
        B, S = tokens.shape
        if S > self.cfg.seq_len:
            raise ValueError(f"sequence length {S} exceeds the model's seq_len={self.cfg.seq_len}")
        # LM head tied to the embedding
        return self.features(self.with_positions(self.tok_emb(tokens))) @ self.tok_emb.weight.t()

    def with_positions(self, x: torch.Tensor) -> torch.Tensor:
        """Embedded input [B, S, d] plus the learned position embedding (ALiBi models: unchanged; the
        attention adds position)."""
        if self.pos_emb is None:
            return x
        return x + self.pos_emb(torch.arange(x.shape[1], device=x.device))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Embedded input [B, S, d] -> final hidden states [B, S, d] (blocks, then ``ln_f``); task
        heads (:mod:`moelab.models.tasks`) read these instead of the tied LM head."""
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def moe_layers(self) -> list:
        """The MoE layers in block order."""
        return list(self._moe)

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' aux losses from the last forward (0 if there are none), each balance loss
        over the global batch (:func:`moelab.moe.layer.global_aux_losses`: with several data-parallel ranks
        a collective, one all-reduce of the layers' counts; every rank calls it after its forward)."""
        total = self.tok_emb.weight.new_zeros(())
        for a in global_aux_losses(self._moe):
            if a is not None:
                total = total + a
        return total

    def expert_parameters(self) -> list:
        """Parameters marked ``moelab_expert``: owned per expert, synchronised by the strategy."""
        return [p for p in self.parameters() if getattr(p, "moelab_expert", False)]

    def dense_parameters(self) -> list:
        """Every other parameter: replicated on all ranks and data-parallel all-reduced."""
        return [p for p in self.parameters() if not getattr(p, "moelab_expert", False)]


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean token cross entropy over positions whose target is not -100 (LM loss only, no aux).

    GPT: next-token loss on every position; BERT: masked-LM loss on masked positions only. A batch
    with no target (possible for BERT on a tiny shard) returns a zero that still reaches every
    parameter, so every rank runs the same backward collectives.
    """
    logits = model(batch["inputs"])
    targets = batch["targets"].to(logits.device)
    flat_t = targets.reshape(-1)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # softmax statistics in fp32 for half-precision runs
    # sum / count instead of reduction="mean": no host sync to test for "no target" (the sum is then a
    # zero that still reaches every parameter), and the same mean otherwise
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat_t, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (flat_t != IGNORE_INDEX).sum().clamp(min=1).to(total.dtype)
