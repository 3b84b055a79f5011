"""Figures over stored or simulated runs; every builder needs a REAL/EMULATED/SIMULATED/SUBSTITUTE label."""
from moelab.viz.export import export_figure
from moelab.viz.figures import bytes_by_link, expert_load_heatmap, loss_curve, timeline

__all__ = ["loss_curve", "expert_load_heatmap", "timeline", "bytes_by_link", "export_figure"]
