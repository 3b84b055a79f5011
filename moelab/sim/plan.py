"""``moelab plan``: for a model on a cluster, every compatible combination of techniques priced and ranked.

The candidates are EP, every registered single strategy with a simulator graph, and every compatible pair of
techniques (:func:`moelab.techniques.compatibility`: generated from the techniques' declarations, so an
incompatible pair never appears), each with its default options. Each is priced by one SIMULATED iteration
(:func:`moelab.sim.graphs.iteration_graph` + :func:`moelab.sim.simulate`) of the preset's shape on the profile
scaled to ``nodes`` (:meth:`ClusterProfile.with_nodes`), on synthetic Zipf(``skew``) loads
(:func:`moelab.sim.graphs.synthetic_loads`): step time, speedup over EP, peak memory of the busiest device
(:meth:`SimResult.peak_memory`: parameters, gradients, optimizer state and activations as the graph's ops
allocate and free them) and bytes sent by link class (:func:`moelab.sim.graphs.graph_bytes`, the runtime's
byte rule). A candidate whose peak does not fit the profile's GPU memory, or that cannot be SIMULATED, is
refused with the reason; the rest are ranked by step time.

Expert parallelism needs the expert count divisible by the GPUs: the preset's count is kept when it is, else
it becomes ``experts_per_gpu`` x GPUs (default: the preset's count per GPU, at least 1), and the header says so.
Not yet here (issue #66 item 4): option search, pruning by bounds, ``--explain``, ``--write config.yaml``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

from moelab.comm.topology import LINK_CLASSES
from moelab.config import ConfigError
from moelab.models.presets import preset as get_preset
from moelab.registry import all_strategies
from moelab.sim import simulate
from moelab.sim.graphs import config_for_profile, get_graph, graph_bytes, synthetic_loads, topology_of
from moelab.sim.profiles import ClusterProfile, get_profile
from moelab.sim.whatif import STRATEGY_NEEDS
from moelab.techniques import SEP, all_techniques, compatibility, name_of, parse, sim_refusal

EP = "ep"


@dataclasses.dataclass
class Plan:
    """The ranked candidates (``rows``: fitting ones by step time, then the refused) and what they price."""

    rows: list
    preset: str
    profile: str
    nodes: int
    gpus: int
    experts: int
    experts_note: str
    skew: float
    label: str
    wall_s: float

    def ranked(self) -> list:
        return [r for r in self.rows if not r["refused"]]

    def refused(self) -> list:
        return [r for r in self.rows if r["refused"]]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def candidates() -> list:
    """(name, refusal) of every candidate: EP, each single strategy with a graph, each compatible pair of
    techniques ("" : it can be SIMULATED; else why not). Incompatible pairs are not candidates."""
    out = [(EP, "")]
    for s in all_strategies():
        if s.name != EP and SEP not in s.name and s.techniques:
            out.append((s.name, "" if s.sim_graph else f"{s.name} has no simulator graph (Strategy.sim_graph)"))
    ts = all_techniques()
    for a, b, why in compatibility(ts):
        if why is None:
            out.append((SEP.join(t.name for t in _ordered(ts[a], ts[b])), sim_refusal((ts[a], ts[b]))))
    return out


def _ordered(*techs):
    return parse(name_of(techs))


def check_inputs(preset: str, profile, nodes: Optional[int], skew: float, layers: Optional[int],
                 tokens_per_gpu: int):
    """(Preset, profile scaled to ``nodes``), or a ConfigError naming the bad input, before any pricing."""
    shape = get_preset(preset)
    if not isinstance(profile, ClusterProfile):
        try:
            profile = get_profile(profile)
        except KeyError as e:
            raise ConfigError(str(e.args[0])) from None
    if nodes is not None:
        if int(nodes) != nodes or nodes < 1:
            raise ConfigError(f"plan: --nodes must be an integer >= 1, got {nodes!r}")
        profile = profile.with_nodes(int(nodes))
    if skew < 0:
        raise ConfigError(f"plan: --skew must be >= 0, got {skew!r}")
    if layers is not None and layers < 1:
        raise ConfigError(f"plan: --layers must be >= 1, got {layers!r}")
    if tokens_per_gpu < 1:
        raise ConfigError(f"plan: --tokens-per-gpu must be >= 1, got {tokens_per_gpu!r}")
    return shape, profile


def base_config(shape, profile, layers: Optional[int] = None, tokens_per_gpu: int = 4096,
                experts_per_gpu: Optional[int] = None):
    """(cfg on the profile's cluster, note on the expert count): the preset's widths, its layers (or
    ``layers``), ``tokens_per_gpu`` tokens per GPU per step."""
    cfg = shape.config()
    N, E = profile.world_size, cfg.model.moe.num_experts
    seq = min(cfg.model.seq_len, tokens_per_gpu)
    note = f"{E} experts (the preset's)"
    if experts_per_gpu is not None or E % N:
        per = experts_per_gpu if experts_per_gpu is not None else max(1, E // N)
        if per < 1:
            raise ConfigError(f"plan: --experts-per-gpu must be >= 1, got {per!r}")
        note = (f"{per * N} experts ({per}/GPU; the preset has {E}"
                + (", which do not divide over" if E % N else ", over") + f" {N} GPUs)")
        E = per * N
    return config_for_profile(cfg, profile, **{
        "model.n_layers": layers or cfg.model.n_layers, "model.seq_len": seq,
        "train.batch_size": max(tokens_per_gpu // seq, 1), "model.moe.num_experts": E,
        "parallel.placement": None, "emulation.enabled": False}), note


def _needs(name: str) -> dict:
    """What the candidate's techniques need to run at all (moelab.sim.whatif.STRATEGY_NEEDS), merged."""
    out: dict = {}
    for part in name.split("+"):
        out.update(STRATEGY_NEEDS.get(part, {}))
    return out


def price(cfg, profile, skew: float = 1.0, seed: int = 0) -> dict:
    """One SIMULATED iteration of ``cfg`` on ``profile``: step, peak memory of the busiest device, bytes by
    link class (summed over the ranks), wall seconds."""
    import inspect

    t0 = time.perf_counter()
    fn = get_graph(cfg.parallel.strategy)
    params = inspect.signature(fn).parameters  # the profile's activation width where the graph takes one
    kw = {"elem_bytes": profile.elem_bytes} if "elem_bytes" in params else {}
    g = fn(cfg, profile, synthetic_loads(cfg, seed=seed, skew=skew), None, **kw)
    res = simulate(g)
    peak = res.peak_memory()
    row = {"step_ms": res.makespan * 1e3, "peak_mem_GB": float(peak["total"].max()) / 1e9 if len(peak) else 0.0}
    per = graph_bytes(g, topology_of(cfg))
    for cls in LINK_CLASSES:
        row[f"{cls}_GB"] = sum(b[cls] for b in per.values()) / 1e9
    row["wall_s"] = time.perf_counter() - t0
    return row


def plan(preset: str, profile, nodes: Optional[int] = None, *, skew: float = 1.0, seed: int = 0,
         layers: Optional[int] = None, tokens_per_gpu: int = 4096, experts_per_gpu: Optional[int] = None,
         names: Optional[list] = None, progress: bool = False) -> Plan:
    """Every candidate (or ``names`` of them) priced and ranked; see the module docstring."""
    shape, prof = check_inputs(preset, profile, nodes, skew, layers, tokens_per_gpu)
    base, note = base_config(shape, prof, layers, tokens_per_gpu, experts_per_gpu)
    cands = candidates()
    if names is not None:
        known = dict(cands)
        bad = [n for n in names if n not in known]
        if bad:
            raise ConfigError(f"plan: {bad} are not candidates (incompatible or unknown); candidates: {sorted(known)}")
        cands = [(n, known[n]) for n in dict.fromkeys([EP, *names])]
    t0 = time.perf_counter()
    rows = []
    for name, refusal in _progress(cands, progress, prof.name):
        row = {"combination": name, "refused": refusal}
        if not refusal:
            try:
                cfg = base.with_overrides({"parallel.strategy": name, **_needs(name)}).validate()
                row.update(price(cfg, prof, skew, seed))
            except (ConfigError, ValueError, KeyError, TypeError) as e:
                row["refused"] = f"not priced: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
        if not row["refused"] and row["peak_mem_GB"] > prof.mem_GB:
            row["refused"] = (f"does not fit: peak {row['peak_mem_GB']:.1f} GB per device > "
                              f"{prof.mem_GB:g} GB of a {prof.gpu}")
        rows.append(row)
    ep = next(r for r in rows if r["combination"] == EP)
    same = ("step_ms", "peak_mem_GB", *(f"{c}_GB" for c in LINK_CLASSES))
    for r in rows:
        r["speedup_vs_ep"] = ep["step_ms"] / r["step_ms"] if "step_ms" in ep and r.get("step_ms") else None
        # a mechanism that did not fire says so: its defaults priced exactly as EP
        r["note"] = ("priced as EP: its default options change nothing here" if r["combination"] != EP
                     and "step_ms" in r and "step_ms" in ep and all(r[k] == ep[k] for k in same) else "")
    fit = sorted((r for r in rows if not r["refused"]), key=lambda r: r["step_ms"])
    label = (f"SIMULATED: {prof.name} x{prof.nodes} nodes ({prof.world_size} {prof.gpu}), "
             f"{shape.title} shape, Zipf({skew:g}) synthetic loads")
    return Plan(fit + [r for r in rows if r["refused"]], preset, prof.name, prof.nodes, prof.world_size,
                base.model.moe.num_experts, note, skew, label, time.perf_counter() - t0)


def _progress(items, on: bool, desc: str):
    if not on:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=f"plan on {desc}", leave=False)


