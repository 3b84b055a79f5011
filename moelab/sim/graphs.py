"""Op graphs of one training iteration, built from the same plan the runtime executes.

The plan is (config, placement, loads): ``loads[layer][src][expert]`` token assignments per MoE
layer, routed to expert holders by :meth:`Placement.split_counts` (the dispatcher's rule), with
per-peer bytes = tokens x d_model x element bytes. Every collective op carries the record the
runtime's communicator would write (``comm``), so :func:`graph_bytes` replays the shared byte rule
and must equal the measured bytes exactly.

Each strategy names its generator in its :class:`~moelab.registry.Strategy` (``sim_graph``);
:func:`iteration_graph` picks the one named by ``cfg.parallel.strategy``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from moelab.comm import costs
from moelab.comm.bytes import by_link_class, exchange_by_class, peer_bytes
from moelab.comm.topology import LINK_CLASSES, Topology
from moelab.moe.dispatch import count_exchange_bytes
from moelab.moe.layer import balance_allreduce_bytes
from moelab.moe.routing import capacity_for
from moelab.placement import Placement
from moelab.registry import get
from moelab.sim.engine import OpGraph

DTYPE_BYTES = {name: getattr(torch, name).itemsize for name in ("float16", "bfloat16", "float32", "float64")}  # torch's


def get_graph(strategy: str) -> Callable:
    """The iteration-graph generator of a registered strategy (its ``Strategy.sim_graph``)."""
    fn = get(strategy).graph()
    if fn is None:
        raise KeyError(f"strategy {strategy!r} has no simulator graph (Strategy.sim_graph)")
    return fn


def iteration_graph(cfg, profile, loads, placement=None, **kw) -> OpGraph:
    """The op graph of one iteration of ``cfg.parallel.strategy``."""
    return get_graph(cfg.parallel.strategy)(cfg, profile, loads, placement, **kw)


# ---- what the model is made of (one place each) -------------------------------------------------
def moe_layer_ids(model) -> list:
    """Layers holding an MoE FFN: all (moe_every=1) or the odd ones (moe_every=2)."""
    return [i for i in range(model.n_layers) if i % model.moe_every == model.moe_every - 1]


def dense_param_count(model) -> int:
    """Non-expert parameters (data-parallel, all-reduced): the model's rule, in one place.

    Embeddings vocab*d + seq_len*d (head tied); per layer attention 4d^2+4d and two LayerNorms 4d;
    a dense layer's FFN 2*d*d_ff + d_ff + d, an MoE layer's gate d*E (no bias); final LayerNorm 2d.
    """
    d, f, E = model.d_model, model.d_ff, model.moe.num_experts
    moe = set(moe_layer_ids(model))
    n = model.vocab_size * d + model.seq_len * d + 2 * d
    for i in range(model.n_layers):
        n += 4 * d * d + 4 * d + 4 * d
        n += d * E if i in moe else 2 * d * f + f + d
    return n


def expert_param_count(model) -> int:
    """Parameters of one expert FFN (d -> d_ff -> d)."""
    d, f = model.d_model, model.d_ff
    return 2 * d * f + ((f + d) if model.moe.expert_bias else 0)


def capacity(cfg) -> Optional[int]:
    """Tokens per expert per source rank: the runtime's own rule (:func:`moelab.moe.routing.capacity_for`,
    exact decimal arithmetic), so simulated bytes equal measured ones; None when dropless."""
    moe = cfg.model.moe
    return capacity_for(cfg.train.batch_size * cfg.model.seq_len, moe.num_experts, moe.top_k,
                        moe.capacity_factor, moe.min_capacity)


def elem_bytes_of(cfg) -> int:
    return DTYPE_BYTES[cfg.train.dtype]


def topology_of(cfg) -> Topology:
    p = cfg.parallel
    return Topology.from_config(p.nproc, p.topology.nodes, p.topology.ranks_per_node)


def config_for_profile(cfg, profile, **overrides):
    """``cfg`` resized to the profile's cluster (nproc, nodes, ranks per node)."""
    o = {"parallel.nproc": profile.world_size, "parallel.topology.nodes": profile.nodes,
         "parallel.topology.ranks_per_node": profile.gpus_per_node}
    o.update({k.replace("__", "."): v for k, v in overrides.items()})
    return cfg.with_overrides(o)


