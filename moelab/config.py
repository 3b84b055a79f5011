"""One config object for a run: model, MoE layer, parallel layout, training, emulation.

Every notebook parameter and CLI ``--set key=value`` maps onto a dotted field of :class:`RunConfig`.
``validate`` is called before any process starts, so a config that cannot work fails with a clear
message instead of a hang or a traceback on some rank.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
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
    # (moelab.comm.cpu_priority)
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
    path_len: int = 3  # Lp: preceding MoE layers in a path; estimation starts at MoE layer Lp
    first_layers: str = "static"  # lina's layers before Lp: static (the paper's slower start) | actual: planned from the actual counts (phase 2 without an estimate)
    k_est: int = 2  # per-token experts kept from the path distribution
    k_cmp: int = 2  # top experts compared by phase 2
    replan_test: str = "sets"  # phase 2 re-plans iff: the top-k_cmp sets differ (the paper's) | load: the kept plan's busiest device exceeds its estimated load by more than replan_tol
    replan_tol: float = 0.1  # [choice] with replan_test=load: the busiest load's tolerated excess over the estimate's
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
        """Raise ConfigError for a config that cannot work (:mod:`moelab.runtime.preflight`, every complaint at
        once). Cheap; runs before any process starts."""
        from moelab.runtime.preflight import config_errors

        errs = config_errors(self)
        if errs:
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(errs))
        return self

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
