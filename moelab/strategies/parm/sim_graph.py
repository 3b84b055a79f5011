"""Parm in the simulator (spec §2.10-2.11): one MoE layer's forward + backward as an op graph built
from the same plan the runtime executes (:mod:`.plan`), so simulated bytes are the door's bytes.

- every collective is one op per group instance over that instance's ranks; instances of one group
  run at once and share the nodes' NICs and ports (:mod:`moelab.sim.costs` link model);
- SAA is priced as its P phases, each an exchange of the all-to-all half (one chunk to rank
  ``(r+i)%P``) together with the gather half (the previous chunk to every MP peer): halves on
  different link classes overlap, halves on the same link share it;
- compute from the §2.10c FLOPs at the profile's achieved throughput (the einsum dispatcher's
  quadratic cost included); no compute/communication overlap, as the paper's schedules have none;
- no count exchange (the buffers are capacity-padded).

:func:`layer_time` simulates one layer and returns its seconds, with the communication share
(Fig. 1's quantity) from the critical path.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from moelab.comm.topology import Topology
from moelab.sim import costs
from moelab.sim.engine import simulate
from moelab.sim.graphs import new_graph
from moelab.strategies.parm.layout import MP, ParmLayout
from moelab.strategies.parm.plan import Shape, steps


def _saa_phases(g, inst, topo, profile, nbytes, mp_groups, deps, name, phase):
    """The P phases of SAA over ``inst`` (all ranks); returns the last phase's op."""
    P = len(inst)
    peers = {r: [p for grp in mp_groups if r in grp for p in grp if p != r] for r in inst}
    last = None
    for i in range(1, P + 1):
        m = np.zeros((P, P))
        for a, r in enumerate(inst):
            if i < P:
                m[a, (a + i) % P] += nbytes
            for p in peers[r]:
                m[a, inst.index(p)] += nbytes
        comm = {"op": "saa", "group": list(inst), "nbytes": nbytes, "sub": mp_groups} if i == 1 else None
        last = g.transfer(f"{name}.phase{i}", inst, costs.alltoall_demands(m, inst, topo, profile, False),
                          deps=deps if last is None else (last,), category="saa", comm=comm, phase=phase)
    return last


def parm_layer_graph(profile, layout: ParmLayout, shape: Shape, schedule: str, variant: str = "fig3a",
                     saa_backward: bool = True, meta: Optional[dict] = None):
    """The op graph of one MoE layer call (forward + backward) of ``schedule`` on ``profile``'s links."""
    topo = Topology(layout.world, layout.ranks_per_node)
    g = new_graph(profile, topo, {"strategy": "parm", "schedule": schedule, "variant": variant, **(meta or {})})
    groups = layout.groups()
    last = {r: None for r in range(layout.world)}
    dep = lambda ranks: tuple(last[r] for r in ranks if last[r] is not None)  # noqa: E731
    for s in steps(layout, shape, schedule, variant, saa_backward):
        if not s.is_comm:
            t = costs.compute_time(s.flops, profile)
            for r in range(layout.world):
                last[r] = g.compute(r, f"{s.name}.{s.phase}", t, deps=dep([r]), category=s.name, phase=s.phase)
            continue
        for inst in groups[s.group]:
            if s.op == "saa":
                op = _saa_phases(g, inst, topo, profile, s.args["nbytes"], groups[MP], dep(inst), s.name, s.phase)
            else:
                args = dict(s.args)
                if s.op == "all_to_all":
                    args["splits"] = np.tile(np.asarray(args["splits"], dtype=np.float64), (len(inst), 1))
                op = g.transfer(f"{s.name}.{s.phase}", inst, costs.demands(s.op, inst, topo, profile, **args),
                                deps=dep(inst), category="comm", comm={"op": s.op, "group": list(inst), **args},
                                phase=s.phase)
            for r in inst:
                last[r] = op
    return g


def layer_time(profile, layout: ParmLayout, shape: Shape, schedule: str, **kw) -> dict:
    """Simulated seconds of one layer call (fwd + bwd) and the share of it spent in communication."""
    res = simulate(parm_layer_graph(profile, layout, shape, schedule, **kw))
    kinds = res.breakdown("kind")
    t = float(res.makespan)
    return {"time_s": t, "comm_share": kinds.get("comm", 0.0) / t if t > 0 else 0.0, "breakdown": res.breakdown()}
