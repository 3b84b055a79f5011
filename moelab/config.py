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
from typing import Any, ClassVar, Optional

ARCHS = ("gpt", "bert")
POSITIONS = ("learned", "alibi")


class ConfigError(ValueError):
    """A configuration that cannot work; raised before any process starts."""


# ---- a field's own rule, as field metadata: each section checks its fields (field_errors) ------------
def at_least(default, lo, *, integer: bool = True, strict: bool = False, note: str = ""):
    """A numeric field ``>= lo`` (``> lo`` when ``strict``), an integer unless ``integer`` is False; ``note``
    follows the bound in the message. A None default is allowed to stay None (the field's own meaning)."""
    return field(default=default, metadata={"min": lo, "integer": integer, "strict": strict, "note": note})


def one_of(default, choices: tuple):
    """A field whose value must be one of ``choices``."""
    return field(default=default, metadata={"choices": choices})


def _field_error(name: str, f: dataclasses.Field, v) -> Optional[str]:
    md = f.metadata
    if "choices" in md:
        return None if v in md["choices"] else f"{name} must be one of {md['choices']}, got {v!r}"
    if "min" not in md or (v is None and f.default is None):
        return None
    integer, lo, strict = md["integer"], md["min"], md["strict"]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or (integer and not isinstance(v, int)):
        return f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}"
    if not math.isfinite(v) or (v <= lo if strict else v < lo):
        return f"{name} must be {'>' if strict else '>='} {lo}{md['note']}, got {v!r}"
    return None


def field_errors(section, prefix: str) -> list:
    """Every field of a config ``section`` (and its nested sections) that breaks its own rule (metadata of
    :func:`at_least` / :func:`one_of`), each message naming the dotted option."""
    errs = []
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        if dataclasses.is_dataclass(v):
            errs += field_errors(v, f"{prefix}{f.name}.")
        else:
            err = _field_error(prefix + f.name, f, v)
            errs += [err] if err else []
    if errs:  # a section's own cross-field rules read its fields: only once they hold
        return errs
    return list(getattr(section, "own_errors", lambda: [])())


# ---- the pre-flight seam ----------------------------------------------------------------------------
# Checks that need another package (the registries of strategies, gates and dispatchers, the hardware, the
# checkpoints, the process groups) live with their owners and run as one pre-flight step,
# :func:`moelab.runtime.preflight.owner_errors`. This module, the lowest layer, does not import it: the package
# root installs it here (``moelab/__init__.py``), so every ``RunConfig.validate()`` runs it.
PREFLIGHT: list = []  # steps ``cfg -> [message]``, run by validate() once every field holds


def install_preflight(step) -> None:
    """Make ``step(cfg) -> [message]`` the pre-flight of :meth:`RunConfig.validate` (replacing any)."""
    PREFLIGHT[:] = [step]


@dataclass
class MoEConfig:
    num_experts: int = at_least(8, 1)  # experts per MoE layer (global)
    top_k: int = 2  # experts per token, 1..num_experts (gshard: 2, switch/base: 1)
    # a registered gate (moelab.moe.gates, which checks what each needs): topk (renormalized top-k softmax) |
    # gshard (top-2) | switch (top-1) | base (balanced top-1)
    gate: str = "topk"
    # None = dropless; else capacity = ceil(k*cf*T/E) per source rank
    capacity_factor: Optional[float] = at_least(None, 0, integer=False, strict=True, note=" (or null for dropless)")
    min_capacity: int = at_least(0, 0)  # lower bound of the per-expert capacity
    random_routing: bool = False  # gshard: drop the 2nd expert when 2*p2 < U(0,1)
    balance_loss_coef: float = at_least(0.01, 0, integer=False)  # weight of the GShard/Switch load-balancing loss
    z_loss_coef: float = at_least(0.0, 0, integer=False)  # weight of the router z-loss mean(logsumexp(logits)^2)
    # a registered dispatcher (moelab.moe.dispatch, which checks what each needs):
    dispatcher: str = "sparse"  # sparse (count exchange + uneven all-to-all) | dense (capacity-padded, equal splits)
    activation: str = one_of("gelu", ("gelu", "relu"))  # expert FFN activation
    expert_bias: bool = True  # biases in the expert FFN
    kernels: str = "torch"  # torch | triton | auto: router, permute/unpermute, expert GEMMs (moelab.kernels)

    def own_errors(self) -> list:
        k, E = self.top_k, self.num_experts
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= max(E, 1):
            return [f"model.moe.top_k must be an integer in 1..model.moe.num_experts={E}, got {k!r}"]
        return []


