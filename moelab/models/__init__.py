"""Tiny GPT/BERT-MoE models, paper model configs and parameter counts, offline data, routing traces.

Names are imported lazily so ``import moelab.models`` stays cheap and does not pull in the MoE layer.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "MoETransformer": "transformer", "lm_loss": "transformer", "DenseFFN": "transformer",
    "is_moe_block": "transformer",
    "count_params": "params", "param_bytes_by_category": "params", "PAPER_MODELS": "params",
    "paper_model": "params", "num_moe_layers": "params",
    "ByteCorpus": "data", "make_batch": "data", "make_eval_batch": "data", "get_corpus": "data",
    "stdlib_text": "data",
    "routing_trace": "traces", "trace_to_token_choices": "traces",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"moelab.models.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'moelab.models' has no attribute {name!r}")
