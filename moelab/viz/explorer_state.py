"""The placement explorer's state and its pure edits: which cluster, which loads, which placement.

State = (cluster profile, load trace source, iteration, layer, placement ``expert -> (owner,
replica, ...)``, model sizes). Trace sources:

- ``"synthetic:<kind>"`` with ``seed``: :func:`moelab.models.traces.routing_trace` of that kind
  (balanced, hot_expert, hot_rank, zipf_drift, zero_rank) on the profile's world. Labelled SYNTHETIC.
- ``"preset:<name>"``: a real model's MoE shape (:mod:`moelab.models.presets`: experts, top-k, d_model,
  d_ff, set by :func:`with_preset`) with SYNTHETIC loads, a Zipf(``skew``) popularity over a random expert
  order per layer (:func:`moelab.sim.graphs.synthetic_loads`), one draw per iteration.
- ``"run:<path>"``: a run folder or its ``loads.csv`` (``iter, layer, expert, tokens``). loads.csv
  holds GLOBAL tokens per expert, not who sent them, so the explorer **assumes uniform sources**:
  expert e's ``g`` tokens come ``g // N`` from every source rank, the remainder one each from the
  lowest ranks. Sources skewed towards one node would change the bytes (not the per-rank compute
  load); the label says so.

Every edit returns a new state whose ``moved_from`` is the placement it was made from, so the cost of
the migration (:mod:`moelab.viz.explorer_cost`) is priced from the previous placement.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from moelab.config import ConfigError, RunConfig
from moelab.models.presets import preset
from moelab.models.traces import routing_trace
from moelab.placement import Placement
from moelab.sim import get_profile
from moelab.sim.graphs import synthetic_loads

SYNTHETIC_KINDS = ("hot_expert", "balanced", "hot_rank", "zipf_drift", "zero_rank")
STRATEGIES = ("ep", "hecate")  # the explorer's pricing: core expert parallelism, or Hecate's FSSDP graph


@dataclass(frozen=True)
class ExplorerState:
    profile: str = "fastermoe_johnny"  # cluster profile (moelab.sim.PROFILES)
    nodes: Optional[int] = None  # override the profile's node count (None: as published)
    gpus_per_node: Optional[int] = None  # override its GPUs per node (None: as published; e.g. 2 x 2 for a local run)
    trace: str = "synthetic:hot_expert"  # "synthetic:<kind>" or "run:<run dir or loads.csv>"
    seed: int = 0  # synthetic traces: RNG seed
    iteration: int = 0  # which iteration of the trace
    layer: int = 0  # which MoE layer of the trace
    holders: tuple = ()  # holders[e] = (owner, replica, ...); () = expert parallelism
    num_experts: int = 16  # synthetic traces (a run's loads.csv sets its own)
    tokens_per_rank: int = 2048  # synthetic traces: tokens per rank per iteration
    top_k: int = 2
    d_model: int = 1024
    d_ff: int = 4096
    trace_iters: int = 8  # synthetic traces: iterations generated
    trace_layers: int = 2  # synthetic traces: MoE layers generated
    skew: float = 1.0  # "preset:<name>" traces: the Zipf exponent of expert popularity (0 = uniform)
    moved_from: tuple = ()  # the holders this placement was edited from (migration priced from them); () none
    strategy: str = "ep"  # how the layer is priced: "ep" (replicas' gradient sync) or "hecate" (spAG / spRS)


# ---- the trace ------------------------------------------------------------------------------------
def profile_of(state: ExplorerState):

    p = get_profile(state.profile)
    p = p.with_nodes(state.nodes) if state.nodes else p
    if state.gpus_per_node:
        if state.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {state.gpus_per_node}")
        g = int(state.gpus_per_node)  # the node's NICs keep attaching to equal contiguous blocks of GPUs
        p = dataclasses.replace(p, gpus_per_node=g, nics_per_node=math.gcd(p.nics_per_node, g) or p.nics_per_node)
    return p


def with_strategy(state: ExplorerState, strategy: str) -> ExplorerState:
    """``state`` priced as ``strategy`` (one of :data:`STRATEGIES`); the placement is kept."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: the explorer prices {STRATEGIES}")
    return dataclasses.replace(state, strategy=strategy)


def world_of(state: ExplorerState) -> int:
    return profile_of(state).world_size


def _run_csv(path: str) -> Path:
    p = Path(path)
    return p / "loads.csv" if p.is_dir() else p


