"""Lina's gradient synchronisation: DDP buckets or per-gradient micro-ops through the priority scheduler.

``policy`` (:mod:`.options`) picks the update:

- ``after_backward``, ``ddp_overlap``: the core's updates (:mod:`moelab.runtime.update`), unchanged;
- ``fixed``, ``priority``: DDP's buckets (``parallel.bucket_mb``, reverse parameter order), each a
  low-priority op of a :class:`moelab.strategies.lina.priority.PriorityScheduler` (``fixed``: released between
  MoE layers; ``priority``: strict priority, whole buckets);
- ``lina``, ``lina_pipe``, ``lina_full``: every dense gradient cut into views of at most
  ``partition_bytes`` (:func:`partition`), all-reduced in place, one gradient per micro-op (with
  ``coalesce_bytes``, runs of small gradients share one, :func:`micro_op_plan`).

Packed experts (``experts_per_device`` > 1) are replicated over ``expert_dp``: with the partitioned
policies their gradients (every copy's partial sum, reduced over the copies) join the same queue from
the same gradient-ready hook as the dense ones, during backward (spec §2.5 item 1); the bucketed
policies reduce them after backward, as the baseline does. With ``pack_controller`` the block shrinks
during the run (:mod:`.packing`, before a forward).

Micro-ops are queued in one fixed order on every rank - reverse parameter order, a gradient's
micro-ops once it and every gradient before it in that order are ready - so all ranks issue the same
sequence on ``dp`` and ``expert_dp`` even if their autograd finished gradients in another order (spec
§6.16). The loss is already scaled by 1/N: the all-reduce is a SUM, nothing is divided afterwards.
"""
from __future__ import annotations

from moelab.moe.sync import packed_expert_params, sync_replica_grads
from moelab.registry import get
from moelab.runtime.update import GRAD_SYNCS, OverlappedDataParallelUpdate, fill_missing_grads
from moelab.strategies.lina.packing import PackingController
from moelab.strategies.lina.priority import LowOp, PriorityScheduler


