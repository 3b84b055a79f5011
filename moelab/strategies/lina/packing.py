"""Lina's packing controller (spec ``papers/lina.md`` §2.2 "Expert packing"): from step
``pack_start_step``, every ``pack_every`` steps, halve the expert block (double q, the experts per rank)
while the forward FFN micro-op is faster than the all-to-all micro-op; otherwise freeze.

A switch happens at a step boundary (before the forward): every rank re-maps its layers' ``ep`` group to
the smaller block, and each expert it newly holds comes with its parameters AND Adam moments from the
holder at that expert's position in the rank's old block (a block is a full copy of the experts), in one
all-to-all through the door (:func:`moelab.moe.migrate.move_experts`). The model's function is unchanged:
a run with switches trains the model a run without them does.

Times are this rank's records over the window, then the MAX over ranks (one decision everywhere):
``t_ffn`` the mean ``experts chunk`` span of the forward, ``t_a2a`` the mean duration of each MoE layer's
first forward dispatch micro-op - the one whose ``wait`` follows its issue with no expert compute in
between, so its duration is the transfer's and not the FFN's it overlaps (a choice of ours, [R]).
"""
from __future__ import annotations

from typing import Optional

import torch

from moelab.moe.migrate import move_experts, reslot


def repack_moves(n_layers: int, nproc: int, num_experts: int, P_old: int, P_new: int) -> list:
    """``[(layer, expert, source, destination), ...]``: what moving from blocks of ``P_old`` ranks to blocks
    of ``P_new`` ranks copies. A rank at new position i needs experts ``[i·q', (i+1)·q')`` (q' = E/P_new);
    each comes from the rank at the expert's position in the destination's old block; nothing a rank already
    holds moves. Pure: the same list on every rank."""
    q_old, q_new = num_experts // P_old, num_experts // P_new
    out = []
    for li in range(n_layers):
        for dst in range(nproc):
            old_block, pos = dst - dst % P_old, dst % P_new
            for e in range(pos * q_new, (pos + 1) * q_new):
                src = old_block + e // q_old
                if src != dst:
                    out.append((li, e, src, dst))
    return out


def decide(t_ffn: float, t_a2a: float, next_block: Optional[int], fits: bool) -> str:
    """The controller's rule: ``"halve"`` when the FFN micro-op is faster than the all-to-all micro-op and a
    smaller block exists and fits in memory; else why not (the controller then freezes)."""
    if next_block is None:
        return "freeze: no smaller block"
    if not t_ffn < t_a2a:
        return "freeze: ffn >= a2a"
    if not fits:
        return "freeze: memory"
    return "halve"


def micro_op_times(rec, iters) -> tuple:
    """(mean forward FFN micro-op, mean first forward dispatch micro-op) seconds over ``iters`` (this rank)."""
    iters = set(iters)
    ffn = [t1 - t0 for name, cat, t0, t1, tags in rec.spans
           if cat == "expert" and name.startswith("experts chunk") and tags.get("iter") in iters]
    a2a = [r.t_done - r.t_start for r in rec.comm  # issue to finish (the chunk's call is waited a little later)
           if r.tags.get("iter") in iters and r.tags.get("chunk") == 0 and r.tags.get("a2a") == "dispatch"]
    mean = lambda v: sum(v) / len(v) if v else 0.0  # noqa: E731
    return mean(ffn), mean(a2a)


class PackingController:
    """Held by Lina's update; :meth:`at_step` runs before each forward."""

    def __init__(self, options, model, comm):
        self.opts, self.comm = options, comm
        self.layers = model.moe_layers()
        self.E = self.layers[0].cfg.num_experts if self.layers else 0
        self.blocks = options.block_sizes(comm.world_size, self.E)
        self.level = 0  # index into self.blocks
        self.frozen = len(self.blocks) == 1
        self.log: list = []  # one dict per decision

    @property
    def block(self) -> int:
        return self.blocks[self.level]

    def _fits(self, P: int) -> bool:
        """One rank's expert parameters, gradients and two Adam moments at block size ``P`` within the budget."""
        if not self.opts.pack_memory_mb:
            return True
        ex = self.layers[0].experts
        per_expert = sum(p[0].numel() * p.element_size() for p in ex.stacked() if p is not None and p.shape[0])
        return 4 * per_expert * (self.E // P) * len(self.layers) <= self.opts.pack_memory_mb * 2 ** 20

    def at_step(self, it: int, optimizer) -> Optional[dict]:
        """Decide at iteration ``it`` (before its forward) and carry a halving out; the decision, or None."""
        o = self.opts
        if self.frozen or it < o.pack_start_step or (it - o.pack_start_step) % o.pack_every:
            return None
        nxt = self.blocks[self.level + 1] if self.level + 1 < len(self.blocks) else None
        mine = torch.tensor(micro_op_times(self.comm.rec, range(max(0, it - o.pack_every), it)), dtype=torch.float64)
        with self.comm.rec.tagged(phase="pack_control"):
            t = self.comm.all_gather(mine).amax(0)
        if nxt is not None and not (t > 0).all():  # no micro-op timed in the window (a resumed run): next period
            return None
        verdict = decide(float(t[0]), float(t[1]), nxt, nxt is not None and self._fits(nxt))
        entry = dict(iter=it, block=self.block, experts_per_rank=self.E // self.block, t_ffn_s=float(t[0]),
                     t_a2a_s=float(t[1]), decision=verdict)
        if verdict == "halve":
            self._switch(nxt, optimizer)
            self.level += 1
            entry.update(new_block=nxt, new_experts_per_rank=self.E // nxt)
        else:
            self.frozen = True
        self.log.append(entry)
        return entry

    def state(self) -> dict:
        return {"level": self.level, "frozen": self.frozen, "log": list(self.log)}

    def restore(self, state: dict, optimizer) -> None:
        """Take back :meth:`state` (a resumed run): the layers move to the saved block with empty slots,
        which the checkpoint's load fills (parameters and Adam state)."""
        self.level, self.frozen, self.log = int(state["level"]), bool(state["frozen"]), list(state["log"])
        for layer in self.layers:
            reslot(layer, layer.use_block(self.block), optimizer)

    def _switch(self, P_new: int, optimizer) -> None:
        moves = repack_moves(len(self.layers), self.comm.world_size, self.E, self.block, P_new)
        placements = {li: layer.use_block(P_new) for li, layer in enumerate(self.layers)}
        move_experts(self.comm, self.layers, moves, placements, optimizer, group="world")  # phase "migrate"
