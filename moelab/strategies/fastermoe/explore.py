"""FasterMoE's placement policy as an explorer starting point (:class:`moelab.placement.query.PolicyQuery`)."""
from __future__ import annotations

from moelab.placement import Placement
from moelab.placement.policy import replicate
from moelab.placement.query import PolicyQuery, single
from moelab.strategies.fastermoe.options import FasterMoEOptions
from moelab.strategies.fastermoe.shadow import select_shadows


def shadowing(q: PolicyQuery) -> tuple:
    """FasterMoE Alg. 1 (:func:`moelab.strategies.fastermoe.shadow.select_shadows`) with the profile's GPU
    FLOP/s and a worker's share of its node's NIC; the chosen experts shadowed on every rank."""
    o, p = FasterMoEOptions(), q.profile
    S = select_shadows(q.loads, h=q.d_model, h_ff=q.d_ff, P=p.achieved_flops,
                       W_net=p.inter_bw_GBps * 1e9 / p.gpus_per_node, s=p.elem_bytes, c=o.shadow_comm_factor,
                       max_shadow=o.shadow_max, exact=o.shadow_exact)
    return replicate(Placement(q.experts, q.ranks, single(q.owners)), S).holders
