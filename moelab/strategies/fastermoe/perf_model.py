"""FasterMoE's performance model (paper §3, spec §2.2): pure functions, no processes.

- **Compute (load-aware):** one forward round of the expert MLPs takes
  ``T_comp = max_i 4 * B_i * h * h_ff / P_i`` (2 FC layers x 2 FLOP per FMA); an iteration has
  3 rounds (forward, input grad, weight grad). The max over workers is what models imbalance.
- **Communication (topology-aware):** ``T_comm = max_e V_e / BW_e`` over the *directed* edges of
  the cluster graph (each duplex link is two edges, loaded separately). All-to-all-v: every ordered
  pair (j != i) puts ``B_ji * h * s`` bytes on every edge of its route (tree: up to the lowest
  common ancestor, then down; a pair joined by a peer link, e.g. NVLink, uses only that link).
  Ring all-reduce: each ring hop carries ``2 (n-1)/n * S``; pipelined broadcast/reduce: each hop
  of the ring chain carries ``S``.
- **End to end** (AE ``flexible_sim``): ``T = 3 T_comp + 4 T_a2a + 2 T_mp_allreduce + T_dp_allreduce``;
  per pass (AE ``run_trace``): ``fw = 2 T_comm + T_comp``, ``bw = 2 T_comm + 2 T_comp``.
- **Smart schedule** (§2.5): the theoretical per-layer speedup
  ``(4 Tm + 3 Tc) / (max(2 Tm, Tc) + max(2 Tm, 2 Tc))`` (max 7/4 at Tm = Tc), and a two-stream
  pipeline simulator for the paper-scale step times.

Counts: ``C[j][e]`` = token-*assignments* (T*k, dropped slots excluded) worker j sends to global
expert e, rank-major expert ids, ``owner(e) = e // E`` (``E = C.shape[1] // N`` experts per worker).

Cluster presets (``johnny``, ``trevor``, ``star``) follow the AE toposim
(``create_pcie_gpu_cluster``, ``create_nvlink_cluster``), Gb/s / 8 = GB/s. The AE code's bug of
adding a peer pair's traffic to the peer link *and* the tree is not reproduced.

``P`` may be a number (the paper's constant-P model, variant ``paper``), a per-worker sequence, or
a callable ``P(B) -> FLOP/s`` (the moelab calibrated variant: small GeMMs are less efficient).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from moelab.comm.bytes import by_link_class, peer_bytes
from moelab.strategies.fastermoe.schedule import check_group_size, send_peers

# ---- constants (spec §2.2, §2.3, §2.7) ----------------------------------------------------------
FLOP_PER_FMA = 2
FC_LAYERS = 2
FWD_FLOP_FACTOR = FC_LAYERS * FLOP_PER_FMA  # 4: forward FLOPs per assignment = 4 * h * h_ff
COMPUTE_ROUNDS = 3  # forward, input grad, weight grad
A2A_ROUNDS = 4  # dispatch + combine, forward and backward
ITER_FLOP_FACTOR = COMPUTE_ROUNDS * FWD_FLOP_FACTOR  # 12: Theta's numerator 12*h*h_ff*sum(B)
GBPS = 1e9 / 8  # bytes/s in one Gb/s
P_V100_PCIE = 11.5e12  # FLOP/s the FastMoE code uses for V100-PCIe fp32 [code]
P_V100_SXM2 = 0.9 * 15.7e12  # [R] trevor: 90 % of the V100-SXM2 fp32 peak (the code gives none)
W_NET_DEFAULT = 50 * GBPS  # FMOE_FASTER_GLBPLC_NETBW default: 50 Gb/s = 6.25 GB/s
ELEM_BYTES = 4  # s: fp32 everywhere in the paper

Edge = Tuple[str, str]
PType = Union[float, Sequence[float], Callable[[float], float]]


# ---- cluster graphs -----------------------------------------------------------------------------
@dataclass
class Cluster:
    """A tree of switches/NICs/sockets with workers at the leaves, plus optional peer links.

    ``parent[v] = (p, up_bw, down_bw)`` (bytes/s of the directed edges v->p and p->v);
    ``peer[(a, b)]`` = bytes/s of the directed peer edge a->b. ``workers[r]`` is rank r's vertex.
    """

    name: str
    workers: List[str]
    parent: Dict[str, Tuple[str, float, float]] = field(default_factory=dict)
    peer: Dict[Edge, float] = field(default_factory=dict)
    P: float = P_V100_PCIE  # achieved GeMM FLOP/s per worker
    ranks_per_node: Optional[int] = None

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def add_link(self, child: str, parent: str, bw: float, down_bw: Optional[float] = None) -> None:
        self.parent[child] = (parent, float(bw), float(bw if down_bw is None else down_bw))

    def add_peer(self, a: str, b: str, bw: float) -> None:
        self.peer[(a, b)] = float(bw)
        self.peer[(b, a)] = float(bw)

    def bandwidth(self, edge: Edge) -> float:
        if edge in self.peer:
            return self.peer[edge]
        u, v = edge
        if u in self.parent and self.parent[u][0] == v:
            return self.parent[u][1]
        if v in self.parent and self.parent[v][0] == u:
            return self.parent[v][2]
        raise KeyError(f"no link {u} -> {v} in cluster {self.name}")

    def edges(self) -> List[Edge]:
        out = list(self.peer)
        for c, (p, _, _) in self.parent.items():
            out += [(c, p), (p, c)]
        return out

    def _ancestors(self, v: str) -> List[str]:
        path = [v]
        while path[-1] in self.parent:
            path.append(self.parent[path[-1]][0])
        return path

    def route(self, src: int, dst: int) -> List[Edge]:
        """Directed edges from rank ``src`` to rank ``dst``: the peer link if any, else via the LCA."""
        a, b = self.workers[src], self.workers[dst]
        if a == b:
            return []
        if (a, b) in self.peer:
            return [(a, b)]
        up, down = self._ancestors(a), self._ancestors(b)
        common = set(down)
        lca_i = next(i for i, v in enumerate(up) if v in common)
        lca = up[lca_i]
        lca_j = down.index(lca)
        edges = [(up[i], up[i + 1]) for i in range(lca_i)]
        edges += [(down[i + 1], down[i]) for i in reversed(range(lca_j))]
        return edges


def star(n: int, bw: float, P: float = P_V100_PCIE) -> Cluster:
    """``n`` workers on one switch, every link ``bw`` bytes/s per direction."""
    c = Cluster("star", [f"w{r}" for r in range(n)], P=P, ranks_per_node=n)
    for r in range(n):
        c.add_link(f"w{r}", "switch", bw)
    return c


def johnny(nodes: int = 2, sockets: int = 2, gpus_per_socket: int = 4, P: float = P_V100_PCIE) -> Cluster:
    """AE ``create_pcie_gpu_cluster``: nodes under a root switch, NIC<->switch 50 Gb/s; socket0 sits
    at the NIC (infinite link), socket1<->NIC QPI 180 Gb/s; GPU<->socket PCIe 88 Gb/s."""
    workers = [f"n{n}.s{s}.g{g}" for n in range(nodes) for s in range(sockets) for g in range(gpus_per_socket)]
    c = Cluster("johnny", workers, P=P, ranks_per_node=sockets * gpus_per_socket)
    for n in range(nodes):
        c.add_link(f"n{n}.nic", "switch", 50 * GBPS)
        for s in range(sockets):
            c.add_link(f"n{n}.s{s}", f"n{n}.nic", math.inf if s == 0 else 180 * GBPS)
            for g in range(gpus_per_socket):
                c.add_link(f"n{n}.s{s}.g{g}", f"n{n}.s{s}", 88 * GBPS)
    return c


TREVOR_PEERS_GBPS = {(0, 1): 317, (2, 3): 317, (0, 3): 171, (1, 2): 171, (0, 2): 88, (1, 3): 88}
TREVOR_NIC_GBPS = (55, 55, 62, 62)


def trevor(nodes: int = 16, P: float = P_V100_SXM2) -> Cluster:
    """AE ``create_nvlink_cluster``: 4 V100-SXM2 per node on a heterogeneous NVLink ring (every
    intra-node pair has a peer link), GPU<->NIC 55/62 Gb/s, NIC<->switch 62 Gb/s."""
    workers = [f"n{n}.g{g}" for n in range(nodes) for g in range(4)]
    c = Cluster("trevor", workers, P=P, ranks_per_node=4)
    for n in range(nodes):
        c.add_link(f"n{n}.nic", "switch", 62 * GBPS)
        for g in range(4):
            c.add_link(f"n{n}.g{g}", f"n{n}.nic", TREVOR_NIC_GBPS[g] * GBPS)
        for (a, b), bw in TREVOR_PEERS_GBPS.items():
            c.add_peer(f"n{n}.g{a}", f"n{n}.g{b}", bw * GBPS)
    return c


PRESETS = {"johnny": johnny, "trevor": trevor}


def cluster(name: str, **kw) -> Cluster:
    try:
        return PRESETS[name](**kw)
    except KeyError:
        raise KeyError(f"unknown cluster preset {name!r}; known: {sorted(PRESETS)}") from None


# ---- count bookkeeping --------------------------------------------------------------------------
def as_counts(C) -> np.ndarray:
    C = np.asarray(C.cpu().numpy() if hasattr(C, "cpu") else C, dtype=np.float64)
    if C.ndim != 2 or C.shape[0] < 1 or C.shape[1] % C.shape[0]:
        raise ValueError(f"count matrix must be [N, N*E], got shape {C.shape}")
    if (C < 0).any():
        raise ValueError("counts must be >= 0")
    return C


def owners(C) -> np.ndarray:
    """``owner(e) = e // E`` for the rank-major expert ids of ``C``."""
    C = as_counts(C)
    N, NE = C.shape
    return np.arange(NE) // (NE // N)


