"""The one point where a communication scheduler sees every collective before it is issued.

Every call of the comm door passes ``scheduler.admit(call)`` on the issuing thread before anything
reaches the network, and ``scheduler.done(call)`` once it completed (at ``wait()``). A scheduler
holds a call by blocking ``admit`` (and so orders calls issued from different threads, as Lina's
priority queue will), and releases it by returning. ``Communicator.scheduler`` is ``None`` by
default: the door then skips the hook entirely, so it costs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Call:
    """What a scheduler knows about a call: enough to prioritise it, nothing to run it."""

    op: str
    group: str
    ranks: tuple  # global ranks of the group instance
    sent_to: dict  # global rank -> bytes this rank sends
    recv_from: dict  # global rank -> bytes this rank receives
    tags: dict = field(default_factory=dict)  # the issuing thread's tags (layer, phase, iter)
    stream: str = "MainThread"


class Scheduler:
    """Pass-through base: admit immediately. Subclasses override ``admit`` (block to hold) / ``done``."""

    def admit(self, call: Call) -> None:
        pass

    def done(self, call: Call) -> None:
        pass
