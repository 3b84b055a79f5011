"""One config object for a run: model, MoE layer, parallel layout, training, emulation.

Every notebook parameter and CLI ``--set key=value`` maps onto a dotted field of :class:`RunConfig`.
``validate`` is called before any process starts, so a config that cannot work fails with a clear
message instead of a hang or a traceback on some rank.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

GATES = ("topk", "gshard", "switch", "base")  # built in; strategies may register more (moelab.moe.gates)
GRAD_SYNCS = ("after_backward", "ddp_overlap")
DISPATCHERS = ("sparse", "dense")
ARCHS = ("gpt", "bert")
POSITIONS = ("learned", "alibi")
STRATEGIES = ("ep",)  # strategies register more names through moelab.strategies


class ConfigError(ValueError):
    """A configuration that cannot work; raised before any process starts."""


@dataclass
class MoEConfig:
    num_experts: int = 8  # experts per MoE layer (global)
    top_k: int = 2  # experts per token, 1..num_experts (gshard: 2, switch/base: 1)
    gate: str = "topk"  # topk (renormalized top-k softmax) | gshard (top-2) | switch (top-1) | base (balanced top-1)
    capacity_factor: Optional[float] = None  # None = dropless; else capacity = ceil(k*cf*T/E) per source rank
    min_capacity: int = 0  # lower bound of the per-expert capacity
    random_routing: bool = False  # gshard: drop the 2nd expert when 2*p2 < U(0,1)
    balance_loss_coef: float = 0.01  # weight of the GShard/Switch load-balancing loss
    z_loss_coef: float = 0.0  # weight of the router z-loss mean(logsumexp(logits)^2)
    dispatcher: str = "sparse"  # sparse (count exchange + uneven all-to-all) | dense (capacity-padded, equal splits)
    activation: str = "gelu"  # expert FFN activation: gelu | relu
    expert_bias: bool = True  # biases in the expert FFN
    kernels: str = "torch"  # torch | triton | auto: router, permute/unpermute, expert GEMMs (moelab.kernels)


@dataclass
class ModelConfig:
    arch: str = "gpt"  # gpt (causal LM) | bert (masked LM)
    vocab_size: int = 256  # byte-level by default
    d_model: int = 64
    d_ff: int = 128  # expert (and dense FFN) hidden size
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 64
    moe_every: int = 1  # 1: every layer is MoE; 2: every other layer (odd layers)
    # learned: a learned absolute embedding (GPT/RoBERTa) | alibi: no embedding, attention scores biased by
    # -slope_h * |i - j| (Press et al.), which tiny byte-level masked LMs learn from without the long early
    # plateau absolute positions give them (moelab.models.transformer)
    positions: str = "learned"
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class TopologyConfig:
    nodes: int = 1  # declared nodes; "2 nodes x 4" works on one machine
    ranks_per_node: Optional[int] = None  # None: nproc / nodes


@dataclass
class EmulationConfig:
    """Link emulation: a collective takes at least the time the declared links would need."""

    enabled: bool = False
    intra_bw_GBps: float = 10.0  # intra-node bandwidth per rank, GB/s
    intra_latency_us: float = 5.0
    inter_bw_GBps: float = 1.0  # inter-node bandwidth per rank, GB/s
    inter_latency_us: float = 20.0
    # an all-to-all and an all-reduce moving on one port at once each get 1/gamma of their fair share
    # (NCCL's channel/SM contention, Lina's gamma; moelab.comm.links); 1 = fair sharing
    interference_gamma: float = 1.0
    # the ranks' compute threads run their iterations (or serving) at SCHED_IDLE, so a communication
    # thread's call does not wait for a core behind compute, as a NIC does not wait for the GPU
    # (moelab.runtime.cpu_priority)
    compute_yields: bool = False


@dataclass
class ParallelConfig:
    nproc: int = 2  # ranks (processes)
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | gloo | nccl
    strategy: str = "ep"  # registered strategy name
    strategy_options: dict = field(default_factory=dict)  # options of that strategy (it validates them)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    # expert -> [owner, replica, ...] ; None means plain expert parallelism
    placement: Optional[dict] = None
    grad_sync: str = "after_backward"  # after_backward (one flat all-reduce after backward) | ddp_overlap (DDP buckets during backward)
    bucket_mb: float = 25.0  # ddp_overlap: bucket size in MiB (PyTorch DDP's default)


@dataclass
class TrainConfig:
    iters: int = 20
    batch_size: int = 4  # sequences per rank per iteration
    lr: float = 1e-3
    seed: int = 0
    dataset: str = "pydocs"  # pydocs | pytests | pytext (byte-level text of the Python installation) | random
    dtype: str = "float32"  # float32 | float64
    autocast: str = "none"  # none | bf16: forward under torch.autocast(bfloat16), fp32 weights and optimizer
    threads_per_rank: int = 1
    timeout_s: float = 600.0  # the launcher kills the run after this
    trace: bool = True  # write a per-rank Chrome trace
    trace_iters: int = 50  # iterations each trace keeps (evenly spaced, first and last); 0 = all. Not in the run id
    fault_rank: Optional[int] = None  # testing aid: this rank raises at fault_iter
    fault_iter: int = 0
    eval_every: int = 0  # evaluate on held-out windows after every n-th iteration (0: never)
    eval_batches: int = 2  # held-out batches (of batch_size per rank) per evaluation
    checkpoint_every: int = 0  # write a checkpoint into the run folder every n iterations (0: never)
    resume_from: Optional[str] = None  # a checkpoint folder (or a run folder: its latest) to continue from
    # objective (moelab.models.tasks): lm (the arch's own: next byte / masked LM) | span (bert: T5-like
    # span corruption) | acceptability | topic | paraphrase (bert: text classification) | digits (bert
    # blocks on image patches); classification runs report eval_acc (and eval_top2_acc)
    task: str = "lm"
    task_classes: int = 4  # topic: the number of (largest) pydoc topics used as classes; paraphrase: drawn from
    patch_size: int = 2  # digits: square patch side in pixels (1, 2, 4 or 8) of the 8x8 images
    init_from: Optional[str] = None  # fine-tune: a checkpoint (or run folder) to copy parameters from; task heads it lacks start fresh


SERVE_VARIANTS = ("baseline", "ideal", "lina", "lina_no_estimation", "lina_no_finetune")


@dataclass
class ServeConfig:
    """Inference serving (``moelab serve``, :mod:`moelab.runtime.serve`): requests, batching, the
    placement variant of the MoE layers (Lina §2.3). Checked by :func:`serve_errors` at launch."""

    variant: str = "baseline"  # baseline (static EP) | ideal (balanced gate, timing only) | lina | lina_no_estimation | lina_no_finetune
    requests: int = 32  # requests drawn (held-out windows of model.seq_len tokens)
    arrival: str = "poisson"  # poisson (rate_per_s) | closed (batch_size clients, each sends again once served)
    rate_per_s: float = 100.0
    batch_size: int = 8  # B: sequences per batch over all ranks
    max_wait_ms: float = 10.0  # a batch leaves when full or when its first request waited this long
    requests_file: Optional[str] = None  # CSV id,arrival_s,text instead of drawn requests; malformed rows rejected
    path_len: int = 3  # Lp: preceding MoE layers in a path; scheduling starts at MoE layer Lp
    k_est: int = 2  # per-token experts kept from the path distribution
    k_cmp: int = 2  # top experts compared by phase 2
    max_pack: int = 4  # experts per device at most
    replica_rounding: str = "floor"  # replicas of an expert wanting n(e) devices: floor (spec [R]) | nearest | balanced (for the busiest device)
    profile_batches: int = 4  # training-split batches per rank traced to fit the path table


@dataclass
class RunConfig:
    paper: str = "core"  # paper or experiment this run belongs to
    name: str = "run"  # short label
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    # ---- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        return _from_dict(cls, d or {})

    @classmethod
    def load(cls, path: str | Path) -> "RunConfig":
        """A YAML config; a malformed file is a ConfigError naming its line and column (1-based)."""
        import yaml

        with open(path) as f:
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
                what = " ".join(filter(None, [getattr(e, "context", None), getattr(e, "problem", None)])) or str(e)
                raise ConfigError(f"{where}: malformed YAML: {what}") from None
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"{path}: a config is a YAML mapping, got a {type(data).__name__}")
        return cls.from_dict(data or {})

    def with_overrides(self, overrides: dict | None = None, **kw) -> "RunConfig":
        """Return a copy with dotted overrides applied: ``{"model.moe.top_k": 1}`` or ``model__moe__top_k=1``."""
        d = self.to_dict()
        items = dict(overrides or {})
        items.update({k.replace("__", "."): v for k, v in kw.items()})
        for key, value in items.items():
            _set_dotted(d, key, value)
        return RunConfig.from_dict(d)

    def short_hash(self) -> str:
        d = self.to_dict()
        if d["serve"] == dataclasses.asdict(ServeConfig()):  # training runs keep the ids they had before serving
            del d["serve"]
        del d["train"]["trace_iters"]  # how much trace is kept does not change what a run computes
        if d["model"]["moe"]["kernels"] == "torch":  # runs keep the ids they had before the kernels existed
            del d["model"]["moe"]["kernels"]
        if d["train"]["autocast"] == "none":  # ... and before autocast
            del d["train"]["autocast"]
        if d["model"]["positions"] == "learned":  # ... and before ALiBi
            del d["model"]["positions"]
        if not d["emulation"]["compute_yields"]:  # ... and before compute could yield to communication
            del d["emulation"]["compute_yields"]
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha1(blob).hexdigest()[:8]

    def run_id(self) -> str:
        """Self-describing id: paper, name, strategy, ranks, model, key options, hash."""
        m, moe, p = self.model, self.model.moe, self.parallel
        parts = [
            self.paper, self.name, p.strategy, f"n{p.nproc}",
            f"{m.arch}-L{m.n_layers}-d{m.d_model}", f"e{moe.num_experts}k{moe.top_k}-{moe.dispatcher}",
        ]
        if self.emulation.enabled:
            parts.append("emu")
        return "_".join(str(x).replace("_", "-") for x in parts) + "_" + self.short_hash()

    # ---- validation ----------------------------------------------------------------------------
    def validate(self) -> "RunConfig":
        """Raise ConfigError for a config that cannot work. Cheap; runs before any process starts."""
        m, moe, p, t = self.model, self.model.moe, self.parallel, self.train
        errs = self._range_errors()
        if errs:  # later checks divide by these numbers: stop here with every range error
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(errs))
        if m.arch not in ARCHS:
            errs.append(f"model.arch must be one of {ARCHS}, got {m.arch!r}")
        if m.positions not in POSITIONS:
            errs.append(f"model.positions must be one of {POSITIONS}, got {m.positions!r}")
        from moelab.strategies import known_strategies

        if p.strategy not in known_strategies():
            errs.append(f"parallel.strategy {p.strategy!r} is unknown; known: {sorted(known_strategies())}")
        elif not errs:
            from moelab.strategies import get

            try:  # the strategy binds and checks its own options against this run
                get(p.strategy).bind(self)
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
        if m.moe_every not in (1, 2):
            errs.append(f"model.moe_every must be 1 or 2, got {m.moe_every}")
        if p.backend not in ("auto", "gloo", "nccl"):
            errs.append(f"parallel.backend must be auto, gloo or nccl, got {p.backend!r}")
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
        if t.dtype not in ("float32", "float64"):
            errs.append(f"train.dtype must be float32 or float64, got {t.dtype!r}")
        if t.fault_rank is not None and not 0 <= t.fault_rank < p.nproc:
            errs.append(f"train.fault_rank={t.fault_rank} is not a rank of nproc={p.nproc}")
        if p.grad_sync not in GRAD_SYNCS:
            errs.append(f"parallel.grad_sync must be one of {GRAD_SYNCS}, got {p.grad_sync!r}")
        elif p.strategy in known_strategies() and p.strategy != "ep":
            from moelab.strategies import get_update

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

        errs += task_errors(self)
        if moe.activation not in ("gelu", "relu"):
            errs.append(f"model.moe.activation must be gelu or relu, got {moe.activation!r}")
        if t.resume_from is not None and not errs:
            from moelab.runtime.checkpoint import resume_errors

            errs += resume_errors(self)
        if self.emulation.compute_yields:
            from moelab.runtime.cpu_priority import UNAVAILABLE, available

            if not available():
                errs.append("emulation.compute_yields " + UNAVAILABLE)
        from moelab.comm.groups import declared_group_errors

        errs += [] if errs else declared_group_errors(self)
        if errs:
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(errs))
        return self

    def _range_errors(self) -> list:
        """Every numeric field's range, with a message naming the option (no process has started)."""
        m, moe, p, t, e = self.model, self.model.moe, self.parallel, self.train, self.emulation
        min_vocab = 3 if m.arch == "bert" else 2  # bert reserves one id for [MASK]
        checks = [  # (option, value, integer?, lower bound, lower bound allowed?)
            ("parallel.nproc", p.nproc, True, 1, True),
            ("model.vocab_size", m.vocab_size, True, min_vocab, True),
            ("model.d_model", m.d_model, True, 1, True),
            ("model.d_ff", m.d_ff, True, 1, True),
            ("model.n_layers", m.n_layers, True, 1, True),
            ("model.n_heads", m.n_heads, True, 1, True),
            ("model.seq_len", m.seq_len, True, 1, True),
            ("model.moe.num_experts", moe.num_experts, True, 1, True),
            ("model.moe.min_capacity", moe.min_capacity, True, 0, True),
            ("model.moe.balance_loss_coef", moe.balance_loss_coef, False, 0, True),
            ("model.moe.z_loss_coef", moe.z_loss_coef, False, 0, True),
            ("parallel.bucket_mb", p.bucket_mb, False, 0, False),
            ("train.iters", t.iters, True, 1, True),
            ("train.batch_size", t.batch_size, True, 1, True),
            ("train.lr", t.lr, False, 0, False),
            ("train.seed", t.seed, True, 0, True),
            ("train.threads_per_rank", t.threads_per_rank, True, 1, True),
            ("train.timeout_s", t.timeout_s, False, 0, False),
            ("train.fault_iter", t.fault_iter, True, 0, True),
            ("train.eval_every", t.eval_every, True, 0, True),
            ("train.eval_batches", t.eval_batches, True, 1, True),
            ("train.checkpoint_every", t.checkpoint_every, True, 0, True),
            ("train.trace_iters", t.trace_iters, True, 0, True),
            ("train.task_classes", t.task_classes, True, 2, True),
            ("train.patch_size", t.patch_size, True, 1, True),
            ("emulation.intra_bw_GBps", e.intra_bw_GBps, False, 0, False),
            ("emulation.inter_bw_GBps", e.inter_bw_GBps, False, 0, False),
            ("emulation.intra_latency_us", e.intra_latency_us, False, 0, True),
            ("emulation.inter_latency_us", e.inter_latency_us, False, 0, True),
            ("emulation.interference_gamma", e.interference_gamma, False, 1, True),
        ]
        if moe.capacity_factor is not None:
            checks.append(("model.moe.capacity_factor", moe.capacity_factor, False, 0, False))
        if p.topology.ranks_per_node is not None:
            checks.append(("parallel.topology.ranks_per_node", p.topology.ranks_per_node, True, 1, True))
        checks.append(("parallel.topology.nodes", p.topology.nodes, True, 1, True))
        errs = []
        for name, v, integer, lo, closed in checks:
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not number or (integer and not isinstance(v, int)):
                errs.append(f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}")
            elif not math.isfinite(v) or (v < lo if closed else v <= lo):
                extra = " (or null for dropless)" if name == "model.moe.capacity_factor" else ""
                errs.append(f"{name} must be {'>=' if closed else '>'} {lo}{extra}, got {v!r}")
        return errs