@functools.lru_cache(maxsize=16)
def _read_run_loads(path: str, mtime: float):
    import pandas as pd

    df = pd.read_csv(path)
    missing = {"iter", "layer", "expert", "tokens"} - set(df.columns)
    if missing:
        raise ValueError(f"{path}: loads.csv needs columns iter, layer, expert, tokens; missing {sorted(missing)}")
    iters, layers, E = int(df["iter"].max()) + 1, int(df["layer"].max()) + 1, int(df["expert"].max()) + 1
    g = np.zeros((iters, layers, E), dtype=np.int64)
    np.add.at(g, (df["iter"].to_numpy(), df["layer"].to_numpy(), df["expert"].to_numpy()), df["tokens"].to_numpy())
    return g


def uniform_sources(global_counts, world: int) -> np.ndarray:
    """``[..., E]`` global tokens per expert -> ``[..., N, E]``: each source sends ``g // N``, the
    remainder one each from the lowest ranks (the documented assumption for loads.csv)."""
    g = np.asarray(global_counts, dtype=np.int64)
    base, rem = np.divmod(g, world)
    out = np.repeat(base[..., None, :], world, axis=-2)
    out += (np.arange(world)[:, None] < rem[..., None, :]).astype(np.int64)
    return out


def run_global_loads(path: str) -> np.ndarray:
    """``[iters, layers, E]`` global tokens per expert from a run folder or its loads.csv."""
    p = _run_csv(path)
    if not p.is_file():
        raise FileNotFoundError(f"no loads.csv at {p}")
    return _read_run_loads(str(p), p.stat().st_mtime)


@functools.lru_cache(maxsize=32)
def _synthetic(kind, iters, layers, world, E, T, k, seed):

    return routing_trace(kind, iters, layers, world, E, T, k, seed).numpy()


def trace_loads(state: ExplorerState) -> np.ndarray:
    """The whole trace as ``[iters, layers, N, E]`` on the profile's world."""
    N = world_of(state)
    src, _, arg = state.trace.partition(":")
    if src == "synthetic":
        if arg not in SYNTHETIC_KINDS:
            raise ValueError(f"unknown synthetic trace {arg!r}; known: {SYNTHETIC_KINDS}")
        return _synthetic(arg, state.trace_iters, state.trace_layers, N, state.num_experts,
                          state.tokens_per_rank, state.top_k, state.seed)
    if src == "run":
        return uniform_sources(run_global_loads(arg), N)
    if src == "preset":
        _preset(arg)
        return _zipf(state.trace_iters, state.trace_layers, N, state.num_experts, state.tokens_per_rank,
                     state.top_k, state.seed, float(state.skew))
    raise ValueError(f"trace must be 'synthetic:<kind>', 'preset:<name>' or 'run:<path>', got {state.trace!r}")


def _preset(name: str):

    try:
        return preset(name)
    except ConfigError as e:
        raise ValueError(str(e)) from None


@functools.lru_cache(maxsize=32)
def _zipf(iters, layers, world, E, T, k, seed, skew):

    if skew < 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    cfg = RunConfig().with_overrides({"parallel.nproc": world, "parallel.topology.nodes": 1, "model.n_layers": layers,
                                      "model.moe_every": 1, "model.moe.num_experts": E, "model.moe.top_k": k,
                                      "model.seq_len": T, "train.batch_size": 1})
    return np.stack([synthetic_loads(cfg, seed=seed + it, skew=skew) for it in range(iters)])


def with_preset(state: ExplorerState, name: str) -> ExplorerState:
    """Loads on a real model's MoE shape: experts, top-k, d_model and d_ff from the preset, placement back to EP."""
    v = {k: val for k, (val, _) in _preset(name).fields.items()}
    return dataclasses.replace(state, trace=f"preset:{name}", num_experts=v["model.moe.num_experts"],
                               top_k=v["model.moe.top_k"], d_model=v["model.d_model"], d_ff=v["model.d_ff"],
                               holders=(), moved_from=(), iteration=0, layer=0)


def trace_shape(state: ExplorerState) -> tuple:
    """(iterations, layers, experts) of the state's trace."""
    t = trace_loads(state)
    return t.shape[0], t.shape[1], t.shape[3]


def layer_loads(state: ExplorerState) -> np.ndarray:
    """``[N, E]``: tokens each source routes to each expert at the state's iteration and layer."""
    t = trace_loads(state)
    if not (0 <= state.iteration < t.shape[0] and 0 <= state.layer < t.shape[1]):
        raise ValueError(f"iteration {state.iteration} / layer {state.layer} outside the trace "
                         f"({t.shape[0]} iterations, {t.shape[1]} layers)")
    return t[state.iteration, state.layer]


def trace_label(state: ExplorerState) -> str:
    src, _, arg = state.trace.partition(":")
    if src == "synthetic":
        return f"loads SYNTHETIC {arg} seed {state.seed}"
    if src == "preset":
        return f"loads SYNTHETIC Zipf(skew {state.skew:g}) seed {state.seed} on the {_preset(arg).label}"
    return f"loads REAL from {_run_csv(arg)} (global per expert; uniform sources assumed)"


