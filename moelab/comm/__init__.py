"""The one communication door: every collective of moelab goes through :mod:`moelab.comm.door`."""
from moelab.comm.topology import LINK_CLASSES, Topology

__all__ = ["Topology", "LINK_CLASSES"]
