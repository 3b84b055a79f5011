"""The strategy registry: one :class:`Strategy` object per system, registered once by name.

A strategy is everything a system changes, as data the core reads:

- ``options``: a :class:`StrategyOptions` dataclass (one shared
  ``from_dict``); bound from ``parallel.strategy_options`` and checked against the run before any
  process starts (:meth:`Strategy.bind`);
- ``layer``: ``(run_cfg, options) -> MoE layer class`` taking :class:`moelab.moe.layer.MoELayer`'s
  constructor arguments (usually a subclass overriding only the stages it changes); None: the core
  layer;
- ``update``: a :class:`moelab.runtime.update.Update` subclass (gradient sync + optimizer) or None
  (the data-parallel update ``parallel.grad_sync`` names);
- ``sim_graph``: the simulator's iteration graph ``(cfg, profile, loads, placement=None, **kw) ->
  OpGraph`` (or ``"module:function"``, imported when first priced); None: the EP graph;
- ``sim_plan``: ``(cfg, records) -> dict`` (or ``"module:function"``): one iteration's plan records
  (``layer.plan_record()`` of every MoE layer, as in ``plans.jsonl``) as keyword arguments of
  ``sim_graph``, so the simulator prices the plan the runtime executed (a re-sharding, a replica set,
  a calibration); None: no per-iteration arguments;
- ``groups``: ``run_cfg -> {name: [[ranks], ...]}``, process groups the strategy needs beyond the
  core's (Parm's MP/ESP, Lina's expert-DP); None: none;
- ``data_shard``: ``(run_cfg, rank, world) -> (index, count)``: which of ``count`` distinct data
  shards a rank reads (the loss is averaged over them); None: ``(rank, world)``. Parm: one
  micro-batch per MP group, replicated on its ranks;
- ``prepare_model``: ``(run_cfg, model, comm) -> None``: reshape the built model in place before the
  update sees it (Parm: tensor-parallel dense parts); ``own_expert_layout``: the strategy checks the
  expert count against its own layout (Parm: N_EP divides E), so the core's "experts divisible by
  ranks" does not apply;
- ``conformance``: option sets the conformance suite (``tests/strategies/test_conformance.py``) runs on every
  registered strategy automatically: fp64 reference with edge loads, training equivalence with the
  1-rank run, simulated bytes == measured bytes. ``changes_model``: the option names that make a
  strategy train a different model on purpose when true (FasterMoE's topology gate), or a predicate
  on the option dict (LSH-MoE: every hash family but identity); such option sets are exempt from the
  equivalences (:meth:`Strategy.changes_model_with`).
- ``serve``: ``(run_cfg, comm, options) -> server`` (or ``"module:function"``): the strategy's inference
  server, which ``moelab serve`` runs when ``serve.strategy`` names it (:mod:`moelab.runtime.serve` says what
  a server provides); ``serve_options``: its :class:`StrategyOptions` for ``serve.strategy_options``, checked
  like ``options`` and handed to ``serve`` bound (:meth:`Strategy.bind_serve`; None without them). None: the
  strategy does not serve.

- ``placement_policies``: ``((name, "module:function"), ...)``, the strategy's placement decisions as pure functions
  of a :class:`moelab.placement.query.PolicyQuery` (one layer's loads and the cluster), which the placement explorer
  offers as starting points without naming any system.

``ep`` (the baseline itself) is registered here. Built-in strategies are the subpackages of
:mod:`moelab.strategies`, each registering the strategy of its own name; one is imported by name on first
use, so the validator and the launcher can ask :func:`known_strategies` before any process starts without
importing everything. A new system adds one subpackage; a user's own strategy calls
:func:`register_strategy` before launching.

Why a leaf module: the runtime, the process groups and the simulator look strategies up by name, and the
strategies build on all of them. The registry sits low (it needs only :mod:`moelab.config`), and a
strategy's code is reached through the name at run time, never imported by the core.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional, Union

from moelab.config import ConfigError


# ---- a strategy's options ------------------------------------------------------------------------
# One ``from_dict`` for every strategy's options (``parallel.strategy_options``).
#
# A strategy's options are a frozen dataclass deriving from :class:`StrategyOptions`; the field's
# default says its type (``bool``, ``int``, ``float``, ``str``; ``None`` defaults name their type in
# ``field(metadata={"type": int})``), and ``metadata={"choices": (...)}`` restricts a value. The
# shared :meth:`StrategyOptions.from_dict` rejects unknown keys, coerces numbers given as strings
# (CLI, YAML 1.1), collects every error into one message naming each option, then asks the subclass
# for value checks (:meth:`value_errors`). Checks that need the run's shape (experts, ranks, gate)
# go in :meth:`run_errors`, called by :meth:`moelab.registry.Strategy.bind` before launch.
class StrategyOptions:
    """Base of a strategy's options dataclass (see module doc)."""

    strategy: ClassVar[str] = "strategy"  # the name used in messages
    error: ClassVar[type] = ConfigError  # the strategy's own ConfigError subclass

    @classmethod
    def from_dict(cls, d: Optional[dict]):
        d = dict(d or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise cls.error(f"unknown {cls.strategy} option(s) {unknown}; known: {sorted(fields)}")
        errs, kw = [], {}
        for name, v in d.items():
            try:
                kw[name] = cls.coerce(fields[name], v)
            except (TypeError, ValueError) as e:
                errs.append(str(e))
        cls.raise_if(errs)
        opts = cls(**kw)
        cls.raise_if(opts.value_errors())
        return opts

    @classmethod
    def raise_if(cls, errs) -> None:
        if errs:
            raise cls.error(f"invalid {cls.strategy} option(s):\n  - " + "\n  - ".join(errs))

    @classmethod
    def coerce(cls, f: dataclasses.Field, v):
        """``v`` as the field's type, or a TypeError/ValueError naming the option."""
        name, default = f.name, f.default
        kind = f.metadata.get("type", type(default))
        if v is None and default is None:
            return None
        if kind is bool:
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be true or false, got {v!r}")
        elif kind is int:
            if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                raise TypeError(f"{name} must be an integer, got {v!r}")
            try:
                x = float(v)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {v!r}") from None
            if x != int(x):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            v = int(x)
        elif kind is float:
            if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                raise TypeError(f"{name} must be a number, got {v!r}")
            try:
                v = float(v)
            except ValueError:
                raise ValueError(f"{name} must be a number, got {v!r}") from None
        elif kind is tuple:  # a list of integers (expert ids, ranks), kept sorted
            if isinstance(v, int) and not isinstance(v, bool):
                v = [v]
            if not isinstance(v, (list, tuple)) or not all(isinstance(e, int) and not isinstance(e, bool) for e in v):
                raise TypeError(f"{name} must be a list of integers or null, got {v!r}")
            v = tuple(sorted(int(e) for e in v))
        choices = f.metadata.get("choices")
        if choices is not None and v not in choices:
            why = f.metadata.get("why", "")
            raise ValueError(f"{name} must be one of {list(choices)}{' (' + why + ')' if why else ''}, got {v!r}")
        return v

    def value_errors(self) -> list:
        """Messages for values that are wrong whatever the run (ranges, combinations)."""
        return []

    def run_errors(self, run_cfg) -> list:
        """Messages for values that do not fit this run (expert count, ranks, gate, dispatcher)."""
        return []


# ---- the registry ----------------------------------------------------------------------------------
_REGISTRY: dict = {}
_PACKAGE = "moelab.strategies"  # its subpackages are the built-in strategies, each registering its own name
COMPOSED, _COMPOSER = "+", "moelab.strategies.compose"  # "a+b": techniques a and b in one run


@functools.lru_cache(maxsize=1)
def _builtin() -> dict:
    """name -> module of every built-in strategy (the subpackages of :mod:`moelab.strategies`), found on disk
    once per process."""
    import pkgutil

    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return {}
    return {m.name: f"{_PACKAGE}.{m.name}" for m in pkgutil.iter_modules(spec.submodule_search_locations) if m.ispkg}


@dataclass(frozen=True)
class Strategy:
    name: str
    options: Optional[type] = None
    layer: Optional[Callable] = None
    update: Optional[type] = None
    sim_graph: Union[Callable, str, None] = None
    sim_plan: Union[Callable, str, None] = None
    groups: Optional[Callable] = None
    data_shard: Optional[Callable] = None
    prepare_model: Optional[Callable] = None
    own_expert_layout: bool = False
    # every rank's ``layer.last_global_counts`` is one matrix (a count exchange);
    # False: each rank's gating pool's (Parm)
    shared_loads: bool = True
    conformance: tuple = ({},)  # option dicts for the conformance suite
    changes_model: Union[tuple, Callable] = ()  # option names (or a predicate) that change the trained model
    serve: Union[Callable, str, None] = None  # (run_cfg, comm, options) -> server (moelab.runtime.serve)
    serve_options: Optional[type] = None  # StrategyOptions of serve.strategy_options
    # the techniques (moelab.techniques.Technique) this strategy is made of; a name joining several with "+"
    # is their composition (moelab.strategies.compose, built on first use)
    techniques: tuple = ()
    sim_refused: str = ""  # why the simulator cannot price this strategy (SIMULATED refused); "" : it can
    # ((button name, "module:function"), ...): the placement policies the explorer offers as starting points,
    # each fn(moelab.placement.query.PolicyQuery) -> holders | (holders, note)
    placement_policies: tuple = ()
    doc: str = ""
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def changes_model_with(self, opts: dict) -> bool:
        """Whether option dict ``opts`` trains a different model than EP on purpose."""
        if callable(self.changes_model):
            return bool(self.changes_model(dict(opts)))
        return any(opts.get(k) for k in self.changes_model)

    def _bind(self, options: Optional[type], section: str, run_cfg):
        """``section``'s ``strategy_options`` parsed by ``options`` and checked against the run (None without
        options; a ConfigError naming the option)."""
        given = getattr(run_cfg, section).strategy_options
        if options is None:
            if given:
                raise ConfigError(f"{section}.strategy {self.name!r} takes no strategy_options, got {sorted(given)}")
            return None
        opts = options.from_dict(given)
        opts.raise_if(opts.run_errors(run_cfg))
        return opts

    def bind(self, run_cfg):
        """The run's options (``parallel.strategy_options``), parsed and checked against the run."""
        return self._bind(self.options, "parallel", run_cfg)

    def bind_serve(self, run_cfg):
        """The run's serving options (``serve.strategy_options``), parsed and checked against the run."""
        if self.serve is None:
            raise ConfigError(f"strategy {self.name!r} has no server; serve.strategy must name one of "
                              f"{sorted(serving_strategies())}")
        return self._bind(self.serve_options, "serve", run_cfg)

    def server(self, run_cfg, comm):
        """This strategy's server for ``run_cfg`` on ``comm`` (:mod:`moelab.runtime.serve`), given its bound
        serving options."""
        return self._resolve("serve", self.serve)(run_cfg, comm, self.bind_serve(run_cfg))

    def layer_class(self, run_cfg):
        """The MoE layer class of this run (options bound), or None for the core layer."""
        opts = self.bind(run_cfg)
        return None if self.layer is None else self.layer(run_cfg, opts)

    def _resolve(self, key: str, ref):
        if isinstance(ref, str):
            if key not in self._cache:
                mod, fn = ref.split(":")
                self._cache[key] = getattr(importlib.import_module(mod), fn)
            return self._cache[key]
        return ref

    def graph(self) -> Optional[Callable]:
        if self.sim_refused:
            raise ConfigError(f"strategy {self.name!r} cannot be SIMULATED: {self.sim_refused}")
        return self._resolve("graph", self.sim_graph)

    def graph_kwargs(self, run_cfg, records) -> dict:
        """The simulator graph's keyword arguments for one iteration's plan ``records`` ({} without ``sim_plan``)."""
        fn = self._resolve("plan", self.sim_plan)
        return dict(fn(run_cfg, list(records))) if fn is not None else {}

    def declared_groups(self, run_cfg) -> dict:
        return dict(self.groups(run_cfg)) if self.groups is not None else {}

    def shard_of(self, run_cfg, rank: int, world: int) -> tuple:
        """(data shard index, distinct shards) of ``rank``."""
        return tuple(self.data_shard(run_cfg, rank, world)) if self.data_shard is not None else (rank, world)


def register_strategy(strategy: Strategy) -> Strategy:
    _REGISTRY[strategy.name] = strategy
    return strategy


def get(name: str) -> Strategy:
    """The registered :class:`Strategy` ``name`` (imports a built-in one on first use)."""
    if name not in _REGISTRY and name in _builtin():
        importlib.import_module(_builtin()[name])
    if name not in _REGISTRY and COMPOSED in name:  # techniques composed: built by the strategies' layer
        importlib.import_module(_COMPOSER).composed(name)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; known: {sorted(known_strategies())}") from None


def known_strategies() -> set:
    return set(_REGISTRY) | set(_builtin())


def strategy_known(name: str) -> bool:
    """``name`` is a known strategy, or a composition of techniques (``lina+lsh_moe``: checked when bound)."""
    return name in known_strategies() or COMPOSED in str(name)


def serving_strategies() -> set:
    """The names of the known strategies that declare a server (imports them)."""
    return {s.name for s in all_strategies() if s.serve is not None}


def all_strategies() -> list:
    """Every known strategy, imported and registered (the conformance suite iterates these)."""
    return [get(n) for n in sorted(known_strategies())]


def get_strategy(name: str):
    """The layer-class factory ``run_cfg -> layer class`` of ``name`` (None for the core layer)."""
    s = get(name)
    return None if s.layer is None else s.layer_class


def get_update(name: str):
    """The Update class of ``name`` (None: the data-parallel update of ``parallel.grad_sync``)."""
    return get(name).update


def strategy_errors(cfg) -> list:
    """``parallel.strategy`` is known and binds its options to the run (the strategy checks them; binding
    imports it, so the gates and dispatchers it registers exist afterwards)."""
    name = cfg.parallel.strategy
    if not strategy_known(name):
        return [f"parallel.strategy {name!r} is unknown; known: {sorted(known_strategies())}"]
    axes = getattr(cfg.parallel, "techniques", None)
    if axes:  # the axis map: each technique named for its own axis
        errs = importlib.import_module(_COMPOSER).axis_errors(axes)
        if errs:
            return errs
    try:
        strategy = get(name)
    except (KeyError, ValueError, ConfigError) as e:  # a composition the techniques refuse, with the reason
        return [f"parallel.strategy {name!r}: {e.args[0] if e.args else e}"]
    try:
        strategy.bind(cfg)
    except Exception as e:  # noqa: BLE001 - any complaint becomes a clear config error
        return [f"parallel.strategy_options for {name!r}: {e}"]
    return []


def get_groups(cfg) -> dict:
    """The process groups ``cfg``'s strategy declares, ``{group: [[ranks of one instance], ...]}``
    (``{}`` for none): each a partition of the ranks, checked before launch
    (:func:`moelab.comm.groups.validate_groups`) and created once by the trainer's communicator."""
    return get(cfg.parallel.strategy).declared_groups(cfg)


register_strategy(Strategy(
    "ep", sim_graph="moelab.sim.graphs:ep_iteration_graph",
    conformance=({},),
    doc="expert parallelism: the core layer and dispatchers, the data-parallel update"))