def route_matrix(placement: Placement, layer_loads) -> np.ndarray:
    """``tokens[src, dst]`` for one layer, by the placement's routing rule: :meth:`Placement.routes`,
    the same split the dispatcher plans with."""
    return placement.routes(layer_loads)


def synthetic_loads(cfg, seed: int = 0, skew: float = 1.0) -> np.ndarray:
    """SYNTHETIC loads ``[moe_layer, src, expert]``: per layer a Zipf(skew) popularity over a random
    expert order; each rank draws its tokens*top_k assignments multinomially. Label results as synthetic."""
    m = cfg.model
    E, N, k = m.moe.num_experts, cfg.parallel.nproc, m.moe.top_k
    T = cfg.train.batch_size * m.seq_len
    rng = np.random.default_rng(seed)
    layers = moe_layer_ids(m)
    out = np.zeros((len(layers), N, E), dtype=np.int64)
    w = 1.0 / np.arange(1, E + 1) ** skew
    for j in range(len(layers)):
        p = np.empty(E)
        p[rng.permutation(E)] = w / w.sum()
        out[j] = rng.multinomial(T * k, p, size=N)
    return out


class RowBytes:
    """An all-to-all's bytes ``tokens[src, dst] x row_bytes``, kept as the route matrix it is made of
    (shared with the graph's other all-to-alls of the layer, a transpose being a view) and multiplied
    out only when read: a 4,096-rank iteration would otherwise hold 48 bytes matrices of 4,096^2."""

    __slots__ = ("tokens", "row_bytes")

    def __init__(self, tokens, row_bytes: int):
        self.tokens, self.row_bytes = np.asarray(tokens), int(row_bytes)

    def __array__(self, dtype=None, copy=None):
        out = self.tokens.astype(np.int64, copy=False) * self.row_bytes
        return out if dtype is None else out.astype(dtype, copy=False)

    def __getitem__(self, index):
        return np.asarray(self.tokens[index], dtype=np.int64) * self.row_bytes

    def __len__(self):
        return len(self.tokens)

    @property
    def shape(self):
        return self.tokens.shape

    @property
    def T(self) -> "RowBytes":
        return RowBytes(self.tokens.T, self.row_bytes)

    def sum(self, *args, **kw):
        return self.tokens.astype(np.int64, copy=False).sum(*args, **kw) * self.row_bytes


