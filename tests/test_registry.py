"""The strategy object: one registration, one options parser, validation before launch (no processes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import pytest

from moelab.config import ConfigError, RunConfig
from moelab.registry import (
    _REGISTRY,
    Strategy,
    StrategyOptions,
    all_strategies,
    get,
    get_update,
    known_strategies,
    register_strategy,
)


class ToyError(ConfigError):
    pass


@dataclass(frozen=True)
class ToyOptions(StrategyOptions):
    strategy = "toy"
    error = ToyError

    on: bool = False
    n: int = 2
    rate: float = 0.5
    mode: str = field(default="a", metadata={"choices": ("a", "b")})
    ids: Optional[Tuple[int, ...]] = field(default=None, metadata={"type": tuple})
    cap: Optional[int] = field(default=None, metadata={"type": int})

    def value_errors(self):
        return [f"n must be >= 1, got {self.n}"] if self.n < 1 else []

    def run_errors(self, run_cfg):
        return ["toy needs 2 ranks"] if run_cfg.parallel.nproc != 2 else []


@pytest.fixture
def toy():
    s = register_strategy(Strategy("toy", options=ToyOptions, conformance=({}, {"on": True})))
    yield s
    _REGISTRY.pop("toy", None)


def test_shared_from_dict_coerces_and_names_every_bad_option():
    o = ToyOptions.from_dict({"on": True, "n": "3", "rate": "1e-2", "mode": "b", "ids": [3, 1], "cap": 4.0})
    assert (o.on, o.n, o.rate, o.mode, o.ids, o.cap) == (True, 3, 0.01, "b", (1, 3), 4)
    assert ToyOptions.from_dict({"ids": 2}).ids == (2,) and ToyOptions.from_dict(None) == ToyOptions()
    with pytest.raises(ToyError, match=r"unknown toy option\(s\) \['nn'\]"):
        ToyOptions.from_dict({"nn": 1})
    with pytest.raises(ToyError) as e:
        ToyOptions.from_dict({"on": "yes", "n": 1.5, "rate": "fast", "mode": "c", "ids": ["x"]})
    msg = str(e.value)
    for part in ("on must be true or false", "n must be an integer", "rate must be a number",
                 "mode must be one of ['a', 'b']", "ids must be a list of integers"):
        assert part in msg
    with pytest.raises(ToyError, match="n must be >= 1"):
        ToyOptions.from_dict({"n": 0})


def test_bind_checks_the_run_and_config_validation_reports_it(toy):
    cfg = RunConfig().with_overrides({"parallel.nproc": 2, "parallel.strategy": "toy",
                                      "parallel.strategy_options": {"n": 2}})
    assert toy.bind(cfg) == ToyOptions(n=2)
    assert toy.layer_class(cfg) is None  # no layer of its own: the core MoELayer
    cfg.validate()
    with pytest.raises(ConfigError, match="toy needs 2 ranks"):
        cfg.with_overrides({"parallel.nproc": 4}).validate()
    with pytest.raises(ConfigError, match="takes no strategy_options"):
        RunConfig().with_overrides({"parallel.strategy_options": {"n": 1}}).validate()


def test_registry_lists_builtins_and_new_strategies(toy):
    assert {"ep", "fastermoe", "zero", "toy"} <= known_strategies()
    names = [s.name for s in all_strategies()]
    assert names == sorted(names) and "toy" in names
    assert get("zero").update is get_update("zero") is not None and get_update("ep") is None
    assert get("fastermoe").graph().__name__ == "fastermoe_iteration_graph"
    with pytest.raises(KeyError, match="unknown strategy 'nope'"):
        get("nope")


def test_a_registered_gate_passes_validation_an_unknown_one_does_not():
    from moelab.moe.gates import GATES, register_gate, topk_rule

    register_gate("toy_gate", topk_rule)
    try:
        RunConfig().with_overrides({"model.moe.gate": "toy_gate"}).validate()
    finally:
        GATES.pop("toy_gate")
    with pytest.raises(ConfigError, match="model.moe.gate must be one of"):
        RunConfig().with_overrides({"model.moe.gate": "toy_gate"}).validate()


def _toy_plan(cfg, records):
    return {"hot": [r["layer"] for r in records if r.get("hot")]}


def test_sim_plan_maps_an_iterations_records_to_graph_kwargs():
    cfg = RunConfig()
    s = Strategy("toy_plan", sim_plan=_toy_plan)
    assert s.graph_kwargs(cfg, [{"layer": 0, "hot": True}, {"layer": 1}]) == {"hot": [0]}
    by_name = Strategy("toy_plan2", sim_plan=f"{__name__}:_toy_plan")
    assert by_name.graph_kwargs(cfg, [{"layer": 3, "hot": 1}]) == {"hot": [3]}
    assert Strategy("toy_none").graph_kwargs(cfg, [{"layer": 0}]) == {}  # no sim_plan: no kwargs


def test_real_run_graph_plans_apply_the_strategys_sim_plan():
    import numpy as np

    from moelab.measure.realruns import RealRun

    s = register_strategy(Strategy("toy_plan3", sim_plan=_toy_plan))
    try:
        cfg = RunConfig().with_overrides({"parallel.strategy": "toy_plan3"})
        run = RealRun(cfg, np.zeros((2, 1)), np.zeros((2, 1, 1, 1)), None, None,
                      plans=[[{"iter": 0, "layer": 0}], [{"iter": 1, "layer": 0, "hot": True}]])
        assert run.graph_plans() == [{"hot": []}, {"hot": [0]}]
    finally:
        _REGISTRY.pop(s.name, None)