def partition(numel: int, element_size: int, max_bytes: float) -> list:
    """``[(start, stop), ...]``: consecutive element ranges of one flat gradient, each at most
    ``max_bytes`` (at least one element), covering ``0..numel`` exactly."""
    n = max(1, int(max_bytes) // element_size)
    return [(a, min(a + n, numel)) for a in range(0, numel, n)]


def micro_op_plan(sizes, groups, max_bytes: float, coalesce_bytes: float = 0.0) -> list:
    """The micro-ops of one step, in issue order: ``[((param index, start, stop), ...), ...]`` over
    gradients ``sizes[i] = (numel, element size)`` in queue order, all-reduced on ``groups[i]``.

    Each gradient is cut by :func:`partition` into micro-ops of one gradient each (the spec's design);
    with ``coalesce_bytes`` > 0, a run of consecutive gradients of at most that many bytes each, on one
    group, shares a micro-op while the run stays within ``max_bytes`` (the paper's "each micro-op is
    uniform in size", for gradients far below S: norms, biases). A micro-op can launch once its last
    gradient is ready."""
    ops: list = []
    pack: list = []
    pack_bytes = 0
    for i, (numel, es) in enumerate(sizes):
        nbytes = numel * es
        if 0 < nbytes <= min(coalesce_bytes, max_bytes):
            if pack and (groups[pack[-1][0]] != groups[i] or pack_bytes + nbytes > max_bytes):
                ops.append(tuple(pack))
                pack, pack_bytes = [], 0
            pack.append((i, 0, numel))
            pack_bytes += nbytes
            continue
        if pack:
            ops.append(tuple(pack))
            pack, pack_bytes = [], 0
        ops += [((i, a, b),) for a, b in partition(numel, es, max_bytes)]
    if pack:
        ops.append(tuple(pack))
    return ops


class LinaUpdate(OverlappedDataParallelUpdate):
    """The scheduled policies (``fixed``, ``priority``, ``lina*``)."""

    checkpoint_ready = True  # its state: the iteration and the packing controller's block

    def __init__(self, model, comm, cfg):
        self.opts = get("lina").bind(cfg)
        super().__init__(model, comm, cfg)
        o = self.opts
        self.sched = PriorityScheduler(
            comm, mode="fixed" if o.policy == "fixed" else "priority", max_inflight=o.max_inflight,
            waits_for_inflight=o.a2a_waits_for_inflight, block_on_imminent=o.block_on_combine_backward,
            stall_s=o.stall_ms / 1e3 if o.stall_ms else None, jitter_s=o.launch_jitter_ms / 1e3,
            seed=cfg.train.seed * 1009 + comm.rank,
            agreement=o.control_groups(comm.world_size, cfg.model.moe.num_experts),
            plan=o.launch_agreement == "plan", drain_inflight=o.drain_bound)
        comm.scheduler = self.sched
        self.iteration = 0
        self.packing = None
        if o.pack_controller:
            self.packing = PackingController(o, model, comm)
        self._order_params()
        self.micro_ops: list = []  # this step's micro-ops ((param index, start, stop), ...), in submission order
        self._packs: list = []  # this step's coalesced micro-ops and their buffers
        self.last_micro_ops: list = []  # the last synchronised step's
        self.before_backward()

    def _order_params(self) -> None:
        """``order``: the gradients the hooks submit, in reverse parameter order - the dense ones (on ``dp``)
        and, for the partitioned policies, packed experts' (on their layer's ``expert_dp``)."""
        packed = {id(p): layer.expert_dp_group for layer in self.model.moe_layers() for p in packed_expert_params(layer)
                  } if self.opts.partitioned else {}
        params = [p for p in self.model.parameters() if p.requires_grad and
                  (id(p) in packed or not getattr(p, "moelab_expert", False))]
        self.order = list(reversed(params))
        self._group_of = [packed.get(id(p), self.group) for p in self.order]
        self._pos = {id(p): i for i, p in enumerate(self.order)}
        self._release: dict = {}  # the last gradient of a micro-op -> the micro-ops it completes
        if self.opts.partitioned:
            o = self.opts
            for op in micro_op_plan([(p.numel(), p.element_size()) for p in self.order], self._group_of,
                                    o.partition_bytes, o.coalesce_bytes):
                self._release.setdefault(op[-1][0], []).append(op)

    def refresh_params(self) -> None:
        super().refresh_params()
        self._order_params()  # the packing controller swapped the expert stacks and their groups

    def before_forward(self) -> None:
        super().before_forward()
        if self.packing is not None:
            entry = self.packing.at_step(self.iteration, self.optimizer)
            if entry is not None:
                for layer in self.model.moe_layers():
                    layer.pack_decision = entry
                if entry["decision"] == "halve":
                    self.refresh_params()

    def step(self) -> None:
        super().step()
        self.iteration += 1

    def close(self) -> None:
        """Stop the communication thread (:meth:`moelab.runtime.train.Trainer.close`)."""
        self.sched.close()

    def checkpoint_state(self) -> dict:
        return {"iteration": self.iteration, "packing": self.packing.state() if self.packing else None}

    def restore_state(self, state: dict) -> None:
        self.iteration = int(state["iteration"])
        if self.packing is not None and state.get("packing"):
            self.packing.restore(state["packing"], self.optimizer)
            self.refresh_params()

    def before_backward(self) -> None:
        super().before_backward()
        sched = getattr(self, "sched", None)
        if sched is not None:
            sched.new_step()
        self._ready_params: set = set()
        self._next_param = 0

    def on_grad_ready(self, p) -> None:
        if not self.opts.partitioned:
            return super().on_grad_ready(p)
        i = self._pos.get(id(p))
        if i is None:
            return
        self._ready_params.add(i)
        while self._next_param in self._ready_params:
            self._submit_param(self._next_param)

    def _submit_param(self, i: int) -> None:
        """Gradient ``i`` is ready, and every one before it in queue order: the micro-ops it completes."""
        import torch

        p = self.order[i]
        if p.grad is None:  # backward never reached it (same on every rank: same graph)
            p.grad = torch.zeros_like(p)
        for op in self._release.get(i, ()):
            self._submit_micro_op(op)
        self._next_param = i + 1

    def _submit_micro_op(self, op: tuple) -> None:
        """One micro-op of :func:`micro_op_plan`: a view of one gradient all-reduced in place, or several
        small gradients copied into one buffer (copied back after :meth:`sync`'s drain)."""
        import torch

        i, a, b = op[0]
        if len(op) == 1:
            view, name = self.order[i].grad.view(-1)[a:b], f"p{i}[{a}:{b}]"
        else:
            view, name = torch.cat([self.order[j].grad.reshape(-1) for j, _, _ in op]), f"p{i}-p{op[-1][0]}"
            self._packs.append((op, view))
        self.micro_ops.append(op)
        self._submit_tensor(view, self._group_of[i], name)

    def _submit_tensor(self, flat, group: str, name: str) -> None:
        """``flat`` (contiguous) all-reduced in place over ``group``: one low-priority op."""
        comm = self.comm
        self.sched.submit(LowOp(lambda: comm.all_reduce_(flat, group=group, async_op=True),
                                flat.numel() * flat.element_size(), group, name))

    def _launch(self, i: int) -> None:
        """A full DDP bucket becomes one low-priority op (``fixed``, ``priority``)."""
        import torch

        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.buckets[i]])
        self._pending.append((i, flat, None))
        comm = self.comm
        self.sched.submit(LowOp(lambda: comm.all_reduce_(flat, group=self.group, async_op=True),
                                flat.numel() * flat.element_size(), self.group, f"bucket{i}"))
        self._next = i + 1
        self.memory.sample()

    def sync(self) -> None:
        if self.opts.partitioned:
            while self._next_param < len(self.order):
                self._submit_param(self._next_param)
        else:
            while self._next < len(self.buckets):
                self._launch(self._next)
        fill_missing_grads(self.model.expert_parameters())
        if not self.opts.partitioned:  # bucketed policies: packed experts' copies reduced after backward
            for layer in self.model.moe_layers():
                for k, p in enumerate(packed_expert_params(layer)):
                    self._submit_tensor(p.grad.view(-1), layer.expert_dp_group, f"L{layer.layer_id}.experts{k}")
        self.sched.drain()
        self.last_micro_ops, self.micro_ops = self.micro_ops, []
        for op, buf in self._packs:
            off = 0
            for j, a, b in op:
                self.order[j].grad.view(-1)[a:b].copy_(buf[off:off + b - a])
                off += b - a
        self._packs = []
        for i, flat, _ in self._pending:
            self._unpack(i, flat)
        for layer in self.model.moe_layers():
            sync_replica_grads(layer, self.comm)
        self.before_backward()


def lina_update(model, comm, cfg):
    """The update of the run's ``policy``: the core's for the unscheduled ones, :class:`LinaUpdate` else."""
    opts = get("lina").bind(cfg)
    if not opts.scheduled:
        return GRAD_SYNCS[opts.policy](model, comm, cfg)
    return LinaUpdate(model, comm, cfg)
