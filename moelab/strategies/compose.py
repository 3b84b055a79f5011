"""A run of several techniques (:mod:`moelab.techniques`): the strategy named by joining them with ``+``.

:func:`composed` checks the choice (one technique per axis, no conflict in their declarations) and registers
the composed :class:`moelab.registry.Strategy`:

- options: ``parallel.strategy_options`` keyed by technique (``{lsh_moe: {hash_family: identity}}``), each
  bound by that technique's own options class and checked against the run as it alone would see it
  (:func:`view`); a key naming a technique not chosen, or options a technique only runs alone with
  (``Technique.alone_only``), are refused before launch;
- layer: one class built from the techniques' layer classes in :data:`moelab.techniques.MRO_AXES` order
  (a schedule's wrap first, then the placement, the wire format), each *scoped* (:func:`scoped`): while a
  technique's method runs (its ``__init__`` included), ``self.options`` is that technique's options, so
  classes written alone compose unedited. Outside any of them ``layer.options`` is the options of the
  technique owning the update (the update reads its layer's options); ``layer.technique_options`` has all;
  ``layer.last_metrics`` merges what each technique's methods set during the call (Lina's scheduler
  counters beside LSH-MoE's compression rate), none overwriting another's;
- update and groups: from the technique that owns them (at most one, by the conflict rule), given the run
  as that technique alone would see it; the data-parallel update when none owns it;
- conformance: the techniques' option sets that keep the EP model, paired in turn (every set of each
  technique once, no per-combination list);
- simulator: each technique's contribution to the iteration skeleton (``Technique.sim``), built into one
  graph by :func:`moelab.sim.compose.composed_graph` (no per-combination code); its plan keyword arguments
  keyed by technique, each from that technique's own ``sim_plan`` on its view of the run. A composition with
  a technique declaring no contribution is refused (``sim_refused``) with the reason.
"""
from __future__ import annotations

import functools
import importlib
import inspect

from moelab.config import ConfigError
from moelab.registry import _REGISTRY, Strategy, StrategyOptions, get, register_strategy
from moelab.sim.compose import composed_graph
from moelab.techniques import AXES, SEP, all_techniques, compatibility, name_of, parse, sim_refusal

_MISSING = object()


def axis_errors(axes: dict) -> list:
    """``parallel.techniques``: known axes, each technique named for its own axis."""
    try:
        parse(dict(axes))
    except ValueError as e:
        return [str(e)]
    return []


def strategy_of(technique) -> Strategy:
    return get(technique.name)


def view(run_cfg, technique, given=None):
    """``run_cfg`` as ``technique``'s strategy alone would see it: its name, its own options."""
    opts = dict(run_cfg.parallel.strategy_options or {}) if given is None else given
    return run_cfg.with_overrides({"parallel.techniques": {}, "parallel.strategy": technique.name,
                                   "parallel.strategy_options": dict(opts.get(technique.name) or {})})