# ---- the expert-parallel baseline -----------------------------------------------------------------
@dataclass
class IterationContext:
    """What a strategy's MoE hooks need while :func:`transformer_iteration_graph` builds a graph."""

    g: OpGraph
    cfg: object
    profile: object
    topo: Topology
    ranks: list
    T: int  # tokens per rank
    eb: int  # bytes per element
    hierarchical_a2a: bool = False
    _priced: dict = field(default_factory=dict, repr=False)  # route matrix view -> (it, its demands)

    def compute_time(self, flops: float) -> float:
        return costs.compute_time(flops, self.profile)

    def a2a(self, name, tokens, deps, layer, phase, category="a2a", op="all_to_all", beside_compute=False):
        """An all-to-all moving ``tokens[src, dst]`` rows of d_model elements (recorded as ``op``:
        ``"p2p"`` for a batch of point-to-point exchanges with the same per-peer bytes);
        ``beside_compute``: issued while the ranks compute (:meth:`moelab.sim.engine.OpGraph.transfer`).

        A layer's forward dispatch and backward combine move the same matrix (its combine and
        dispatch gradient the transpose): each view is priced once per graph, the entry keeping the
        view alive (route matrices are never changed after they are built)."""
        tokens = np.asarray(tokens)
        key = (tokens.__array_interface__["data"][0], tokens.shape, tokens.strides, tokens.dtype.str)
        hit = self._priced.get(key)
        if hit is None:
            mat = RowBytes(tokens, self.cfg.model.d_model * self.eb)
            hit = self._priced[key] = (mat, costs.alltoall_demands(mat, self.ranks, self.topo, self.profile,
                                                                   self.hierarchical_a2a))
        mat, demands = hit
        return self.g.transfer(name, self.ranks, demands, deps=deps, category=category, layer=layer, phase=phase,
                               comm={"op": op, "group": self.ranks, "splits": mat}, beside_compute=beside_compute)

    def experts(self, r, name, tokens, deps, layer, phase):
        """Expert FFN compute of ``tokens`` rows on rank r (backward: 2x, frees the activations)."""
        m, bwd = self.cfg.model, phase == "bwd"
        act = {"activations": int(tokens) * (m.d_model + 2 * m.d_ff) * self.eb}  # [estimate] in, pre/post act
        return self.g.compute(r, name,
                              (2 if bwd else 1) * self.compute_time(costs.ffn_flops(int(tokens), m.d_model, m.d_ff)),
                              deps=deps, category="expert", layer=layer, phase=phase,
                              **({"free": act} if bwd else {"alloc": act}))


def new_graph(profile, topo: Topology, meta: Optional[dict] = None) -> OpGraph:
    """An empty graph on ``profile``'s links; on a profile of CPU ranks sharing a host
    (``shared_cores``) compute ops share those cores; every compute op pays ``op_overhead_s``, every
    collective call ``call_overhead_s`` (both 0 on the paper testbeds), a phased one
    ``phase_overhead_s`` per phase where set; ``emulated_sync_s`` prices the door's EMULATED links
    (:meth:`moelab.sim.engine.OpGraph.transfer`); ``busy_call_overhead_s`` (and ``busy_emulated_sync_s``)
    price a call issued while its ranks compute, where measured; ``software_on_cores`` makes the fixed costs
    CPU work on the shared cores instead (every member rank draws min(1, cores / ranks) of them: the
    held-out cost ran with every rank calling at once), and each byte moved ``cpu_s_per_byte``, which prices
    a busy host without the busy costs."""
    g = OpGraph(topo.world_size, costs.link_capacities(profile, topo), meta=meta)
    g.share_cores(getattr(profile, "shared_cores", 0) or 0, getattr(profile, "op_overhead_s", 0.0) or 0.0)
    g.call_overhead_s = float(getattr(profile, "call_overhead_s", 0.0) or 0.0)
    g.phase_overhead_s = float(getattr(profile, "phase_overhead_s", 0.0) or 0.0)
    g.emulated_sync_s = getattr(profile, "emulated_sync_s", None)
    busy = getattr(profile, "busy_call_overhead_s", None)
    if busy is not None:
        g.busy_fixed = (float(busy), getattr(profile, "busy_emulated_sync_s", None) or 0.0)
    cores = getattr(profile, "shared_cores", 0) or 0
    if getattr(profile, "software_on_cores", False) and cores > 0:
        g.software_cpu_share = min(1.0, cores / topo.world_size)
        g.cpu_s_per_byte = float(getattr(profile, "cpu_s_per_byte", 0.0) or 0.0)
    return g


