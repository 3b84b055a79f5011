"""LSH-MoE (NeurIPS'24) in moelab: all-to-all compression by locality-sensitive hashing.
Spec: ``shared/papers/lsh-moe.md``.

Pure (no processes): :mod:`.hashing` (cross-polytope, spherical, hyperplane, identity, constant;
§2.3) and :mod:`.buckets` (partition, centroids, residual compensation; §2.4, §2.6). Runtime:
:class:`.layer.LSHMoELayer` (a ``MoELayer`` subclass changing only bucketing, count exchange, plan,
dispatch/combine). Simulator: :mod:`.sim_graph` (all-to-alls priced on centroid rows); the analytic side
(Eq. 6-9, the Amdahl form, Table 1's counts) in :mod:`.analysis`. Reproduction: :mod:`moelab.papers.lsh_moe`
(``notebooks/lsh_moe.ipynb``).

Registered as strategy ``lsh_moe``: ``parallel.strategy: lsh_moe`` with ``parallel.strategy_options``
such as ``{hash_family: cross_polytope, num_hashes: 6, cp_dim: 2, error_compensation: true}``.
``identity`` computes the EP model bit for bit; every other family trains a (slightly) different model.
"""
from __future__ import annotations

import functools

from moelab.registry import Strategy, register_strategy
from moelab.strategies.lsh_moe.layer import LSHMoELayer
from moelab.strategies.lsh_moe.options import LSHMoEOptionError, LSHMoEOptions
from moelab.techniques import Technique


def layer_factory(run_cfg, opts: LSHMoEOptions):
    return functools.partial(LSHMoELayer, options=opts)


def changes_model(opts: dict) -> bool:
    """Every family but ``identity`` and ``none`` computes experts on centroids: a different model."""
    return opts.get("hash_family", "cross_polytope") not in ("identity", "none")


STRATEGY = register_strategy(Strategy(
    "lsh_moe", options=LSHMoEOptions, layer=layer_factory,
    techniques=(Technique("lsh_moe", "wire", owns=("exchange_counts", "plan", "dispatch_compute_combine"),
        wraps=("route", "plan_record"),
        calls=("token_dispatch", "dispatch_postprocess", "compute_experts", "combine_preprocess", "token_combine"),
        excludes=tuple((p, "LSH-MoE runs on placements without replicas (a replica set would split a bucket's "
                        "centroid across holders)") for p in ("fastermoe", "flexmoe", "hecate")),
        sim="moelab.strategies.lsh_moe.sim_graph:lsh_moe_contribution",
        doc="centroids of hashed buckets on the wire"),),
    sim_graph="moelab.strategies.lsh_moe.sim_graph:lsh_moe_iteration_graph",
    sim_plan="moelab.strategies.lsh_moe.sim_graph:lsh_sim_plan",
    conformance=({"hash_family": "identity"}, {"hash_family": "none"}, {}),
    changes_model=changes_model,
    doc="LSH-MoE: centroids of hashed buckets on the wire, residual error compensation"))

__all__ = ["STRATEGY", "layer_factory", "LSHMoEOptions", "LSHMoEOptionError"]