@dataclass
class ModelConfig:
    arch: str = one_of("gpt", ARCHS)  # gpt (causal LM) | bert (masked LM)
    vocab_size: int = at_least(256, 2)  # byte-level by default
    d_model: int = at_least(64, 1)
    d_ff: int = at_least(128, 1)  # expert (and dense FFN) hidden size
    n_layers: int = at_least(2, 1)
    n_heads: int = at_least(4, 1)
    seq_len: int = at_least(64, 1)
    moe_every: int = one_of(1, (1, 2))  # 1: every layer is MoE; 2: every other layer (odd layers)
    # learned: a learned absolute embedding (GPT/RoBERTa) | alibi: no embedding, attention scores biased by
    # -slope_h * |i - j| (Press et al.), which tiny byte-level masked LMs learn from without the long early
    # plateau absolute positions give them (moelab.models.transformer)
    positions: str = one_of("learned", POSITIONS)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def own_errors(self) -> list:
        """bert reserves one id for [MASK]: its vocabulary needs 3 ids at least; heads split d_model evenly."""
        errs = [f"model.vocab_size must be >= 3, got {self.vocab_size!r}"] \
            if self.arch == "bert" and self.vocab_size == 2 else []
        if self.d_model % self.n_heads != 0:
            errs.append(f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}")
        return errs


@dataclass
class TopologyConfig:
    nodes: int = at_least(1, 1)  # declared nodes; "2 nodes x 4" works on one machine
    ranks_per_node: Optional[int] = at_least(None, 1)  # None: nproc / nodes


@dataclass
class EmulationConfig:
    """Link emulation: a collective takes at least the time the declared links would need."""

    enabled: bool = False
    intra_bw_GBps: float = at_least(10.0, 0, integer=False, strict=True)  # intra-node bandwidth per rank, GB/s
    intra_latency_us: float = at_least(5.0, 0, integer=False)
    inter_bw_GBps: float = at_least(1.0, 0, integer=False, strict=True)  # inter-node bandwidth per rank, GB/s
    inter_latency_us: float = at_least(20.0, 0, integer=False)
    # an all-to-all and an all-reduce moving on one port at once each get 1/gamma of their fair share
    # (NCCL's channel/SM contention, Lina's gamma; moelab.comm.links); 1 = fair sharing
    interference_gamma: float = at_least(1.0, 1, integer=False)
    # the ranks' compute threads run their iterations (or serving) at SCHED_IDLE, so a communication
    # thread's call does not wait for a core behind compute, as a NIC does not wait for the GPU
    # (moelab.comm.cpu_priority)
    compute_yields: bool = False