def _own_expert_layout(strategy: str) -> bool:
    """Whether ``strategy`` validates the expert count against its own layout (Parm: N_EP | E)."""
    from moelab.strategies import get, known_strategies

    return strategy in known_strategies() and get(strategy).own_expert_layout


def registered_gates() -> tuple:
    """Gate names the layer can resolve: the built-in ones and any a strategy registered."""
    from moelab.moe.gates import GATES as rules

    return tuple(sorted(set(GATES) | set(rules)))


def registered_dispatchers() -> tuple:
    from moelab.moe.dispatch import DISPATCHERS as classes

    return tuple(sorted(set(DISPATCHERS) | set(classes)))


def _from_dict(cls, d: dict):
    if not isinstance(d, dict):
        raise ConfigError(f"expected a mapping for {cls.__name__}, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(d) - set(fields)
    if unknown:
        raise ConfigError(f"unknown field(s) for {cls.__name__}: {sorted(unknown)}; known: {sorted(fields)}")
    kw = {}
    for name, value in d.items():
        sub = _NESTED.get((cls, name))
        kw[name] = _from_dict(sub, value) if sub is not None and value is not None else _coerce(cls, fields[name], value)
    return cls(**kw)


def _coerce(cls, f, value):
    """Numbers given as strings ("3e-4" from a CLI or YAML 1.1) become the field's type; else a clear error."""
    kind = str(f.type).replace("Optional[", "").rstrip("]")
    if value is None or kind not in ("float", "int", "bool"):
        return value
    try:
        if kind == "float" and isinstance(value, (str, int)) and not isinstance(value, bool):
            return float(value)
        if kind == "int" and isinstance(value, str):
            return int(value)
    except ValueError:
        raise ConfigError(f"{cls.__name__}.{f.name} must be a {kind}, got {value!r}") from None
    if kind == "bool" and not isinstance(value, bool):
        raise ConfigError(f"{cls.__name__}.{f.name} must be true or false, got {value!r}")
    return value


_NESTED = {
    (RunConfig, "model"): ModelConfig,
    (RunConfig, "parallel"): ParallelConfig,
    (RunConfig, "train"): TrainConfig,
    (RunConfig, "emulation"): EmulationConfig,
    (RunConfig, "serve"): ServeConfig,
    (ModelConfig, "moe"): MoEConfig,
    (ParallelConfig, "topology"): TopologyConfig,
}


def _set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    cur = d
    for p in parts[:-1]:
        if p not in cur or not isinstance(cur[p], dict):
            if p in cur and cur[p] is None:
                cur[p] = {}
            else:
                raise ConfigError(f"unknown config key {key!r} (no section {p!r})")
        cur = cur[p]
    if parts[-1] not in cur and not (len(parts) >= 2 and parts[-2] in ("placement", "strategy_options")):
        raise ConfigError(f"unknown config key {key!r}")
    cur[parts[-1]] = parse_value(value)


def parse_value(value: Any) -> Any:
    """Parse a CLI string (``"2"``, ``"true"``, ``"null"``, ``"[0,1]"``) into a Python value; others pass through."""
    if not isinstance(value, str):
        return value
    import yaml

    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def serve_errors(cfg: "RunConfig") -> list:
    """Everything that makes ``cfg`` unservable, each naming the option (before any process starts)."""
    sv, m, moe, p = cfg.serve, cfg.model, cfg.model.moe, cfg.parallel
    errs = []
    if sv.variant not in SERVE_VARIANTS:
        errs.append(f"serve.variant must be one of {list(SERVE_VARIANTS)}, got {sv.variant!r}")
    from moelab.placement.lina import ROUNDING

    if sv.replica_rounding not in ROUNDING:
        errs.append(f"serve.replica_rounding must be one of {list(ROUNDING)}, got {sv.replica_rounding!r}")
    if sv.arrival not in ("poisson", "closed"):
        errs.append(f"serve.arrival must be 'poisson' or 'closed', got {sv.arrival!r}")
    for name, v, lo in (("requests", sv.requests, 1), ("batch_size", sv.batch_size, 1), ("max_pack", sv.max_pack, 1),
                        ("profile_batches", sv.profile_batches, 1), ("path_len", sv.path_len, 1)):
        if not isinstance(v, int) or v < lo:
            errs.append(f"serve.{name} must be an integer >= {lo}, got {v!r}")
    for name, v in (("rate_per_s", sv.rate_per_s), ("max_wait_ms", sv.max_wait_ms)):
        if not v > 0:
            errs.append(f"serve.{name} must be > 0, got {v!r}")
    E = moe.num_experts
    n_moe = m.n_layers if m.moe_every == 1 else m.n_layers // 2
    if isinstance(sv.path_len, int) and sv.path_len >= n_moe:
        errs.append(f"serve.path_len={sv.path_len} must be below the number of MoE layers ({n_moe})")
    for name, v in (("k_est", sv.k_est), ("k_cmp", sv.k_cmp)):
        if not isinstance(v, int) or not 1 <= v <= E:
            errs.append(f"serve.{name} must lie in 1..num_experts={E}, got {v!r}")
    if isinstance(sv.max_pack, int) and sv.max_pack * p.nproc < E:
        errs.append(f"serve.max_pack={sv.max_pack} x parallel.nproc={p.nproc} devices cannot hold {E} experts")
    if E % p.nproc:
        errs.append(f"serving places experts statically one block per rank: num_experts={E} must be divisible "
                    f"by parallel.nproc={p.nproc}")
    if moe.capacity_factor is not None:
        errs.append("serving computes every token (no drops): set model.moe.capacity_factor to null")
    if moe.top_k != 1:
        errs.append(f"serving routes top-1 (Lina's inference gate): set model.moe.top_k=1, got {moe.top_k}")
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


def _autocast_errors(t: "TrainConfig", backend: str) -> list:
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
