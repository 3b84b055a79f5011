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
(after forward, at every gradient-ready hook during backward, after sync, after step) and keeps
each category's peak over the iteration; ``mem_total_peak_bytes`` is the largest sum at one point.
"""
from __future__ import annotations

import contextlib

import torch

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
        self.reset()

    def reset(self) -> None:
        """Start a new iteration: peaks back to 0."""
        self.peaks = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0

    def current(self) -> dict:
        u = self.update
        return {"params": u.param_bytes(), "grads": u.grad_bytes(), "optim": u.optimizer_state_bytes(),
                "activations": self.live_activations}

    def sample(self) -> dict:
        now = self.current()
        for k, v in now.items():
            self.peaks[k] = max(self.peaks[k], v)
        self.peak_total = max(self.peak_total, sum(now.values()))
        return now

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
