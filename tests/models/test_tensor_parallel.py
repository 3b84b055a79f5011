"""Tensor-parallel dense parts (core seam for Parm): at MP degree 2 and 4 every rank computes the
1-degree model's logits and input-embedding grads, sharded parameters' grads are slices of the full
grads, replicated ones equal them (fp64, real gloo ranks)."""
from __future__ import annotations

import pytest
import torch

from moelab.runtime.ranks import run_ranks


def _model(cfg):
    from moelab.models.transformer import DenseFFN, MoETransformer

    dense = lambda d, d_ff, moe, **kw: DenseFFN(d, d_ff, dtype=kw["dtype"])  # noqa: E731 - an all-dense model
    return MoETransformer(cfg, seed=5, dtype=torch.float64, moe_layer_cls=dense)


def _cfg(arch, positions="learned"):
    from moelab.config import ModelConfig

    return ModelConfig(arch=arch, vocab_size=32, d_model=16, d_ff=32, n_layers=2, n_heads=4, seq_len=8,
                       positions=positions)


def _tokens():
    return torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(2))


def _tp_rank(rank, world, arch, positions):
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.models.tensor_parallel import shard_dense

    out = {}
    for n in (2, 4):
        comm = Communicator(Topology(world, world), groups={"mp": [list(range(b, b + n)) for b in range(0, world, n)]})
        model = shard_dense(_model(_cfg(arch, positions)), comm, "mp")
        logits = model(_tokens())
        (logits * torch.linspace(-1, 1, logits.numel(), dtype=torch.float64).view_as(logits)).sum().backward()
        out[n] = dict(logits=logits.detach(), me=comm.group_ranks("mp").index(rank),
                      grads={k: (p.grad.clone(), getattr(p, "moelab_tp", False)) for k, p in model.named_parameters()},
                      calls=sorted({(r.op, r.group) for r in comm.rec.comm}))
    return out


@pytest.mark.parametrize("arch,positions", [("gpt", "learned"), ("bert", "learned"), ("bert", "alibi")])
def test_sharded_model_computes_the_full_model(arch, positions):
    """ALiBi: each rank biases its own heads with their own slopes."""
    full = _model(_cfg(arch, positions))
    logits = full(_tokens())
    (logits * torch.linspace(-1, 1, logits.numel(), dtype=torch.float64).view_as(logits)).sum().backward()
    fg = dict(full.named_parameters())
    res = run_ranks(_tp_rank, 4, arch, positions, timeout=120)
    tol = dict(rtol=1e-10, atol=1e-12)
    for r, per in enumerate(res):
        for n, o in per.items():
            torch.testing.assert_close(o["logits"], logits.detach(), **tol)
            assert o["calls"] == [("all_reduce", "mp")]  # f and g: nothing else moves
            m = o["me"]
            for b in range(2):
                p = f"blocks.{b}."
                H, dh, D = 4, 4, 16
                hn = H // n
                qkv = fg[p + "attn.qkv.weight"].grad.view(3, H, dh, D)[:, m * hn:(m + 1) * hn].reshape(-1, D)
                torch.testing.assert_close(o["grads"][p + "attn.qkv_w"][0], qkv, **tol)
                torch.testing.assert_close(o["grads"][p + "attn.out_w"][0],
                                           fg[p + "attn.out.weight"].grad[:, m * hn * dh:(m + 1) * hn * dh], **tol)
                torch.testing.assert_close(o["grads"][p + "attn.out_b"][0], fg[p + "attn.out.bias"].grad, **tol)
                f = 32 // n
                torch.testing.assert_close(o["grads"][p + "ffn.fc1_w"][0],
                                           fg[p + "ffn.fc1.weight"].grad[m * f:(m + 1) * f],
                                           **tol)
                torch.testing.assert_close(o["grads"][p + "ffn.fc2_w"][0],
                                           fg[p + "ffn.fc2.weight"].grad[:, m * f:(m + 1) * f],
                                           **tol)
                assert o["grads"][p + "ffn.fc1_w"][1] and not o["grads"][p + "ffn.fc2_b"][1]
            for k in ("tok_emb.weight", "pos_emb.weight", "ln_f.weight", "blocks.0.ln1.weight", "blocks.1.ln2.bias"):
                if k == "pos_emb.weight" and positions == "alibi":
                    continue
                torch.testing.assert_close(o["grads"][k][0], fg[k].grad, **tol)


def test_heads_or_hidden_that_do_not_split_are_named():
    from moelab.comm.door import Communicator
    from moelab.comm.topology import Topology
    from moelab.models.tensor_parallel import TPDenseFFN, TPSelfAttention
    from moelab.models.transformer import DenseFFN, SelfAttention

    comm = Communicator(Topology(1, 1))
    comm._groups["three"] = (None, [0, 1, 2])  # a 3-member view, only to reach the checks
    with pytest.raises(ValueError, match="n_heads=4 does not split over an MP group of 3"):
        TPSelfAttention(SelfAttention(16, 4, True), comm, "three")
    with pytest.raises(ValueError, match="d_ff=32 does not split over an MP group of 3"):
        TPDenseFFN(DenseFFN(16, 32), comm, "three")
