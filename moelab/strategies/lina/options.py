"""Options of Lina's training side (``parallel.strategy_options``), checked before any process starts.

Each option, its default and its meaning (spec ``papers/lina.md`` §2.2, §2.5, §3):

- ``policy`` (default lina): ``after_backward`` (one all-reduce after backward), ``ddp_overlap`` (DDP buckets during
  backward, free overlap: THE baseline), ``fixed`` (DDP buckets released only between MoE layers), ``priority`` (whole
  buckets, strict priority), ``lina`` (+ partitioned micro-ops), ``lina_pipe`` (+ chunked all-to-all pipelined with the
  FFN), ``lina_full`` (+ expert packing)
- ``partition_bytes`` (default 30e6): S, the all-reduce micro-op size in bytes (one gradient per micro-op)
- ``coalesce_bytes`` (default 0): partitioned policies: consecutive gradients of at most this many bytes (on one group)
  share a micro-op of at most S, copied into one buffer; 0: one gradient per micro-op (the spec's §2.2; coalescing is a
  departure from it, for the many tiny norm and bias gradients)
- ``a2a_chunks`` (default 4): m, all-to-all micro-ops per all-to-all (``lina_pipe``, ``lina_full``)
- ``max_inflight`` (default 1): low-priority micro-ops in flight at once
- ``drain_inflight`` (default 0): micro-ops in flight at once during the drain after backward, where no all-to-all can
  arrive (0: ``max_inflight``, the spec's one bound throughout; else at least ``max_inflight``; more overlaps each
  call's fixed cost with the ops before it)
- ``a2a_waits_for_inflight`` (default true): an arriving all-to-all waits for the micro-op in flight (non-preemptive;
  bounded, see :mod:`moelab.strategies.lina.priority`)
- ``block_on_combine_backward`` (default true): stop launching micro-ops once a MoE layer's combine backward starts
- ``stall_ms`` (default 0): the bound of that wait in ms (0: three times the median of the last 16 micro-op times, at
  least 5 ms)
- ``launch_agreement`` (default none): ``none``: each rank's scheduler decides alone (the paper's design; its
  non-preemptive wait is bounded against the cross-rank stall); ``leader``: the first rank of a group decides every
  micro-op's launch and tells the others by a 1-element broadcast on a control group (no stall, one more small call per
  micro-op); ``plan``: every rank launches the same micro-ops in the same backward window, planned from the previous
  step's windows and op durations agreed by two small all-gathers a step (no stall; the first step reduces everything
  after backward; :mod:`moelab.strategies.lina.priority`)
- ``experts_per_device`` (default 0): q, experts packed per rank: EP over blocks of E/q contiguous ranks, each block a
  full copy, ``expert_dp`` over the copies (0: 2 for ``lina_full``, else 1)
- ``launch_jitter_ms`` (default 0): a random per-rank delay before each micro-op launch (robustness runs, spec §5 I7)
- ``pack_controller`` (default false): ``lina_full`` only: start from ``experts_per_device`` (0: 1) and let
  :mod:`.packing` double q from measured micro-op times
- ``pack_start_step`` / ``pack_every`` (default 10 / 4): the controller's first decision and its period, in steps
- ``pack_memory_mb`` (default 0): the controller doubles q only while one rank's expert parameters, gradients and Adam
  moments fit this (0: no limit)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moelab.config import ConfigError
from moelab.moe.routing import capacity_for
from moelab.placement import Placement
from moelab.registry import StrategyOptions
from moelab.strategies.lina.placement import REPLAN_TESTS, ROUNDING

POLICIES = ("after_backward", "ddp_overlap", "fixed", "priority", "lina", "lina_pipe", "lina_full")
SCHEDULED = ("fixed", "priority", "lina", "lina_pipe", "lina_full")  # policies that run the priority scheduler
PARTITIONED = ("lina", "lina_pipe", "lina_full")  # micro-ops per gradient instead of DDP buckets
PIPELINED = ("lina_pipe", "lina_full")
SERVE_VARIANTS = ("baseline", "ideal", "lina", "lina_no_estimation", "lina_no_finetune")  # Lina's inference, §2.3


class LinaOptionError(ConfigError):
    """A ``ConfigError`` naming the bad lina option."""


@dataclass(frozen=True)
class LinaOptions(StrategyOptions):
    strategy = "lina"
    error = LinaOptionError

    policy: str = field(default="lina", metadata={"choices": POLICIES})
    partition_bytes: float = 30e6
    coalesce_bytes: float = 0.0
    a2a_chunks: int = 4
    max_inflight: int = 1
    drain_inflight: int = 0
    a2a_waits_for_inflight: bool = True
    block_on_combine_backward: bool = True
    stall_ms: float = 0.0
    launch_jitter_ms: float = 0.0
    experts_per_device: int = 0
    launch_agreement: str = field(default="none", metadata={"choices": ("none", "leader", "plan")})
    pack_controller: bool = False
    pack_start_step: int = 10
    pack_every: int = 4
    pack_memory_mb: float = 0.0

    def value_errors(self) -> list:
        errs = []
        if self.max_inflight < 1:
            errs.append(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.drain_inflight < 0:
            errs.append(f"drain_inflight must be >= 0 (0: max_inflight), got {self.drain_inflight}")
        elif 0 < self.drain_inflight < self.max_inflight:
            errs.append(f"drain_inflight lifts the in-flight bound after backward: 0 (max_inflight) or >= "
                        f"max_inflight={self.max_inflight}, got {self.drain_inflight}")
        if self.a2a_chunks < 1:
            errs.append(f"a2a_chunks must be >= 1, got {self.a2a_chunks}")
        if self.experts_per_device < 0:
            errs.append(f"experts_per_device must be >= 0 (0: the policy's default), got {self.experts_per_device}")
        if self.launch_jitter_ms < 0:
            errs.append(f"launch_jitter_ms must be >= 0, got {self.launch_jitter_ms}")
        if self.stall_ms < 0:
            errs.append(f"stall_ms must be >= 0, got {self.stall_ms}")
        if self.partition_bytes <= 0:
            errs.append(f"partition_bytes must be > 0, got {self.partition_bytes}")
        if not 0 <= self.coalesce_bytes <= self.partition_bytes:
            errs.append(f"coalesce_bytes must lie in 0..partition_bytes={self.partition_bytes:g} (a packed micro-op is "
                        f"at most S), got {self.coalesce_bytes:g}")
        elif self.coalesce_bytes and not self.partitioned:
            errs.append(f"coalesce_bytes packs the micro-ops of the partitioned policies {PARTITIONED}: policy "
                        f"{self.policy!r} sends DDP buckets")
        if self.pack_start_step < 1 or self.pack_every < 1:
            errs.append(f"pack_start_step and pack_every must be >= 1 (steps), got {self.pack_start_step}, "
                        f"{self.pack_every}")
        if self.pack_memory_mb < 0:
            errs.append(f"pack_memory_mb must be >= 0 (0: no limit), got {self.pack_memory_mb}")
        if self.pack_controller and self.policy != "lina_full":
            errs.append("pack_controller times lina_full's pipelined micro-ops: set policy='lina_full' "
                        f"(got {self.policy!r})")
        return errs

    @property
    def q(self) -> int:
        """Experts packed per rank at the start (``experts_per_device``; 0 means 2 under ``lina_full``
        without the controller, else 1)."""
        return self.experts_per_device or (2 if self.policy == "lina_full" and not self.pack_controller else 1)

    @property
    def drain_bound(self) -> int:
        """Micro-ops in flight in the drain after backward (the scheduler and the simulator both use this)."""
        return self.drain_inflight or self.max_inflight

    @property
    def holds_pipelined_backward(self) -> bool:
        """A pipelined layer's backward holds the scheduler
        (:meth:`moelab.strategies.lina.priority.PriorityScheduler.hold`, built from these options: priority mode, the
        combine block on, no plan); the simulator prices it."""
        return self.pipelined and self.block_on_combine_backward and self.launch_agreement != "plan"

    @property
    def scheduled(self) -> bool:
        return self.policy in SCHEDULED

    @property
    def partitioned(self) -> bool:
        return self.policy in PARTITIONED

    @property
    def pipelined(self) -> bool:
        return self.policy in PIPELINED

    def run_errors(self, run_cfg) -> list:
        moe, p = run_cfg.model.moe, run_cfg.parallel
        errs = []
        if p.nproc < 2:
            errs.append(f"lina schedules communication between ranks: parallel.nproc must be >= 2, got {p.nproc}")
        elsize = {"float32": 4, "float64": 8}.get(run_cfg.train.dtype, 2)
        if self.partitioned and self.partition_bytes < elsize:
            errs.append(f"partition_bytes={self.partition_bytes:g} is below one {run_cfg.train.dtype} element "
                        f"({elsize} bytes)")
        if self.pipelined:
            if moe.dispatcher != "dense":
                errs.append(f"policy {self.policy!r} pipelines the dense [P, E_loc, C, h] buffer: set "
                            f"model.moe.dispatcher='dense' (got {moe.dispatcher!r})")
            cap = _capacity(run_cfg)
            if cap is not None and not 1 <= self.a2a_chunks <= cap:
                errs.append(f"a2a_chunks={self.a2a_chunks} must lie in 1..C={cap} (the capacity, the dim it cuts)")
        if self.launch_agreement == "plan" and self.policy not in SCHEDULED[1:]:
            errs.append(f"launch_agreement='plan' plans the priority scheduler's launches: policy {self.policy!r} "
                        f"has none to plan (use one of {SCHEDULED[1:]})")
        if p.placement is not None:
            errs.append("lina places experts one block per rank (or by packing): parallel.placement must be unset")
        E, N, q = moe.num_experts, p.nproc, self.q
        if q & (q - 1) or E % q:
            errs.append(f"experts_per_device={q} must be a power of two dividing model.moe.num_experts={E}")
        elif q > 1 and N % (E // q):
            errs.append(f"experts_per_device={q}: E/q = {E // q} ranks per expert block must divide parallel.nproc={N}")
        elif q == 1 and E % N:
            errs.append(f"model.moe.num_experts={E} is not divisible by parallel.nproc={N}: expert parallelism "
                        "needs the same number of experts on every rank")
        if q > 1 and moe.dispatcher != "dense":
            errs.append(f"expert packing runs the dense dispatcher inside each block: set model.moe.dispatcher='dense' "
                        f"(got {moe.dispatcher!r})")
        return errs

    def block_sizes(self, nproc: int, num_experts: int) -> list:
        """The expert blocks packing may use, in ranks, the starting one first: ``min(N, E/q)``, then (with
        the controller) halvings while a block stays whole and holds every expert evenly. Block size P
        means EP over P contiguous ranks with E/P experts each and N/P copies of every expert."""
        P = min(nproc, num_experts // self.q)
        out = [P]
        while self.pack_controller and P % 2 == 0 and num_experts % (P // 2) == 0:
            P //= 2
            out.append(P)
        return out

    @staticmethod
    def block_groups(P: int, nproc: int) -> tuple:
        """``(ep group, expert-dp group)`` of block size ``P``: the world's ``ep`` and none when a block is
        the world, else ``lina_ep{P}`` (blocks of P contiguous ranks) and ``lina_edp{P}`` (the ranks at one
        position of every block: the copies of the same experts)."""
        return ("ep", None) if P == nproc else (f"lina_ep{P}", f"lina_edp{P}")

    def placement(self, nproc: int, num_experts: int):
        """Every expert's holders at the start, global ranks: expert e on position e // (E/P) of every block."""
        P = self.block_sizes(nproc, num_experts)[0]
        if P == nproc:
            return Placement.expert_parallel(num_experts, nproc)
        q = num_experts // P
        return Placement(num_experts, nproc, tuple(tuple(b + e // q for b in range(0, nproc, P))
                                                   for e in range(num_experts)))

    def groups(self, nproc: int, num_experts: int) -> dict:
        """The process groups of every block size this run may use (:meth:`block_groups`), plus the
        control groups of ``launch_agreement: leader``."""
        out = {}
        for P in self.block_sizes(nproc, num_experts):
            if P == nproc:
                continue
            ep, edp = self.block_groups(P, nproc)
            out[ep] = [list(range(b, b + P)) for b in range(0, nproc, P)]
            out[edp] = [list(range(i, nproc, P)) for i in range(P)]
        for group, ctl in (self.control_groups(nproc, num_experts) or {}).items():
            out[ctl] = [list(range(nproc))] if group == "dp" else out[group]
        return out

    def control_groups(self, nproc: int, num_experts: int):
        """``launch_agreement: leader``: ``{scheduled group: its control group}`` (``dp``, and the expert-dp
        group of every block size), else None."""
        if self.launch_agreement != "leader":
            return None
        out = {"dp": "lina_ctl"}
        for P in self.block_sizes(nproc, num_experts):
            edp = self.block_groups(P, nproc)[1]
            if edp is not None:
                out[edp] = edp + "_ctl"
        return out


def _capacity(run_cfg):
    """C of the dense dispatcher for this run (tokens per rank), or None without a capacity factor."""
    m, moe, t = run_cfg.model, run_cfg.model.moe, run_cfg.train
    return capacity_for(t.batch_size * m.seq_len, moe.num_experts, moe.top_k, moe.capacity_factor,
                        getattr(moe, "min_capacity", 0))


@dataclass(frozen=True)
class LinaServeOptions(StrategyOptions):
    """Options of Lina's server (``serve.strategy_options`` with ``serve.strategy: lina``; spec §2.3, §4.2):
    which placement the MoE layers serve with, and Lina's two-phase estimator."""

    strategy = "lina serve"
    error = LinaOptionError

    # baseline (static EP) | ideal (balanced gate, timing only) | lina | lina_no_estimation | lina_no_finetune
    variant: str = field(default="baseline", metadata={"choices": SERVE_VARIANTS})
    path_len: int = 3  # Lp: preceding MoE layers in a path; estimation starts at MoE layer Lp
    # lina's layers before Lp: static (the paper's slower start) | actual: planned from the actual counts (phase 2
    # without an estimate)
    first_layers: str = field(default="static", metadata={"choices": ("static", "actual")})
    k_est: int = 2  # per-token experts kept from the path distribution
    k_cmp: int = 2  # top experts compared by phase 2
    # phase 2 re-plans iff: the top-k_cmp sets differ (the paper's) | load: the kept plan's busiest device exceeds
    # its estimated load by more than replan_tol
    replan_test: str = field(default="sets", metadata={"choices": REPLAN_TESTS})
    replan_tol: float = 0.1  # [choice] with replan_test=load: the busiest load's tolerated excess over the estimate's
    max_pack: int = 4  # experts per device at most
    # replicas of an expert wanting n(e) devices: floor (spec [R]) | nearest | balanced (for the busiest device)
    replica_rounding: str = field(default="floor", metadata={"choices": ROUNDING})
    profile_batches: int = 4  # training-split batches per rank traced to fit the path table

    def value_errors(self) -> list:
        errs = [f"{name} must be an integer >= 1, got {v}" for name, v in (
            ("path_len", self.path_len), ("max_pack", self.max_pack), ("profile_batches", self.profile_batches))
            if v < 1]
        if not self.replan_tol >= 0:
            errs.append(f"replan_tol must be a number >= 0, got {self.replan_tol!r}")
        return errs

    def run_errors(self, run_cfg) -> list:
        m, moe, nproc = run_cfg.model, run_cfg.model.moe, run_cfg.parallel.nproc
        E = moe.num_experts
        n_moe = m.n_layers if m.moe_every == 1 else m.n_layers // 2
        errs = []
        if self.path_len >= n_moe:
            errs.append(f"path_len={self.path_len} must be below the number of MoE layers ({n_moe})")
        errs += [f"{name} must lie in 1..num_experts={E}, got {v}" for name, v in (("k_est", self.k_est),
                                                                                  ("k_cmp", self.k_cmp))
                 if not 1 <= v <= E]
        if self.max_pack * nproc < E:
            errs.append(f"max_pack={self.max_pack} x parallel.nproc={nproc} devices cannot hold {E} experts")
        if E % nproc:
            errs.append(f"Lina's server places experts statically one block per rank: num_experts={E} must be "
                        f"divisible by parallel.nproc={nproc}")
        if moe.capacity_factor is not None:
            errs.append("Lina's server computes every token (no drops): set model.moe.capacity_factor to null")
        if moe.top_k != 1:
            errs.append(f"Lina's server routes top-1 (its inference gate): set model.moe.top_k=1, got {moe.top_k}")
        return errs