def composed(name: str) -> Strategy:
    """Register (once) and return the strategy composing the techniques ``name`` joins; a ValueError naming
    the choice and the reason when they cannot run together."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    techs = parse(name)
    if len(techs) < 2:
        raise ValueError(f"a composition names two or more techniques, got {name!r}")
    owner = {hook: t for t in techs for hook in t.owns}
    opts_cls = _options_class(name, techs)
    upd, grp = owner.get("update"), owner.get("groups")
    s = register_strategy(Strategy(
        name, options=opts_cls, layer=functools.partial(_layer, techs),
        update=_update(strategy_of(upd), upd) if upd is not None else None,
        groups=(lambda cfg: strategy_of(grp).declared_groups(view(cfg, grp))) if grp is not None else None,
        own_expert_layout=False, techniques=techs, sim_refused=sim_refusal(techs), conformance=_conformance(techs),
        sim_graph=_sim_graph(techs), sim_plan=_sim_plan(techs),
        doc="composed: " + ", ".join(f"{t.axis} {t.name}" for t in techs)))
    return s


def _options_class(name, techs):
    class ComposedOptions(StrategyOptions):
        """{technique: its options}, each bound by the technique's own class."""

        strategy = name

        def __init__(self, by_tech: dict):
            self.by_tech = by_tech

        @classmethod
        def from_dict(cls, d):
            d = dict(d or {})
            chosen = [t.name for t in techs]
            stray = sorted(set(d) - set(chosen))
            if stray:
                raise ConfigError(f"parallel.strategy_options of {name!r} names technique(s) {stray} not chosen "
                                  f"(keys are the chosen techniques {chosen}, each with its own options)")
            out, errs = {}, []
            for t in techs:
                oc = strategy_of(t).options
                given = d.get(t.name)
                if oc is None:
                    if given:
                        errs.append(f"{t.name} takes no options, got {sorted(given)}")
                    out[t.name] = None
                    continue
                out[t.name] = o = oc.from_dict(given)
                why = t.alone_only(o) if t.alone_only is not None else None
                if why:
                    errs.append(f"{t.name} {dict(given or {})} runs alone only: {why}")
            cls.raise_if(errs)
            return cls(out)

        def run_errors(self, run_cfg) -> list:
            given = {k: dict(v or {}) for k, v in (run_cfg.parallel.strategy_options or {}).items()}
            errs = []
            for t in techs:
                o = self.by_tech[t.name]
                if o is not None:
                    errs += [f"{t.name}: {e}" for e in o.run_errors(view(run_cfg, t, given))]
            return errs

    return ComposedOptions


# ---- the layer ---------------------------------------------------------------------------------------
def _scope(fn, key):
    @functools.wraps(fn)
    def call(self, *a, **kw):
        d = self.__dict__
        prev = d.get("options", _MISSING)
        d["options"] = d["technique_options"][key]
        try:
            if fn.__name__ == "__init__":
                kw.update(d["_technique_kw"][key])
            return fn(self, *a, **kw)
        finally:
            if prev is _MISSING:
                d.pop("options", None)
            else:
                d["options"] = prev
    return call


@functools.lru_cache(maxsize=None)
def scoped(cls, key: str):
    """``cls`` whose own methods (``__init__`` and properties included) see ``self.options`` as the options of
    technique ``key`` while they run (and whose ``__init__`` receives that technique's keyword arguments)."""
    body = {}
    for k, v in vars(cls).items():
        if isinstance(v, property):
            body[k] = property(_scope(v.fget, key), v.fset and _scope(v.fset, key))
        elif callable(v) and not isinstance(v, (type, staticmethod, classmethod)) and (
                k == "__init__" or not k.startswith("__")):
            body[k] = _scope(v, key)
    return type(cls.__name__, (cls,), body)


def _layer(techs, run_cfg, opts):
    """The composed layer class of a run: the techniques' layer classes, each scoped to its options."""
    parts = []
    for t in techs:
        o = opts.by_tech[t.name]
        made = strategy_of(t).layer(view(run_cfg, t), o) if strategy_of(t).layer is not None else None
        if made is None:
            continue
        cls, kw = (made.func, dict(made.keywords)) if isinstance(made, functools.partial) else (made, {})
        parts.append((t, cls, kw))
    bases = tuple(scoped(cls, t.name) for t, cls, _ in parts)
    kws = {t.name: kw for t, _, kw in parts}
    by_tech = dict(opts.by_tech)
    primary = next((t.name for t in techs if "update" in t.owns), parts[0][0].name)

    def __init__(self, *a, **kw):
        object.__setattr__(self, "technique_options", by_tech)
        object.__setattr__(self, "_technique_kw", kws)
        super(composed_cls, self).__init__(*a, **kw)
        self.__dict__["options"] = by_tech[primary]

    def forward(self, x):
        self.__dict__["_composed_metrics"] = {}  # this call's metrics: every technique's, merged
        return super(composed_cls, self).forward(x)

    def metrics(self):
        return self.__dict__.setdefault("_composed_metrics", {})

    def set_metrics(self, m):  # each technique assigns its own dict: merged, none overwrites another's
        self.__dict__.setdefault("_composed_metrics", {}).update(m or {})

    composed_cls = type(name_of(techs), bases, {"__init__": __init__, "forward": forward,
                                                "last_metrics": property(metrics, set_metrics)})
    return composed_cls


