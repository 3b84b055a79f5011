"""The training runtime: one rank's loop and the machinery around it.

- :mod:`.train` - the :class:`~.train.Trainer` loop (batch, forward, backward, update, metrics,
  evaluation on held-out windows, checkpoints, ``plans.jsonl``);
- :mod:`.update` - the update seam: gradient sync + optimizer as a swappable :class:`~.update.Update`
  with lifecycle hooks (``before_forward``, ``before_backward``, per-parameter ``on_grad_ready``
  during backward, ``sync``, ``step``, ``zero_grad``) and memory by category from real storages;
  ``parallel.grad_sync`` picks today's all-reduce after backward or DDP's buckets during backward;
- :mod:`.memory` - storage-aware live memory accounting and per-iteration peaks;
- :mod:`.cpu_priority` - ``emulation.compute_yields``: compute threads at SCHED_IDLE during the iterations,
  so communication threads do not wait for a core on a host the ranks share;
- :mod:`.checkpoint` - atomic checkpoints, experts stored per global id (resume at another EP size);
- :mod:`.launch`, :mod:`.worker`, :mod:`.results`, :mod:`.progress` - torchrun supervision, the
  per-rank entry point, the results store.

How a strategy plugs in an update: subclass :class:`~.update.Update` (or
:class:`~.update.DataParallelUpdate`), override the hooks it needs and ``param_tensors`` /
``grad_tensors`` for buffers it owns (so memory is measured), and register it with
its ``moelab.registry.Strategy`` (``update=cls``); the Trainer calls the hooks, nothing else changes.
"""