@dataclass
class ParallelConfig:
    nproc: int = at_least(2, 1)  # ranks (processes)
    backend: str = one_of("auto", ("auto", "gloo", "nccl"))  # auto: nccl on GPU, gloo on CPU
    strategy: str = "ep"  # registered strategy name
    strategy_options: dict = field(default_factory=dict)  # options of that strategy (it validates them)
    # {axis: technique}, one per axis (moelab.techniques): the run's strategy is their composition, named
    # by joining them with "+" (set by upgrade; strategy_options then keyed by technique)
    techniques: dict = field(default_factory=dict)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    # expert -> [owner, replica, ...] ; None means plain expert parallelism
    placement: Optional[dict] = None
    # after_backward (one flat all-reduce after backward) | ddp_overlap (DDP buckets during backward)
    grad_sync: str = "after_backward"
    # ddp_overlap: bucket size in MiB (PyTorch DDP's default)
    bucket_mb: float = at_least(25.0, 0, integer=False, strict=True)

    @classmethod
    def upgrade(cls, d: dict) -> dict:
        """``techniques`` given: ``strategy`` becomes their composition (``ep`` or that name before)."""
        t = d.get("techniques")
        if not t:
            return d
        if not isinstance(t, dict):
            raise ConfigError(f"parallel.techniques must map an axis to a technique, got {t!r}")
        name = "+".join(str(v) for v in t.values())
        if d.get("strategy", "ep") not in ("ep", name):
            raise ConfigError(f"parallel.techniques {t} and parallel.strategy {d['strategy']!r} both name the "
                              f"run's system: give one (a strategy is a preset of techniques)")
        return {**d, "strategy": name}

    def own_errors(self) -> list:
        """The declared topology holds exactly ``nproc`` ranks."""
        topo = self.topology
        rpn = topo.ranks_per_node if topo.ranks_per_node is not None else self.nproc // topo.nodes
        if rpn < 1 or topo.nodes * rpn != self.nproc:
            return [f"topology {topo.nodes} nodes x {topo.ranks_per_node or '?'} ranks does not fit nproc={self.nproc}"]
        return []


@dataclass
class TrainConfig:
    iters: int = at_least(20, 1)
    batch_size: int = at_least(4, 1)  # sequences per rank per iteration
    lr: float = at_least(1e-3, 0, integer=False, strict=True)
    seed: int = at_least(0, 0)
    dataset: str = "pydocs"  # pydocs | pytests | pytext (byte-level text of the Python installation) | random
    dtype: str = one_of("float32", ("float32", "float64"))
    autocast: str = "none"  # none | bf16: forward under torch.autocast(bfloat16), fp32 weights and optimizer
    threads_per_rank: int = at_least(1, 1)
    timeout_s: float = at_least(600.0, 0, integer=False, strict=True)  # the launcher kills the run after this
    trace: bool = True  # write a per-rank Chrome trace
    # iterations each trace keeps (evenly spaced, first and last); 0 = all. Not in the run id
    trace_iters: int = at_least(50, 0)
    fault_rank: Optional[int] = None  # testing aid: this rank raises at fault_iter
    fault_iter: int = at_least(0, 0)
    eval_every: int = at_least(0, 0)  # evaluate on held-out windows after every n-th iteration (0: never)
    eval_batches: int = at_least(2, 1)  # held-out batches (of batch_size per rank) per evaluation
    checkpoint_every: int = at_least(0, 0)  # write a checkpoint into the run folder every n iterations (0: never)
    resume_from: Optional[str] = None  # a checkpoint folder (or a run folder: its latest) to continue from
    # objective (moelab.models.tasks): lm (the arch's own: next byte / masked LM) | span (bert: T5-like
    # span corruption) | acceptability | topic | paraphrase (bert: text classification) | digits (bert
    # blocks on image patches); classification runs report eval_acc (and eval_top2_acc)
    task: str = "lm"
    # topic: the number of (largest) pydoc topics used as classes; paraphrase: drawn from
    task_classes: int = at_least(4, 2)
    patch_size: int = at_least(2, 1)  # digits: square patch side in pixels (1, 2, 4 or 8) of the 8x8 images
    # fine-tune: a checkpoint (or run folder) to copy parameters from; task heads it lacks start fresh
    init_from: Optional[str] = None


