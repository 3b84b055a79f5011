"""Placement explorer: pure callbacks, evaluation through the simulator, run loads.csv input, widget wiring."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from moelab.comm.topology import Topology
from moelab.viz import explorer as X
from moelab.viz.explorer_ui import build_widget

torch.set_num_threads(1)

# 2 nodes x 8 (FasterMoE johnny), 16 experts, expert 0 hot (40% of each rank's assignments)
STATE = X.ExplorerState(profile="fastermoe_johnny", trace="synthetic:hot_expert", num_experts=16,
                        tokens_per_rank=512, d_model=64, d_ff=128, trace_iters=3, trace_layers=2)


def expected_a2a_bytes(state, L, placement):
    """Per rank and class: the layer's four all-to-alls by hand from Placement.split_counts (the slow
    reference rule) plus the count exchange (int64[E] to every member, itself included)."""
    prof = X.profile_of(state)
    topo = Topology(prof.world_size, prof.gpus_per_node)
    N, E = L.shape
    route = np.stack([placement.split_counts(s, torch.tensor(L[s])).sum(0).numpy() for s in range(N)])
    per_tok = state.d_model * prof.elem_bytes
    out = np.zeros((N, 3), dtype=np.int64)
    cls = {"local": 0, "intra": 1, "inter": 2}
    for r in range(N):
        for p in range(N):
            # dispatch + combine.bwd send route[r, p]; combine + dispatch.bwd send route[p, r]
            out[r, cls[topo.link_class(r, p)]] += 2 * (route[r, p] + route[p, r]) * per_tok + 8 * E
    return out


def test_hot_expert_replica_reduces_max_load():
    ev = X.evaluate(STATE)
    hot = X.hottest_expert(STATE)
    assert hot == 0 and ev["max_load"] == ev["rank_tokens"][0]
    assert ev["imbalance"] > 2
    # one replica on the least loaded rank of the other node splits the remote tokens in two
    one = X.toggle_replica(STATE, hot, 15)
    ev1 = X.evaluate(one)
    assert ev1["max_load"] < ev["max_load"]
    assert X.mapping(one)[hot] == [0, 15]
    # shadowing everywhere brings it near the mean: the layer's forward and backward get faster, and its
    # 15 replicas pay their gradient sync (priced by the simulator, inside the layer time)
    ev_all = X.evaluate(X.shadow_hottest(STATE))
    assert ev_all["max_load"] < ev1["max_load"] and ev_all["imbalance"] < 1.2
    assert ev_all["fwd_s"] + ev_all["bwd_s"] < ev["fwd_s"] + ev["bwd_s"]
    assert ev["replica_sync_s"] == 0 < ev_all["replica_sync_s"]
    assert ev_all["layer_time_s"] == ev_all["fwd_s"] + ev_all["bwd_s"] + ev_all["replica_sync_s"]
    assert ev_all["placement"].num_replicas == 15


def test_reset_and_owner_moves():
    s = X.set_owner(STATE, 3, 9)
    assert X.mapping(s)[3] == [9]
    s = X.toggle_replica(s, 3, 2)
    s = X.set_owner(s, 3, 2)  # a replica becomes owner: swap
    assert X.mapping(s)[3] == [2, 9]
    with pytest.raises(ValueError, match="owns"):
        X.toggle_replica(s, 3, 2)
    s = X.toggle_replica(s, 3, 9)  # toggling again removes the replica
    assert X.mapping(s)[3] == [2]
    ep = X.reset_ep(s)
    assert ep.holders == () and X.mapping(ep) == {e: [e] for e in range(16)}
    assert X.placement_of(ep).is_trivial
    with pytest.raises(ValueError):
        X.set_owner(STATE, 0, 99)  # rank outside the cluster


def test_bytes_follow_the_routing_rule_and_change_as_expected():
    L = X.layer_loads(STATE)
    ev = X.evaluate(STATE)
    assert np.array_equal(ev["bytes"].to_numpy(), expected_a2a_bytes(STATE, L, ev["placement"]))
    # shadowing expert 0: every rank keeps its own tokens for it; the owner (rank 0) stops receiving
    sh = X.shadow_hottest(STATE)
    ev2 = X.evaluate(sh)
    assert np.array_equal(ev2["bytes"].to_numpy(), expected_a2a_bytes(sh, L, ev2["placement"]))
    per_tok = STATE.d_model * X.profile_of(STATE).elem_bytes
    for r in range(1, 16):
        assert ev2["bytes"].loc[r, "local"] - ev["bytes"].loc[r, "local"] == 4 * L[r, 0] * per_tok
    moved = ev["bytes"].loc[0, ["intra", "inter"]].sum() - ev2["bytes"].loc[0, ["intra", "inter"]].sum()
    assert moved == 2 * L[1:, 0].sum() * per_tok  # combine and dispatch.bwd no longer send them back
    assert ev2["bytes"][["intra", "inter"]].to_numpy().sum() < ev["bytes"][["intra", "inter"]].to_numpy().sum()
    # the replicas' gradient sync (the graph's ops): 15 replicas x 2 directions x one expert's params
    p_bytes = (2 * 64 * 128 + 64 + 128) * X.profile_of(STATE).elem_bytes
    assert ev2["replica_sync_bytes"].to_numpy().sum() == 15 * 2 * p_bytes
    assert ev["replica_sync_bytes"].to_numpy().sum() == 0


def test_moving_an_expert_across_nodes_turns_intra_into_inter():
    # expert 1 (rank 1, node 0) moved to rank 9 (node 1): its node-0 senders now cross the NIC
    moved = X.set_owner(STATE, 1, 9)
    a, b = X.evaluate(STATE)["bytes"].sum(), X.evaluate(moved)["bytes"].sum()
    L = X.layer_loads(STATE)
    per_tok = STATE.d_model * X.profile_of(STATE).elem_bytes
    # sources 0..7 (node 0) sent to rank 1: intra (local for rank 1 itself); now all of node 0 is inter
    delta_inter = 4 * (L[0:8, 1].sum() - L[8:16, 1].sum()) * per_tok
    assert b["inter"] - a["inter"] == delta_inter


@pytest.fixture
def run_dir(tmp_path):
    """A fake real-run folder: loads.csv with GLOBAL tokens per expert (iter, layer, expert, tokens)."""
    rows = []
    rng = np.random.default_rng(0)
    for it in range(3):
        for layer in range(2):
            g = rng.multinomial(16 * 256 * 2, [0.5] + [0.5 / 15] * 15)
            rows += [dict(iter=it, layer=layer, expert=e, tokens=int(t)) for e, t in enumerate(g)]
    pd.DataFrame(rows).to_csv(tmp_path / "loads.csv", index=False)
    return tmp_path


def test_evaluate_real_run_loads_csv(run_dir):
    s = X.ExplorerState(profile="fastermoe_johnny", trace=f"run:{run_dir}", iteration=2, layer=1, d_model=64, d_ff=128)
    assert X.trace_shape(s) == (3, 2, 16)
    g = pd.read_csv(run_dir / "loads.csv").query("iter == 2 and layer == 1").sort_values("expert").tokens.to_numpy()
    L = X.layer_loads(s)
    assert L.shape == (16, 16) and np.array_equal(L.sum(0), g)  # global tokens preserved
    assert L.max(0).tolist() == [-(-x // 16) for x in g] and (L.max(0) - L.min(0) <= 1).all()  # uniform sources
    ev = X.evaluate(s)
    assert ev["rank_tokens"].sum() == g.sum() and ev["max_load"] == g[0]
    assert "uniform sources" in ev["label"] and ev["label"].startswith("SIMULATED")
    ev2 = X.evaluate(X.shadow_hottest(s))
    assert ev2["max_load"] < ev["max_load"]
    # the csv file path works as well as its folder
    assert np.array_equal(X.layer_loads(X.ExplorerState(trace=f"run:{run_dir / 'loads.csv'}", iteration=2, layer=1)), L)


def test_uniform_sources_rule():
    out = X.uniform_sources(np.array([7, 0, 4]), 3)
    assert out.tolist() == [[3, 0, 2], [2, 0, 1], [2, 0, 1]]


def test_widget_callbacks_without_a_browser(run_dir):
    ui = build_widget(STATE, runs=[str(run_dir)])
    assert ui.last["max_load"] == X.evaluate(STATE)["max_load"]
    assert {"load", "bytes", "memory", "grid"} <= set(ui.figures)
    assert ui.figures["load"].layout.meta["label"].startswith("SIMULATED")
    ui.owner[2].value = 12  # as a user would: the dropdown calls set_owner
    assert X.mapping(ui.state)[2] == [12] and "layer time" in ui.summary.value
    ui.replicas[0].value = (8, 9)
    assert X.mapping(ui.state)[0] == [0, 8, 9]
    before = ui.last["max_load"]
    ui.shadow.click()
    assert ui.last["max_load"] < before and len(X.mapping(ui.state)[0]) == 16
    assert ui.replicas[0].value == tuple(range(1, 16))  # the controls follow the state
    ui.reset.click()
    assert ui.state.holders == () and ui.owner[2].value == 2
    ui.layer.value = 1
    ui.iteration.value = 2
    assert (ui.state.layer, ui.state.iteration) == (1, 2)
    ui.trace.value = f"run:{run_dir}"
    assert ui.state.trace.startswith("run:") and ui.state.iteration == 0 and ui.iteration.max == 2
    ui.profile.value = "lina"
    assert X.world_of(ui.state) == 16 and len(ui.owner[0].options) == 16
    ui.on_toggle(0, ui.owner[0].value)  # an invalid edit is reported, not raised
    assert ui.error and "owns" in ui.error


@pytest.mark.parametrize("text, message", [
    ("3:", "expert 3 has no owner"),
    ("3: 5 40", "outside 0..15"),
    ("16: 0", "expert 16 does not exist: experts are 0..15"),
    ("3 5", "write 'expert: owner [replicas...]'"),
    ("x: 1", "cannot read 'x: 1'"),
    ("3: 5 5", "lists a rank twice"),
])
def test_typed_edit_that_breaks_the_placement_is_refused_and_the_state_kept(text, message):
    ui = build_widget(STATE)
    good = ui.on_edit("3: 5 12; 7: 0")  # a valid edit, then an invalid one
    assert X.mapping(good)[3] == [5, 12] and X.mapping(good)[7] == [0]
    shown = ui.last
    ui.edit.value = text  # as typed in the widget
    assert ui.state is good and X.mapping(ui.state)[3] == [5, 12]  # the last valid placement stays
    assert message in ui.error and message.split(":")[0] in ui.summary.value
    assert ui.last["layer_time_s"] == shown["layer_time_s"]  # still showing the valid placement
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        X.edit_placement(good, text)
