"""The serving seam: ``moelab serve``'s loop drives any registered strategy's server, not one paper's.

A toy strategy whose server is a fixed bigram table (no MoE at all) is served on 2 gloo ranks through
:func:`moelab.runtime.serve.run`: every request is answered with the table's next token for its window, the
server's hooks run in order (``prepare`` once before the clock, ``new_batch`` per batch, ``close`` at the end),
and its ``records`` reach the layer rows. Lina's server is tested in ``tests/strategies/lina/test_serve.py``."""
from __future__ import annotations

import numpy as np
import torch

from moelab.config import RunConfig
from moelab.registry import _REGISTRY, Strategy, register_strategy
from moelab.runtime.preflight import serve_errors
from moelab.runtime.ranks import run_ranks

CFG = {"model.d_model": 16, "model.d_ff": 32, "model.n_layers": 2, "model.n_heads": 2, "model.seq_len": 8,
       "model.moe.num_experts": 2, "serve.strategy": "toy_bigram", "serve.requests": 7, "serve.batch_size": 3,
       "serve.rate_per_s": 5000.0, "serve.max_wait_ms": 1.0}


class _Bigram(torch.nn.Module):
    """logits[t] = 1 at (token[t] * 7 + 3) mod vocab: a next-token rule the test can recompute."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, tokens):
        return torch.nn.functional.one_hot((tokens * 7 + 3) % self.vocab, self.vocab).double()


class _ToyServer:
    def __init__(self, cfg, comm, opts):
        assert opts is None  # the toy declares no serve_options
        self.model, self.calls = _Bigram(cfg.model.vocab_size), []

    def prepare(self):
        self.calls.append("prepare")
        return None

    def new_batch(self, b):
        self.calls.append(f"batch{b}")
        self.records = [{"batch": b, "layer": 0, "note": "toy"}]

    def close(self):
        self.calls.append("close")


SERVERS: list = []


def _toy_serve(cfg, comm, opts):
    SERVERS.append(_ToyServer(cfg, comm, opts))
    return SERVERS[-1]


def _register():
    register_strategy(Strategy("toy_bigram", serve=_toy_serve, doc="test: a bigram table as a server"))


def _rank(rank, world):
    from moelab.runtime.serve import draw_requests, run

    _register()
    cfg = RunConfig().with_overrides({**CFG, "parallel.nproc": world}).validate()
    res = run(cfg)
    want = {r["id"]: int((r["tokens"][cfg.model.seq_len - 1] * 7 + 3) % cfg.model.vocab_size)
            for r in draw_requests(cfg)}
    return dict(res=res, want=want, calls=SERVERS[-1].calls)


def test_any_registered_server_is_served_by_the_core_loop():
    _register()
    try:
        cfg = RunConfig().with_overrides({**CFG, "parallel.nproc": 2})
        assert serve_errors(cfg) == []
    finally:
        _REGISTRY.pop("toy_bigram", None)
    out = run_ranks(_rank, 2, timeout=120)
    res, want = out[0]["res"], out[0]["want"]
    served = {r["id"]: r["next_token"] for r in res["requests"]}
    assert served == want and len(served) == CFG["serve.requests"]
    n_batches = len(res["batches"])
    assert n_batches >= -(-CFG["serve.requests"] // CFG["serve.batch_size"])
    for o in out:  # every rank: prepare once, one new_batch per batch in order, close last
        assert o["calls"] == ["prepare", *[f"batch{b}" for b in range(n_batches)], "close"]
    assert [r["batch"] for r in res["layers"]] == list(range(n_batches))
    assert all(r["note"] == "toy" for r in res["layers"])
    assert np.isfinite([b["batch_s"] for b in res["batches"]]).all()


def test_a_strategy_without_a_server_or_a_bad_option_is_refused_before_launch():
    cfg = RunConfig().with_overrides({**CFG, "serve.strategy": "ep"})
    assert any("strategy 'ep' has no server" in e for e in serve_errors(cfg))
    cfg = RunConfig().with_overrides({**CFG, "serve.strategy": "lina", "serve.strategy_options.replan_test": "x"})
    assert any("replan_test must be one of" in e for e in serve_errors(cfg))
