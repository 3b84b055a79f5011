"""Parm (arXiv 2407.00599) in moelab: MP x EP x ESP with MP paused inside the MoE layer. Spec:
``shared/papers/parm.md``.

- :mod:`.layout`: the pure rank layout (§2.3) and the process groups it declares;
- :mod:`.gating`: DeepSpeed gating and the (E, T, M) capacity buffers, ``einsum`` and ``index`` (§2.2);
- :mod:`.layer`: the MoE layer on real groups: schedules ``baseline`` (Fig. 3a, ``ds081``), ``s1``,
  ``s2`` (SAA, :mod:`moelab.comm.saa`), ``s2_aas`` (§2.5-2.8);
- :mod:`.perf_model`: the alpha-beta model, Alg. 1 and its closed form (§2.10a, §2.11, §2.13);
- :mod:`.grid`: the Table III grid, the memory filter, per-schedule token counts and FLOPs;
- :mod:`.plan`: a schedule as data (its ordered collectives and compute), :mod:`.sim_graph`: the same plan
  priced by the simulator. Reproduction: :mod:`moelab.papers.parm` (``notebooks/parm.ipynb``).

- :mod:`.fits`: alpha-beta fits taken through the door on the live groups; :mod:`.select`: ``auto``;
- :mod:`.model`, :mod:`.update`: the trainer's view (layer adapter, tensor-parallel dense parts, one
  micro-batch per MP group, the §2.9 gradient semantics).

Registered as ``parallel.strategy: parm`` with ``strategy_options`` such as ``{mp: 2, esp: 2,
schedule: s2}``; needs ``model.moe.dispatcher: dense``, a capacity factor and a switch or gshard
gate. Exempt from the generic conformance suite (its gating pools and MP-replicated inputs are not
the core layer's contract); its own fp64 references are ``tests/strategies/parm/``.
"""
from __future__ import annotations

import functools

from moelab.registry import Strategy, register_strategy
from moelab.strategies.parm.model import ParmMoELayer, data_shard, prepare_model
from moelab.strategies.parm.options import ParmOptionError, ParmOptions, layout_of
from moelab.strategies.parm.update import ParmUpdate
from moelab.techniques import LAYER_STAGES, Technique


def layer_factory(run_cfg, opts: ParmOptions):
    return functools.partial(ParmMoELayer, options=opts, run_cfg=run_cfg)


def declared_groups(run_cfg) -> dict:
    return layout_of(run_cfg, ParmOptions.from_dict(run_cfg.parallel.strategy_options)).groups()


def _update():
    return ParmUpdate


def _shard(run_cfg, rank, world):
    return data_shard(run_cfg, rank, world)


def _prepare(run_cfg, model, comm):
    prepare_model(run_cfg, model, comm)


STRATEGY = register_strategy(Strategy(
    "parm", options=ParmOptions, layer=layer_factory, update=_update(), groups=declared_groups,
    techniques=(Technique("parm", "layout",
        owns=("own_layer", "update", "groups", "data_shard", "prepare_model", "expert_layout") + LAYER_STAGES,
        doc="MP x EP x ESP, its own layer (not a MoELayer)"),),
    data_shard=_shard, prepare_model=_prepare, own_expert_layout=True, shared_loads=False, conformance=(),
    sim_graph="moelab.strategies.parm.sim_graph:parm_iteration_graph",
    doc="Parm: MP x EP x ESP with MP paused in the MoE layer (baseline, S1, S2 with SAA, S2-AAS, auto)"))

__all__ = ["STRATEGY", "ParmOptions", "ParmOptionError"]
