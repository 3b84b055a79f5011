"""The update step of an iteration as a swappable object: gradient synchronisation + optimizer.

Lifecycle (the :class:`~moelab.runtime.train.Trainer` calls these in order every iteration):
``before_forward()`` -> forward -> ``before_backward()`` -> backward, during which
``on_grad_ready(p)`` runs for each parameter as soon as its gradient is accumulated (a
``register_post_accumulate_grad_hook``) -> ``sync()`` -> ``step()`` -> ``zero_grad()``. The hooks
are the seams an update needs to overlap communication with backward (DDP buckets, Lina's
prioritised gradient sync) or to manage a parameter lifecycle (ZeRO-3, FSSDP).

One optimizer semantics: every parameter takes an optimizer step every iteration. An expert that
received no token on this rank (a stack whose slots all got no rows, so autograd never reached it)
gets a zero gradient, exactly as its slice of the stacked parameter does in the single-process run,
so Adam's moments and step count move identically in EP and in the reference.

Updates here:

- :class:`DataParallelUpdate` (``parallel.grad_sync: after_backward``): after backward, the dense
  grads in one flat all-reduce (SUM, the loss being scaled by 1/N) over ``dp``, replicated experts'
  grads summed over their holders, then Adam on every local parameter.
- :class:`OverlappedDataParallelUpdate` (``parallel.grad_sync: ddp_overlap``): PyTorch DDP's
  schedule, what a user of ``DistributedDataParallel`` runs: dense params in buckets of
  ``parallel.bucket_mb`` MiB, the first one at most DDP's 1 MiB (reverse parameter order, as DDP
  fills them, since backward produces the last parameters' grads first); a bucket is all-reduced from
  the gradient-ready hook of its last parameter, *during* backward, buckets launched in index order on
  every rank.

Strategies that change *how parameters and their optimizer state live* (ZeRO-1/2/3, FSSDP, Lina)
provide another ``Update`` in their :class:`~moelab.registry.Strategy` (``update=``).

Memory (:mod:`moelab.runtime.memory`): an update reports what it holds by category from real
storages (``param_tensors``, ``grad_tensors``, ``optimizer_tensors``); ``self.memory`` samples them
at the loop's points and at every gradient-ready hook and keeps the iteration's peaks.
"""
from __future__ import annotations

import contextlib

import torch

from moelab.moe.sync import sync_dense_grads, sync_packed_grads, sync_replica_grads
from moelab.registry import get_update, known_strategies
from moelab.runtime.memory import MemoryMeter, storage_bytes


class Update:
    """Interface: the lifecycle hooks above, ``step()``, ``zero_grad()``, and memory by category.

    Checkpoints (:mod:`moelab.runtime.checkpoint`) save the model, one Adam optimizer's state per
    parameter and the placement; an update whose own state decides what a later iteration does (a load
    window, an iteration counter) says so with ``checkpoint_ready = True`` and the two hooks
    :meth:`checkpoint_state` / :meth:`restore_state`. Strategies' updates without it are refused
    checkpoints before launch."""

    checkpoint_ready = False  # a strategy's update opts in in its own class body (not inherited)
    saves_params = False  # True: checkpoint_state holds the rank's parameters and Adam state too (a layout the
    # core's by-name / by-expert files cannot express, e.g. tensor-parallel shards); resumable on the same layout only

    def __init__(self, model, comm, cfg):
        self.model, self.comm, self.cfg = model, comm, cfg
        self.memory = MemoryMeter(self)
        self._params = list(model.parameters())  # fixed for the run; walking the module tree is slow
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                            for p in self._params if p.requires_grad]

    def checkpoint_state(self) -> dict:
        """This rank's update state a resumed run needs to continue exactly (picklable)."""
        return {}

    def restore_state(self, state: dict) -> None:
        """Take back :meth:`checkpoint_state` (same world size)."""

    def refresh_params(self) -> None:
        """The model's parameter objects changed (a migration swapped an expert stack,
        :meth:`moelab.moe.layer.MoELayer.set_placement`): hook the gradient-ready callbacks onto the
        live ones (the optimizer's entries are moved by the migration itself)."""
        for h in self._grad_hooks:
            h.remove()
        self._params = list(self.model.parameters())
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                            for p in self._params if p.requires_grad]

    def _grad_ready(self, p) -> None:
        self.on_grad_ready(p)
        self.memory.grad_ready(p)

    # ---- lifecycle hooks -----------------------------------------------------------------------
    def before_forward(self) -> None:
        """Hook for strategies that gather parameters before the forward pass (ZeRO-3)."""

    def before_backward(self) -> None:
        """Called right before ``loss.backward()``: reset per-backward state (buckets, schedules)."""

    def on_grad_ready(self, p) -> None:
        """``p.grad`` has just been accumulated during backward (a post-accumulate-grad hook)."""

    def sync(self) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def resident_params(self):
        """``with update.resident_params() as model: ...`` - every parameter resident (evaluation). A
        collective where parameters are sharded (ZeRO-3 gathers them: its ``full_params``)."""
        yield self.model

    # ---- memory by category (live storages) ----------------------------------------------------
    def param_tensors(self) -> list:
        return self._params

    def grad_tensors(self) -> list:
        return [p.grad for p in self._params if p.grad is not None]

    def optimizer_tensors(self) -> list:
        opt = getattr(self, "optimizer", None)
        if opt is None:
            return []
        return [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]

    def param_bytes(self) -> int:
        return storage_bytes(self.param_tensors())

    def grad_bytes(self) -> int:
        return storage_bytes(self.grad_tensors())

    def optimizer_state_bytes(self) -> int:
        return storage_bytes(self.optimizer_tensors())


