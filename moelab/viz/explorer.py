"""The placement explorer: edit which ranks hold which expert and see, through the simulator, what it does
to per-rank load, bytes per link class, the time of one MoE layer with its replicas' gradient sync, the count
exchange, the dense update, peak memory per rank and the migration from the previous placement.

Everything is a plain function over an immutable :class:`ExplorerState`, so tests (and notebooks run
headless by papermill) need no browser; :func:`moelab.viz.explorer_ui.build_widget` only wires ipywidgets
controls to those functions. This module gathers them:

- :mod:`.explorer_state`: the state, its load traces and the pure placement edits;
- :mod:`.explorer_cost`: :func:`evaluate`, every price from one simulated iteration;
- :mod:`.explorer_figures`: the figures (tokens, bytes, memory, the experts x ranks grid, A vs B);
- :mod:`.explorer_policies`: each registered placement policy applied to the current loads;
- :mod:`.explorer_run`: export to a run config and a REAL run beside the simulated one.
"""
from __future__ import annotations

from moelab.viz.explorer_cost import (
    MEMORY_CATEGORIES,
    check_fits,
    evaluate,
    hecate_graph,
    hecate_plan,
    label_of,
    replica_sync_bytes,
    sim_config,
    summary_text,
)
from moelab.viz.explorer_figures import (
    ab_figure,
    ab_table,
    bytes_figure,
    expert_rank_tokens,
    grid_arrays,
    grid_figure,
    grid_headline,
    load_figure,
    memory_figure,
)
from moelab.viz.explorer_state import (
    STRATEGIES,
    SYNTHETIC_KINDS,
    ExplorerState,
    edit_placement,
    ep_holders,
    hottest_expert,
    layer_loads,
    mapping,
    placement_of,
    profile_of,
    reset_ep,
    run_global_loads,
    set_owner,
    set_replicas,
    shadow_hottest,
    toggle_replica,
    trace_label,
    trace_loads,
    trace_shape,
    uniform_sources,
    with_holders,
    with_preset,
    with_strategy,
    world_of,
)

__all__ = ["ExplorerState", "evaluate", "check_fits", "set_owner", "toggle_replica", "set_replicas", "with_holders",
           "with_preset", "reset_ep", "edit_placement", "shadow_hottest", "hottest_expert", "placement_of", "mapping",
           "trace_loads",
           "trace_shape", "trace_label", "layer_loads", "profile_of", "world_of", "sim_config",
           "uniform_sources", "run_global_loads", "replica_sync_bytes", "load_figure", "bytes_figure",
           "memory_figure", "grid_figure", "grid_arrays", "grid_headline", "expert_rank_tokens", "ab_table",
           "ab_figure",
           "summary_text", "label_of", "ep_holders", "SYNTHETIC_KINDS", "MEMORY_CATEGORIES", "STRATEGIES",
           "with_strategy", "hecate_graph", "hecate_plan"]
