"""Hecate's cost model (spec ``papers/hecate.md`` §2.9), pure: the overlap degree t, the calibration's
accept rule, and the rearranging baselines' decisions all price plans with it.

Inputs are a plan (``holders``: per expert ``(owner, replicas...)``) and the per-source token counts
``[N][E]`` of one layer; tokens go to holders by Hecate's dispatcher rule
(:class:`moelab.placement.rules.LocalityFirst`, through :meth:`moelab.placement.Placement.routes`: the
same split the runtime dispatches with). Times in seconds:

- expert forward: ``max_q load[q] · 2 P_e / flops`` (the busiest device; backward is twice that);
- all-to-all: ``alpha + max(intra term per device, inter term per node)``, bytes = tokens · d · β_act, a
  node's NIC carrying the traffic of all its devices to other nodes;
- sparse all-gather (spRS mirrors it): ``hier`` — each new remote expert crosses a node's NIC once;
  flat — once per receiving device; plus the intra-node fan-in per device;
- one MoE layer's forward critical path: dispatch + experts + combine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from typing import Optional

import numpy as np

from moelab.placement import Placement
from moelab.placement.rules import LocalityFirst, add_routes
from moelab.sim.graphs import expert_param_count
from moelab.sim.profiles import get_profile


def overlap_degree(t_nonmoe_s: float, bw_Bps: float, expert_bytes: float, E: int) -> int:
    """t = min(E, ⌊T_nonMoE · bw / s_e⌋) (spec §2.3): experts a device (or node) receives while the
    non-MoE compute before the layer runs."""
    if t_nonmoe_s < 0 or bw_Bps <= 0 or expert_bytes <= 0:
        raise ValueError(f"need T_nonMoE >= 0, bw > 0, s_e > 0; got {t_nonmoe_s}, {bw_Bps}, {expert_bytes}")
    return int(min(E, math.floor(t_nonmoe_s * bw_Bps / expert_bytes)))


@dataclass(frozen=True)
class PlacementCost:
    d_model: int
    d_ff: int
    ranks_per_node: int
    flops: float  # effective expert GEMM FLOP/s per device
    intra_Bps: float  # per device, per direction, inside a node
    nic_Bps: float  # per NODE (all its NICs), per direction
    alpha_a2a_s: float = 0.0
    param_bytes: int = 2  # bytes per parameter on the wire (fp16 in the paper)
    act_bytes: int = 2  # bytes per activation element (β_act)
    expert_numel: Optional[int] = None  # P_e; default 2·d·d_ff (no biases, as the paper's experts)
    hier: bool = True  # spAG/spRS cross a node's NIC once per expert (broadcast trees), else per replica
    state_factor: float = 6.0  # optimizer state bytes per parameter byte moved by a migration (§2.9: 12 B / 2 B)

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.flops <= 0 or self.intra_Bps <= 0 or self.nic_Bps <= 0:
            raise ValueError(f"ranks_per_node >= 1 and positive flops/bandwidths needed, got {self}")

    @classmethod
    def from_profile(cls, profile, d_model: int, d_ff: int, *, ranks_per_node: Optional[int] = None,
                     expert_numel: Optional[int] = None, param_bytes: Optional[int] = None,
                     act_bytes: Optional[int] = None, alpha_a2a_s: Optional[float] = None,
                     hier: bool = True) -> "PlacementCost":
        """From a simulator :class:`~moelab.sim.profiles.ClusterProfile`: ``achieved_flops``, per-device intra
        bandwidth, per-node inter bandwidth (its NICs together), ``elem_bytes`` for params and activations,
        alpha = the inter-node latency per collective step unless given."""
        return cls(d_model=int(d_model), d_ff=int(d_ff),
                   ranks_per_node=int(ranks_per_node or profile.gpus_per_node), flops=float(profile.achieved_flops),
                   intra_Bps=profile.intra_bw_GBps * 1e9, nic_Bps=profile.inter_bw_GBps * 1e9,
                   alpha_a2a_s=float(profile.inter_latency_us * 1e-6 if alpha_a2a_s is None else alpha_a2a_s),
                   param_bytes=int(param_bytes or profile.elem_bytes), act_bytes=int(act_bytes or profile.elem_bytes),
                   expert_numel=expert_numel, hier=hier)

    # ---- sizes -------------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return int(self.expert_numel or 2 * self.d_model * self.d_ff)

    @property
    def expert_bytes(self) -> float:
        """s_e: one expert's parameters on the wire."""
        return float(self.numel * self.param_bytes)

    def migration_bytes(self, n_experts: int) -> float:
        """Bytes to move ``n_experts`` with their optimizer state (§2.9: s_e · (1 + 6))."""
        return float(n_experts) * self.expert_bytes * (1.0 + self.state_factor)

    # ---- tokens ---------------------------------------------------------------------------------------
    def routes(self, holders, counts) -> np.ndarray:
        """``tokens[src, dst]`` of one layer: the dispatcher's split of ``counts[src][e]`` over ``holders``."""
        C = np.asarray(counts, dtype=np.int64)
        N, E = C.shape
        return Placement(E, N, tuple(tuple(h) for h in holders), self.rule).routes(C)

    @property
    def rule(self) -> LocalityFirst:
        """Hecate's dispatcher rule on this cluster's nodes: where a plan's tokens go."""
        return LocalityFirst(self.ranks_per_node)

    def load(self, holders, counts) -> np.ndarray:
        """Tokens each device computes."""
        return self.routes(holders, counts).sum(0)

    def t_expert_fwd(self, holders, counts) -> float:
        return self.t_expert_fwd_routes(self.routes(holders, counts))

    def t_a2a(self, holders, counts) -> float:
        return self.t_a2a_routes(self.routes(holders, counts))

    def t_moe(self, holders, counts) -> float:
        """One MoE layer's forward critical path: dispatch all-to-all, experts, combine all-to-all."""
        return self.t_moe_routes(self.routes(holders, counts))

    def t_moe_routes(self, routes) -> float:
        """:meth:`t_moe` of a route matrix ``tokens[src, dst]`` (:meth:`routes`)."""
        return 2.0 * self.t_a2a_routes(routes) + self.t_expert_fwd_routes(routes)

    def pricer(self, counts) -> "PlanPricer":
        """Prices many plans of one call's ``counts``, each expert's routes computed once per holder set."""
        return PlanPricer(self, counts)

    def t_moe_many(self, routes) -> np.ndarray:
        """:meth:`t_moe_routes` of a stack of route matrices ``[plans, src, dst]`` in one pass (the one-plan
        prices are this on a stack of one)."""
        T = np.asarray(routes)
        return 2.0 * self._t_a2a_many(T) + self._t_expert_fwd_many(T)

    def _t_expert_fwd_many(self, T) -> np.ndarray:
        """Per plan of ``T`` ``[plans, src, dst]``: the busiest device's expert forward."""
        return T.sum(1).max(1, initial=0).astype(np.float64) * 2.0 * self.numel / self.flops

    def _t_a2a_many(self, T) -> np.ndarray:
        """Per plan of ``T`` ``[plans, src, dst]``: alpha + the larger of the busiest device's intra-node bytes
        (out or in) and the busiest node's NIC bytes (out or in), each over its bandwidth."""
        K, N, G = T.shape[0], T.shape[1], self.ranks_per_node
        R = T.astype(np.float64) * self.d_model * self.act_bytes
        node = np.arange(N) // G
        same = node[:, None] == node[None, :]
        R[:, np.arange(N), np.arange(N)] = 0.0
        intra, inter = np.where(same, R, 0.0), np.where(same, 0.0, R)
        t_intra = np.maximum(intra.sum(2).max(1, initial=0), intra.sum(1).max(1, initial=0)) / self.intra_Bps
        out_n = inter.reshape(K, N // G, G, N).sum(axis=(2, 3))
        in_n = inter.reshape(K, N, N // G, G).sum(axis=(1, 3))
        t_inter = np.maximum(out_n.max(1, initial=0), in_n.max(1, initial=0)) / self.nic_Bps
        return self.alpha_a2a_s + np.maximum(t_intra, t_inter)

    def t_expert_fwd_routes(self, routes) -> float:
        """:meth:`t_expert_fwd` of a route matrix (:meth:`routes`)."""
        return float(self._t_expert_fwd_many(np.asarray(routes)[None])[0])

    def t_a2a_routes(self, routes) -> float:
        """:meth:`t_a2a` of a route matrix (:meth:`routes`)."""
        return float(self._t_a2a_many(np.asarray(routes)[None])[0])

    # ---- sparse collectives ---------------------------------------------------------------------------
    def _spag_counts(self, pairs, N: int) -> tuple:
        """Per ``(h0, h1)`` of ``pairs`` (one expert's holders before and after), its share of spAG(h0 -> h1)
        as int arrays ``[pairs, devices]`` and ``[pairs, nodes]``: copies each device receives, and expert
        crossings into / out of each node's NIC (``hier``: a remote node once; flat: once per device)."""
        G = self.ranks_per_node
        K, nodes = len(pairs), -(-N // G)
        before, after = np.zeros((K, nodes * G), bool), np.zeros((K, nodes * G), bool)
        for side, out in ((0, before), (1, after)):  # one flat scatter per side, not one per expert
            sets = [p[side] for p in pairs]
            out[np.repeat(np.arange(K), [len(h) for h in sets]),
                np.fromiter(chain.from_iterable(sets), np.int64)] = True
        per_dev = (after & ~before).astype(np.int64)
        owner_node = np.array([h0[0] // G for h0, _ in pairs], dtype=np.int64)
        remote = per_dev.reshape(K, nodes, G).sum(-1)
        remote[np.arange(K), owner_node] = 0
        node_in = (remote > 0).astype(np.int64) if self.hier else remote
        node_out = np.zeros_like(node_in)
        node_out[np.arange(K), owner_node] = node_in.sum(1)
        return per_dev, node_in, node_out

    def _spag_time(self, per_dev, node_in, node_out) -> np.ndarray:
        """Seconds of a gather whose totals (arrays, last axis per device or node) are given."""
        s = self.expert_bytes
        t_nic = s * np.maximum(node_in.max(-1, initial=0), node_out.max(-1, initial=0)) / self.nic_Bps
        return np.maximum(t_nic, s * per_dev.max(-1, initial=0) / self.intra_Bps)

    def t_spag(self, holders_from, holders_to) -> float:
        """Seconds of spAG(P_from, P_to) (spRS(P_to, P_from) is its mirror, same time): every copy in
        ``holders_to`` not in ``holders_from`` comes from the expert's owner."""
        pairs = [(h0, h1) for h0, h1 in zip(holders_from, holders_to) if h0 != h1]
        if not pairs:
            return 0.0
        N = 1 + max(d for pair in pairs for h in pair for d in h)
        return float(self._spag_time(*(a.sum(0) for a in self._spag_counts(pairs, N))))

    def t_spag_growing(self, holders_from, steps, N: int) -> np.ndarray:
        """:meth:`t_spag` from ``holders_from`` to each plan of a growing sequence: plan k applies ``steps[:k+1]``
        (``(expert, its new holders)``, each expert once), one time per plan."""
        counts = self._spag_counts([(tuple(holders_from[e]), tuple(h)) for e, h in steps], N)
        return self._spag_time(*(np.cumsum(a, axis=0) for a in counts))

    # ---- overlap ---------------------------------------------------------------------------------------
    @staticmethod
    def exposed(t_comm: float, t_hide: float) -> float:
        return max(0.0, float(t_comm) - float(t_hide))

    def overlap_degree(self, t_nonmoe_s: float, E: int) -> int:
        """t for this cluster: the node's NIC bandwidth with the hierarchical collectives, its per-device
        share (NIC / G) with flat ones (spec §2.3 [choice])."""
        return overlap_degree(t_nonmoe_s, self.overlap_bw_Bps(), self.expert_bytes, E)

    def overlap_bw_Bps(self) -> float:
        """The bandwidth t is sized on (see :meth:`overlap_degree`)."""
        return self.nic_Bps if self.hier else self.nic_Bps / self.ranks_per_node


def cost_for_run(cfg, profile, ranks_per_node: Optional[int] = None) -> PlacementCost:
    """The cost model of a run's experts (``cfg.model``: d, d_ff, biases) on ``profile`` (a profile or its
    name): what the rearranging baselines' decisions and the paper-scale replays price plans with."""
    prof = get_profile(profile) if isinstance(profile, str) else profile
    m = cfg.model
    return PlacementCost.from_profile(prof, m.d_model, m.d_ff, ranks_per_node=ranks_per_node,
                                  expert_numel=expert_param_count(m))


class PlanPricer:
    """:meth:`PlacementCost.t_moe` for many plans of one call's counts. A plan's route matrix is the sum of its
    experts' routes, and the plans a policy compares (calibration's ``best`` rule: up to m of them) differ in
    a few experts, so each ``(expert, holders)`` pair is routed once and memoized: exact (integer routes),
    and the cost of pricing drops from one full routing per plan to one per changed expert."""

    def __init__(self, cost: PlacementCost, counts):
        self.cost = cost
        self.counts = np.asarray(counts, dtype=np.int64)
        self._rule = cost.rule
        self._memo: dict = {}
        self._base = None  # (holders, routes) of the first plan priced, fully routed: later plans are its deltas
        self._last = None  # (holders, routes) of the latest plan priced (or of its nearest)

    def _expert_routes(self, e: int, holders_e: tuple) -> np.ndarray:
        key = (e, holders_e)
        if key not in self._memo:
            N = self.counts.shape[0]
            out = np.zeros((N, N), dtype=np.int64)
            add_routes(self._rule, N, holders_e, self.counts[:, e], out)
            self._memo[key] = out
        return self._memo[key]

    def routes(self, holders) -> np.ndarray:
        holders = tuple(tuple(h) for h in holders)
        if self._base is None:
            self._base = self._last = (holders, self.cost.routes(holders, self.counts))
        if len(holders) != len(self._base[0]):
            raise ValueError(f"plan has {len(holders)} experts, the counts {len(self._base[0])}")
        # from whichever of the first and the last plan differs in fewer experts: calibration's `best`
        # candidates are nested (each adds the next hottest expert), so the last one is one expert away
        refs = (self._base,) if self._last is self._base else (self._base, self._last)
        (ref_h, R), changed = min(((ref, [e for e, (h0, h1) in enumerate(zip(ref[0], holders)) if h0 != h1])
                                   for ref in refs), key=lambda x: len(x[1]))
        R = R.copy()
        for e in changed:
            R += self._expert_routes(e, holders[e]) - self._expert_routes(e, ref_h[e])
        self._last = (holders, R)
        return R.copy()  # the caller's to change; the pricer keeps its own

    def t_moe(self, holders) -> float:
        return self.cost.t_moe_routes(self.routes(holders))

    def routes_growing(self, holders, steps) -> np.ndarray:
        """Route matrices ``[plans, src, dst]`` of a growing sequence from ``holders``: plan k applies
        ``steps[:k+1]`` (``(expert, its new holders)``, each expert once), as cumulative expert deltas."""
        holders = tuple(tuple(h) for h in holders)
        R0 = self.routes(holders)
        zero = np.zeros_like(R0)
        D = np.stack([zero if tuple(h) == holders[e]
                      else self._expert_routes(e, tuple(h)) - self._expert_routes(e, holders[e])
                      for e, h in steps])
        return R0[None] + np.cumsum(D, axis=0)
