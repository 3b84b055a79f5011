"""The checks behind :meth:`moelab.config.RunConfig.validate`: every way a config cannot work, each a
message naming the option, found before any process starts (a strategy checks its own options through
its ``bind``)."""
from __future__ import annotations

from moelab.config import ConfigError, MoEConfig, RunConfig, TrainConfig, field_errors


def config_errors(cfg: RunConfig) -> list:
    """Every complaint about ``cfg``; the range errors alone when there are any (later checks divide by
    those numbers)."""
    m, moe, p, t = cfg.model, cfg.model.moe, cfg.parallel, cfg.train
    errs = field_errors(cfg, "")  # each section's own fields (their metadata, moelab.config)
    if errs:  # later checks divide by these numbers: stop here with every field error
        return errs
    from moelab.registry import known_strategies

    if p.strategy not in known_strategies():
        errs.append(f"parallel.strategy {p.strategy!r} is unknown; known: {sorted(known_strategies())}")
    elif not errs:
        from moelab.registry import get

        try:  # the strategy binds and checks its own options against this run
            get(p.strategy).bind(cfg)
        except Exception as e:  # noqa: BLE001 - any complaint becomes a clear config error
            errs.append(f"parallel.strategy_options for {p.strategy!r}: {e}")
    gates, dispatchers = registered_gates(), registered_dispatchers()  # after the strategy registered its own
    if moe.gate not in gates:
        errs.append(f"model.moe.gate must be one of {gates}, got {moe.gate!r}")
    if moe.dispatcher not in dispatchers:
        errs.append(f"model.moe.dispatcher must be one of {dispatchers}, got {moe.dispatcher!r}")
    if p.placement is None and moe.num_experts % p.nproc != 0 and not _own_expert_layout(p.strategy):
        errs.append(
            f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.nproc={p.nproc}: "
            "expert parallelism needs the same number of experts on every rank")
    if not isinstance(moe.top_k, int) or not 1 <= moe.top_k <= max(moe.num_experts, 1):
        errs.append(f"model.moe.top_k must be an integer in 1..model.moe.num_experts={moe.num_experts}, "
                    f"got {moe.top_k!r}")
    errs += _kernel_errors(moe, p.backend)
    errs += _autocast_errors(t, p.backend)
    if moe.gate == "gshard" and moe.top_k != 2:
        errs.append("model.moe.gate='gshard' is a top-2 gate: set model.moe.top_k=2")
    if moe.gate == "switch" and moe.top_k != 1:
        errs.append("model.moe.gate='switch' is a top-1 gate: set model.moe.top_k=1")
    if moe.gate == "base" and (moe.top_k != 1 or (t.batch_size * m.seq_len) % max(moe.num_experts, 1)):
        errs.append(f"model.moe.gate='base' is a balanced top-1 gate (every expert gets exactly T/E of a rank's "
                    f"T = train.batch_size * model.seq_len = {t.batch_size * m.seq_len} tokens): set "
                    f"model.moe.top_k=1 (got {moe.top_k}) and make T divisible by num_experts={moe.num_experts}")
    if moe.dispatcher == "dense" and moe.capacity_factor is None:
        errs.append("the dense dispatcher pads to a capacity: set model.moe.capacity_factor")
    if moe.dispatcher == "dense" and p.placement is not None:
        errs.append("the dense (DeepSpeed-style) dispatcher supports plain expert parallelism only")
    if m.d_model % m.n_heads != 0:
        errs.append(f"model.d_model={m.d_model} must be divisible by model.n_heads={m.n_heads}")
    topo = p.topology
    rpn = topo.ranks_per_node if topo.ranks_per_node is not None else (
        p.nproc // topo.nodes if topo.nodes > 0 else 0)
    if topo.nodes < 1 or rpn < 1 or topo.nodes * rpn != p.nproc:
        errs.append(
            f"topology {topo.nodes} nodes x {topo.ranks_per_node or '?'} ranks does not fit nproc={p.nproc}")
    if p.placement is not None:
        from moelab.placement import Placement

        try:
            Placement.from_mapping(p.placement, moe.num_experts, p.nproc)
        except ValueError as e:
            errs.append(f"parallel.placement: {e}")
    if t.fault_rank is not None and not 0 <= t.fault_rank < p.nproc:
        errs.append(f"train.fault_rank={t.fault_rank} is not a rank of nproc={p.nproc}")
    from moelab.runtime.update import GRAD_SYNCS  # the data-parallel updates by name: the one list of them

    if p.grad_sync not in GRAD_SYNCS:
        errs.append(f"parallel.grad_sync must be one of {tuple(GRAD_SYNCS)}, got {p.grad_sync!r}")
    elif p.strategy in known_strategies() and p.strategy != "ep":
        from moelab.registry import get_update

        if get_update(p.strategy) is not None:
            if p.grad_sync != "after_backward":
                errs.append(f"parallel.grad_sync={p.grad_sync!r} chooses the data-parallel update; strategy "
                            f"{p.strategy!r} brings its own gradient sync: leave it at 'after_backward'")
            if (t.checkpoint_every or t.resume_from) and not vars(get_update(p.strategy)).get("checkpoint_ready"):
                errs.append(f"train.checkpoint_every / train.resume_from: checkpoints cover the data-parallel "
                            f"updates and the strategies whose update saves its own state; strategy "
                            f"{p.strategy!r} brings its own update, not yet checkpointed")
    from moelab.models.data import DATASETS

    if t.dataset not in DATASETS:
        errs.append(f"train.dataset must be one of {DATASETS}, got {t.dataset!r}")
    from moelab.models.tasks import task_errors
    from moelab.runtime.checkpoint import checkpoint_errors

    errs += task_errors(cfg) + checkpoint_errors(cfg)
    if t.resume_from is not None and not errs:
        from moelab.runtime.checkpoint import resume_errors

        errs += resume_errors(cfg)
    if cfg.emulation.compute_yields:
        from moelab.comm.cpu_priority import UNAVAILABLE, available

        if not available():
            errs.append("emulation.compute_yields " + UNAVAILABLE)
    from moelab.comm.groups import declared_group_errors

    errs += [] if errs else declared_group_errors(cfg)
    return errs


def _own_expert_layout(strategy: str) -> bool:
    """Whether ``strategy`` validates the expert count against its own layout (Parm: N_EP | E)."""
    from moelab.registry import get, known_strategies

    return strategy in known_strategies() and get(strategy).own_expert_layout


def registered_gates() -> tuple:
    """Gate names the layer can resolve: the registry of :mod:`moelab.moe.gates` (built-in and strategies')."""
    from moelab.moe.gates import GATES

    return tuple(sorted(GATES))


def registered_dispatchers() -> tuple:
    """Dispatcher names the layer can resolve: the registry of :mod:`moelab.moe.dispatch`."""
    from moelab.moe.dispatch import DISPATCHERS

    return tuple(sorted(DISPATCHERS))


def serve_errors(cfg: RunConfig) -> list:
    """Everything that makes ``cfg`` unservable, each naming the option (before any process starts): the
    serving loop's own fields here, the server's options by the strategy that declares them."""
    from moelab.registry import get, known_strategies, serving_strategies

    sv = cfg.serve
    errs = []
    if sv.arrival not in ("poisson", "closed"):
        errs.append(f"serve.arrival must be 'poisson' or 'closed', got {sv.arrival!r}")
    for name, v in (("requests", sv.requests), ("batch_size", sv.batch_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            errs.append(f"serve.{name} must be an integer >= 1, got {v!r}")
    for name, v in (("rate_per_s", sv.rate_per_s), ("max_wait_ms", sv.max_wait_ms)):
        if not v > 0:
            errs.append(f"serve.{name} must be > 0, got {v!r}")
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
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def _kernel_errors(moe: MoEConfig, backend: str) -> list:
    """``model.moe.kernels`` must name a selector, and Triton must be able to run where the ranks will."""
    from moelab.kernels import KINDS, MAX_TOP_K, triton_error

    if moe.kernels not in KINDS:
        return [f"model.moe.kernels must be one of {KINDS}, got {moe.kernels!r}"]
    if moe.kernels != "triton":
        return []
    errs = [f"model.moe.kernels=triton routes top-k up to {MAX_TOP_K}, got model.moe.top_k={moe.top_k}"] \
        if isinstance(moe.top_k, int) and moe.top_k > MAX_TOP_K else []
    why = triton_error("cuda" if resolve_backend(backend) == "nccl" else "cpu")
    return errs + ([why] if why else [])


def _autocast_errors(t: TrainConfig, backend: str) -> list:
    """bf16 autocast needs an fp32 model and, on a CPU, native bf16 (AVX512-BF16 or AMX)."""
    if t.autocast not in ("none", "bf16"):
        return [f"train.autocast must be none or bf16, got {t.autocast!r}"]
    if t.autocast == "none":
        return []
    if t.dtype != "float32":
        return [f"train.autocast=bf16 runs an fp32 model in bf16: set train.dtype=float32 (got {t.dtype})"]
    if resolve_backend(backend) != "nccl" and not cpu_has_bf16():
        return ["train.autocast=bf16: this CPU has no native bf16 (AVX512-BF16 or AMX); use train.autocast=none "
                "or run on a GPU"]
    return []


def cpu_has_bf16() -> bool:
    import torch

    probes = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(p() for p in probes if p is not None)
