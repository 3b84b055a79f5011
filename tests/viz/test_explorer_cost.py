"""Every price the explorer shows comes from the simulator: the replicas' gradient sync equals the simulator's
graph for the same placement, the count exchange and the dense update are that graph's ops, peak memory
follows the holders (a replica costs its parameters, gradients and Adam state), the migration is the bytes
moe/migrate.py moves, and a placement that does not fit memory is refused."""
from __future__ import annotations

import numpy as np
import pytest

from moelab.comm.topology import LINK_CLASSES
from moelab.moe.migrate import copies_between
from moelab.sim.engine import simulate
from moelab.sim.graphs import ep_iteration_graph, expert_param_count, graph_bytes, topology_of
from moelab.sim.migration import migration_matrix, migration_row_bytes, migration_time
from moelab.viz import explorer as X
from moelab.viz.explorer_policies import POLICIES, apply_policy

STATE = X.ExplorerState(profile="fastermoe_johnny", trace="synthetic:hot_expert", num_experts=16,
                        tokens_per_rank=512, d_model=64, d_ff=128, trace_iters=2, trace_layers=1)


def _graph(state):
    """The simulator's own graph of the state's placement, built here without the explorer."""
    L = X.layer_loads(state)
    N, E = L.shape
    cfg = X.sim_config(state, E, int(round(L.sum() / (state.top_k * N))))
    prof = X.profile_of(state)
    g = ep_iteration_graph(cfg, prof, L[None], X.placement_of(state), elem_bytes=prof.elem_bytes)
    return cfg, g, simulate(g)


def test_replica_sync_equals_the_simulators_graph_for_the_same_placement():
    s = X.toggle_replica(X.toggle_replica(STATE, 0, 9), 0, 3)  # one replica across nodes, one inside
    ev = X.evaluate(s)
    cfg, g, res = _graph(s)
    ops = res.ops_frame()
    sync = ops[ops.category == "replica_sync"]
    assert len(sync) == 4  # two replicas x (grad to owner, sum back)
    assert ev["replica_sync_s"] == pytest.approx(float(sync.end.max() - sync.start.min()), rel=1e-12)
    gb = graph_bytes(g, topology_of(cfg), categories={"replica_sync"})
    assert ev["replica_sync_bytes"].to_numpy().tolist() == [[gb[r][c] for c in LINK_CLASSES] for r in range(16)]
    # and the runtime's rule by hand agrees: 2 replicas x 2 directions x one expert's parameters
    p_bytes = expert_param_count(cfg.model) * X.profile_of(s).elem_bytes
    by_hand = X.replica_sync_bytes(ev["placement"], topology_of(cfg), p_bytes)
    assert np.array_equal(by_hand.to_numpy(), ev["replica_sync_bytes"].to_numpy())
    sync_b = ev["replica_sync_bytes"].sum()
    assert sync_b["inter"] == 2 * p_bytes and sync_b["intra"] == 2 * p_bytes
    assert ev["layer_time_s"] == ev["fwd_s"] + ev["bwd_s"] + ev["replica_sync_s"]
    assert X.evaluate(STATE)["replica_sync_s"] == 0.0  # EP: no replica, no sync


def test_count_exchange_dense_update_and_iteration_are_the_graphs_ops():
    ev = X.evaluate(STATE)
    _, _, res = _graph(STATE)
    ops = res.ops_frame()
    assert ev["count_exchange_s"] == pytest.approx(float(ops[ops.name == "L0.counts"].duration.iloc[0]), rel=1e-12)
    assert ev["dense_update_s"] == pytest.approx(float(ops[ops.name == "dense_grads.allreduce"].duration.iloc[0]),
                                                 rel=1e-12)
    assert ev["count_exchange_s"] > 0 and ev["dense_update_s"] > 0
    assert ev["iteration_s"] == pytest.approx(res.makespan, rel=1e-12)
    assert "not simulated" not in X.summary_text(ev)


