"""The tokens LSH-MoE hashes, from a real model: a tiny RoBERTa-like masked-LM MoE trained on the stdlib's
text (REAL, one rank, in this process, at the global batch of a quality run: ``q_nproc × batch``
sequences), then its MoE layers' inputs and routings on held-out batches.

Each captured batch plays one source rank (``batch × seq`` tokens, as a rank of a quality run has), so a
group is (batch, expert) as in Alg. 1. Two controls test the spec's "similarity comes from training /
data" (§6.16): the same model untrained (0 iterations), and random rows (isotropic Gaussian of the
trained rows' mean norm) with the trained routing, so groups keep their sizes but lose their content.
The expert weights come along, so the compression error can be measured against the exact output.
"""
from __future__ import annotations

import numpy as np
import torch

from moelab.config import RunConfig
from moelab.models.tasks import make_eval_batch
from moelab.models.transformer import lm_loss
from moelab.moe.experts import ACTIVATIONS, ffn
from moelab.papers.kit.cache import cached
from moelab.runtime.checkpoint import save
from moelab.runtime.train import Trainer

from .common import scale_spec, tiny_overrides

SOURCES = ("trained", "untrained", "random")


@cached
def capture(scale, seed: int = 0, trained: bool = True) -> dict:
    """``{"x": [layer][batch] -> [T, d], "idx": [layer][batch] -> [T, k], "experts": [layer] -> (w1, b1, w2, b2),
    "gates": [layer] -> the gate's weight [E, d], "ckpt": a checkpoint of the trained model (None untrained),
    "act": activation name, "cfg": the run config (dict), "loss": last training loss, "eval_ppl": held-out
    perplexity on the captured batches}`` (numpy / torch CPU)."""
    s = scale_spec(scale)
    # pretrain at a quality run's global batch (q_nproc ranks x batch), capture at one rank's batch
    train_cfg = RunConfig().with_overrides({**tiny_overrides(s, iters=s.capture_iters, seed=seed), "parallel.nproc": 1,
                                            "train.batch_size": s.batch * s.q_nproc}).validate()
    cfg = train_cfg.with_overrides({"train.batch_size": s.batch}).validate()
    torch.manual_seed(seed)
    tr = Trainer.build(train_cfg)
    rows = tr.run() if trained else []  # untrained: the seeded initialisation
    layers = tr.model.moe_layers()
    xs = [[] for _ in layers]
    hooks = [layer.register_forward_pre_hook(
                 lambda mod, args, j=j: xs[j].append(args[0].detach().reshape(-1, args[0].shape[-1]).clone()))
             for j, layer in enumerate(layers)]
    idx = [[] for _ in layers]
    losses = []
    try:
        with torch.no_grad():
            for b in range(s.capture_batches):
                batch = make_eval_batch(cfg, 0, 1, b)
                losses.append(float(lm_loss(tr.model, batch)))
                for j, layer in enumerate(layers):
                    idx[j].append(layer.last_routing.idx.clone())
    finally:
        for h in hooks:
            h.remove()
    experts = [tuple(None if p is None else p.detach().clone() for p in layer.experts.stacked()) for layer in layers]
    gates = [layer.gate.wg.weight.detach().clone() for layer in layers]
    ckpt = None
    if trained:  # the pretrained model the fine-tuning substitutes start from (train.init_from)
        import tempfile

        ckpt = str(save(tr, tempfile.mkdtemp(prefix=f"moelab-lsh-pretrained-{s.name}-"), len(rows)))
    return dict(x=xs, idx=idx, experts=experts, gates=gates, act=cfg.model.moe.activation, cfg=cfg.to_dict(), ckpt=ckpt,
                loss=rows[-1]["loss"] if rows else None, iters=len(rows), eval_ppl=float(np.exp(np.mean(losses))))


def pretrained(scale, seed: int = 0) -> str:
    """The checkpoint folder of the trained capture model (uncompressed masked-LM pretraining)."""
    return capture(scale, seed)["ckpt"]


def dispatched(cap: dict, layer: int, batch: int, source: str = "trained", seed: int = 0):
    """``(xa [A, d], expert [A])``: one source rank's dispatched rows of ``layer``, expert-major in slot
    order (what :class:`moelab.strategies.lsh_moe.layer.LSHMoELayer` hashes). ``source="random"`` keeps
    the routing and replaces the rows by Gaussian ones of the same mean norm."""
    x, idx = cap["x"][layer][batch], cap["idx"][layer][batch]
    k = idx.shape[1]
    dest = idx.reshape(-1)
    valid = (dest >= 0).nonzero().squeeze(1)
    pos = valid[torch.argsort(dest[valid], stable=True)]
    xa = x[pos // k]
    if source == "random":
        g = torch.Generator().manual_seed(int(seed) * 1000 + layer * 31 + batch)
        z = torch.randn(xa.shape, generator=g, dtype=xa.dtype)
        xa = z / z.norm(dim=1, keepdim=True) * x.norm(dim=1).mean()
    return xa, dest[pos]


def groups_of(cap: dict, layer: int, source: str = "trained", seed: int = 0):
    """Every captured source rank's ``(xa, expert)`` of ``layer``."""
    return [dispatched(cap, layer, b, source, seed) for b in range(len(cap["x"][layer]))]


def capture_for(scale, source: str, seed: int = 0) -> dict:
    """The capture a ``source`` reads (random rows ride on the trained routing)."""
    return capture(scale, seed, trained=source != "untrained")


def expert_fn(cap: dict, layer: int):
    """``f(rows, experts) -> outputs``: the captured layer's expert FFNs (exact, no communication)."""
    w1, b1, w2, b2 = cap["experts"][layer]
    act = ACTIVATIONS[cap["act"]]

    def f(rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        for e in torch.unique(experts).tolist():
            sel = (experts == e).nonzero().squeeze(1)
            out[sel] = ffn(rows[sel], w1[e], None if b1 is None else b1[e], w2[e], None if b2 is None else b2[e], act)
        return out

    return f


def summary(scale, seed: int = 0) -> dict:
    """What the capture is, for labels: model size, training iterations, rows per group."""
    cap = capture(scale, seed)
    s = scale_spec(scale)
    A = [int((i >= 0).sum()) for i in cap["idx"][0]]
    return dict(d=s.d, layers=s.layers, experts=s.experts, iters=cap["iters"], final_loss=cap["loss"],
                rows_per_source=int(np.mean(A)), rows_per_group=float(np.mean(A)) / s.experts)
