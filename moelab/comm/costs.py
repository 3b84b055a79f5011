"""Cost model: compute from FLOPs, collectives as alpha-beta demands on shared links.

A collective is priced as a :class:`Demand`: a fixed latency ``alpha`` plus bytes on named links.

Declared hardware (the same the link emulator of :meth:`moelab.comm.door.Communicator.emulated_time`
assumes): every GPU (rank) has its own intra-node port, ``("intra_out", rank)`` / ``("intra_in",
rank)`` of ``profile.intra_bw_GBps`` per direction, and a node has ``k = nics_per_node`` NICs
(at least 1, at most one per GPU), ``("nic_out", i)`` / ``("nic_in", i)`` with global NIC index
``i = node * k + j``, each of ``profile.inter_bw_GBps / k`` per direction (the profile's inter
bandwidth is the node's NICs together). A GPU reaches other nodes only through the NIC it is
attached to: GPUs are attached in contiguous blocks of ``ranks_per_node / k`` (as GPUs share a PCIe
switch with their NIC), so with ``k = 1`` all GPUs of a node share one NIC (and NIC ``i`` is node
``i``), with ``k = ranks_per_node`` every GPU has its own (multi-NIC servers; what the emulator
declares). Cross-node traffic uses the sender's NIC out and the receiver's NIC in, never the
intra ports. Alone on its links a demand takes ``alpha + max_link bytes/capacity``; the event
engine runs the same demands with fair sharing when transfers overlap. One description, two uses:
the closed-form times here and the simulated times agree whenever nothing overlaps.

The link emulator (:mod:`moelab.comm.links`) shares a rank's ports by the same rule as the event
engine (k flows on a port get 1/k each; a flow moves at its slowest share), runs the same rings
(:func:`ring_channels`) and ends a collective on every member at its slowest member's finish. It
sees only its own rank's ports, and a call using both link classes starts each class after that
class's latency (here: one ``alpha``, the inter latency): alone they agree whenever one class
dominates, which :func:`moelab.measure.validate.emulation_profile` relies on. Which demand a collective
is priced here for the built-in collectives (:data:`BUILT_IN_DEMANDS`), by its own declaration for the others
(:mod:`moelab.comm.collectives`); :func:`demands` asks either by name.

Bytes on links follow the algorithm, while *accounted* bytes follow :mod:`moelab.comm.bytes`
(pairwise, what the runtime records). All-to-all and p2p are direct (both the same). All-reduce,
all-gather and reduce-scatter are rings over the group in node-major order (``ring_channels``):
inside one node a single ring; across nodes one ring *channel* per NIC the members of a node are
attached to (as NCCL runs one channel per NIC), channel c leaving every node through a different
NIC and carrying 1/C of the data, so a node's NICs share the ring traffic; with one NIC per node
this is exactly the single ring. A ring of n ranks costs its steps' latencies (``n-1``; all-reduce
``2(n-1)``) plus its slowest link. Broadcast/reduce are pipelined chains (S on every edge).
A profile of an NCCL cluster (``profile.allreduce == "nccl"``) lets an all-reduce over 2^m > 2 members
take the faster, alone, of the ring and recursive halving-then-doubling (``2m`` step latencies, the
nearest partner getting the largest piece, so across nodes a node's NIC carries the message about once
instead of the ring's 2(n-1)/n): NCCL's tuner picks between its ring and its tree, which has the
log-depth latency and the hierarchical NIC volume this schedule stands for. gloo (the emulator, local
profiles) keeps the ring.

Where a profile carries a measured fit for an op (``profile.fits[op] = (alpha, beta)``) and the
group sits in one node, the demand is rescaled so that alone it takes ``alpha + beta * x`` with
x = the most non-local bytes any member sends (:func:`moelab.comm.bytes.sent_bytes`, the byte rule), which is
the x the calibrator fits against.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from moelab.comm.bytes import exchange_by_class, sent_bytes
from moelab.comm.collectives import collective
from moelab.comm.topology import Topology


# ---- the alpha-beta line: every measured cost the model reuses is one (fitted by moelab.measure.calibrate) ----
@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # s
    beta: float  # s per byte
    r2: float
    n: int = 0  # points fitted
    alpha_se: float = 0.0  # OLS standard errors (0 with 2 points or an exact fit)
    beta_se: float = 0.0

    @property
    def bandwidth(self) -> float:
        """Bytes/s implied by beta."""
        return 1.0 / self.beta if self.beta > 0 else float("inf")

    def predict(self, x):
        return self.alpha + self.beta * np.asarray(x, dtype=float)

    def as_dict(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta, "r2": self.r2, "n": self.n, "alpha_se": self.alpha_se,
                "beta_se": self.beta_se}


def fit_alpha_beta(x, t) -> AlphaBeta:
    """Ordinary least squares ``t = alpha + beta * x``; R^2 and the standard errors of the fit."""
    x, t = np.asarray(x, dtype=float), np.asarray(t, dtype=float)
    A = np.stack([np.ones_like(x), x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(A, t, rcond=None)
    resid = t - (alpha + beta * x)
    ss_res = float((resid ** 2).sum())
    ss_tot = float(((t - t.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    se = (0.0, 0.0)
    if len(x) > 2:
        cov = ss_res / (len(x) - 2) * np.linalg.pinv(A.T @ A)
        se = (float(np.sqrt(max(cov[0, 0], 0.0))), float(np.sqrt(max(cov[1, 1], 0.0))))
    return AlphaBeta(float(alpha), float(beta), r2, len(x), *se)


@dataclass
class Demand:
    alpha: float  # seconds of fixed latency before the bytes flow
    links: dict = field(default_factory=dict)  # link -> bytes

    def time(self, caps: dict) -> float:
        """Seconds alone on its links."""
        return self.alpha + max((b / caps[l] for l, b in self.links.items() if b > 0), default=0.0)


def nic_count(profile, topo: Topology) -> int:
    """NICs per node in the link model: ``profile.nics_per_node`` clipped to [1, ranks per node]
    (0, as single-node profiles declare, means one; more NICs than GPUs pool per GPU)."""
    return max(1, min(int(getattr(profile, "nics_per_node", 1) or 1), topo.ranks_per_node))


def nic_of(rank: int, topo: Topology, nics: int) -> int:
    """Global index of the NIC ``rank`` uses (node * nics + its block's NIC; = node with one NIC)."""
    node = topo.node_of(rank)
    return node * nics + (rank - node * topo.ranks_per_node) * nics // topo.ranks_per_node


def _port_capacities(profile, nics: int) -> tuple:
    """(bytes/s of an intra port, of one NIC): the node's inter bandwidth shared by its ``nics`` NICs."""
    return profile.bandwidth("intra"), profile.bandwidth("inter") / nics


def link_capacities(profile, topo: Topology) -> dict:
    """Bytes/s of every link of ``topo`` under ``profile``: per-rank intra ports, ``nic_count`` NICs
    per node sharing the node's inter bandwidth equally."""
    k = nic_count(profile, topo)
    intra, nic = _port_capacities(profile, k)
    caps = {}
    for r in range(topo.world_size):
        caps[("intra_out", r)] = caps[("intra_in", r)] = intra
    for i in range(topo.nodes * k):
        caps[("nic_out", i)] = caps[("nic_in", i)] = nic
    return caps


# ---- compute -------------------------------------------------------------------------------------
def gemm_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def ffn_flops(tokens, d: int, d_ff: int):
    """Forward FLOPs of a 2-GEMM FFN (d -> d_ff -> d); biases and activation are noise."""
    return 4.0 * tokens * d * d_ff


def attention_flops(tokens, d: int, seq_len: int):
    """Forward FLOPs of self-attention: QKV+O projections (8 t d^2) plus scores and AV (4 t s d)."""
    return 8.0 * tokens * d * d + 4.0 * tokens * seq_len * d


def gate_flops(tokens, d: int, num_experts: int):
    return 2.0 * tokens * d * num_experts


def head_flops(tokens, d: int, vocab: int):
    """The tied LM head's logits GEMM."""
    return 2.0 * tokens * d * vocab


def compute_time(flops, profile) -> float:
    """Seconds for ``flops`` at the profile's achieved GEMM throughput (backward = 2x forward)."""
    return flops / profile.achieved_flops


# ---- link demands --------------------------------------------------------------------------------
def _send(links: dict, topo: Topology, src: int, dst: int, nbytes: float, nics: int = 1) -> None:
    if src == dst or nbytes <= 0:
        return
    if topo.node_of(src) == topo.node_of(dst):
        out, inn = ("intra_out", src), ("intra_in", dst)
    else:
        out, inn = ("nic_out", nic_of(src, topo, nics)), ("nic_in", nic_of(dst, topo, nics))
    links[out] = links.get(out, 0) + nbytes
    links[inn] = links.get(inn, 0) + nbytes


def _spans_nodes(group: Sequence[int], topo: Topology) -> bool:
    return len({topo.node_of(r) for r in group}) > 1


def _class_latency(group, topo, profile) -> float:
    if len(group) <= 1:
        return 0.0
    return profile.latency("inter" if _spans_nodes(group, topo) else "intra")


def _fitted(op, demand: Demand, group, topo, profile, x_fn) -> Demand:
    fit = profile.fits.get(op) if getattr(profile, "fits", None) else None
    if fit is None or len(group) <= 1 or (_spans_nodes(group, topo) and not getattr(profile, "one_host", False)):
        return demand  # a fit measured inside one node says nothing of a real inter-node link
    alpha, beta = fit
    caps = link_capacities(profile, topo)
    bw_part = demand.time(caps) - demand.alpha
    want = beta * x_fn()
    scale = want / bw_part if bw_part > 0 else 0.0
    return Demand(alpha, {l: b * scale for l, b in demand.links.items()})


def alltoall_demands(matrix, group: Sequence[int], topo: Topology, profile,
                     hierarchical: bool = False) -> list:
    """Uneven all-to-all; ``matrix[i][j]`` = bytes group member i sends to member j.

    Flat: one direct phase; the time is the largest load of any intra-node port or NIC (a NIC
    carries the cross-node bytes of every rank attached to it), plus one latency. Hierarchical
    (2D, as Tutel/DeepSpeed): phase 1 gathers, in the node, everything bound for local index j on
    rank j; phase 2 ships node-to-node between ranks of the same local index. Same NIC bytes
    (with one NIC per GPU, rank j's NIC carries what phase 1 gathered on it), extra intra bytes,
    two latencies.
    """
    scale = getattr(matrix, "row_bytes", None)  # rows x bytes per row (graphs.RowBytes): link loads are
    if scale is not None:  # linear in it, so sum the row counts and scale the per-member sums
        M = np.asarray(matrix.tokens).astype(np.int64, copy=False)  # whole rows, as RowBytes reads them
    else:
        M, scale = np.asarray(matrix), 1  # integer bytes stay integers: exact sums, no float copy
    if M.dtype.kind not in "iuf":
        M = M.astype(np.float64)
    group = list(group)
    n = len(group)
    if n <= 1:
        return [Demand(0.0, {})]
    node = np.fromiter((topo.node_of(r) for r in group), dtype=np.int64, count=n)
    k = nic_count(profile, topo)
    nic = np.fromiter((nic_of(r, topo, k) for r in group), dtype=np.int64, count=n)
    if not hierarchical or not _spans_nodes(group, topo):
        d = Demand(_class_latency(group, topo, profile), _a2a_links(M, group, node, nic, scale))
        return [_fitted("all_to_all", d, group, topo, profile,
                        lambda: sent_bytes("all_to_all", group, topo, splits=np.asarray(matrix).astype(np.int64)))]
    # hierarchical: member i = (node a, local slot p); assume equal members per node, node-major.
    nodes = np.unique(node)
    g = n // len(nodes)
    if g * len(nodes) != n or not np.all(node == np.repeat(nodes, g)):
        raise ValueError("hierarchical all-to-all needs the same number of members on every node, node-major")
    M4 = M.reshape(len(nodes), g, len(nodes), g)  # [a, i, b, j]
    ph1 = M4.sum(axis=2)  # [a, i, j]: from (a,i) to (a,j), everything bound for local index j
    P1 = np.zeros_like(M)
    for a in range(len(nodes)):
        blk = ph1[a].copy()
        # what (a,i) sends to its own node's (a,j) directly is part of ph1; local (i == j) stays local
        np.fill_diagonal(blk, 0)
        P1[a * g:(a + 1) * g, a * g:(a + 1) * g] = blk
    P2 = np.zeros_like(M)
    agg = M4.sum(axis=1)  # [a, b, j]: node a's bytes for (b, j), held by (a, j) after phase 1
    for a in range(len(nodes)):
        for b in range(len(nodes)):
            if a != b:
                P2[a * g + np.arange(g), b * g + np.arange(g)] = agg[a, b]
    return [Demand(profile.latency("intra"), _a2a_links(P1, group, node, nic, scale)),
            Demand(profile.latency("inter"), _a2a_links(P2, group, node, nic, scale))]


def _a2a_links(M: np.ndarray, group, node: np.ndarray, nic: np.ndarray, scale=1) -> dict:
    """Port and NIC loads of a direct exchange ``M * scale`` (node / NIC index per group member): per
    member, what it sends to / receives from its own node (intra ports) and other nodes (its NIC)."""
    _, intra_out, inter_out = (x * scale for x in exchange_by_class(M, node))
    _, intra_in, inter_in = (x * scale for x in exchange_by_class(M, node, received=True))
    links = {}
    for i in np.flatnonzero(intra_out > 0):
        links[("intra_out", group[i])] = float(intra_out[i])
    for i in np.flatnonzero(intra_in > 0):
        links[("intra_in", group[i])] = float(intra_in[i])
    if (inter_out > 0).any():
        uniq, inv = np.unique(nic, return_inverse=True)
        out_n = np.bincount(inv, weights=inter_out, minlength=len(uniq))
        in_n = np.bincount(inv, weights=inter_in, minlength=len(uniq))
        for k, nic_id in enumerate(uniq):
            if out_n[k] > 0:
                links[("nic_out", int(nic_id))] = out_n[k]
            if in_n[k] > 0:
                links[("nic_in", int(nic_id))] = in_n[k]
    return links


_RING = {  # op -> (bytes each rank puts on its ring edge as a function of (n, nbytes), steps)
    "all_gather": (lambda n, s: (n - 1) * s, lambda n: n - 1),  # nbytes = the rank's block
    "reduce_scatter": (lambda n, s: (n - 1) * s / n, lambda n: n - 1),  # nbytes = full input
    "all_reduce": (lambda n, s: 2 * (n - 1) * s / n, lambda n: 2 * (n - 1)),
}


def ring_channels(group: Sequence[int], topo: Topology, nics: int = 1) -> list:
    """The rings of a ring collective over ``group``: a list of rank orders (each a cycle).

    Inside one node: one ring in rank order. Across nodes (node-major): one channel per NIC the
    members of a node are attached to (C = the most over nodes); in channel c every node's members
    are rotated so that the node is left by the last member attached to its NIC (c - 1 mod its
    NIC count), so the channels leave each node through different NICs. Channel 0 is the plain
    node-major ring; with one NIC per node it is the only one. Each channel carries 1/C of the bytes.
    """
    group = sorted(group)
    by_node: dict = {}
    for r in group:
        by_node.setdefault(topo.node_of(r), []).append(r)
    if len(by_node) <= 1:
        return [group]
    per_node = []
    for mem in by_node.values():
        last_on = {}
        for i, r in enumerate(mem):  # mem is sorted: the last member attached to each NIC wins
            last_on[nic_of(r, topo, nics)] = i
        per_node.append((mem, [last_on[x] for x in sorted(last_on)]))
    C = max(len(ex) for _, ex in per_node)
    rings = []
    for c in range(C):
        order = []
        for mem, ex in per_node:
            k = ex[(c + len(ex) - 1) % len(ex)]
            order += mem[k + 1:] + mem[:k + 1]
        rings.append(order)
    return rings


@functools.lru_cache(maxsize=256)
def _ring_ports(group: tuple, topo: Topology, nics: int) -> tuple:
    """``(channels, ports)``: the ports every edge of :func:`ring_channels` puts its bytes on, in edge
    order (out port, then in port), computed once per group: a simulated iteration prices the same
    groups' rings hundreds of times."""
    rings = ring_channels(group, topo, nics)
    links: dict = {}
    ports = []
    for order in rings:
        for i, r in enumerate(order):
            links.clear()
            _send(links, topo, r, order[(i + 1) % len(order)], 1, nics)
            ports += list(links)
    return len(rings), tuple(ports)


def ring_demand(op: str, group: Sequence[int], topo: Topology, profile, nbytes: int) -> Demand:
    """Ring all-gather / reduce-scatter / all-reduce over ``group`` (:func:`ring_channels`: node-major,
    one channel per NIC across nodes): every edge of a channel carries per-edge bytes / channels. An
    NCCL profile's all-reduce may take :func:`_halving_doubling_ports` instead (module doc)."""
    group = sorted(group)
    n = len(group)
    if n <= 1:
        return Demand(0.0, {})
    per_edge, steps = _RING[op]
    nics = nic_count(profile, topo)
    channels, ports = _ring_ports(tuple(group), topo, nics)
    v = per_edge(n, nbytes) / channels
    links: dict = {}
    get = links.get
    for port in ports:  # the same additions, in the same order, as sending edge by edge
        links[port] = get(port, 0) + v
    lat = _class_latency(group, topo, profile)
    d = Demand(steps(n) * lat, links)
    if op == "all_reduce" and getattr(profile, "allreduce", "ring") == "nccl" and n > 2 and not n & (n - 1):
        m, shares = _halving_doubling_ports(tuple(group), topo, nics)
        hd = Demand(2 * m * lat, {port: share * nbytes for port, share in shares})
        if _alone_time(hd, profile, nics) < _alone_time(d, profile, nics):
            d = hd
    return _fitted(op, d, group, topo, profile, lambda: sent_bytes(op, group, topo, nbytes))


@functools.lru_cache(maxsize=256)
def _halving_doubling_ports(group: tuple, topo: Topology, nics: int) -> tuple:
    """``(m, ((port, share of nbytes), ...))`` of an all-reduce over ``group`` (2^m members, sorted) by
    recursive halving (reduce-scatter) then doubling (all-gather): step k pairs members ``2^k`` apart,
    who exchange ``nbytes / 2^(k+1)`` each way in each half, so every member sends ``2(n-1)/n`` of
    ``nbytes`` (the ring's) with the largest pieces to its nearest partners."""
    links: dict = {}
    m = len(group).bit_length() - 1
    for k in range(m):
        for i, a in enumerate(group):
            _send(links, topo, a, group[i ^ (1 << k)], 2.0 / (2 << k), nics)
    return m, tuple(links.items())


def _alone_time(d: Demand, profile, nics: int) -> float:
    """:meth:`Demand.time` with the capacities of the ports it uses (no per-rank capacity table)."""
    intra, nic = _port_capacities(profile, nics)
    return d.alpha + max((b / (intra if port[0].startswith("intra") else nic) for port, b in d.links.items() if b > 0),
                         default=0.0)


def broadcast_demand(group: Sequence[int], root: int, topo: Topology, profile, nbytes: int,
                     op: str = "broadcast") -> Demand:
    """Pipelined ring broadcast (or reduce, edges reversed): every ring edge carries S once."""
    group = sorted(group)
    n = len(group)
    if n <= 1:
        return Demand(0.0, {})
    k = group.index(root)
    order = group[k:] + group[:k]
    links: dict = {}
    for a, b in zip(order[:-1], order[1:]):
        _send(links, topo, *((a, b) if op == "broadcast" else (b, a)), nbytes, nic_count(profile, topo))
    d = Demand((n - 1) * _class_latency(group, topo, profile), links)
    return _fitted(op, d, group, topo, profile, lambda: sent_bytes(op, group, topo, nbytes, root=root))


def p2p_demand(src: int, dst: int, topo: Topology, profile, nbytes: int) -> Demand:
    links: dict = {}
    _send(links, topo, src, dst, nbytes, nic_count(profile, topo))
    return Demand(0.0 if src == dst else profile.latency(topo.link_class(src, dst)), links)


# ---- the built-in collectives' demands, by name ((group, topo, profile, **args) -> [Demand, ...]) ----------
def _a2a_demands(group, topo, profile, splits=None, hierarchical=False, **_):
    return alltoall_demands(splits, group, topo, profile, hierarchical)


def _ring_demands(op: str):
    return lambda group, topo, profile, nbytes=0, **_: [ring_demand(op, group, topo, profile, nbytes)]


def _chain_demands(op: str):
    return lambda group, topo, profile, nbytes=0, root=None, **_: [
        broadcast_demand(group, root, topo, profile, nbytes, op=op)]


def _p2p_demands(sends: bool):
    """p2p / send / recv: ``group = (src, dst)``; a p2p with ``splits`` is a batch of exchanges over the group."""
    def price(group, topo, profile, nbytes=0, splits=None, **_):
        if splits is not None:
            return alltoall_demands(splits, group, topo, profile, False)
        return [p2p_demand(group[0], group[1], topo, profile, nbytes)] if sends else []
    return price


BUILT_IN_DEMANDS = {"all_to_all": _a2a_demands,
                    **{op: _ring_demands(op) for op in ("all_gather", "reduce_scatter", "all_reduce")},
                    **{op: _chain_demands(op) for op in ("broadcast", "reduce")},
                    "p2p": _p2p_demands(True), "send": _p2p_demands(True), "recv": _p2p_demands(False)}


def demands(op: str, group: Sequence[int], topo: Topology, profile, **args) -> list:
    """The link demands of any declared collective (:mod:`moelab.comm.collectives`): the functions
    above for the built-in ones, whatever a newly declared one says for it. ``args``: ``nbytes``,
    ``splits`` (all_to_all: the [n, n] byte matrix), ``root``, ``hierarchical``; p2p: ``group=(src, dst)``."""
    price = collective(op).demands or BUILT_IN_DEMANDS.get(op)
    if price is None:
        raise ValueError(f"collective {op!r} declares no demands and is not one the cost model prices")
    return price(list(group), topo, profile, **args)


# ---- closed forms (a collective alone on the cluster) --------------------------------------------
def _alone(demands, topo, profile) -> float:
    caps = link_capacities(profile, topo)
    return sum(d.time(caps) for d in demands)


def alltoall_time(matrix, topo: Topology, profile, group=None, hierarchical: bool = False) -> float:
    group = list(range(topo.world_size)) if group is None else group
    return _alone(alltoall_demands(matrix, group, topo, profile, hierarchical), topo, profile)


def allreduce_time(nbytes, topo: Topology, profile, group=None) -> float:
    group = list(range(topo.world_size)) if group is None else group
    return _alone([ring_demand("all_reduce", group, topo, profile, nbytes)], topo, profile)


def allgather_time(block_bytes, topo: Topology, profile, group=None) -> float:
    group = list(range(topo.world_size)) if group is None else group
    return _alone([ring_demand("all_gather", group, topo, profile, block_bytes)], topo, profile)


def reduce_scatter_time(nbytes, topo: Topology, profile, group=None) -> float:
    group = list(range(topo.world_size)) if group is None else group
    return _alone([ring_demand("reduce_scatter", group, topo, profile, nbytes)], topo, profile)


def broadcast_time(nbytes, topo: Topology, profile, root: int = 0, group=None, op: str = "broadcast") -> float:
    group = list(range(topo.world_size)) if group is None else group
    return _alone([broadcast_demand(group, root, topo, profile, nbytes, op)], topo, profile)


def p2p_time(nbytes, src: int, dst: int, topo: Topology, profile) -> float:
    return _alone([p2p_demand(src, dst, topo, profile, nbytes)], topo, profile)
