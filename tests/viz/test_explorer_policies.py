"""The explorer's starting points are the strategies' own declared placement policies (``Strategy.placement_policies``),
reached through the registry, each asked the same :class:`moelab.placement.query.PolicyQuery`."""
from __future__ import annotations

import numpy as np

from moelab.placement.query import PolicyQuery
from moelab.registry import all_strategies
from moelab.viz import explorer as X
from moelab.viz.explorer_policies import POLICIES, POLICY_STRATEGY, decide, query_of
from moelab.viz.explorer_state import STRATEGIES


def test_every_declared_policy_is_a_button_priced_by_its_strategy_where_the_explorer_can():
    declared = {name: s.name for s in all_strategies() for name, _ in s.placement_policies}
    assert declared and set(declared) <= set(POLICIES)
    for name, strategy in declared.items():
        assert POLICY_STRATEGY[name] == (strategy if strategy in STRATEGIES else "ep")


def test_the_query_holds_the_state_and_its_evaluation():
    state = X.ExplorerState(profile="fastermoe_johnny", trace="synthetic:hot_expert", num_experts=16)
    ev = X.evaluate(state)
    q = query_of(state, ev)
    assert isinstance(q, PolicyQuery) and q.loads.shape == (X.world_of(state), state.num_experts)
    assert np.array_equal(q.loads, ev["loads"]) and q.attention_s > 0 and q.free_bytes >= 0
    assert q.owners == tuple(h[0] for h in X.placement_of(state).holders)
    # a declared policy answers the query with one holder tuple per expert, each on ranks of the cluster
    new, _ = decide(state, "SmartMoE", ev)
    assert len(X.placement_of(new).holders) == state.num_experts
