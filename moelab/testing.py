"""Helpers for moelab's own tests: a tiny fp64 training config, the fp64 MoE reference's gradients, and
the assertions the distributed tests share. Ranks are spawned by :mod:`moelab.runtime.ranks`; the library never
imports this module."""
from __future__ import annotations

import torch

# A tiny fp64 model for training-equivalence tests: small enough for 4 ranks on 2 cores.
TINY_TRAIN = {
    "model.d_model": 16, "model.d_ff": 32, "model.n_layers": 2, "model.n_heads": 2, "model.seq_len": 16,
    "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.balance_loss_coef": 0.0,
    "model.moe.z_loss_coef": 0.001, "train.iters": 3, "train.batch_size": 2, "train.dtype": "float64",
    "train.lr": 1e-2, "train.trace": False,
}


def train_snapshot(rank: int, world: int, overrides: dict) -> dict:
    """Rank function for :func:`run_ranks`: train ``TINY_TRAIN`` + ``overrides`` and return what the
    equivalence tests compare: losses, each held expert's flat params by (moe layer, expert), the
    flat dense params, loads, each MoE layer's shadow log, collective counts by op, the layer class."""
    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer

    cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": world, **overrides}).validate()
    tr = Trainer.build(cfg)
    losses = [row["loss"] for row in tr.run()]
    ops: dict = {}
    for r in tr.comm.rec.comm:  # training traffic only: the inspection gather below comes after
        ops[r.op] = ops.get(r.op, 0) + 1
    experts = {}
    with tr.update.resident_params() as model:  # ZeRO-3 frees parameters between iterations
        for li, layer in enumerate(model.moe_layers()):
            ex = layer.experts
            for s, e in enumerate(ex.experts):
                experts[(li, e)] = torch.cat([p[s].detach().reshape(-1) for p in (ex.w1, ex.b1, ex.w2, ex.b2)]).clone()
        dense = torch.cat([p.detach().reshape(-1) for p in model.dense_parameters()]).clone()
    tr.close()  # callers train many configurations in one spawn
    return dict(losses=losses, experts=experts, loads=tr.loads, dense=dense,
                shadows=[list(getattr(layer, "shadow_log", [])) for layer in tr.model.moe_layers()],
                ops=ops, cls=type(tr.model.moe_layers()[0]).__name__)


def expert_grads(experts) -> dict:
    """``{global expert id: [grad of w1, b1, w2, b2 slice]}`` of the slots an ``Experts`` holds (no
    bias: w1, w2 only); a slot autograd never reached (no rows on this rank) has a zero gradient."""
    grad = lambda p: p.grad if p.grad is not None else torch.zeros_like(p)  # noqa: E731
    return {e: [grad(p)[s].clone() for p in experts.stacked() if p is not None] for s, e in enumerate(experts.experts)}


# ---- layer vs the fp64 reference ---------------------------------------------------------------
def rank_inputs(tokens, d: int, seed: int = 0, shift: float = 0.0):
    """Per-rank fp64 inputs ``xs`` and upstream grads ``gys`` (``tokens[r]`` rows each), seeded;
    ``shift`` moves every input (tests use it with a biased gate to make one expert hot)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, d, generator=g, dtype=torch.float64) for t in tokens]
    gys = [torch.randn(t, d, generator=g, dtype=torch.float64) for t in tokens]
    return [x + shift for x in xs] if shift else xs, gys


def reference_grads(ref, xs, gys) -> dict:
    """Run :class:`moelab.moe.reference.ReferenceMoE` on the per-rank chunks with the loss the
    distributed tests use, ``sum_r <y_r, gy_r> + aux``; return outputs and every gradient
    (an expert that got no token has a zero gradient)."""
    xs = [x.clone().requires_grad_() for x in xs]
    outs, aux, routes = ref(xs)
    (sum((y * g).sum() for y, g in zip(outs, gys)) + aux).backward()
    eg = {e: [p.grad if p.grad is not None else torch.zeros_like(p) for p in ref.expert(e)]
          for e in range(ref.cfg.num_experts)}
    return dict(y=[o.detach() for o in outs], gx=[x.grad for x in xs], gg=ref.gate.wg.weight.grad, eg=eg, routes=routes)


def assert_matches_reference(results, ref: dict, *, bias: bool = True, scale: float = 1, **tol) -> None:
    """Each rank's ``{y, gx, gg, eg}`` equals the reference; gradients times ``scale`` (e.g. the
    number of micro-batches a test accumulated). Without expert biases only w1, w2 are compared."""
    tol = tol or dict(rtol=1e-9, atol=1e-10)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["y"], ref["y"][rank], **tol)
        torch.testing.assert_close(res["gx"], scale * ref["gx"][rank], **tol)
        torch.testing.assert_close(res["gg"], scale * ref["gg"], **tol)
        for e, grads in res["eg"].items():
            want = ref["eg"][e] if bias else [ref["eg"][e][0], ref["eg"][e][2]]
            for got, w in zip(grads, want):
                torch.testing.assert_close(got, scale * w, **tol)


# ---- schedules ---------------------------------------------------------------------------------
def peak_overlap(intervals) -> int:
    """The most ``(start, end)`` intervals open at once (one ending where another starts does not
    overlap it): how many ops a scheduler's log or a simulated schedule had in flight at its peak."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    return peak