def format_table(p: Plan, top: Optional[int] = None) -> str:
    """The ranked table (``top`` rows), then the refused candidates with their reasons, under the label."""
    head = (f"{p.label}\n{p.preset} on {p.gpus} GPUs ({p.nodes} nodes): {p.experts_note}; "
            f"priced in {p.wall_s:.1f} s; bytes sent, summed over the GPUs, by link class")
    cols = ["rank", "combination", "step_ms", "speedup_vs_ep", "peak_mem_GB", *(f"{c}_GB" for c in LINK_CLASSES)]
    ranked = p.ranked()[:top] if top else p.ranked()
    lines = [head, "  ".join(f"{c:>14}" if i else f"{c:>4}" for i, c in enumerate(cols))]
    for i, r in enumerate(ranked, 1):
        vals = [f"{i:>4}", f"{r['combination']:>14}", f"{r['step_ms']:>14.2f}", f"{r['speedup_vs_ep']:>14.3f}",
                f"{r['peak_mem_GB']:>14.2f}", *(f"{r[f'{c}_GB']:>14.3f}" for c in LINK_CLASSES)]
        lines.append("  ".join(vals) + (f"  ({r['note']})" if r["note"] else ""))
    for r in p.refused():
        lines.append(f"refused {r['combination']}: {r['refused']}")
    if not ranked:
        lines.append("no combination fits: " + p.preset + " fits no candidate on this cluster")
    return "\n".join(lines)


__all__ = ["Plan", "candidates", "check_inputs", "base_config", "price", "plan", "format_table"]
