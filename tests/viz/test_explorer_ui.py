"""The explorer widget without a browser: the grid editor's clicks (toggle a holder, set an owner), the policy
buttons, A vs B, the node count, and a 256-expert x 64-rank grid."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moelab.viz import explorer as X
from moelab.viz.explorer_policies import POLICIES
from moelab.viz.explorer_ui import build_widget

torch.set_num_threads(1)
pytest.importorskip("anywidget")

STATE = X.ExplorerState(profile="fastermoe_johnny", trace="synthetic:hot_expert", num_experts=64,
                        tokens_per_rank=512, d_model=64, d_ff=128, trace_iters=2, trace_layers=1)


def click(ui, e, r):
    """What plotly's click on the grid's cell (x = rank r, y = expert e) hands the widget."""
    ui._clicked(ui.grid.data[0], SimpleNamespace(xs=[r], ys=[e], point_inds=[(e, r)]), None)


def test_grid_clicks_toggle_holders_and_set_owners():
    ui = build_widget(STATE)
    assert ui.grid.data[0].z.shape == (64, 16) and ui.owner == []  # 64 experts: the grid alone, no list rows
    hot = X.hottest_expert(STATE)
    owner = X.placement_of(STATE).owner(hot)
    click(ui, hot, 12)  # toggle: a replica on rank 12
    assert X.mapping(ui.state)[hot] == [owner, 12]
    want = X.evaluate(X.toggle_replica(STATE, hot, 12))
    assert ui.last["layer_time_s"] == want["layer_time_s"]
    assert f"{want['layer_time_s'] * 1e3:.2f} ms" in ui.summary.value
    z = np.asarray(ui.grid.data[0].z)
    toks = X.expert_rank_tokens(want["placement"], want["loads"])
    assert z[hot, 12] == toks[hot, 12] > 0 and z[hot, 5 if owner != 5 else 6] is None  # redrawn in place
    click(ui, hot, 12)  # again: removed
    assert X.mapping(ui.state)[hot] == [owner]
    click(ui, hot, owner)  # the owner cannot be toggled off: a message, the placement kept
    assert "owns" in ui.error and X.mapping(ui.state)[hot] == [owner]
    ui.mode.value = "set owner"
    click(ui, 5, 9)
    assert X.mapping(ui.state)[5] == [9] and ui.error is None
    ui.colour.value = "holders"
    z = np.asarray(ui.grid.data[0].z)
    assert z[5, 9] == 2 and sum(v for v in z.ravel() if v is not None) == 2 * 64  # owners only: one 2 per row


def test_policy_buttons_apply_each_policy_to_the_current_loads():
    ui = build_widget(STATE)
    assert set(ui.policy_buttons) == set(POLICIES)
    for name, button in ui.policy_buttons.items():
        before = ui.state
        button.click()
        if ui.error is None:
            assert ui.state.moved_from == X.placement_of(before).holders
            assert f"{ui.last['layer_time_s'] * 1e3:.2f} ms" in ui.summary.value
        else:  # a policy that does not apply here says why and keeps the placement
            assert ui.state is before
    ui.reset.click()
    ui.policy_buttons["Hecate Alg. 1"].click()  # what the policy decided with is shown: t and m
    assert ui.error is None and "overlap degree t = " in ui.summary.value and ui.note.startswith("Hecate")
    ui.reset.click()
    ui.policy_buttons["FasterMoE shadowing"].click()
    assert len(X.mapping(ui.state)[X.hottest_expert(STATE)]) == 16


def test_a_vs_b_shows_both_and_the_deltas():
    ui = build_widget(STATE)
    assert "pin a placement" in ui.ab.value and "ab" not in ui.figures
    ui.pin.click()
    a = ui.state
    ui.policy_buttons["Lina popularity"].click()
    b = ui.state
    table = X.ab_table(X.evaluate(a), X.evaluate(b))
    assert table.loc["layer time (ms)", "B - A"] == pytest.approx(
        (X.evaluate(b)["layer_time_s"] - X.evaluate(a)["layer_time_s"]) * 1e3)
    assert "A (pinned) vs B (current)" in ui.ab.value and f"{table.loc['layer time (ms)', 'B - A']:.3f}" in ui.ab.value
    assert [t.name for t in ui.figures["ab"].data] == ["A (pinned)", "B (current)"]
    assert list(ui.figures["ab"].data[1].y) == list(X.evaluate(b)["rank_tokens"])
    ui.unpin.click()
    assert "ab" not in ui.figures


def test_nodes_scale_the_cluster():
    ui = build_widget(STATE)
    ui.nodes.value = 4  # johnny's 8-GPU nodes, four of them
    assert X.world_of(ui.state) == 32 and ui.grid.data[0].z.shape == (64, 32)
    ui.nodes.value = 0
    assert X.world_of(ui.state) == 16


def test_256_experts_on_64_ranks():
    s = X.ExplorerState(profile="fastermoe_johnny", nodes=8, num_experts=256, tokens_per_rank=1024,
                        d_model=256, d_ff=512, trace_iters=1, trace_layers=1)
    ui = build_widget(s)
    assert ui.grid.data[0].z.shape == (256, 64)
    t = time.perf_counter()
    click(ui, X.hottest_expert(s), 63)
    took = time.perf_counter() - t
    assert len(X.mapping(ui.state)[X.hottest_expert(s)]) == 2
    print(f"256 x 64: a click re-evaluated and redrew in {took:.2f} s (kernel side)")


def test_loads_from_a_real_models_shape_with_a_skew():
    ui = build_widget(STATE)
    ui.nodes.value = 4  # 32 ranks
    ui.trace.value = "preset:qwen3_30b_a3b"
    s = ui.state
    assert (s.num_experts, s.top_k, s.d_model, s.d_ff) == (128, 8, 2048, 768) and ui.error is None
    assert "Qwen3-30B-A3B MoE shape" in ui.last["label"] and "SYNTHETIC Zipf(skew 1)" in ui.last["label"]
    assert ui.grid.data[0].z.shape == (128, 32) and not ui.skew.disabled
    flat = ui.on_skew(0.0)
    steep = ui.on_skew(2.0)
    L0, L2 = X.layer_loads(flat).sum(0), X.layer_loads(steep).sum(0)
    assert L0.sum() == L2.sum() == 32 * s.tokens_per_rank * 8  # every token's k choices, whatever the skew
    assert L2.max() / L2.mean() > L0.max() / L0.mean() + 1  # a steeper Zipf: a hotter expert
    assert X.evaluate(steep)["imbalance"] > X.evaluate(flat)["imbalance"]


def test_the_strategy_control_prices_the_same_placement_as_hecate():
    ui = build_widget(STATE)
    hot = X.hottest_expert(STATE)
    click(ui, hot, 12)
    ui.strategy.value = "hecate"
    assert ui.state.strategy == "hecate" and X.mapping(ui.state)[hot][1:] == [12]  # the placement is kept
    want = X.evaluate(ui.state)
    assert ui.last["layer_time_s"] == want["layer_time_s"] and want["spag_bytes"].values.sum() > 0
    assert "spAG" in ui.summary.value and "spRS" in ui.summary.value
    ui.on_policy("FlexMoE")  # a policy priced by expert parallelism puts the control back
    assert ui.state.strategy == "ep" and ui.strategy.value == "ep"


def test_node_view_folds_ranks_and_a_click_drills_into_a_node():
    from moelab.viz.explorer_nodes import expert_node_holders, expert_node_tokens

    s = X.ExplorerState(profile="fastermoe_johnny", nodes=8, trace="synthetic:hot_expert", num_experts=256,
                        tokens_per_rank=256, d_model=64, d_ff=128, trace_iters=1, trace_layers=1)
    ui = build_widget(s)
    G = X.profile_of(s).gpus_per_node
    assert X.world_of(s) == 64 and G == 8
    hot = X.hottest_expert(s)
    click(ui, hot, 9)  # a replica on rank 9 (node 1) in the rank view
    ev = ui.last
    ui.view.value = "nodes"
    z = np.asarray(ui.grid.data[0].z)
    assert z.shape == (256, 8) and list(ui.grid.data[0].x) == list(range(8))
    toks, held = X.expert_rank_tokens(ev["placement"], ev["loads"]), expert_node_holders(ev["placement"], G)
    # the aggregation: a node's cell is its ranks' cells summed; holders count the node's ranks holding the expert
    assert (expert_node_tokens(ev["placement"], ev["loads"], G) == toks.reshape(256, 8, G).sum(2)).all()
    assert held.sum() == 256 + ev["placement"].num_replicas and held[hot, 9 // G] >= 1
    assert z[hot, 9 // G] == toks[hot, 8:16].sum() and "click a node" in ui.grid.layout.title.text
    click(ui, hot, 9 // G)  # a click on node 1's column drills into ranks 8-15
    assert ui.node == 1 and list(ui.grid.data[0].x) == list(range(8, 16)) and not ui.back.disabled
    assert np.asarray(ui.grid.data[0].z)[hot, 1] == toks[hot, 9]
    before = X.mapping(ui.state)[hot]
    click(ui, hot, 10)  # in the drill-down a click edits the global rank, as in the rank grid
    assert X.mapping(ui.state)[hot] == before + [10] and ui.node == 1
    ui.back.click()
    assert ui.node is None and np.asarray(ui.grid.data[0].z).shape == (256, 8)


def test_a_cluster_change_redraws_the_same_grid_widget_so_it_keeps_the_notebooks_width():
    ui = build_widget(STATE)
    grid = ui.grid
    ui.nodes.value = 4  # johnny's 8 GPUs per node: 32 ranks
    assert ui.grid is grid and ui.grid_box.children == (grid,)  # no new widget measured before it is attached
    assert np.asarray(grid.data[0].z).shape == (64, 32) and list(grid.data[0].x) == list(range(32))
    assert grid.layout.width is None and grid.layout.autosize and len(grid.layout.shapes) == 3  # node lines