def test_peak_memory_counts_a_replicas_parameters_gradients_and_optimizer_state():
    ev0 = X.evaluate(STATE)
    ev1 = X.evaluate(X.toggle_replica(STATE, 0, 9))
    eb = X.profile_of(STATE).elem_bytes
    numel = 2 * 64 * 128 + 64 + 128
    d = ev1["memory"] - ev0["memory"]
    assert d.loc[9, "params"] == numel * eb and d.loc[9, "grads"] == numel * eb
    assert d.loc[9, "optimizer"] == 2 * numel * 4  # Adam's two fp32 moments
    assert (d.drop(index=9)[["params", "grads", "optimizer"]] == 0).all().all()
    assert ev1["memory"]["total"].max() <= ev1["memory_limit"] and ev1["fits_memory"]


def test_a_placement_that_does_not_fit_memory_is_refused_and_the_widget_keeps_the_last_valid():
    from moelab.viz.explorer_ui import build_widget

    big = X.ExplorerState(profile="fastermoe_johnny", num_experts=16, tokens_per_rank=64, d_model=8192, d_ff=32768,
                          trace_iters=1, trace_layers=1)  # one 537M-parameter expert per 16 GB GPU
    assert X.evaluate(big)["fits_memory"]
    over = X.toggle_replica(big, 0, 1)
    ev = X.evaluate(over)
    assert not ev["fits_memory"]
    with pytest.raises(ValueError, match="does not fit memory: rank"):
        X.check_fits(ev)
    ui = build_widget(big)
    ui.on_toggle(0, 1)
    assert ui.state is big and "does not fit memory" in ui.error and "kept the last valid" in ui.summary.value


def test_migration_is_the_bytes_migrate_moves_and_their_all_to_all():
    s = X.set_owner(STATE, 3, 12)  # expert 3 moves from rank 3 (node 0) to rank 12 (node 1)
    s = X.toggle_replica(s, 0, 9)  # then a replica of expert 0 on rank 9: priced from the previous placement
    ev = X.evaluate(s)
    prev = X.placement_of(X.set_owner(STATE, 3, 12)).holders
    assert copies_between(prev, ev["placement"].holders) == [(0, 0, 9)]
    cfg, _, _ = _graph(s)
    prof = X.profile_of(s)
    row = migration_row_bytes(expert_param_count(cfg.model), prof.elem_bytes)
    want = migration_matrix(prev, ev["placement"].holders, 16, row)
    assert np.array_equal(ev["migration_bytes"], want) and want[0, 9] == row and want.sum() == row
    assert ev["experts_moved"] == 1
    assert ev["migration_s"] > 0
    assert ev["migration_s"] == pytest.approx(migration_time(want, prof, prof.topology()), rel=1e-12)
    back = X.evaluate(X.reset_ep(s))  # back to EP: expert 3 copied back to rank 3; dropped copies cost nothing
    assert back["experts_moved"] == 1 and back["migration_bytes"][12, 3] == row
    assert X.evaluate(STATE)["experts_moved"] == 0  # nothing edited yet


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_registered_policy_gives_a_valid_placement_from_the_current_loads(name):
    s = apply_policy(STATE, name)
    ev = X.evaluate(s)
    assert ev["placement"].num_experts == 16 and ev["fits_memory"]
    assert s.moved_from == X.placement_of(STATE).holders  # its migration is priced from where we were
    assert ev["rank_tokens"].sum() == X.evaluate(STATE)["rank_tokens"].sum()  # every token still computed


def test_policies_do_what_their_papers_say_on_a_hot_expert():
    hot = X.hottest_expert(STATE)
    base = X.evaluate(STATE)
    fm = X.evaluate(apply_policy(STATE, "FasterMoE shadowing"))
    assert len(fm["placement"].holders[hot]) == 16  # the shadowed expert is on every rank
    lina = X.evaluate(apply_policy(STATE, "Lina popularity"))
    assert len(lina["placement"].holders[hot]) > 1 and lina["max_load"] < base["max_load"]
    flex = X.evaluate(apply_policy(STATE, "FlexMoE"))
    assert flex["max_load"] < base["max_load"]  # Expand steps on the hot expert
    smart = apply_policy(STATE, "SmartMoE")
    assert X.placement_of(smart).is_trivial  # a permutation: owners only
    with pytest.raises(ValueError, match="unknown placement policy"):
        apply_policy(STATE, "nope")