def traffic_matrix(C) -> np.ndarray:
    """``B[j][i]`` = assignments worker j sends to worker i (diagonal: kept local)."""
    C = as_counts(C)
    N, NE = C.shape
    return C.reshape(N, N, NE // N).sum(2)


def worker_loads(C) -> np.ndarray:
    """``B_i = sum_j B_ji``: the compute batch of each worker."""
    return traffic_matrix(C).sum(0)


def _throughput(P: PType, B: np.ndarray) -> np.ndarray:
    if callable(P):
        return np.array([float(P(float(b))) for b in B])
    P = np.broadcast_to(np.asarray(P, dtype=np.float64), B.shape)
    return P


def compute_time_from_loads(B, h: int, h_ff: int, P: PType) -> float:
    """``max_i 4 * B_i * h * h_ff / P_i`` (one forward round)."""
    B = np.asarray(B, dtype=np.float64)
    if B.size == 0:
        return 0.0
    return float((FWD_FLOP_FACTOR * B * h * h_ff / _throughput(P, B)).max())


def compute_time(C, h: int, h_ff: int, P: PType) -> float:
    """Load-aware forward compute time of one round from the count matrix."""
    return compute_time_from_loads(worker_loads(C), h, h_ff, P)


# ---- link loads ----------------------------------------------------------------------------------
def _add(loads: dict, edges, nbytes: float) -> None:
    for e in edges:
        loads[e] = loads.get(e, 0.0) + nbytes


def max_link_time(cl: Cluster, loads: dict) -> float:
    t = 0.0
    for e, v in loads.items():
        if v > 0:
            t = max(t, v / cl.bandwidth(e))
    return t


def a2a_link_loads(cl: Cluster, M_bytes) -> dict:
    """Bytes on every directed edge when every ordered pair (j != i) sends ``M_bytes[j][i]`` at once."""
    M = np.asarray(M_bytes, dtype=np.float64)
    n = cl.world_size
    if M.shape != (n, n):
        raise ValueError(f"traffic matrix must be [{n}, {n}], got {M.shape}")
    loads: dict = {}
    for j in range(n):
        for i in range(n):
            if i != j and M[j, i] > 0:
                _add(loads, cl.route(j, i), M[j, i])
    return loads


def a2a_time_bytes(cl: Cluster, M_bytes) -> float:
    return max_link_time(cl, a2a_link_loads(cl, M_bytes))


def comm_time(C, cl: Cluster, h: int, s: int = ELEM_BYTES) -> float:
    """One all-to-all round of the tokens of ``C`` (``B_ji * h * s`` bytes per pair)."""
    return a2a_time_bytes(cl, traffic_matrix(C) * h * s)


def ring_hops(cl: Cluster, ranks: Optional[Sequence[int]] = None) -> List[Tuple[int, int]]:
    ranks = list(range(cl.world_size)) if ranks is None else list(ranks)
    n = len(ranks)
    return [(ranks[i], ranks[(i + 1) % n]) for i in range(n)] if n > 1 else []


def allreduce_link_loads(cl: Cluster, nbytes: float, ranks=None) -> dict:
    """Ring all-reduce: each ring hop carries ``2 (n-1)/n * S`` (along its route)."""
    hops = ring_hops(cl, ranks)
    n = len(hops)
    loads: dict = {}
    for a, b in hops:
        _add(loads, cl.route(a, b), 2 * (n - 1) / n * nbytes)
    return loads


def allreduce_time(cl: Cluster, nbytes: float, ranks=None) -> float:
    return max_link_time(cl, allreduce_link_loads(cl, nbytes, ranks))


def broadcast_link_loads(cl: Cluster, nbytes: float, root: int = 0, ranks=None, reduce: bool = False) -> dict:
    """Pipelined ring broadcast: a chain root -> next -> ... (n-1 hops), each carrying ``S``; a
    reduce is the same chain reversed (into the root)."""
    ranks = list(range(cl.world_size)) if ranks is None else list(ranks)
    n = len(ranks)
    if n < 2:
        return {}
    k = ranks.index(root)
    chain = [ranks[(k + i) % n] for i in range(n)]
    loads: dict = {}
    for a, b in zip(chain, chain[1:]):
        _add(loads, cl.route(b, a) if reduce else cl.route(a, b), nbytes)
    return loads


def broadcast_time(cl: Cluster, nbytes: float, root: int = 0, ranks=None) -> float:
    return max_link_time(cl, broadcast_link_loads(cl, nbytes, root, ranks))


def reduce_time(cl: Cluster, nbytes: float, root: int = 0, ranks=None) -> float:
    return max_link_time(cl, broadcast_link_loads(cl, nbytes, root, ranks, reduce=True))


# ---- end to end ----------------------------------------------------------------------------------
def e2e_time(T_comp: float, T_a2a: float, T_mp_allreduce: float = 0.0, T_dp_allreduce: float = 0.0) -> float:
    """AE flexible_sim: ``3 T_comp + 4 T_a2a + 2 T_mp_allreduce + T_dp_allreduce``."""
    return COMPUTE_ROUNDS * T_comp + A2A_ROUNDS * T_a2a + 2 * T_mp_allreduce + T_dp_allreduce


@dataclass
class LayerPrediction:
    T_comp: float  # one forward compute round (max over workers)
    T_comm: float  # one all-to-all round
    loads: np.ndarray  # B_i

    @property
    def fw(self) -> float:  # AE run_trace
        return 2 * self.T_comm + self.T_comp

    @property
    def bw(self) -> float:
        return 2 * self.T_comm + 2 * self.T_comp

    @property
    def e2e(self) -> float:
        return e2e_time(self.T_comp, self.T_comm)


def predict_layer(C, cl: Cluster, h: int, h_ff: int, s: int = ELEM_BYTES, P: Optional[PType] = None) -> LayerPrediction:
    """Synchronous EP layer (FastMoE): per-round compute and all-to-all times from ``C``."""
    P = cl.P if P is None else P
    return LayerPrediction(compute_time(C, h, h_ff, P), comm_time(C, cl, h, s), worker_loads(C))


# ---- smart schedule -------------------------------------------------------------------------------
def smart_speedup_theoretical(Tm: float, Tc: float) -> float:
    """Fig. 12's theoretical speedup (AE plotting/fig12.py): ``Tm`` one all-to-all, ``Tc`` one
    forward compute. ``(4 Tm + 3 Tc) / (max(2 Tm, Tc) + max(2 Tm, 2 Tc))``; 1 <= it <= 7/4."""
    if Tm < 0 or Tc < 0:
        raise ValueError("times must be >= 0")
    den = max(2 * Tm, Tc) + max(2 * Tm, 2 * Tc)
    return 1.0 if den == 0 else (4 * Tm + 3 * Tc) / den


def pipeline_time(dur_S: Sequence[float], dur_C: Sequence[float], dur_R: Sequence[float],
                  mid_comm: float = 0.0, tail_compute: float = 0.0) -> float:
    """Two-stream event simulation of one pass (spec §2.5 Fig. 8b/8c).

    Comm stream, in order: ``S_0 .. S_{G-1}``, then ``mid_comm`` (e.g. the shadow broadcasts),
    then ``R_0 .. R_{G-1}``. Compute stream: ``C_0 .. C_{G-1}`` then ``tail_compute`` (shadowed
    experts). ``C_s`` starts after ``S_s`` and ``C_{s-1}``; ``R_s`` after ``C_s`` and the previous
    comm op. Returns the finish time of the last op."""
    G = len(dur_S)
    if not (len(dur_C) == len(dur_R) == G):
        raise ValueError("dur_S, dur_C, dur_R need one entry per step")
    comm_t, s_end = 0.0, []
    for d in dur_S:
        comm_t += d
        s_end.append(comm_t)
    comm_t += mid_comm
    comp_t, c_end = 0.0, []
    for s in range(G):
        comp_t = max(comp_t, s_end[s]) + dur_C[s]
        c_end.append(comp_t)
    for s in range(G):
        comm_t = max(comm_t, c_end[s]) + dur_R[s]
    comp_t += tail_compute
    return max(comm_t, comp_t)


def smart_step_times(C, cl: Cluster, group_size: int, h: int, h_ff: int, s: int = ELEM_BYTES,
                     P: Optional[PType] = None, backward: bool = False):
    """Per-step durations of the smart schedule, globally aligned steps (spec §2.5):
    ``dur_S[s]``/``dur_R[s]`` = toposim time of that step's flows (R is the reverse direction),
    ``dur_C[s] = max_r 4 h h_ff (tokens r receives at s) / P`` (x2 in backward)."""
    P = cl.P if P is None else P
    B = traffic_matrix(C)
    N = B.shape[0]
    G = check_group_size(N, group_size)
    dur_S, dur_C, dur_R = [], [], []
    for st in range(G):
        M = np.zeros_like(B)
        for src in range(N):
            for dst in send_peers(src, st, N, group_size):
                M[src, dst] = B[src, dst]
        dur_S.append(a2a_time_bytes(cl, M * h * s))
        dur_R.append(a2a_time_bytes(cl, M.T * h * s))
        dur_C.append((2 if backward else 1) * compute_time_from_loads(M.sum(0), h, h_ff, P))
    return dur_S, dur_C, dur_R


def smart_layer_time(C, cl: Cluster, group_size: int, h: int, h_ff: int, s: int = ELEM_BYTES,
                     P: Optional[PType] = None) -> float:
    """Forward + backward pipelined time of one layer under the smart schedule."""
    fw = pipeline_time(*smart_step_times(C, cl, group_size, h, h_ff, s, P))
    bw = pipeline_time(*smart_step_times(C, cl, group_size, h, h_ff, s, P, backward=True))
    return fw + bw


# ---- bytes of one layer call, by the runtime's own accounting rule ----------------------------------
def layer_sent_bytes(C, shadowed, d_model: int, elem_bytes: int, expert_numel: int, topo, rank: int) -> dict:
    """Bytes ``rank`` sends in one forward+backward of a FasterMoE layer (count all-gather, the
    four all-to-alls - or the smart schedule's p2p steps, which move the same per-peer bytes - and
    one broadcast + one reduce per shadowed expert), folded into ``{local, intra, inter}`` by
    :mod:`moelab.comm.bytes`: exactly what the comm door records. ``C``: ``[N, N*E]`` counts
    (int64 counts are gathered, 8 bytes each); ``expert_numel``: elements of one expert's params."""
    C = as_counts(C)
    N, NE = C.shape
    group = list(range(N))
    S = sorted(int(e) for e in shadowed)
    Cd = C.copy()
    Cd[:, S] = 0
    B = traffic_matrix(Cd) * d_model * elem_bytes
    acc = dict.fromkeys(("local", "intra", "inter"), 0)

    def add(per):
        for k, v in by_link_class(topo, rank, per).items():
            acc[k] += int(v)

    add(peer_bytes("all_gather", group, rank, 8 * NE))
    for _ in range(2):  # dispatch (fwd) + combine (bwd) send my tokens; combine (fwd) + dispatch (bwd) return
        add(peer_bytes("all_to_all", group, rank, splits=[int(v) for v in B[rank]]))
        add(peer_bytes("all_to_all", group, rank, splits=[int(v) for v in B[:, rank]]))
    E = NE // N
    pbytes = expert_numel * elem_bytes
    for e in S:
        add(peer_bytes("broadcast", group, rank, pbytes, root=e // E))
        add(peer_bytes("reduce", group, rank, pbytes, root=e // E))
    return acc