def _update(strategy, technique):
    """The update of the technique owning it, built on the run as that technique alone sees it."""
    u = strategy.update
    if isinstance(u, type):
        return type(u.__name__, (u,), {"__init__": lambda self, model, comm, cfg, **kw:
                                       u.__init__(self, model, comm, view(cfg, technique), **kw)})

    def update(model, comm, cfg):
        return u(model, comm, view(cfg, technique))

    update.__dict__.update(vars(u))  # checkpoint_ready and the like
    return update


def _conformance(techs) -> tuple:
    """Each technique's option sets that keep the EP model (and may compose), paired in turn."""
    sets = []
    for t in techs:
        s = strategy_of(t)
        keep = [o for o in s.conformance if not s.changes_model_with(o) and not _alone(t, s, o)]
        sets.append(keep)
    if not all(sets):
        return ()
    n = max(len(k) for k in sets)
    return tuple({t.name: k[i % len(k)] for t, k in zip(techs, sets)} for i in range(n))


def _alone(t, s, o) -> bool:
    return t.alone_only is not None and s.options is not None and bool(t.alone_only(s.options.from_dict(o)))


# ---- the simulator ------------------------------------------------------------------------------------
def contribution_fn(technique):
    """The function a technique declares for its simulator contribution (``Technique.sim``)."""
    mod, fn = technique.sim.split(":")
    return getattr(importlib.import_module(mod), fn)


def _sim_graph(techs):
    """The composed strategy's ``sim_graph``: each technique's contribution on its view of the run (its plan
    keyword arguments under its name), one graph; a contribution priced to a steady state (Lina's planned
    launches) rebuilds the whole composition with its windows."""
    def graph(cfg, profile, loads, placement=None, *, elem_bytes=None, hierarchical_a2a=False, **plan):
        stray = sorted(set(plan) - {t.name for t in techs})
        if stray:
            raise TypeError(f"{name_of(techs)}'s graph takes plan keywords keyed by technique, got {stray}")

        def build(extra):
            parts = []
            for t in techs:
                fn = contribution_fn(t)
                kw = {**dict(plan.get(t.name) or {}), **extra.get(t.name, {})}
                common = {"elem_bytes": elem_bytes, "hierarchical_a2a": hierarchical_a2a}
                kw.update({k: v for k, v in common.items() if k in inspect.signature(fn).parameters})
                parts.append((t, fn(view(cfg, t), profile, loads, placement, **kw)))
            for t, p in parts:
                if p.steady is not None:
                    return p.steady(lambda w, t=t: build({**extra, t.name: {"windows": w}}))
            return composed_graph(cfg, profile, loads, placement, [p for _, p in parts], elem_bytes=elem_bytes,
                                  hierarchical_a2a=hierarchical_a2a, meta={"strategy": name_of(techs)})
        return build({})
    return graph


def _sim_plan(techs):
    """The composed strategy's ``sim_plan``: each technique's own, on its view of the run, under its name."""
    def plan(cfg, records):
        return {t.name: strategy_of(t).graph_kwargs(view(cfg, t), records) for t in techs}
    return plan


def compatible_strategies() -> list:
    """The composed strategy of every compatible pair of techniques (registered)."""
    return [composed(SEP.join((a, b))) for a, b, why in compatibility() if why is None]


def pairs_by_axis() -> dict:
    """axis -> techniques on it (the choices a run has)."""
    ts = all_techniques()
    return {a: sorted(n for n, t in ts.items() if t.axis == a) for a in AXES}


__all__ = ["composed", "compatible_strategies", "axis_errors", "scoped", "view", "contribution_fn"]
