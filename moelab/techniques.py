"""Techniques on axes: what each system contributes to a MoE step, declared as data, and which combine.

A system (a registered :class:`moelab.registry.Strategy`) is made of *techniques*, each on one *axis* of a
MoE training step (:data:`AXES`): where experts live over time (``placement``), what the tokens look like on
the wire (``wire``), how collectives are ordered (``schedule``), how ranks are laid out (``layout``), how the
dense parameters are updated (``update``). Each axis has a default that changes nothing (static EP, plain
rows, plain order, EP x DP, the data-parallel update of ``parallel.grad_sync``): a strategy names only the
techniques it adds, in ``Strategy(techniques=(Technique(...), ...))``; ``parallel.strategy: lina`` is the
preset "Lina's schedule, every other axis its default".

A technique declares the *hooks* it **owns** (replaces; :data:`LAYER_STAGES` of
:class:`moelab.moe.layer.MoELayer`, and the strategy hooks :data:`RUN_HOOKS`), the stages it only **wraps**
(overrides and calls ``super()``: composes with whoever owns them), for a technique owning
``dispatch_compute_combine`` the chain stages it still **calls**, and what it **excludes** (by name, with the
reason). Two techniques conflict (:func:`conflict`) when they sit on the same axis, own the same hook, one
excludes the other, or one owns ``dispatch_compute_combine`` without calling a chain stage the other owns.
Everything else composes: :func:`compatibility` is generated from the declarations only, never a
hand-written pair table (``docs/compose.md`` is written from it by ``tests/test_techniques.py``).

A run composes techniques by naming them, one per axis: ``parallel.strategy: lina+lsh_moe`` (or the axis map
``parallel.techniques: {schedule: lina, wire: lsh_moe}``), with ``parallel.strategy_options`` keyed by
technique (``{lsh_moe: {hash_family: identity}}``); :mod:`moelab.strategies.compose` builds that run's
strategy (its layer from the techniques' layer classes, its update and groups from their owners) or refuses
it before any process starts (:func:`composition_errors`).

In the simulator a technique declares ``sim``: the function returning its
:class:`moelab.sim.compose.Contribution` (the skeleton's hooks it fills: a placement's per-layer placements and
migration, a wire format's token rows and count bytes, a schedule's dense sync and stream priorities); a
composition's graph is built from its techniques' contributions, and refused (:func:`sim_refusal`) where one
declares none.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional

AXES = ("placement", "wire", "schedule", "layout", "update")
DEFAULTS = {"placement": "static EP", "wire": "plain rows", "schedule": "plain order", "layout": "EP x DP",
            "update": "data parallel (parallel.grad_sync)"}
# The chain dispatch_compute_combine runs (MoELayer): a technique owning it replaces every stage it does not call.
CHAIN = ("materialize", "dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "compute_experts",
         "combine_preprocess", "token_combine", "combine_postprocess")
LAYER_STAGES = ("route", "exchange_counts", "place", "plan", "dispatch_compute_combine") + CHAIN
# Strategy hooks beside the layer: the Update, process groups, the expert layout (own_expert_layout: experts
# need not divide the ranks), data shards / model preparation (Parm), the layer class not being a MoELayer.
RUN_HOOKS = ("update", "groups", "expert_layout", "data_shard", "prepare_model", "own_layer")
HOOKS = LAYER_STAGES + RUN_HOOKS
WRAP_ONLY = ("forward", "plan_record")  # always wrapped (super() called), never owned
SEP = "+"  # a composed strategy's name: its techniques joined by SEP


@dataclass(frozen=True)
class Technique:
    """One technique: its name (the strategy that implements it), axis, the hooks it owns / wraps / calls,
    what it excludes ({name: reason}), and ``alone_only(options) -> reason or None`` for option values that
    only run alone (e.g. a policy replacing a chain a partner owns)."""

    name: str
    axis: str
    owns: tuple = ()
    wraps: tuple = ()
    calls: tuple = ()  # chain stages a dispatch_compute_combine owner still calls
    excludes: tuple = ()  # ((technique name, reason), ...)
    alone_only: Optional[Callable] = None
    doc: str = ""
    # "module:function" -> (cfg, profile, loads, placement, **plan) -> moelab.sim.compose.Contribution: what the
    # technique contributes to the simulator's iteration skeleton (None: a composition with it is not SIMULATED)
    sim: Optional[str] = None

    def __post_init__(self):
        if self.axis not in AXES:
            raise ValueError(f"technique {self.name!r}: axis {self.axis!r} is not one of {AXES}")
        bad = [h for h in (*self.owns, *self.wraps, *self.calls) if h not in HOOKS + WRAP_ONLY]
        if bad:
            raise ValueError(f"technique {self.name!r}: unknown hooks {bad}; known: {HOOKS}")

    def replaces(self) -> set:
        """Every hook this technique decides alone: those it owns, and the chain stages an owned
        ``dispatch_compute_combine`` does not call."""
        out = set(self.owns)
        if "dispatch_compute_combine" in out:
            out |= set(CHAIN) - set(self.calls)
        return out


def all_techniques() -> dict:
    """name -> :class:`Technique` of every known strategy (imports them)."""
    from moelab.registry import all_strategies

    out = {}
    for s in all_strategies():
        for t in getattr(s, "techniques", ()):
            out[t.name] = t
    return out


def conflict(a: Technique, b: Technique) -> Optional[str]:
    """Why ``a`` and ``b`` cannot run together, every reason (None: they compose), from their declarations only."""
    if a.axis == b.axis:
        return f"both on axis {a.axis} (a run names one technique per axis)"
    why = [f"{x.name} excludes {y.name}: {r}" for x, y in ((a, b), (b, a)) for name, r in x.excludes if name == y.name]
    both = sorted(set(a.owns) & set(b.owns))
    if both:
        why.append(f"both own {', '.join(both)}")
    for x, y in ((a, b), (b, a)):
        skipped = sorted((x.replaces() - set(x.owns)) & (set(y.owns) | set(y.wraps)))
        if skipped:
            why.append(f"{x.name}'s dispatch_compute_combine skips {y.name}'s {', '.join(skipped)}")
    return "; ".join(why) or None


def compatibility(techniques: Optional[dict] = None) -> list:
    """Every pair of techniques on different axes: ``(a, b, reason or None)``, sorted."""
    ts = techniques if techniques is not None else all_techniques()
    rows = []
    for a, b in itertools.combinations(sorted(ts), 2):
        if ts[a].axis != ts[b].axis:
            rows.append((a, b, conflict(ts[a], ts[b])))
    return rows


def parse(spec, techniques: Optional[dict] = None) -> tuple:
    """``"lina+lsh_moe"`` or ``{schedule: lina, wire: lsh_moe}`` -> the techniques, in the composed layer's
    order (:data:`MRO_AXES`); a ValueError naming the choice and the reason for anything that cannot run."""
    ts = techniques if techniques is not None else all_techniques()
    if isinstance(spec, dict):
        for axis, name in spec.items():
            if axis not in AXES:
                raise ValueError(f"parallel.techniques: {axis!r} is not an axis; axes: {list(AXES)}")
            if name in ts and ts[name].axis != axis:
                raise ValueError(f"parallel.techniques: {name!r} is a {ts[name].axis} technique, named for {axis}")
        names = [n for n in spec.values()]
    else:
        names = [n for n in str(spec).split(SEP) if n]
    unknown = [n for n in names if n not in ts]
    if unknown:
        raise ValueError(f"unknown technique(s) {unknown}; known: {sorted(ts)}")
    if len(set(names)) < len(names):
        raise ValueError(f"technique named twice in {names}")
    chosen = [ts[n] for n in names]
    by_axis: dict = {}
    for t in chosen:
        by_axis.setdefault(t.axis, []).append(t.name)
    twice = {a: ns for a, ns in by_axis.items() if len(ns) > 1}
    if twice:
        raise ValueError("axis named twice: " + "; ".join(f"{a}: {' and '.join(ns)}" for a, ns in twice.items()))
    why = [f"{a.name} + {b.name}: {r}" for a, b in itertools.combinations(chosen, 2) if (r := conflict(a, b))]
    if why:
        raise ValueError("incompatible techniques: " + "; ".join(why))
    return tuple(sorted(chosen, key=lambda t: MRO_AXES.index(t.axis)))


# The composed layer's class order (its MRO): a schedule wraps the chain a placement or wire format owns.
MRO_AXES = ("schedule", "placement", "wire", "layout", "update")


def name_of(techniques) -> str:
    """The composed strategy's canonical name (its techniques in :data:`MRO_AXES` order)."""
    return SEP.join(t.name for t in techniques)


