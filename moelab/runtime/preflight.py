"""The pre-flight of a run: every check of a config that needs another package than :mod:`moelab.config`, run in
one step before any process starts. Each check lives with what it checks and says what that needs:

- the strategy binds its own options (:func:`moelab.registry.strategy_errors`; first: binding imports it, and it
  may register its own gates and dispatchers);
- the gate registry entry says what a gate needs of the run (:func:`moelab.moe.gates.gate_errors`), the
  dispatcher likewise (:func:`moelab.moe.dispatch.dispatcher_errors`);
- the expert placement (:func:`moelab.runtime.train.placement_errors`), the kernels on the ranks' device
  (:func:`moelab.kernels.kernel_errors`), autocast on this hardware (:func:`autocast_errors`, here), the update
  (:func:`moelab.runtime.update.update_errors`), the data and the task (:mod:`moelab.models.data`,
  :mod:`moelab.models.tasks`), checkpoints (:mod:`moelab.runtime.checkpoint`), the compute-yields probe
  (:mod:`moelab.comm.cpu_priority`) and the strategy's process groups (:mod:`moelab.comm.groups`).

Each config section checks its own fields first (field metadata and ``own_errors``,
:func:`moelab.config.field_errors`); :meth:`moelab.config.RunConfig.validate` runs :func:`owner_errors` once they
hold (the package root installs it there). :func:`serve_errors` is the same for ``moelab serve``.
"""
from __future__ import annotations

import torch

from moelab.comm.cpu_priority import yield_errors
from moelab.comm.groups import declared_group_errors
from moelab.config import ConfigError, RunConfig, TrainConfig, field_errors
from moelab.kernels import kernel_errors
from moelab.models.data import dataset_errors
from moelab.models.tasks import task_errors
from moelab.moe.dispatch import dispatcher_errors
from moelab.moe.gates import gate_errors
from moelab.registry import get, known_strategies, serving_strategies, strategy_errors
from moelab.runtime.checkpoint import checkpoint_errors, resume_errors
from moelab.runtime.train import placement_errors
from moelab.runtime.update import update_errors


def config_errors(cfg: RunConfig) -> list:
    """Every complaint about ``cfg``: the sections' own field errors alone when there are any (later checks
    divide by those numbers), else the owners' (:func:`owner_errors`)."""
    return field_errors(cfg, "") or owner_errors(cfg)


def owner_errors(cfg: RunConfig) -> list:
    """The owners' checks of a config whose fields hold (module doc), every complaint at once."""
    probe = cfg.model.moe.kernels == "triton" or cfg.train.autocast == "bf16"  # the only checks that ask the device
    device = "cuda" if probe and resolve_backend(cfg.parallel.backend) == "nccl" else "cpu"
    errs = strategy_errors(cfg)  # first: the strategy registers its own gates and dispatchers
    errs += gate_errors(cfg) + dispatcher_errors(cfg) + placement_errors(cfg)
    errs += kernel_errors(cfg.model.moe, device) + autocast_errors(cfg.train, device)
    errs += update_errors(cfg) + dataset_errors(cfg) + task_errors(cfg) + checkpoint_errors(cfg)
    if cfg.train.resume_from is not None and not errs:  # reads the checkpoint: only a config otherwise sound
        errs += resume_errors(cfg)
    errs += yield_errors(cfg)
    return errs or declared_group_errors(cfg)  # the strategy's groups: built from a sound config only


def serve_errors(cfg: RunConfig) -> list:
    """Everything that makes ``cfg`` unservable, each naming the option (before any process starts): the serving
    loop's own fields (their metadata, :class:`moelab.config.ServeConfig`), the server's options by the strategy
    that declares them."""
    sv = cfg.serve
    errs = field_errors(sv, "serve.")
    if sv.strategy is None or sv.strategy not in known_strategies():
        return errs + [f"serve.strategy must name a strategy with a server, one of {sorted(serving_strategies())}; "
                       f"got {sv.strategy!r}"]
    try:
        get(sv.strategy).bind_serve(cfg)
    except ConfigError as e:
        errs.append(f"serve.strategy_options ({sv.strategy}): {e}")
    return errs


def resolve_backend(requested: str) -> str:
    """The process-group backend ``parallel.backend`` means here: ``auto`` is NCCL with CUDA, else gloo."""
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def autocast_errors(t: TrainConfig, device: str) -> list:
    """bf16 autocast needs an fp32 model and, on a CPU, native bf16 (AVX512-BF16 or AMX)."""
    if t.autocast not in ("none", "bf16"):
        return [f"train.autocast must be none or bf16, got {t.autocast!r}"]
    if t.autocast == "none":
        return []
    if t.dtype != "float32":
        return [f"train.autocast=bf16 runs an fp32 model in bf16: set train.dtype=float32 (got {t.dtype})"]
    if device != "cuda" and not cpu_has_bf16():
        return ["train.autocast=bf16: this CPU has no native bf16 (AVX512-BF16 or AMX); use train.autocast=none "
                "or run on a GPU"]
    return []


def cpu_has_bf16() -> bool:
    probes = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(p() for p in probes if p is not None)
