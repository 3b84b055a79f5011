"""Parameter counts for paper-size configs without building tensors, and the papers' model configs.

Why: the simulator and the memory model need parameter and byte counts for 1–7B-parameter models
that cannot be built on a CPU box; a closed-form count that matches the built tiny models exactly
(tested) is what lets us trust it at paper scale.
"""
from __future__ import annotations

import torch.nn as nn

from moelab.config import ModelConfig, MoEConfig

CATEGORIES = ("embedding", "attention", "dense_ffn", "expert", "gate", "norm")


def num_moe_layers(cfg: ModelConfig) -> int:
    """MoE blocks: all of them (moe_every=1) or the odd ones (moe_every=2)."""
    return cfg.n_layers if cfg.moe_every == 1 else cfg.n_layers // 2


def expert_params(cfg: ModelConfig) -> int:
    """Parameters of one expert FFN: 2*d*d_ff weights (+ d_ff + d biases if moe.expert_bias)."""
    d, f = cfg.d_model, cfg.d_ff
    return 2 * d * f + ((f + d) if cfg.moe.expert_bias else 0)


def count_params(cfg: ModelConfig, convention: str = "full") -> dict:
    """Parameter counts by category (see CATEGORIES) plus ``total``.

    ``full``: what :class:`moelab.models.transformer.MoETransformer` really holds: token + position
    embeddings (the LM head is tied, so not counted again), attention qkv/out weights and biases,
    dense FFNs with biases, experts, a bias-free router ``d x E`` per MoE layer, LayerNorms.

    ``hecate``: the rule of Hecate Table 1 (papers/hecate.md §4): per layer 4*d^2 attention and
    E experts of 2*d*d_ff weights, no biases; embeddings, norms and gates excluded. With
    d_ff = 2d and every FFN an MoE layer this is L*(4E+4)*d^2.
    """
    d, f, L, E = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.moe.num_experts
    n_moe = num_moe_layers(cfg)
    n_dense = L - n_moe
    if convention == "full":
        out = {
            "embedding": cfg.vocab_size * d + (cfg.seq_len * d if cfg.positions == "learned" else 0),
            "attention": L * (4 * d * d + 4 * d),
            "dense_ffn": n_dense * (2 * d * f + f + d),
            "expert": n_moe * E * expert_params(cfg),
            "gate": n_moe * d * E,
            "norm": (2 * L + 1) * 2 * d,
        }
    elif convention == "hecate":
        out = {
            "embedding": 0,
            "attention": L * 4 * d * d,
            "dense_ffn": n_dense * 2 * d * f,
            "expert": n_moe * E * 2 * d * f,
            "gate": 0,
            "norm": 0,
        }
    else:
        raise ValueError(f"convention must be 'full' or 'hecate', got {convention!r}")
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out


def param_bytes_by_category(model: nn.Module) -> dict:
    """Params and bytes of a built model split by the ``moelab_expert`` attribute (memory metrics).

    Shared tensors (the tied embedding/LM head) are counted once, as ``model.parameters()`` does.
    """
    out = {"dense_params": 0, "expert_params": 0, "dense_bytes": 0, "expert_bytes": 0}
    for p in model.parameters():
        kind = "expert" if getattr(p, "moelab_expert", False) else "dense"
        out[f"{kind}_params"] += p.numel()
        out[f"{kind}_bytes"] += p.numel() * p.element_size()
    out["total_params"] = out["dense_params"] + out["expert_params"]
    out["total_bytes"] = out["dense_bytes"] + out["expert_bytes"]
    return out


def _hecate(arch: str, d: int, seq: int, layers: int, heads: int) -> ModelConfig:
    """Hecate Table 1 model: GShard top-2, 64 experts, every FFN an MoE layer, d_ff = 2d, no expert biases."""
    return ModelConfig(
        arch=arch, vocab_size=50257 if arch == "gpt" else 30522, d_model=d, d_ff=2 * d,
        n_layers=layers, n_heads=heads, seq_len=seq, moe_every=1,
        moe=MoEConfig(num_experts=64, top_k=2, gate="gshard", expert_bias=False))


