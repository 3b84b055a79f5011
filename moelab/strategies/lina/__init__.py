"""Lina (ATC'23) in moelab: all-to-all before all-reduce in training. Spec: ``shared/papers/lina.md``.

Training (§2.2): :mod:`moelab.strategies.lina.priority` (the per-rank priority scheduler, a core seam every
collective passes), :mod:`.update` (DDP buckets or partitioned micro-ops as low-priority ops),
:mod:`.layer` (the combine marker). Policies: ``after_backward``, ``ddp_overlap`` (the baseline),
``fixed``, ``priority``, ``lina`` (:mod:`.options`).

Inference (§2.3): :mod:`.server` (what ``moelab serve`` runs with ``serve.strategy: lina``), :mod:`.infer`
(the serve layer and its two-phase scheduling), :mod:`.popularity` (the path table estimator),
:mod:`.placement` (packing and replica allocation), :mod:`.dispatch` (replica-aware serving dispatch);
options :class:`.options.LinaServeOptions`. Simulated: :mod:`.sim_graph` (training), :mod:`.sim_windows`,
:mod:`.sim_infer` (serving); :mod:`.packing` (the expert-packing controller), :mod:`.pipeline`.
Reproduction: :mod:`moelab.papers.lina` (``notebooks/lina.ipynb``).

Registered as strategy ``lina``: ``parallel.strategy: lina`` with ``parallel.strategy_options`` such
as ``{policy: lina, partition_bytes: 30e6}``. Scheduling only: every policy trains the EP model.
"""
from __future__ import annotations

import functools

from moelab.registry import Strategy, register_strategy
from moelab.strategies.lina.layer import LinaMoELayer
from moelab.strategies.lina.options import POLICIES, LinaOptionError, LinaOptions, LinaServeOptions
from moelab.strategies.lina.update import lina_update
from moelab.techniques import Technique


def layer_factory(run_cfg, opts: LinaOptions):
    return functools.partial(LinaMoELayer, options=opts)


def _update(model, comm, cfg):
    return lina_update(model, comm, cfg)


_update.checkpoint_ready = True  # every policy's update saves what it needs (the core's, or LinaUpdate's state)


def _groups(run_cfg) -> dict:
    opts = LinaOptions.from_dict(run_cfg.parallel.strategy_options)
    return opts.groups(run_cfg.parallel.nproc, run_cfg.model.moe.num_experts)


def lina_alone_only(opts: LinaOptions):
    """Lina's options that cannot compose: packing moves the layer onto a block of ranks, lina_pipe replaces
    the dispatch chain a partner may own."""
    if opts.pipelined:
        return "policy lina_pipe replaces the dispatch chain"
    if opts.pack_controller or opts.q != 1:
        return f"packing ({opts.q} experts per device) runs the layer over a block of ranks"
    return None


STRATEGY = register_strategy(Strategy(
    "lina", options=LinaOptions, layer=layer_factory, update=_update, groups=_groups, own_expert_layout=True,
    techniques=(Technique("lina", "schedule", owns=("update", "groups", "expert_layout"),
        wraps=("forward", "dispatch_compute_combine"), alone_only=lina_alone_only,
        sim="moelab.strategies.lina.sim_graph:lina_contribution",
        doc="all-to-all before all-reduce: priority scheduler, gradient micro-ops"),),
    sim_graph="moelab.strategies.lina.sim_graph:lina_iteration_graph",
    serve="moelab.strategies.lina.server:build", serve_options=LinaServeOptions,
    conformance=tuple({"policy": p} for p in ("ddp_overlap", "priority", "lina")),
    placement_policies=(("Lina popularity", "moelab.strategies.lina.explore:popularity"),),
    doc="Lina: all-to-all before all-reduce (priority scheduler, partitioned gradient micro-ops)"))

__all__ = ["STRATEGY", "layer_factory", "LinaOptions", "LinaServeOptions", "LinaOptionError", "POLICIES"]