def test_a_policy_that_places_no_replica_says_why():
    from moelab.viz.explorer_policies import decide

    s, note = decide(STATE, "Hecate Alg. 1")
    t = int(note.split("t = ")[1].split(",")[0])
    assert note.startswith("Hecate: overlap degree t = ") and "memory slots m = " in note
    if X.placement_of(s).num_replicas == 0:
        assert t == 0 and "keeps the sharding" in note or "no memory left" in note
    assert decide(STATE, "SmartMoE")[1] == ""


# ---- Hecate's pricing: spAG / spRS from Hecate's own simulator graph ----------------------------------
def _hecate_graph(state):
    """Hecate's registered simulator graph for the state's plan (P = owners, P' = holders), built here."""
    from moelab.sim.graphs import get_graph

    L = X.layer_loads(state)
    N, E = L.shape
    cfg = X.sim_config(state, E, int(round(L.sum() / (state.top_k * N))))
    prof = X.profile_of(state)
    pl = X.placement_of(state)
    g = get_graph("hecate")(cfg, prof, L[None], owners=[[h[0] for h in pl.holders]], holders=[pl.holders],
                            elem_bytes=prof.elem_bytes)
    return cfg, g, simulate(g)


def test_hecate_prices_spag_and_sprs_equal_to_hecates_graph_for_the_same_plan():
    s = X.with_strategy(X.toggle_replica(X.toggle_replica(STATE, 0, 9), 0, 3), "hecate")
    ev = X.evaluate(s)
    cfg, g, res = _hecate_graph(s)
    ops, topo = res.ops_frame(), topology_of(cfg)
    assert not (ops.category == "replica_sync").any() and (ops.category == "spag").any()  # spAG/spRS replace it
    for cat in ("spag", "sprs"):
        o = ops[ops.category == cat]
        assert ev[f"{cat}_s"] == pytest.approx(float(o.end.max() - o.start.min()), rel=1e-12)
        gb = graph_bytes(g, topo, categories={cat})
        assert ev[f"{cat}_bytes"].values.tolist() == [[gb[r][c] for c in LINK_CLASSES] for r in range(16)]
        # each replica gathers its expert's parameters whole from the owner (spAG), its gradient goes back (spRS)
        row = expert_param_count(cfg.model) * X.profile_of(s).elem_bytes
        assert ev[f"{cat}_bytes"].values.sum() == 2 * row
    assert ev["replica_sync_bytes"].values.sum() == 0
    assert ev["iteration_s"] == pytest.approx(float(res.makespan), rel=1e-12)
    assert ev["layer_time_s"] == pytest.approx(ev["fwd_s"] + ev["bwd_s"] + ev["sprs_exposed_s"])
    assert 0 <= ev["spag_exposed_s"] <= ev["spag_s"] and 0 <= ev["sprs_exposed_s"] <= ev["sprs_s"]
    assert "spAG" in X.summary_text(ev) and "Hecate" in ev["label"]
    # without replicas nothing is gathered or reduced
    plain = X.evaluate(X.with_strategy(STATE, "hecate"))
    assert plain["spag_bytes"].values.sum() == 0 and plain["sprs_s"] == 0.0


def test_hecate_migration_moves_owners_only_and_is_the_graphs_migrate_op():
    base = X.with_strategy(X.toggle_replica(STATE, 0, 9), "hecate")
    s = X.set_owner(X.toggle_replica(base, 0, 9), 5, 12)  # a replica dropped (rebuilt each iteration) + an owner moved
    ev = X.evaluate(s)
    cfg = X.sim_config(s, 16, 1)
    row = migration_row_bytes(expert_param_count(cfg.model), X.profile_of(s).elem_bytes)
    old = X.placement_of(base).holders[5][0]
    assert ev["experts_moved"] == 1 and ev["migration_bytes"][old, 12] == row and ev["migration_bytes"].sum() == row
    mig = ev["result"].ops_frame()
    mig = mig[mig.category == "migrate"]
    assert len(mig) == 1 and ev["migration_s"] == pytest.approx(float(mig.duration.iloc[0]), rel=1e-12)


def test_hecate_policies_are_priced_as_hecate_and_the_others_as_ep():
    from moelab.viz.explorer_policies import decide

    s = X.with_strategy(STATE, "hecate")
    assert decide(STATE, "Hecate Alg. 2")[0].strategy == "hecate"
    assert decide(s, "FlexMoE")[0].strategy == "ep"
    with pytest.raises(ValueError, match="strategy"):
        X.with_strategy(STATE, "zero")