# ---- placement edits (pure: each returns a new state) ------------------------------------------------
def ep_holders(num_experts: int, world: int) -> tuple:
    """Expert parallelism: contiguous blocks, expert e on rank ``e * N // E`` (E/N per rank when divisible)."""
    return tuple((e * world // num_experts,) for e in range(num_experts))


def placement_of(state: ExplorerState) -> Placement:
    N = world_of(state)
    E = trace_shape(state)[2]
    holders = state.holders or ep_holders(E, N)
    if len(holders) != E:
        raise ValueError(f"the placement covers {len(holders)} experts, the trace has {E}")
    return Placement(E, N, tuple(tuple(h) for h in holders))


def mapping(state: ExplorerState) -> dict:
    """``{expert: [owner, replicas...]}`` (the config's ``parallel.placement`` format)."""
    return placement_of(state).to_mapping()


def _with_holders(state: ExplorerState, holders) -> ExplorerState:
    """``state`` with ``holders``, validated (every expert an owner, distinct ranks inside the cluster); its
    ``moved_from`` is ``state``'s placement (the migration is priced from there)."""
    old = placement_of(state).holders
    new = dataclasses.replace(state, holders=tuple(tuple(int(r) for r in h) for h in holders), moved_from=old)
    placement_of(new)  # validate: distinct ranks in range
    return new


def with_holders(state: ExplorerState, holders) -> ExplorerState:
    """Replace the whole placement (a policy's, a pinned one's): :func:`_with_holders` from the outside."""
    return _with_holders(state, holders)


def set_owner(state: ExplorerState, expert: int, rank: int) -> ExplorerState:
    """Make ``rank`` the owner of ``expert``; if it held a replica, the old owner takes its place
    among the replicas (a swap), otherwise the old owner's copy moves to ``rank``."""
    h = [list(x) for x in placement_of(state).holders]
    cur = h[expert]
    if cur[0] == rank:
        return state
    if rank in cur:
        i = cur.index(rank)
        cur[0], cur[i] = cur[i], cur[0]
    else:
        cur[0] = rank
    return _with_holders(state, h)


def toggle_replica(state: ExplorerState, expert: int, rank: int) -> ExplorerState:
    """Add a replica of ``expert`` on ``rank``, or remove it if there is one. The owner cannot be
    toggled off (move it with :func:`set_owner`): ValueError."""
    h = [list(x) for x in placement_of(state).holders]
    cur = h[expert]
    if cur[0] == rank:
        raise ValueError(f"rank {rank} owns expert {expert}: move the owner with set_owner instead")
    if rank in cur:
        cur.remove(rank)
    else:
        cur.append(rank)
    return _with_holders(state, h)


def set_replicas(state: ExplorerState, expert: int, ranks) -> ExplorerState:
    """Replace ``expert``'s replicas by ``ranks`` (the owner is kept, and skipped if listed)."""
    h = [list(x) for x in placement_of(state).holders]
    owner = h[expert][0]
    h[expert] = [owner] + [int(r) for r in dict.fromkeys(ranks) if int(r) != owner]
    return _with_holders(state, h)


def edit_placement(state: ExplorerState, text: str) -> ExplorerState:
    """Apply typed edits ``"EXPERT: OWNER [REPLICA ...]"``, several separated by ``;`` (``"3: 5 12; 7: 0"``).
    Anything that is not a valid placement (no owner, a rank outside the world, an unknown expert) is a
    ValueError saying what is wrong, and the state is not changed."""
    h = [list(x) for x in placement_of(state).holders]
    for part in filter(None, (p.strip() for p in text.split(";"))):
        head, colon, ranks = part.partition(":")
        try:
            if not colon:
                raise ValueError
            e, listed = int(head), [int(r) for r in ranks.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"cannot read {part!r}: write 'expert: owner [replicas...]', e.g. '3: 5 12'") from None
        if not 0 <= e < len(h):
            raise ValueError(f"expert {e} does not exist: experts are 0..{len(h) - 1}")
        h[e] = listed
    return _with_holders(state, h)


def reset_ep(state: ExplorerState) -> ExplorerState:
    """Back to plain expert parallelism (no replicas)."""
    return dataclasses.replace(state, holders=(), moved_from=placement_of(state).holders)


def hottest_expert(state: ExplorerState) -> int:
    return int(np.argmax(layer_loads(state).sum(0)))


def shadow_hottest(state: ExplorerState) -> ExplorerState:
    """FasterMoE-style shadowing of the hottest expert: a replica on every rank."""
    e = hottest_expert(state)
    return set_replicas(state, e, range(world_of(state)))