def sim_refusal(techniques) -> str:
    """Why the composition of ``techniques`` cannot be SIMULATED ("" : it can): a technique that declares no
    simulator contribution (``Technique.sim``)."""
    missing = [t.name for t in techniques if t.sim is None]
    if not missing:
        return ""
    return (f"{', '.join(missing)} declare{'s' if len(missing) == 1 else ''} no simulator contribution "
            "(Technique.sim: its hooks of moelab.sim.graphs.transformer_iteration_graph), so no composed graph")


def table_markdown(techniques: Optional[dict] = None) -> str:
    """The techniques and the pair table as markdown (``docs/compose.md``'s generated part)."""
    ts = techniques if techniques is not None else all_techniques()
    lines = ["| technique | axis | owns | wraps | dispatch chain still called |", "|---|---|---|---|---|"]
    for n in sorted(ts, key=lambda n: (AXES.index(ts[n].axis), n)):
        t = ts[n]
        lines.append(f"| {n} | {t.axis} | {', '.join(t.owns) or '-'} | {', '.join(t.wraps) or '-'} | "
                     f"{', '.join(t.calls) if 'dispatch_compute_combine' in t.owns else '-'} |")
    lines += ["", "| pair | composes | REAL | SIMULATED | why not |", "|---|---|---|---|---|"]
    for a, b, why in compatibility(ts):
        refused = sim_refusal((ts[a], ts[b])) if why is None else ""
        run = (("yes", "conformance suite", f"refused: {refused}" if refused else "conformance suite (bytes)")
               if why is None else ("no", "-", "-"))
        lines.append(f"| {a} + {b} | {' | '.join(run)} | {why or ''} |")
    return "\n".join(lines) + "\n"


def print_table() -> None:
    print(table_markdown())


BEGIN, END = "<!-- generated by moelab.techniques: begin -->", "<!-- generated by moelab.techniques: end -->"


def write_page(path: str) -> bool:
    """Rewrite the generated part of ``path`` (between :data:`BEGIN` and :data:`END`); True when it changed."""
    with open(path) as f:
        text = f.read()
    head, rest = text.split(BEGIN, 1)
    new = head + BEGIN + "\n" + table_markdown() + END + rest.split(END, 1)[1]
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


if __name__ == "__main__":  # python -m moelab.techniques [--write docs/compose.md]
    import sys

    if sys.argv[1:2] == ["--write"]:
        print("changed" if write_page(sys.argv[2]) else "up to date")
    else:
        print_table()
