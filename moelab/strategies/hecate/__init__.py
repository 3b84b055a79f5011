"""Hecate / FSSDP (arXiv 2502.02581) in moelab: fully sharded sparse data parallelism. Spec:
``shared/papers/hecate.md``.

Pure (no processes): Alg. 1/2, calibration and the load window in :mod:`moelab.strategies.hecate.policy`, the
§2.9 cost model in :mod:`moelab.sim.placement_cost`; the sparse collectives in
:mod:`moelab.comm.sparse`; the migration routine in :mod:`moelab.moe.migrate`. Runtime:
:class:`.layer.HecateMoELayer` (a ``MoELayer`` subclass) driven by :class:`.update.HecateUpdate`;
options in :mod:`.options`; the replica pool and its materialization autograd boundary in :mod:`.replicas`.
Simulator: :mod:`.sim_graph` (the same plans priced by ``moelab.sim``).
Reproduction: :mod:`moelab.papers.hecate` (``notebooks/hecate.ipynb``).

Registered as strategy ``hecate``: ``parallel.strategy: hecate`` with ``parallel.strategy_options``
such as ``{t: 2, m: 1}``, ``{rm: true}``, ``{reshard_interval: 50}``, ``{spag_backend: hier}``. The
strategy declares its own process group ``sparse`` (all ranks) for spAG/spRS, and with a staged backend
(``hier``, ``stripe``) ``sparse_later`` for the stages a comm stream posts.
"""
from __future__ import annotations

import functools

from moelab.comm.sparse import NODE_BACKENDS
from moelab.registry import Strategy, register_strategy
from moelab.strategies.hecate.layer import HecateMoELayer
from moelab.strategies.hecate.options import LATER_GROUP, HecateOptionError, HecateOptions
from moelab.strategies.hecate.update import HecateUpdate
from moelab.techniques import Technique


def layer_factory(run_cfg, opts: HecateOptions):
    return functools.partial(HecateMoELayer, options=opts)


def sparse_group(run_cfg) -> dict:
    """The sparse collectives' group; the staged backends also get one for their later stages (posted by a
    comm stream, :func:`moelab.comm.sparse._handle`)."""
    world = [list(range(run_cfg.parallel.nproc))]
    staged = (run_cfg.parallel.strategy_options or {}).get("spag_backend") in NODE_BACKENDS
    return {"sparse": world, **({LATER_GROUP: world} if staged else {})}


STRATEGY = register_strategy(Strategy(
    "hecate", options=HecateOptions, layer=layer_factory, update=HecateUpdate, groups=sparse_group,
    techniques=(Technique("hecate", "placement", owns=("place", "materialize", "update", "groups"),
        wraps=("compute_experts", "forward", "plan_record"), doc="sparse materialization, re-sharding"),),
    sim_graph="moelab.strategies.hecate.sim_graph:hecate_iteration_graph",
    sim_plan="moelab.strategies.hecate.sim_graph:hecate_sim_plan",
    conformance=({"t": 1}, {"t": 2, "m": 1, "calibration": False}, {"t": 1, "replicate_force": [0, 1, 2, 3]},
                 {"t": 2, "m": 2, "spag_backend": "p2p"}, {"t": 1, "rm": True}),
    placement_policies=(("Hecate Alg. 1", "moelab.strategies.hecate.explore:alg1"),
                        ("Hecate Alg. 2", "moelab.strategies.hecate.explore:alg2")),
    doc="Hecate / FSSDP: sparse materialization (Alg. 1), heterogeneous sharding (Alg. 2), spAG/spRS, RM"))

__all__ = ["STRATEGY", "layer_factory", "HecateOptions", "HecateOptionError"]
