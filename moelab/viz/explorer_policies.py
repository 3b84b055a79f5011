"""Starting points for the placement explorer: each registered placement policy applied to the current loads.

Every strategy declares its placement decisions (``Strategy.placement_policies``: button name -> ``"module:function"``,
each a pure ``fn(PolicyQuery) -> holders | (holders, note)`` in the strategy's own package), so this module names no
system: it builds a :class:`moelab.placement.query.PolicyQuery` from the explorer's state and its simulated
evaluation (the layer's loads, the owners, the cluster, the attention forward a gather can hide behind, the memory the
busiest rank has left at peak) and applies what the strategy returns with :func:`moelab.viz.explorer_state.with_holders`
(so the migration from the current placement is priced); the user edits from there. A strategy the explorer can price
by its own graph (:data:`moelab.viz.explorer_state.STRATEGIES`: Hecate's spAG / spRS) prices its policies' placements
so; the others are priced by expert parallelism with the replicas' gradient sync. :func:`register_policy` adds one of
the user's own (``fn(state, ev)``).
"""
from __future__ import annotations

import importlib
from typing import Callable

from moelab.placement.query import PolicyQuery
from moelab.registry import all_strategies
from moelab.viz.explorer_cost import evaluate
from moelab.viz.explorer_state import STRATEGIES, ExplorerState, placement_of, profile_of, with_holders, with_strategy

POLICIES: dict = {}  # name -> (fn(state, ev) -> holders | (holders, note), one line saying what it does)
POLICY_STRATEGY: dict = {}  # name -> how its placement is priced (explorer_state.STRATEGIES)


def register_policy(name: str, fn: Callable, doc: str, strategy: str = "ep") -> Callable:
    """Offer ``fn(state, ev) -> holders`` as a starting point named ``name`` (one button in the widget); its
    placement is priced as ``strategy`` (``"hecate"``: by Hecate's spAG / spRS graph, the strategy that executes it)."""
    POLICIES[name] = (fn, doc)
    POLICY_STRATEGY[name] = strategy
    return fn


def query_of(state: ExplorerState, ev: dict) -> PolicyQuery:
    """What a strategy's policy is asked: this state's layer loads and cluster, from its evaluation ``ev``."""
    ops = ev["result"].ops_frame()
    return PolicyQuery(loads=ev["loads"], owners=tuple(int(h[0]) for h in placement_of(state).holders),
                       profile=profile_of(state), d_model=state.d_model, d_ff=state.d_ff,
                       attention_s=float(ops[ops.name == "L0.attn.fwd"].duration.max()),
                       free_bytes=max(0.0, ev["memory_limit"] - float(ev["memory"]["total"].max())))


def _register_strategies() -> None:
    for s in all_strategies():
        for name, spec in s.placement_policies:
            mod, attr = spec.split(":")
            fn = getattr(importlib.import_module(mod), attr)
            register_policy(name, lambda state, ev, fn=fn: fn(query_of(state, ev)), (fn.__doc__ or "").split("\n")[0],
                            s.name if s.name in STRATEGIES else "ep")


def apply_policy(state: ExplorerState, name: str, ev: dict = None) -> ExplorerState:
    """``state`` with the placement policy ``name`` decides for its current loads (``ev``: its evaluation,
    computed when not given). ValueError when the policy does not apply (e.g. experts not divisible by ranks)."""
    return decide(state, name, ev)[0]


def decide(state: ExplorerState, name: str, ev: dict = None) -> tuple:
    """``(new state, note)``: :func:`apply_policy` and what the policy said about its decision ("" if nothing)."""
    if name not in POLICIES:
        raise ValueError(f"unknown placement policy {name!r}; known: {sorted(POLICIES)}")
    ev = ev if ev is not None else evaluate(state)
    out = POLICIES[name][0](state, ev)
    holders, note = out if len(out) == 2 and isinstance(out[1], str) else (out, "")
    return with_strategy(with_holders(state, holders), POLICY_STRATEGY.get(name, "ep")), note


_register_strategies()

__all__ = ["POLICIES", "POLICY_STRATEGY", "register_policy", "apply_policy", "decide", "query_of"]
