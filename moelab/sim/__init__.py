"""Paper-scale simulator: prices the runtime's plans on a cluster profile.

``profiles`` (testbeds as data) -> ``graphs`` (one iteration of a strategy as an op graph, bytes
by the runtime's own rule) -> ``engine`` (event simulation with shared links) -> timelines,
makespan, critical-path breakdown, peak memory. :mod:`moelab.measure` calibrates it on this machine so
the same simulator can be checked against real small runs: on a CPU host, ranks share its cores (an engine
CPU pool) and pay fitted per-op and per-call costs (profile fields ``shared_cores``,
``op_overhead_s``, ``call_overhead_s``; 0 on the paper testbeds); a call issued while its ranks
compute can pay costs measured that way (``busy_call_overhead_s``, ``OpGraph.transfer(beside_compute=)``), or
every call's fixed costs and moved bytes can be CPU work on the pooled cores (``software_on_cores``,
``cpu_s_per_byte``, held out by ``local.transport_cpu_per_byte``).
"""
from moelab.comm import costs  # noqa: F401  (before graphs, which uses it)
from moelab.comm.costs import (
    AlphaBeta,
    Demand,
    allgather_time,
    allreduce_time,
    alltoall_demands,
    alltoall_time,
    broadcast_demand,
    broadcast_time,
    compute_time,
    fit_alpha_beta,
    link_capacities,
    p2p_demand,
    p2p_time,
    reduce_scatter_time,
    ring_demand,
)
from moelab.sim.engine import DeadlockError, OpGraph, SimResult, simulate
from moelab.sim.graphs import (
    capacity,
    config_for_profile,
    dense_param_count,
    ep_iteration_graph,
    expert_param_count,
    get_graph,
    graph_bytes,
    iteration_graph,
    moe_layer_ids,
    route_matrix,
    synthetic_loads,
)
from moelab.sim.profiles import PROFILES, ClusterProfile, get_profile, local_profile_from_calibration, register_profile


def simulate_iteration(cfg, profile, loads, placement=None, **kw) -> SimResult:
    """Build ``cfg``'s strategy graph for one iteration and simulate it."""
    if isinstance(profile, str):
        profile = get_profile(profile)
    return simulate(iteration_graph(cfg, profile, loads, placement, **kw))


__all__ = [
    "ClusterProfile", "PROFILES", "get_profile", "register_profile", "local_profile_from_calibration",
    "Demand", "link_capacities", "compute_time", "alltoall_demands", "ring_demand", "broadcast_demand",
    "p2p_demand", "alltoall_time", "allreduce_time", "allgather_time", "reduce_scatter_time",
    "broadcast_time", "p2p_time",
    "OpGraph", "SimResult", "DeadlockError", "simulate", "simulate_iteration",
    "ep_iteration_graph", "iteration_graph", "get_graph", "graph_bytes",
    "dense_param_count", "expert_param_count", "moe_layer_ids", "route_matrix", "synthetic_loads",
    "config_for_profile", "capacity",
    "AlphaBeta", "fit_alpha_beta",
]