@dataclass
class ServeConfig:
    """Inference serving (``moelab serve``, :mod:`moelab.runtime.serve`): what every server has - requests,
    arrivals, batching - and the strategy whose server answers them. The server's own settings are its
    ``strategy_options``, declared and checked by that strategy (``Strategy.serve_options``: a placement
    variant, an estimator), before any process starts (:func:`moelab.runtime.preflight.serve_errors`); the
    numbers here check themselves (field metadata) with every other section."""

    strategy: Optional[str] = None  # the registered strategy whose server answers (one declaring ``serve``)
    strategy_options: dict = field(default_factory=dict)  # that server's options (its ``serve_options``)
    requests: int = at_least(32, 1)  # requests drawn (held-out windows of model.seq_len tokens)
    # poisson (rate_per_s) | closed (batch_size clients, each sends again once served)
    arrival: str = one_of("poisson", ("poisson", "closed"))
    rate_per_s: float = at_least(100.0, 0, integer=False, strict=True)
    batch_size: int = at_least(8, 1)  # B: sequences per batch over all ranks
    # a batch leaves when full or when its first request waited this long
    max_wait_ms: float = at_least(10.0, 0, integer=False, strict=True)
    requests_file: Optional[str] = None  # CSV id,arrival_s,text instead of drawn requests; malformed rows rejected

    # Settings older versions kept on this section itself, with their defaults then: a stored run's config still
    # loads (from_dict moves the ones that differ into strategy_options and drops the rest, so a training run
    # keeps its id). They are the server's options now.
    MOVED: ClassVar[dict] = {"variant": "baseline", "path_len": 3, "first_layers": "static", "k_est": 2, "k_cmp": 2,
                             "replan_test": "sets", "replan_tol": 0.1, "max_pack": 4, "replica_rounding": "floor",
                             "profile_batches": 4}

    @classmethod
    def upgrade(cls, d: dict) -> dict:
        """``d`` with the :data:`MOVED` keys of an older config moved into ``strategy_options``."""
        old = {k: d[k] for k in cls.MOVED if k in d}
        if not old:
            return d
        d = {k: v for k, v in d.items() if k not in old}
        moved = {k: v for k, v in old.items() if v != cls.MOVED[k]}
        if moved:
            d["strategy_options"] = {**moved, **dict(d.get("strategy_options") or {})}
        return d


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
        del d["parallel"]["techniques"]  # the strategy names them ("lina+lsh_moe"): one id for either spelling
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
    def own_errors(self) -> list:
        """Rules across sections: the faulty rank is one of the run's."""
        t, n = self.train, self.parallel.nproc
        if t.fault_rank is not None and not 0 <= t.fault_rank < n:
            return [f"train.fault_rank={t.fault_rank} is not a rank of nproc={n}"]
        return []

    def validate(self) -> "RunConfig":
        """Raise ConfigError for a config that cannot work, every complaint at once: each section's fields
        (:func:`field_errors`); once they hold, the owners' checks (the :data:`PREFLIGHT` step,
        :func:`moelab.runtime.preflight.owner_errors`). Cheap; runs before any process starts."""
        errs = field_errors(self, "")
        for step in PREFLIGHT if not errs else ():  # later checks divide by the fields' numbers
            errs += step(self)
        if errs:
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(errs))
        return self


def _from_dict(cls, d: dict):
    if not isinstance(d, dict):
        raise ConfigError(f"expected a mapping for {cls.__name__}, got {type(d).__name__}")
    d = cls.upgrade(d) if hasattr(cls, "upgrade") else d
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(d) - set(fields)
    if unknown:
        raise ConfigError(f"unknown field(s) for {cls.__name__}: {sorted(unknown)}; known: {sorted(fields)}")
    kw = {}
    for name, value in d.items():
        sub = _NESTED.get((cls, name))
        nested = sub is not None and value is not None
        kw[name] = _from_dict(sub, value) if nested else _coerce(cls, fields[name], value)
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
    if parts[-1] not in cur and not (len(parts) >= 2 and parts[-2] in ("placement", "strategy_options", "techniques")):
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