def transformer_iteration_graph(cfg, profile, loads, placement: Placement, moe_forward, moe_backward, *,
                                elem_bytes: Optional[int] = None, hierarchical_a2a: bool = False,
                                meta: Optional[dict] = None, beside_attention: Optional[Callable] = None,
                                stream_priority: Optional[dict] = None, count_bytes: Optional[int] = None,
                                dense_sync: Optional[Callable] = None):
    """The skeleton every data/expert-parallel strategy shares: per layer attention, then for an MoE
    layer gate + count exchange + ``moe_forward(ctx, i, j, deps) -> per-rank ops`` (else the dense
    FFN), the tied head, the mirror backward with ``moe_backward(ctx, i, j, deps)``, and one
    all_reduce of the dense grads. Returns ``(graph, ctx, last_ops)`` so a strategy can append its
    own synchronisation. Topology = ``cfg``'s (the runtime's), bandwidths = ``profile``'s.

    ``beside_attention(ctx, i, phase, deps) -> per-rank op ids | None`` adds ops that run *while*
    layer i's attention does (forward and backward), issued when the attention is (same ``deps``),
    on a stream of the strategy's choosing (Hecate prefetches expert parameters there); whatever
    follows the attention waits for them too. ``stream_priority`` (stream -> int) decides which
    stream wins a link both use (:class:`moelab.sim.engine.OpGraph`). ``count_bytes``: bytes each rank
    all-gathers in the count exchange (default the core dispatchers': int64 per expert, + the dense
    capacity; LSH-MoE sends token and centroid counts, 2E).

    ``dense_sync(ctx, ready) -> op ids``: the strategy synchronises the dense gradients itself
    (Lina's buckets and micro-ops) instead of the one all-reduce after backward. ``ready``: the
    gradient-ready points in backward order, ``[(label, per-rank op ids, [parameter sizes])]`` in
    reverse parameter order (the order the runtime's hooks see them), covering
    :func:`dense_param_count` exactly."""
    m, moe = cfg.model, cfg.model.moe
    topo = topology_of(cfg)
    N, E, k = topo.world_size, moe.num_experts, moe.top_k
    eb = elem_bytes or elem_bytes_of(cfg)
    d, f, s, V = m.d_model, m.d_ff, m.seq_len, m.vocab_size
    T = cfg.train.batch_size * s
    moe_ids = moe_layer_ids(m)
    if np.asarray(loads).shape != (len(moe_ids), N, E):
        raise ValueError(f"loads must be [moe_layers={len(moe_ids)}][ranks={N}][experts={E}], "
                         f"got {np.asarray(loads).shape}")
    g = new_graph(profile, topo, meta={"profile": profile.name, "topology": topo.describe(), "elem_bytes": eb,
                                       **(meta or {})})
    g.stream_priority.update(stream_priority or {})
    ranks = list(range(N))
    ctx = IterationContext(g, cfg, profile, topo, ranks, T, eb, hierarchical_a2a)
    ct = ctx.compute_time
    t_attn, t_gate = ct(costs.attention_flops(T, d, s)), ct(costs.gate_flops(T, d, E))
    t_ffn, t_head = ct(costs.ffn_flops(T, d, f)), ct(costs.head_flops(T, d, V))
    act_attn = T * (6 * d + m.n_heads * s) * eb  # [estimate] LN, QKV, probs, context, output
    act_ffn = T * (d + 2 * f) * eb  # [estimate] input, pre- and post-activation hidden
    act_gate = T * (E + k * d) * eb
    if count_bytes is None:
        count_bytes = count_exchange_bytes(E, moe.dispatcher)

    n_dense = dense_param_count(m)
    n_local = [len(placement.local_experts(r)) * expert_param_count(m) for r in ranks]
    last = [g.add("init", r, category="other", kind="compute",
                  alloc={"params": (n_dense + n_local[r]) * eb, "grads": (n_dense + n_local[r]) * eb,
                         "optimizer": 2 * (n_dense + n_local[r]) * 4}) for r in ranks]

    def attention(i, phase, deps, **kw):
        """Layer i's attention on every rank and the strategy's side ops beside it; per rank, the
        ops whatever comes next must wait for."""
        side = beside_attention(ctx, i, phase, deps) if beside_attention is not None else None
        attn = [g.compute(r, f"L{i}.attn.{phase}", (1 if phase == "fwd" else 2) * t_attn, deps=(deps[r],),
                          category="attention", layer=i, phase=phase, **kw) for r in ranks]
        return [(a,) if side is None or side[r] is None else (a, side[r]) for r, a in enumerate(attn)]

    for i in range(m.n_layers):  # forward
        after = attention(i, "fwd", last, alloc={"activations": act_attn})
        last = [a[0] for a in after]
        if i in moe_ids:
            gates = [g.compute(r, f"L{i}.gate.fwd", t_gate, deps=after[r], category="gate", layer=i,
                               phase="fwd", alloc={"activations": act_gate}) for r in ranks]
            counts = g.transfer(f"L{i}.counts", ranks,
                                [costs.ring_demand("all_gather", ranks, topo, profile, count_bytes)],
                                deps=gates, category="count_exchange", layer=i, phase="fwd",
                                comm={"op": "all_gather", "group": ranks, "nbytes": count_bytes})
            last = moe_forward(ctx, i, moe_ids.index(i), (counts,))
        else:
            last = [g.compute(r, f"L{i}.ffn.fwd", t_ffn, deps=after[r], category="ffn", layer=i, phase="fwd",
                              alloc={"activations": act_ffn}) for r in ranks]
    last = [g.compute(r, "head.fwd", t_head, deps=(last[r],), category="head", phase="fwd",
                      alloc={"activations": T * V * eb}) for r in ranks]
    bal = balance_allreduce_bytes(moe, len(moe_ids), N)  # the global balance loss's counts (model's aux_loss)
    if bal:
        ar = g.transfer("balance.allreduce", ranks, [costs.ring_demand("all_reduce", ranks, topo, profile, bal)],
                        deps=last, category="balance", phase="fwd",
                        comm={"op": "all_reduce", "group": ranks, "nbytes": bal})
        last = [ar] * N
    last = [g.compute(r, "head.bwd", 2 * t_head, deps=(last[r],), category="head", phase="bwd",
                      free={"activations": T * V * eb}) for r in ranks]
    ready = [("ln_f", list(last), [d, d])]  # gradient-ready points (dense_sync)
    for i in reversed(range(m.n_layers)):  # backward
        if i in moe_ids:
            done = moe_backward(ctx, i, moe_ids.index(i), last)
            last = [g.compute(r, f"L{i}.gate.bwd", 2 * t_gate, deps=(done[r],), category="gate", layer=i,
                              phase="bwd", free={"activations": act_gate}) for r in ranks]
            ready.append((f"L{i}.gate", list(last), [E * d]))
        else:
            last = [g.compute(r, f"L{i}.ffn.bwd", 2 * t_ffn, deps=(last[r],), category="ffn", layer=i,
                              phase="bwd", free={"activations": act_ffn}) for r in ranks]
            ready.append((f"L{i}.ffn", list(last), [d, d * f, f, f * d]))
        after = attention(i, "bwd", last, free={"activations": act_attn})
        last = [g.add(f"L{i}.attn.bwd.done", r, kind="compute", category="other", deps=a, layer=i, phase="bwd")
                if len(a) > 1 else a[0] for r, a in enumerate(after)]
        ready.append((f"L{i}.attn", list(last), [d, d, d, d * d, 3 * d, 3 * d * d, d, d]))
    ready.append(("embeddings", list(last), [s * d, V * d]))
    if dense_sync is not None:
        return g, ctx, tuple(dense_sync(ctx, ready))
    grad_bytes = n_dense * eb
    prev = (g.transfer("dense_grads.allreduce", ranks,
                       [costs.ring_demand("all_reduce", ranks, topo, profile, grad_bytes)],
                       deps=last, category="allreduce", phase="sync",
                       comm={"op": "all_reduce", "group": ranks, "nbytes": grad_bytes}),)
    return g, ctx, prev


