"""Parm in the simulator (spec §2.10-2.11): one MoE layer's forward + backward as an op graph built
from the same plan the runtime executes (:mod:`.plan`), so simulated bytes are the door's bytes.

- every collective is one op per group instance over that instance's ranks; instances of one group
  run at once and share the nodes' NICs and ports (:mod:`moelab.comm.costs` link model);
- SAA is priced as its P phases (the collective's own ``phases`` rule, :mod:`moelab.comm.saa`), each
  an exchange of the all-to-all half (one chunk to rank ``(r+i)%P``) together with the gather half
  (the chunk or, ``saa_mode: combined``, the ESP sum completed in the phase before, to every MP
  peer): halves on different link classes overlap, halves on the same link share it. ``saa_streams=1``
  is moelab's runtime (a phase ends when both halves are done); ``saa_streams=2`` is the paper's kernel
  (:func:`_saa_kernel`: the halves on two streams, the all-to-all never waiting for the gather);
- compute from the §2.10c FLOPs at the profile's achieved throughput (the einsum dispatcher's
  quadratic cost included); no compute/communication overlap, as the paper's schedules have none;
- no count exchange (the buffers are capacity-padded).

:func:`layer_time` simulates one layer and returns its seconds, with the communication share
(Fig. 1's quantity) from the critical path.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from moelab.comm import costs
from moelab.comm.costs import alltoall_demands, fit_alpha_beta
from moelab.comm.saa import forward_phases, sub_groups
from moelab.comm.topology import Topology
from moelab.models.tensor_parallel import sharded_param_count
from moelab.sim.engine import simulate
from moelab.sim.graphs import dense_param_count, moe_layer_ids, new_graph
from moelab.strategies.parm.fits import COLLECTIVES
from moelab.strategies.parm.layout import DENSE_DP, EPESP, MP, ParmLayout
from moelab.strategies.parm.options import ParmOptions, layout_of
from moelab.strategies.parm.perf_model import ParmShape, select
from moelab.strategies.parm.plan import Shape, Step, steps


def _saa_alpha(demands: list, saa_phase_alpha: float) -> list:
    """SAA's phase demands with each phase's fixed cost (its link class's latency) scaled by ``saa_phase_alpha``
    (Parm's assumption of that name: the paper gives no per-phase cost of its two-stream kernel)."""
    if saa_phase_alpha == 1.0:
        return demands
    return [costs.Demand(d.alpha * saa_phase_alpha, d.links) for d in demands]


def _saa_kernel(g, name: str, group: list, topo: Topology, profile, args: dict, deps: tuple, phase_alpha: float,
                comm: dict, phase: str, round_s: Optional[float] = None):
    """SAA as the paper's kernel runs it (github.com/Fragile-azalea/Parm, commit 5e0bc31,
    ``test_overlap_alltoall_and_allgather/src/custom_kernel.cpp``): one host call enqueues the all-to-all's rounds
    1..P-1 back to back on one NCCL stream and the gather's rounds on a second; gather round i waits (a CUDA event)
    for all-to-all round i-1, the all-to-all never waits for the gather, and the last gather round follows the last
    all-to-all round on the first stream. Each round is a grouped ncclSend/ncclRecv and pays ``phase_alpha`` of its
    class latency (all-to-all: the group's class, gather: the MP sub-group's), or, with ``round_s``, the call pays
    one class latency (what an all-to-all call pays: the host call) and each round ``round_s`` seconds (a round's
    device-side latency); concurrent rounds share links. Returns the op that ends the call."""
    P, nb, c = len(group), int(args["nbytes"]), int(args.get("combine", 1))
    idx = {r: i for i, r in enumerate(group)}
    subs = sub_groups(args["sub"])
    peers = {r: [p for p in next((q for q in subs if r in q), []) if p != r] for r in group}
    fwd = {r: forward_phases(P, c, idx[r]) for r in group}
    lat = lambda ranks: profile.latency("intra" if len({topo.node_of(r) for r in ranks}) == 1 else "inter")  # noqa: E731
    a_lat = lat(group) * phase_alpha
    g_lat = max((lat([r, *peers[r]]) for r in group if peers[r]), default=0.0) * phase_alpha
    if round_s is not None:
        a_lat = g_lat = round_s
        deps = (g.add(f"{name}.call", group, stream="comm", duration=lat(group), deps=deps, category="saa", kind="comm",
                      phase=phase),)
    first, a_prev, g_prev, g_last = [True], None, None, None

    def add(label, matrix, alpha, on, after):
        d = alltoall_demands(matrix, group, topo, profile, False)[0]
        rec = comm if first[0] else None
        first[0] = False
        return g.transfer(f"{name}.{label}", group, [costs.Demand(alpha, d.links)], deps=after, stream=on,
                          category="saa", comm=rec, phase=phase, phased=True)

    for i in range(1, P + 1):
        m = np.zeros((P, P), dtype=np.int64)
        for r in group:
            if i in fwd[r]:
                for p in peers[r]:
                    m[idx[r], idx[p]] += nb
        if m.any():
            if i < P:  # on the second stream, after all-to-all round i-1 (round 0: the local copy)
                after = tuple(x for x in (a_prev, g_prev) if x is not None) or deps
                g_prev = add(f"gather#{i}", m, g_lat, "comm.saa", after)
            else:  # the kernel's last round, on the first stream
                g_last = add(f"gather#{i}", m, g_lat, "comm", (a_prev,) if a_prev is not None else deps)
        if i < P:
            m = np.zeros((P, P), dtype=np.int64)
            for r in group:
                m[idx[r], idx[group[(idx[r] + i) % P]]] = nb
            a_prev = add(f"a2a#{i}", m, a_lat, "comm", (a_prev,) if a_prev is not None else deps)
    ends = tuple(x for x in (a_prev, g_prev, g_last) if x is not None)
    return g.add(f"{name}.end", group, stream="comm", duration=0.0, deps=ends, category="saa", kind="comm",
                 phase=phase)


def _build(g, layout: ParmLayout, topo: Topology, profile, plan, saa_phase_alpha: float = 1.0,
           saa_streams: int = 1, saa_round_s: Optional[float] = None) -> None:
    """Append ``plan`` (a list of :class:`~.plan.Step`) to ``g``: each rank's steps in order; every SAA phase
    pays ``saa_phase_alpha`` of its class latency as its fixed cost (:func:`_saa_alpha`); ``saa_streams``: 1 =
    moelab's runtime SAA (phase by phase), 2 = the paper's two-stream kernel (:func:`_saa_kernel`, with
    ``saa_round_s``: its per-round latency)."""
    groups = layout.groups()
    last = {r: None for r in range(layout.world)}
    dep = lambda ranks: tuple(last[r] for r in ranks if last[r] is not None)  # noqa: E731
    priced: dict = {}  # (step, instance) -> (its args, its demands); the plan keeps its steps alive
    for s in plan:
        if not s.is_comm:
            t = costs.compute_time(s.flops, profile)
            for r in range(layout.world):
                last[r] = g.compute(r, f"{s.name}.{s.phase}", t, deps=dep([r]), category=s.name, phase=s.phase)
            continue
        for inst in groups[s.group]:
            key = (id(s), tuple(inst))  # a model repeats its MoE layer's steps: price each once
            if key not in priced:
                args = dict(s.args)
                if s.op == "all_to_all":
                    args["splits"] = np.tile(np.asarray(args["splits"], dtype=np.float64), (len(inst), 1))
                if s.op == "saa":  # every MP group: the gather halves of all of them
                    args["sub"] = groups[MP]
                d = costs.demands(s.op, inst, topo, profile, **args)
                priced[key] = (args, _saa_alpha(d, saa_phase_alpha) if s.op == "saa" else d)
            args, demands = priced[key]
            if s.op == "saa" and saa_streams == 2:
                op = _saa_kernel(g, f"{s.name}.{s.phase}", list(inst), topo, profile, args, dep(inst), saa_phase_alpha,
                                 {"op": s.op, "group": list(inst), **args}, s.phase, saa_round_s)
                for r in inst:
                    last[r] = op
                continue
            op = g.transfer(f"{s.name}.{s.phase}", inst, demands, deps=dep(inst),
                            category="saa" if s.op == "saa" else "comm",
                            comm={"op": s.op, "group": list(inst), **args}, phase=s.phase, phased=s.op == "saa")
            for r in inst:
                last[r] = op


def parm_layer_graph(profile, layout: ParmLayout, shape: Shape, schedule: str, variant: str = "fig3a",
                     saa_backward: bool = True, meta: Optional[dict] = None, saa_mode: str = "raw",
                     saa_phase_alpha: float = 1.0, saa_streams: int = 1, saa_round_s: Optional[float] = None):
    """The op graph of one MoE layer call (forward + backward) of ``schedule`` on ``profile``'s links."""
    topo = Topology(layout.world, layout.ranks_per_node)
    g = new_graph(profile, topo, {"strategy": "parm", "schedule": schedule, "variant": variant, **(meta or {})})
    _build(g, layout, topo, profile, steps(layout, shape, schedule, variant, saa_backward, saa_mode), saa_phase_alpha,
           saa_streams, saa_round_s)
    return g


def model_steps(layout: ParmLayout, shape: Shape, *, n_layers: int, seq_len: int, vocab: int, d_ff: int,
                moe_every: int = 2, schedule: str = "s1", variant: str = "fig3a", saa_backward: bool = True,
                saa_mode: str = "raw",
                grad_sync: bool = True) -> list:
    """One training iteration of a Transformer with Megatron tensor parallelism over MP: per block
    attention (its FLOPs / N_MP) and an MP all-reduce of the S x M activations in each pass (g forward,
    f backward), then a dense FFN (the same) or Parm's MoE layer (:func:`~.plan.steps`); the tied LM
    head replicated; with ``grad_sync`` the update's all-reduces (:class:`~.update.ParmUpdate`): the dense
    gradients over the dense-DP group (the model's dense parameters with the tensor-parallel ones / N_MP,
    the gates left out), then each MoE layer's gate gradient over the world."""
    from types import SimpleNamespace

    L, S, M, b = layout, shape.S, shape.M, shape.elem_bytes
    attn_f = costs.attention_flops(S, M, seq_len) / L.n_mp
    ffn_f = costs.ffn_flops(S, M, d_ff) / L.n_mp
    ar = [Step(p, "tp_allreduce", "all_reduce", MP, {"nbytes": S * M * b}) for p in ("fwd", "bwd")] if L.n_mp > 1 \
        else [None, None]
    moe = steps(layout, shape, schedule, variant, saa_backward, saa_mode)
    fwd, bwd = [], []
    for i in range(n_layers):
        is_moe = moe_every == 1 or i % 2 == 1
        blk_f = [Step("fwd", "attention", flops=attn_f), ar[0]]
        blk_b = [Step("bwd", "attention", flops=2 * attn_f), ar[1]]
        if is_moe:
            blk_f += [s for s in moe if s.phase == "fwd"]
            blk_b = [s for s in moe if s.phase == "bwd"] + blk_b
        else:
            blk_f += [Step("fwd", "ffn", flops=ffn_f), ar[0]]
            blk_b = [Step("bwd", "ffn", flops=2 * ffn_f), ar[1]] + blk_b
        fwd += blk_f
        bwd = blk_b + bwd
    head = costs.head_flops(S, M, vocab)
    plan = [s for s in fwd + [Step("fwd", "head", flops=head), Step("bwd", "head", flops=2 * head)] + bwd if s]
    if grad_sync:
        m = SimpleNamespace(d_model=M, d_ff=d_ff, n_layers=n_layers, vocab_size=vocab, seq_len=seq_len,
                            moe_every=moe_every, moe=SimpleNamespace(num_experts=L.num_experts))
        gate, n_moe = M * L.num_experts, len(moe_layer_ids(m))
        dense = dense_param_count(m) - n_moe * gate - sharded_param_count(m) * (L.n_mp - 1) // L.n_mp
        # N_DP = 1: local
        plan.append(Step("sync", "dense_grad_allreduce", "all_reduce", DENSE_DP, {"nbytes": dense * b}))
        plan += [Step("sync", "gate_grad_allreduce", "all_reduce", EPESP, {"nbytes": gate * b})] * n_moe
    return plan


def parm_model_graph(profile, layout: ParmLayout, shape: Shape, meta: Optional[dict] = None,
                     saa_phase_alpha: float = 1.0, saa_streams: int = 1, saa_round_s: Optional[float] = None, **kw):
    """The op graph of one training iteration (:func:`model_steps`)."""
    topo = Topology(layout.world, layout.ranks_per_node)
    g = new_graph(profile, topo, {"strategy": "parm", "model": True, **(meta or {})})
    _build(g, layout, topo, profile, model_steps(layout, shape, **kw), saa_phase_alpha, saa_streams, saa_round_s)
    return g


def layer_time(profile, layout: ParmLayout, shape: Shape, schedule: str, **kw) -> dict:
    """Simulated seconds of one layer call (fwd + bwd) and the share of it spent in communication."""
    res = simulate(parm_layer_graph(profile, layout, shape, schedule, **kw))
    kinds = res.breakdown("kind")
    t = float(res.makespan)
    return {"time_s": t, "comm_share": kinds.get("comm", 0.0) / t if t > 0 else 0.0, "breakdown": res.breakdown()}


# ---- alpha-beta lines of the simulator's own collectives (what Alg. 1 gets at paper scale) -------------
def sim_curve(profile, layout, name: str, xs, saa_phase_alpha: float = 1.0, saa_streams: int = 1,
              saa_round_s: Optional[float] = None) -> list:
    """Seconds the simulator gives one collective of ``name`` alone at paper-``x`` elements on ``layout``
    (``saa_phase_alpha``: :func:`_saa_alpha`; ``saa_streams``: :func:`_build`)."""
    topo = Topology(layout.world, layout.ranks_per_node)
    op, group = COLLECTIVES[name]
    groups = layout.groups()
    b = profile.elem_bytes
    out = []
    for x in xs:
        if op == "saa":
            g = new_graph(profile, topo)
            chunk = max(1, int(x) // (layout.n_mp * layout.world)) * b
            world = list(range(layout.world))
            if saa_streams == 2:
                _saa_kernel(g, "saa", world, topo, profile, {"nbytes": chunk, "sub": groups[MP]}, (), saa_phase_alpha,
                            {"op": "saa", "group": world}, "fwd", saa_round_s)
            else:
                d = costs.demands("saa", world, topo, profile, nbytes=chunk, sub=groups[MP])
                g.transfer("saa", world, _saa_alpha(d, saa_phase_alpha))
            out.append(simulate(g).makespan)
            continue
        inst = groups[group][0]
        n = len(inst)
        if op == "all_gather":
            d = costs.demands(op, inst, topo, profile, nbytes=max(1, int(x) // n) * b)
        elif op == "all_to_all":
            d = costs.demands(op, inst, topo, profile, splits=np.full((n, n), max(1, int(x) // n) * b, dtype=float))
        else:
            d = costs.demands(op, inst, topo, profile, nbytes=int(x) * b)
        caps = costs.link_capacities(profile, topo)
        out.append(sum(dd.time(caps) for dd in d))
    return out


def model_fits(profile, layout, names=("AG_MP", "A2A_EPESP", "SAA"), exps=range(8, 25, 2),
               saa_phase_alpha: float = 1.0, saa_streams: int = 1, saa_round_s: Optional[float] = None) -> dict:
    """alpha-beta lines fitted to the simulator's own curves on ``layout`` (what Alg. 1 gets at paper scale)."""
    xs = [2 ** e for e in exps]
    out = {}
    for name in names:
        if name == "AG_MP" and layout.n_mp == 1 or name == "SAA" and layout.n_mp == 1:
            continue
        out[name] = fit_alpha_beta(xs, sim_curve(profile, layout, name, xs, saa_phase_alpha, saa_streams, saa_round_s))
    return out


def parm_iteration_graph(cfg, profile, loads=None, placement=None, *, schedule: Optional[str] = None, **kw):
    """The strategy's simulator graph (``Strategy.sim_graph``): one training iteration of ``cfg`` on
    ``profile`` (:func:`parm_model_graph`; loads do not matter: the buffers are capacity-padded).
    ``auto`` resolves with Alg. 1 on alpha-beta lines fitted to the profile's own collective curves.
    The update's all-reduces are :func:`model_steps`'."""
    opts = ParmOptions.from_dict(cfg.parallel.strategy_options)
    lay = layout_of(cfg, opts)
    m, moe = cfg.model, cfg.model.moe
    shape = Shape(S=cfg.train.batch_size * m.seq_len, M=m.d_model, H=m.d_ff, k=moe.top_k, f=moe.capacity_factor,
                  elem_bytes=8 if cfg.train.dtype == "float64" else 4, dispatcher=opts.dispatcher)
    sched = schedule or opts.schedule
    if sched == "auto":
        sched = select(ParmShape(cfg.train.batch_size, m.seq_len, m.d_model, moe.num_experts, moe.top_k,
                                 moe.capacity_factor, lay.n_mp, lay.n_esp), model_fits(profile, lay))[0]
    return parm_model_graph(profile, lay, shape, meta={"schedule": sched}, n_layers=m.n_layers, seq_len=m.seq_len,
                            vocab=m.vocab_size, d_ff=m.d_ff, moe_every=m.moe_every, schedule=sched,
                            variant=opts.baseline_variant, saa_backward=opts.saa_backward, saa_mode=opts.saa_mode,
                            **kw)
