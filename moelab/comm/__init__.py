"""The one communication door: every collective of moelab goes through :mod:`moelab.comm.door`.

- :mod:`.door`: :class:`~moelab.comm.door.Communicator` (named groups, sync or async calls with
  handles, records, link emulation, the scheduler hook) and ``Communicator.run`` for any declared
  collective.
- :mod:`.groups`: groups as data (``{name: [[ranks], ...]}``, each a partition of the ranks) and their
  validator; a strategy declares its groups in its ``moelab.registry.Strategy`` (``groups``).
- :mod:`.collectives`: each collective declared once (byte rule, emulator pricing, simulator demand);
  :mod:`.bytes` is the byte rule's public face (``peer_bytes``, ``recv_bytes``, ``by_link_class``).
- :mod:`.record`: per-call records and spans, thread-local tags, the Chrome/Perfetto trace.
- :mod:`.links`: a rank's ports shared by concurrent calls (fluid sharing) for link emulation.
- :mod:`.scheduler`: the hook a communication scheduler (Lina's priority queue) plugs into.
- :mod:`.stream`: FastMoE-style comm stream (an in-order task queue on its own thread).
- :mod:`.topology`: which ranks share a node; link classes.
"""
from moelab.comm.topology import LINK_CLASSES, Topology

__all__ = ["Topology", "LINK_CLASSES"]