def fill_missing_grads(params) -> None:
    """A parameter autograd never reached this iteration gets a zero gradient (one optimizer
    semantics: it still takes its Adam step, as its slice does in the single-process run)."""
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


class DataParallelUpdate(Update):
    def __init__(self, model, comm, cfg):
        super().__init__(model, comm, cfg)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr)

    def sync(self) -> None:
        sync_dense_grads(self.model.dense_parameters(), self.comm)
        self._sync_experts()

    def _sync_experts(self) -> None:
        fill_missing_grads(self.model.expert_parameters())
        for layer in self.model.moe_layers():
            sync_replica_grads(layer, self.comm)
            sync_packed_grads(layer, self.comm)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


DDP_FIRST_BUCKET_BYTES = 2**20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES: DDP's first bucket (default caps)


def bucket_groups(nbytes, cap_bytes: float) -> list:
    """DDP's bucket rule on sizes in issue order: ``[[indices of bucket 0], ...]``, a bucket closed once
    it reaches its cap (an item larger than the cap gets a bucket of its own). The first bucket's cap
    is DDP's 1 MiB (or ``cap_bytes`` if smaller), so the first gradients of backward go out early, as
    with PyTorch's defaults. The simulator prices Lina's buckets with the same rule."""
    buckets, cur, size = [], [], 0
    cap = min(DDP_FIRST_BUCKET_BYTES, cap_bytes)
    for i, n in enumerate(nbytes):
        cur.append(i)
        size += n
        if size >= cap:
            buckets.append(cur)
            cur, size, cap = [], 0, cap_bytes
    if cur:
        buckets.append(cur)
    return buckets


def make_buckets(params, cap_bytes: float) -> list:
    """DDP's bucketing: parameters in reverse order (backward produces the last ones' grads first),
    grouped by :func:`bucket_groups`."""
    rev = list(reversed(list(params)))
    return [[rev[i] for i in b] for b in bucket_groups([p.numel() * p.element_size() for p in rev], cap_bytes)]


class OverlappedDataParallelUpdate(DataParallelUpdate):
    """Dense grads all-reduced in buckets from the gradient-ready hooks, during backward (DDP)."""

    group = "dp"

    def __init__(self, model, comm, cfg):
        super().__init__(model, comm, cfg)
        dense = [p for p in model.dense_parameters() if p.requires_grad]
        self.buckets = make_buckets(dense, cfg.parallel.bucket_mb * 2**20)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.before_backward()

    def before_backward(self) -> None:
        self._ready = [set() for _ in self.buckets]
        self._next = 0  # buckets are launched in index order on every rank (collectives must pair)
        self._pending: list = []  # (bucket index, flat buffer, handle)

    def on_grad_ready(self, p) -> None:
        i = self._bucket_of.get(id(p))
        if i is None or self.comm.world_size == 1:
            return
        self._ready[i].add(id(p))
        while self._next < len(self.buckets) and len(self._ready[self._next]) == len(self.buckets[self._next]):
            self._launch(self._next)

    def _launch(self, i: int) -> None:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.buckets[i]])
        with self.comm.rec.tagged(phase="grad_sync", bucket=i):  # issued now, waited for in sync()
            handle = self.comm.all_reduce_(flat, group=self.group, async_op=True)
        self._pending.append((i, flat, handle))
        self._next = i + 1
        self.memory.sample()  # the bucket's flat buffer is gradient memory until sync

    def grad_tensors(self) -> list:
        return super().grad_tensors() + [flat for _, flat, _ in self._pending]

    def sync(self) -> None:
        if self.comm.world_size > 1:
            while self._next < len(self.buckets):  # buckets holding a parameter backward never reached
                self._launch(self._next)
            for i, flat, handle in self._pending:  # in bucket order on every rank
                handle.wait()
                self._unpack(i, flat)
        self._sync_experts()
        self.before_backward()

    def _unpack(self, i: int, flat) -> None:
        """Bucket ``i``'s reduced flat buffer back into its parameters' gradients."""
        off = 0
        for p in self.buckets[i]:
            n = p.numel()
            p.grad = flat[off:off + n].view_as(p).clone()
            off += n


GRAD_SYNCS = {"after_backward": DataParallelUpdate, "ddp_overlap": OverlappedDataParallelUpdate}


def update_errors(cfg) -> list:
    """``parallel.grad_sync`` names a data-parallel update (:data:`GRAD_SYNCS`, the one list of them); a strategy
    that brings its own update leaves it at the default, and checkpoints only with an update that saves its
    state."""
    p, t = cfg.parallel, cfg.train
    if p.grad_sync not in GRAD_SYNCS:
        return [f"parallel.grad_sync must be one of {tuple(GRAD_SYNCS)}, got {p.grad_sync!r}"]
    if p.strategy not in known_strategies() or p.strategy == "ep" or get_update(p.strategy) is None:
        return []
    errs = []
    if p.grad_sync != "after_backward":
        errs.append(f"parallel.grad_sync={p.grad_sync!r} chooses the data-parallel update; strategy "
                    f"{p.strategy!r} brings its own gradient sync: leave it at 'after_backward'")
    if (t.checkpoint_every or t.resume_from) and not vars(get_update(p.strategy)).get("checkpoint_ready"):
        errs.append(f"train.checkpoint_every / train.resume_from: checkpoints cover the data-parallel "
                    f"updates and the strategies whose update saves its own state; strategy "
                    f"{p.strategy!r} brings its own update, not yet checkpointed")
    return errs