def token_stages(routes, before_experts_bwd=None, expert_rows=None, local_work=None):
    """The token path of an MoE layer as the two hooks of :func:`transformer_iteration_graph`: dispatch
    all-to-all, experts on the received rows, combine all-to-all (backward: the mirror, 2x compute).
    ``routes[j]``: rows ``[src, dst]`` the all-to-alls of MoE layer j move; ``expert_rows[j]``: rows each
    rank's experts compute (default: the rows received); ``before_experts_bwd(i) -> op ids``: extra ops the
    expert backward of layer i waits for (Hecate's re-materialization). ``local_work(ctx, i, j, phase,
    where, deps) -> one op id per rank`` (``where``: ``"before"`` the phase's first all-to-all or
    ``"after"`` its last; ``deps[r]``: the tuple of ops rank r's work waits for): per-rank work around
    the token path (LSH-MoE's hashing, centroids and decompression)."""
    def around(ctx, i, j, phase, where, per_rank):
        if local_work is None:
            return per_rank
        return local_work(ctx, i, j, phase, where, [tuple(d) if isinstance(d, (tuple, list)) else (d,)
                                                    for d in per_rank])

    def rows(j):
        return routes[j].sum(0) if expert_rows is None else np.asarray(expert_rows[j])

    def moe_forward(ctx, i, j, deps):
        pre = tuple(deps) if local_work is None else tuple(around(ctx, i, j, "fwd", "before", [deps] * len(ctx.ranks)))
        disp = ctx.a2a(f"L{i}.dispatch", routes[j], pre, i, "fwd")
        work = rows(j)
        exps = [ctx.experts(r, f"L{i}.experts.fwd", work[r], (disp,), i, "fwd") for r in ctx.ranks]
        comb = ctx.a2a(f"L{i}.combine", routes[j].T, exps, i, "fwd")
        return around(ctx, i, j, "fwd", "after", [comb] * len(ctx.ranks))

    def moe_backward(ctx, i, j, deps):
        pre = around(ctx, i, j, "bwd", "before", deps)
        comb_b = ctx.a2a(f"L{i}.combine.bwd", routes[j], pre, i, "bwd")
        wait = (comb_b,) + tuple(before_experts_bwd(i) if before_experts_bwd is not None else ())
        work = rows(j)
        exps = [ctx.experts(r, f"L{i}.experts.bwd", work[r], wait, i, "bwd") for r in ctx.ranks]
        disp_b = ctx.a2a(f"L{i}.dispatch.bwd", routes[j].T, exps, i, "bwd")
        return around(ctx, i, j, "bwd", "after", [disp_b] * len(ctx.ranks))

    return moe_forward, moe_backward


