"""Every collective declared once: its byte rule, how the link emulator prices it, its simulator demand.

A :class:`Collective` says, in one place, what a collective *is* for the three parts of moelab that
price or account it:

- ``sent`` / ``received``: the pairwise byte rule (:mod:`moelab.comm.bytes` explains the model):
  bytes a member sends to / receives from each global rank. By construction
  ``received(.., me)[j] == sent(.., j)[me]``, which the tests check on real records.
- ``pricing``: how the link emulator prices it alone and loads the rank's ports
  (:meth:`moelab.comm.door.Communicator.port_flows`): ``"ring"`` (the simulator's rings),
  ``"chain"`` (the simulator's pipelined chain from the root: broadcast, reduce) or ``"direct"``
  (per link class, own port, sent out / received in).
- ``demands``: the simulator's link demands, one per phase. The built-in collectives leave it None: the cost
  model prices them itself (:data:`moelab.comm.costs.BUILT_IN_DEMANDS`), and reads their byte rule here for its
  fits (:func:`moelab.comm.bytes.sent_bytes`), so this module needs nothing from it. A newly declared
  collective states its own (Parm's SAA: :mod:`moelab.comm.saa`).
- ``phases`` (optional): a collective that runs as phases one after the other (Parm's SAA) says what
  each phase moves; the link emulator then prices the phases in order, not one direct transfer.

The comm door runs any declared collective through one path (:meth:`Communicator.run`: scheduler,
sequence number, record, emulation), so a new one - Hecate's sparse all-gather, Parm's fused
all-to-all + all-gather, a compressed all-to-all - is one :func:`register_collective` call plus the
few lines that issue it. Arguments the rules take: ``nbytes`` (the member's input size: all_gather its
block; the full tensor otherwise), ``splits`` (all_to_all: per member bytes; to ``demands``: the
whole [n, n] matrix), ``root``, ``peer``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Collective:
    name: str
    sent: Callable  # (group, me, **args) -> {global rank: bytes me sends it}
    received: Callable  # (group, me, **args) -> {global rank: bytes me receives from it}
    pricing: str  # "ring" | "chain" | "direct": the link emulator's model
    demands: Optional[Callable] = None  # (group, topo, profile, **args) -> [Demand, ...]; None: the cost model's own
    phases: Optional[Callable] = None  # (group, me, **args) -> [(sent, received) per peer] per phase, run in order

    def __post_init__(self):
        if self.pricing not in ("ring", "chain", "direct"):
            raise ValueError(f"collective {self.name!r}: pricing must be 'ring', 'chain' or 'direct', "
                             f"got {self.pricing!r}")


_COLLECTIVES: dict = {}


def register_collective(c: Collective) -> Collective:
    _COLLECTIVES[c.name] = c
    return c


def collective(name: str) -> Collective:
    try:
        return _COLLECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; known: {tuple(_COLLECTIVES)}") from None


def known_collectives() -> tuple:
    return tuple(_COLLECTIVES)


def ring_ops() -> tuple:
    return tuple(n for n, c in _COLLECTIVES.items() if c.pricing == "ring")


# ---- the built-in collectives -------------------------------------------------------------------
def _per_member(group, splits):
    assert splits is not None and len(splits) == len(group), "all_to_all needs one split per group member"
    return dict(zip(group, map(int, splits)))  # group members are distinct ranks


def _ring(op: str, sent_per_member: Callable) -> Collective:
    rule = lambda group, me, nbytes=0, **_: {r: sent_per_member(len(group), int(nbytes)) for r in group}  # noqa: E731
    return Collective(op, rule, rule, "ring")


def _chain(op: str) -> Collective:
    """broadcast (root -> every member) / reduce (every non-root -> root): a flat tree for the byte
    rule (what the root ships logically), priced as a pipelined chain from the root by the simulator
    and the link emulator alike (:func:`moelab.comm.pricing.chain_edges`), as NCCL runs them."""
    def sent(group, me, nbytes=0, root=None, **_):
        if op == "broadcast":
            return {r: int(nbytes) for r in group} if me == root else {}
        return {root: int(nbytes)} if me != root or len(group) == 1 else {}

    def received(group, me, nbytes=0, root=None, **_):
        if op == "broadcast":
            return {root: int(nbytes)}
        return {r: int(nbytes) for r in group if r != root or len(group) == 1} if me == root else {}

    return Collective(op, sent, received, "chain")


def _p2p(op: str, sends: bool, receives: bool) -> Collective:
    """``group = (src, dst)`` for the demand; ``peer`` is the other side for the byte rule. ``p2p`` is
    also a batch of exchanges over a group (``splits``: bytes per member, as the simulator records a
    step of FasterMoE's smart schedule, which the runtime runs as one ``Communicator.exchange``)."""
    def rule(active):
        def per_peer(group, me, nbytes=0, peer=None, splits=None, **_):
            if not active:
                return {}
            return _per_member(group, splits) if splits is not None else {peer: int(nbytes)}
        return per_peer

    return Collective(op, rule(sends), rule(receives), "direct")


register_collective(Collective(
    "all_to_all",
    lambda group, me, splits=None, **_: _per_member(group, splits),
    lambda group, me, splits=None, **_: _per_member(group, splits),  # splits = what each member sends me
    "direct"))
register_collective(_ring("all_gather", lambda n, s: s))
register_collective(_ring("reduce_scatter", lambda n, s: s // n))
register_collective(_ring("all_reduce", lambda n, s: 2 * (s // n) if n > 1 else s))
register_collective(_chain("broadcast"))
register_collective(_chain("reduce"))
register_collective(_p2p("p2p", True, True))  # what Communicator.exchange records (sends and receives)
register_collective(_p2p("send", True, False))
register_collective(_p2p("recv", False, True))
