"""Hecate reproduction, the SIMULATED paper scale: one priced iteration per (system, model, cluster, trace
iteration), every system's plan made by the same pure functions its runtime runs.

A configuration is a Table 1 model on a cluster profile (``hecate_A`` at 16 GPUs / 32 experts or 32 GPUs /
64 experts, ``hecate_B`` at 32 GPUs; weak scaling: 2 experts per GPU, spec §6.12), fp16 on the wire,
``batch`` sequences per GPU. Loads: the REAL trace recorded with the configuration's expert count
(:mod:`.trace`), upsampled to the cluster's ranks. Systems (:data:`SYSTEMS`) map to a strategy's simulator
graph plus per-iteration graph arguments from a *replay*: the strategy's policy run over the trace in
iteration order exactly as its runtime Update runs it (decisions from previous iterations only)."""
from __future__ import annotations

import numpy as np

from moelab.config import RunConfig
from moelab.models.params import paper_model
from moelab.papers.kit.cache import cached
from moelab.sim.engine import simulate
from moelab.sim.graphs import config_for_profile, iteration_graph
from moelab.sim.profiles import get_profile

from .common import scale_spec
from .trace import real_trace, upsample

CLUSTER_GPUS = {"hecate_A": (16, 32), "hecate_B": (32,)}


def paper_config(model: str, profile, strategy: str = "ep", options=None, layers=None, batch: int = 1):
    """A RunConfig of Table 1 ``model`` on ``profile`` (its ranks; 2 experts per GPU), ``layers`` MoE layers."""
    m = paper_model(model)
    cfg = RunConfig().with_overrides({
        "paper": "hecate", "name": model,
        "model.arch": m.arch, "model.vocab_size": m.vocab_size, "model.d_model": m.d_model, "model.d_ff": m.d_ff,
        "model.n_layers": layers or m.n_layers, "model.n_heads": m.n_heads, "model.seq_len": m.seq_len,
        "model.moe.num_experts": 2 * profile.world_size, "model.moe.top_k": 2, "model.moe.gate": "topk",
        "model.moe.expert_bias": False, "train.batch_size": batch,
        "parallel.strategy": strategy, "parallel.strategy_options": dict(options or {})})
    return config_for_profile(cfg, profile)


def paper_profile(cluster: str, gpus: int):
    p = get_profile(cluster)
    return p.with_nodes(gpus // p.gpus_per_node)


@cached
def paper_loads(scale, model: str, cluster: str, gpus: int, seed: int = 0, iters=None, layers=None,
                skew: float = 1.0) -> np.ndarray:
    """``[iters, layers, gpus, 2*gpus]``: the REAL trace with ``2*gpus`` experts (its layers cycled to the
    model's depth, or ``layers``), its first ``iters`` iterations (default: the scale's ``paper_iters + 1``),
    upsampled to ``gpus`` sources of ``seq_len`` tokens each (batch 1); ``skew`` != 1: a SUBSTITUTE trace, the
    shares sharpened (:func:`.trace.upsample`)."""
    sp = scale_spec(scale)
    m = paper_model(model)
    L = layers or (m.n_layers if sp.paper_layers is None else min(sp.paper_layers, m.n_layers))
    tr = real_trace(sp.name, experts=2 * gpus)
    tr = tr[:iters or sp.paper_iters + 1]
    tr = tr[:, [l % tr.shape[1] for l in range(L)]]  # the trace's layers, cycled over the model's
    return upsample(tr, gpus, m.seq_len, seed=seed, skew=skew)


def simulate_iterations(cfg, profile, loads, plans=None, elem_bytes: int = 2) -> list:
    """One :class:`moelab.sim.engine.SimResult` per iteration of ``loads`` with ``plans[it]`` graph kwargs."""
    plans = plans or [{}] * len(loads)
    return [simulate(iteration_graph(cfg, profile, loads[i], None, elem_bytes=elem_bytes, **plans[i]))
            for i in range(len(loads))]


def frame_label(cluster: str, extra: str = "") -> str:
    return (f"SIMULATED: {cluster} profile (moelab.sim), loads = REAL tiny-GPT-MoE trace upsampled to the "
            f"cluster's ranks{'; ' + extra if extra else ''}")