def ep_iteration_graph(cfg, profile, loads, placement: Optional[Placement] = None, *,
                       elem_bytes: Optional[int] = None, hierarchical_a2a: bool = False) -> OpGraph:
    """One training iteration of the EP baseline, every rank, every layer.

    MoE layer forward: dispatch all-to-all (tokens routed to expert holders by the placement's
    rule), experts on the received tokens, combine all-to-all; backward mirrors it with 2x compute.
    After the dense all-reduce, the replica gradient sync of :mod:`moelab.moe.sync`. ``elem_bytes``
    defaults to ``cfg.train.dtype`` so bytes equal the runtime's (pass 2 to price fp16 at paper
    scale). With a capacity factor, loads are clipped to the capacity (a no-op on loads recorded
    after dropping). The ``dense`` dispatcher (DeepSpeed style) sends capacity-padded equal splits
    and its experts compute the padded buffers.
    """
    m, moe = cfg.model, cfg.model.moe
    N, E = topology_of(cfg).world_size, moe.num_experts
    placement = placement or Placement.expert_parallel(E, N)
    loads = np.asarray(loads, dtype=np.int64)
    cap = capacity(cfg)
    if cap is not None:
        loads = np.minimum(loads, cap)
    if moe.dispatcher == "dense":
        per_dst = np.array([len(placement.local_experts(r)) * cap for r in range(N)], dtype=np.int64)
        routes = [np.tile(per_dst, (N, 1)) for _ in range(loads.shape[0])]
    else:
        routes = [route_matrix(placement, L) for L in loads]

    moe_forward, moe_backward = token_stages(routes)
    g, ctx, prev = transformer_iteration_graph(cfg, profile, loads, placement, moe_forward, moe_backward,
                                               elem_bytes=elem_bytes, hierarchical_a2a=hierarchical_a2a,
                                               meta={"strategy": "ep"})
    # replica grad sync (moelab.moe.sync): per MoE layer, per replicated expert in id order, each
    # replica sends its grad to the owner, then the owner sends the sum back
    p_bytes = expert_param_count(m) * ctx.eb
    for i in moe_layer_ids(m):
        for e, holders in enumerate(placement.holders):
            owner = holders[0]

            def send(src, dst, deps, what):
                return g.transfer(f"L{i}.e{e}.{what}.{src}->{dst}", [src, dst],
                                  [costs.p2p_demand(src, dst, ctx.topo, profile, p_bytes)], deps=deps,
                                  category="replica_sync", layer=i, phase="sync",
                                  comm={"op": "p2p", "group": [src], "peer": dst, "nbytes": p_bytes})

            if len(holders) > 1:
                ups = tuple(send(r, owner, prev, "grad_to_owner") for r in holders[1:])
                prev = tuple(send(owner, r, ups, "sum_to_replica") for r in holders[1:])
    return g