def _fastermoe(arch: str, layers: int, seq: int) -> ModelConfig:
    """FasterMoE Table 2 (from the AE scripts): 16 experts, top-2, h=1024, h_ff=2h, all FFNs MoE.

    Seq length and vocabulary are unknown in the paper [choice]: 1024/50257 (GPT), 512/30522 (BERT).
    FastMoE experts carry biases, so expert_bias=True.
    """
    return ModelConfig(
        arch=arch, vocab_size=50257 if arch == "gpt" else 30522, d_model=1024, d_ff=2048,
        n_layers=layers, n_heads=16, seq_len=seq, moe_every=1,
        moe=MoEConfig(num_experts=16, top_k=2, gate="topk", expert_bias=True))


def _lsh(arch: str, layers: int, d: int, f: int, experts: int, moe_every: int, bias: bool, seq: int,
         heads: int) -> ModelConfig:
    """LSH-MoE Table 1 model (papers/lsh-moe.md §4): top-2 (renormalized), vocab 50257 (the paper's); the MoE
    placement and expert biases are the ones that reproduce the paper's MoE-parameter column; seq and heads
    are [choice] (the paper gives neither)."""
    return ModelConfig(
        arch=arch, vocab_size=50257, d_model=d, d_ff=f, n_layers=layers, n_heads=heads, seq_len=seq,
        moe_every=moe_every, moe=MoEConfig(num_experts=experts, top_k=2, gate="topk", expert_bias=bias))


PAPER_MODELS: dict = {
    # papers/hecate.md §4 Table 1 (heads/vocab are [choice] there: 12/16/16/16, 50257/30522)
    "GPT-MoE-S": _hecate("gpt", 768, 2048, 12, 12),
    "GPT-MoE-L": _hecate("gpt", 1536, 2048, 12, 16),
    "BERT-MoE": _hecate("bert", 1024, 512, 12, 16),
    "BERT-MoE-Deep": _hecate("bert", 1024, 512, 24, 16),
    # papers/fastermoe.md §4 "Models (Table 2)", johnny / 16 GPUs
    "MoE-GPT": _fastermoe("gpt", 12, 1024),
    "MoE-BERT-Deep": _fastermoe("bert", 24, 512),
    # papers/lsh-moe.md §4 Table 1: GPT 15B = 6 alternate MoE layers with biases, 52B = 12 alternate without,
    # T5 = all 16 layers MoE (an encoder-only stand-in for the encoder-decoder), RoBERTa = 6 alternate
    # (453M MoE params against the paper's 302M: a known mismatch, never forced)
    "RoBERTa-MoE": _lsh("bert", 12, 768, 3072, 16, 2, True, 512, 12),
    "T5-MoE": _lsh("bert", 16, 1024, 16384, 16, 1, True, 512, 16),
    "GPT-MoE-15B": _lsh("gpt", 12, 768, 3072, 512, 2, True, 1024, 12),
    "GPT-MoE-52B": _lsh("gpt", 24, 1024, 4096, 512, 2, False, 1024, 16),
}

# LSH-MoE Table 1, millions of parameters: (MoE, total) (papers/lsh-moe.md §4)
LSH_TABLE1_PARAMS_M = {"RoBERTa-MoE": (302, 394), "T5-MoE": (8594, 9288), "GPT-MoE-15B": (14507, 14629),
                       "GPT-MoE-52B": (51539, 51740), "Swin-MoE-L": (None, 946)}


def paper_model(name: str) -> ModelConfig:
    """A fresh copy of ``PAPER_MODELS[name]`` (safe to edit)."""
    import copy

    try:
        return copy.deepcopy(PAPER_MODELS[name])
    except KeyError:
        raise KeyError(f"unknown paper model {name!r}; known: {sorted(PAPER_MODELS)}") from None
