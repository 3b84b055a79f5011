"""Memory by category, measured from the live tensors an iteration really holds.

Why storage-aware: ZeRO's parameters are views into one flat buffer, a stacked expert's slots
share one storage, a saved activation is often a view of another; counting ``numel`` per tensor
would count such bytes several times. Every category therefore sums the bytes of the *distinct
storages* its tensors live in (a released storage, resized to 0 as ZeRO-3 does, counts 0).

Categories (per rank):

- ``params``: the storages of the model's parameters plus any the update holds (ZeRO's shard),
  so gathered shards and replicas count while they are resident;
- ``grads``: ``p.grad`` plus the update's own gradient buffers (buckets, flat shards);
- ``optim``: the optimizer's state tensors;
- ``activations``: the storages autograd saved for backward, minus parameter storages. They are
  tracked *live*: the saved-tensor pack hook counts a storage when it is first saved, and the
  packed handle's finaliser uncounts it when autograd frees the last reference (during backward),
  so the value falls back to 0 after backward.

:class:`MemoryMeter` samples all four at the points the training loop and the update choose
(before and after forward, at every gradient-ready hook during backward, after sync, after step)
and keeps each category's peak over the iteration; ``mem_total_peak_bytes`` is the largest sum at
one point. During backward only gradients (and saved activations, which only fall) change, so the
hooks update the gradient bytes incrementally; a full pass costs ~0.3 ms on the quickstart model.

Before a run, :func:`fits_memory` refuses a config whose CPU ranks cannot fit this machine (a lower
bound from parameter counts), so an oversized model or preset fails with a message, not an OOM kill.
"""
from __future__ import annotations

import contextlib
import os

import torch

from moelab.config import ConfigError, RunConfig
from moelab.models.params import count_params

CATEGORIES = ("params", "grads", "optim", "activations")


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries are skipped)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


class _Saved:
    """What the pack hook hands autograd: the tensor, plus a finaliser that uncounts its storage."""

    __slots__ = ("t", "key", "meter")

    def __init__(self, t, key, meter):
        self.t, self.key, self.meter = t, key, meter

    def __del__(self):
        if self.key is not None:
            self.meter._release(self.key)


class MemoryMeter:
    """Per-iteration peaks of the four categories of one :class:`~moelab.runtime.update.Update`."""

    def __init__(self, update):
        self.update = update
        self.live_activations = 0
        self._refs: dict = {}  # storage pointer -> (saved handles alive, bytes)
        self._param_ptrs: set = set()
        self._backward = None  # (values, grad storages seen) while hooks sample incrementally
        self._optim = None  # optimizer-state bytes at the last step
        self.reset()

    def reset(self) -> None:
        """Start a new iteration: peaks back to 0."""
        self.peaks = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0

    def current(self, optim: bool = True) -> dict:
        u = self.update
        if optim or self._optim is None:
            self._optim = u.optimizer_state_bytes()
        return {"params": u.param_bytes(), "grads": u.grad_bytes(), "optim": self._optim,
                "activations": self.live_activations}

    def sample(self, optim: bool = False) -> dict:
        """Measure every category now (a full pass over the update's tensors). Optimizer state
        changes only in ``step()``: it is re-measured with ``optim=True`` (the loop does after the step)."""
        now = self.current(optim)
        self._note(now)
        self._backward = None  # the next gradient-ready hook starts a fresh pass
        return now

    def _note(self, now: dict) -> None:
        for k, v in now.items():
            self.peaks[k] = max(self.peaks[k], v)
        self.peak_total = max(self.peak_total, sum(now.values()))

    def grad_ready(self, p) -> None:
        """At a gradient-ready hook. The first hook after a full sample measures everything (ZeRO-3
        has just re-gathered); later ones only add ``p.grad``'s storage if it is new, O(1) per
        parameter instead of a pass over the model. An update that allocates other buffers during
        backward (DDP's buckets) calls :meth:`sample` when it does."""
        if self._backward is None:
            now = self.current(optim=False)
            seen = {g.untyped_storage().data_ptr() for g in self.update.grad_tensors() if g is not None}
            self._backward = (now, seen)
        else:
            now, seen = self._backward
            g = p.grad
            if g is not None and g.untyped_storage().data_ptr() not in seen:
                seen.add(g.untyped_storage().data_ptr())
                now["grads"] += g.untyped_storage().nbytes()
        now["activations"] = self.live_activations
        self._note(now)

    # ---- saved activations ---------------------------------------------------------------------
    @contextlib.contextmanager
    def saving(self):
        """Around the forward pass: count what autograd saves for backward (live, storage-aware)."""
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.update.param_tensors()}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t):
        s = t.untyped_storage()
        key = s.data_ptr()
        t = t.detach()  # an output saved by its own node would otherwise form a cycle the GC cannot see
        if key in self._param_ptrs or s.nbytes() == 0:
            return _Saved(t, None, self)
        n, size = self._refs.get(key, (0, s.nbytes()))
        if n == 0:
            self.live_activations += size
        self._refs[key] = (n + 1, size)
        self.peaks["activations"] = max(self.peaks["activations"], self.live_activations)
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(saved):
        return saved.t

    def _release(self, key) -> None:
        n, size = self._refs[key]
        if n == 1:
            del self._refs[key]
            self.live_activations -= size
        else:
            self._refs[key] = (n - 1, size)


# ---- before a run: will it fit this machine? -------------------------------------------------------
def run_bytes_per_rank(cfg: RunConfig) -> int:
    """A lower bound of one rank's memory when ``cfg`` runs for real: dense parameters on every
    rank, its share of the experts, each with gradient and two Adam moments (fp32 state), plus the
    logits of one batch. Used to refuse a run that cannot fit before any process starts."""
    m, N = cfg.model, cfg.parallel.nproc
    p = count_params(m)
    expert = p["expert"]
    eb = getattr(torch, cfg.train.dtype).itemsize
    per_rank = (p["total"] - expert) + expert // max(N, 1)
    logits = cfg.train.batch_size * m.seq_len * m.vocab_size * eb
    return per_rank * (2 * eb + 8) + logits


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    """Bytes the host can still give out without swapping: ``MemAvailable`` (page cache it may drop counts as
    free), else the free pages where ``/proc/meminfo`` is absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def free_memory_bytes(device=None, sharers: int = 1) -> int:
    """What one rank may still allocate: its CUDA device's free memory, or on a CPU the host's available
    memory split evenly over the ``sharers`` ranks that run on this host (they draw from one pool)."""
    if sharers < 1:
        raise ValueError(f"sharers must be >= 1, got {sharers}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_memory() // int(sharers)


def fits_memory(cfg: RunConfig, nproc: int | None = None, memory: int | None = None) -> None:
    """ConfigError when ``nproc`` ranks of ``cfg`` on this machine need more than 80 % of its memory."""
    nproc = nproc or cfg.parallel.nproc
    need, have = nproc * run_bytes_per_rank(cfg), memory or physical_memory()
    if need > 0.8 * have:
        raise ConfigError(f"{cfg.name}: {nproc} ranks need at least {need / 2**30:.1f} GiB (parameters, gradients, "
                          f"Adam state, logits) but this machine has {have / 2**30:.1f} GiB: use a smaller "
                          "preset scale (--scale) or fewer ranks")