_RECORD_KEYS = ("op", "group", "nbytes", "splits", "root", "peer")  # the rest of a record: the op's own rule's (SAA)


def replay_bytes(graph: OpGraph, topo: Topology):
    """Yield ``(rank, op, category, {local, intra, inter})`` for every rank of every op with a
    ``comm`` record, through :func:`moelab.comm.bytes.peer_bytes`: the runtime's own rule."""
    for op in graph.ops:
        c = op.comm
        if c is None:
            continue
        group = list(c["group"])
        splits = c.get("splits")
        splits = None if splits is None else np.asarray(splits)  # once per op, not once per rank
        for i, me in enumerate(group):
            row = None if splits is None else [int(x) for x in splits[i]]
            per = peer_bytes(c["op"], group, me, int(c.get("nbytes", 0)), splits=row, root=c.get("root"),
                             peer=c.get("peer"), **{k: v for k, v in c.items() if k not in _RECORD_KEYS})
            yield me, c["op"], op.category, by_link_class(topo, me, per)


def graph_bytes(graph: OpGraph, topo: Topology, categories=None) -> dict:
    """Per rank ``{local, intra, inter}`` bytes sent, exactly as the runtime records them: the
    per-member exchanges (``all_to_all``, batched ``p2p``) folded into link classes as arrays (a
    1,024-rank iteration has 48 of 1,024^2 entries), every other op through :func:`replay_bytes`."""
    acc = np.zeros((graph.world_size, len(LINK_CLASSES)), dtype=np.int64)
    node = np.arange(graph.world_size) // topo.ranks_per_node
    rest = []
    for op in graph.ops:
        c = op.comm
        if c is None or (categories is not None and op.category not in categories):
            continue
        if c["op"] in ("all_to_all", "p2p") and c.get("splits") is not None:
            group = np.asarray(c["group"])
            S = np.asarray(c["splits"]).astype(np.int64, copy=False)  # [i, j]: member i sends member j
            for k, sent in enumerate(exchange_by_class(S, node[group])):  # local, intra, inter
                np.add.at(acc, (group, k), sent)
        else:
            rest.append(op)
    out = {r: {cls: int(acc[r, i]) for i, cls in enumerate(LINK_CLASSES)} for r in range(graph.world_size)}
    for me, _, _, by_cls in replay_bytes(_Ops(rest), topo):
        for cls, b in by_cls.items():
            out[me][cls] += b
    return out


@dataclass
class _Ops:
    """A list of ops seen as a graph by :func:`replay_bytes`."""

    ops: list
