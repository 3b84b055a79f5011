"""Parm's local MoE pieces (spec §2.2), pure: DeepSpeed gating over a token pool with a given
capacity, the (E, T, M) capacity buffers in ``einsum`` (DeepSpeed's dense mask) and ``index``
form, and the experts' sharded FFN.

The gate rule and the capacity drops are the core's (:data:`moelab.moe.gates.GATES`,
:func:`moelab.moe.routing.finish_routing`: token-order priority, DeepSpeed's slot order, GShard's
renormalisation over surviving slots); what a schedule changes is only *which* tokens form the pool
and the capacity ``T`` (baseline ``T_b``, S1 ``T_1``, S2 ``T_2`` padded to a multiple of N_MP).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from moelab.config import MoEConfig
from moelab.moe.dispatch import capacity_index, from_capacity_buffer, to_capacity_buffer
from moelab.moe.experts import ACTIVATIONS
from moelab.moe.gates import GATES
from moelab.moe.routing import Routing, capacity_for

GATE_K = {"switch": 1, "gshard": 2}
DISPATCHERS = ("einsum", "index")


def capacity(n_tok: int, num_experts: int, k: int, f: float, multiple: int = 1) -> int:
    """``ceil(k*f*n_tok/E)`` (exact decimal f), rounded up to a multiple of ``multiple`` (S2: N_MP)."""
    c = capacity_for(n_tok, num_experts, k, f)
    return multiple * math.ceil(c / multiple)


def route(wg: torch.Tensor, x: torch.Tensor, gate: str, f: float, cap: int) -> Routing:
    """Gate the pool ``x`` [n, M] with weight ``wg`` [E, M] (no bias): softmax, top-k by ``gate``
    (``switch`` k=1, ``gshard`` k=2), capacity ``cap`` slots per expert, token-order priority.
    ``aux_loss`` is DeepSpeed's ``l_aux = E * sum_e mean_prob_e * frac_e``."""
    E = wg.shape[0]
    cfg = MoEConfig(num_experts=E, top_k=GATE_K[gate], gate=gate, capacity_factor=f, min_capacity=cap,
                    balance_loss_coef=1.0, z_loss_coef=0.0)
    if capacity(x.shape[0], E, cfg.top_k, f) > cap:
        raise ValueError(f"capacity {cap} is below ceil(k*f*n/E) for n={x.shape[0]}, E={E}, f={f}")
    r = GATES[gate](SimpleNamespace(cfg=cfg, k=cfg.top_k, num_experts=E), x, x @ wg.t(), None)
    assert r.capacity == cap
    return r


def dispatch_mask(r: Routing, num_experts: int, cap: int, dtype) -> torch.Tensor:
    """DeepSpeed's dense combine weights C [n, E, T] (gate weight at each kept (e, slot), else 0);
    ``C != 0`` is the dispatch mask. Quadratic in n: the cost the paper's baseline pays N_ESP^2 times."""
    n, k = r.idx.shape
    valid, rows = capacity_index(r, cap)
    C = torch.zeros(n * num_experts * cap, dtype=dtype, device=r.weights.device)
    C = C.index_put((valid // k * num_experts * cap + rows,), r.weights.reshape(-1)[valid].to(dtype))
    return C.view(n, num_experts, cap)


def dispatch(x: torch.Tensor, r: Routing, num_experts: int, cap: int, mode: str) -> torch.Tensor:
    """The (E, T, M) buffer G[e, t] = the token in slot (e, t), zero-padded."""
    if mode == "index":
        return to_capacity_buffer(x, r, num_experts, cap)
    mask = (dispatch_mask(r, num_experts, cap, x.dtype).detach() != 0).to(x.dtype)
    return torch.einsum("sec,sm->ecm", mask, x)


def combine(Z: torch.Tensor, r: Routing, cap: int, mode: str) -> torch.Tensor:
    """out[s] = sum over the slots (e, t) of token s of weight(s, e) * Z[e, t]."""
    if mode == "index":
        return from_capacity_buffer(Z, r, cap)
    return torch.einsum("sec,ecm->sm", dispatch_mask(r, Z.shape[0], cap, Z.dtype), Z)


def expert_shards(w1: torch.Tensor, w2: torch.Tensor, n_esp: int, j: int) -> tuple:
    """Shard j of experts ``w1`` [E_l, M, H], ``w2`` [E_l, H, M]: columns / rows ``j*h:(j+1)*h``."""
    H = w1.shape[-1]
    if H % n_esp:
        raise ValueError(f"expert hidden size {H} does not split over esp={n_esp}")
    h = H // n_esp
    return w1[..., j * h:(j + 1) * h], w2[:, j * h:(j + 1) * h, :]


def expert_partials(R: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b2, activation: str = "gelu"):
    """Each source's rows through this rank's shards: R [n_src, E_l, T, M] -> partial sums, same shape.
    ``b2`` (or None) is added by ESP shard 0 only, so the partials still sum to the expert's output."""
    n_src, E_l, T, M = R.shape
    act = ACTIVATIONS[activation]
    X = R.transpose(0, 1).reshape(E_l, n_src * T, M)
    Y = torch.bmm(act(torch.bmm(X, w1)), w2)
    if b2 is not None:
        Y = Y + b2.unsqueeze(1)
    return Y.view(E_l, n_src, T, M).transpose(0, 1)
