"""Moving experts between ranks with their optimizer state: the one migration routine of Hecate's
re-sharding (Alg. 2), SmartMoE's re-placement and FlexMoE's Migrate (spec ``papers/hecate.md`` §2.5,
§3).

Every rank calls :func:`migrate_owners` with the same new owners (plans are pure functions of
all-reduced loads, so they agree). Each moved expert travels as one row of ``3 × numel`` elements —
its parameters, Adam's ``exp_avg`` and ``exp_avg_sq`` (zeros before the first step) — in ONE uneven
all-to-all over all layers through the comm door (phase ``migrate``). Adam's ``step`` is not sent:
every expert steps every iteration (one optimizer semantics), so all steps are equal. The layers then
swap their expert slots (:meth:`moelab.moe.layer.MoELayer.set_placement`) and the optimizer's entries
follow the new parameter objects. Nothing is issued when nothing moves. Parameters and states are
copied bitwise: a migration never re-initialises an expert.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from moelab.moe.experts import expert_param_shapes, flatten_slot, unflatten
from moelab.placement import Placement

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _state(optimizer, params) -> list:
    """Per state key, the stacked state tensors of ``params`` (None where a param has no state yet)."""
    out = []
    for key in STATE_KEYS:
        row = []
        for p in params:
            st = optimizer.state.get(p, {}) if (optimizer is not None and p is not None) else {}
            row.append(st.get(key) if p is not None else None)
        out.append(row)
    return out


def _zeros_like_params(params):
    return [None if p is None else torch.zeros_like(p) for p in params]


def migrate_owners(comm, layers: Sequence, new_owners: Sequence[Sequence[int]], optimizer=None,
                   group: str = "world") -> list:
    """Give expert e of layer i the owner ``new_owners[i][e]``, moving parameters and Adam state.

    ``layers``: MoE layers whose static placement has one holder per expert (owners only). Returns the
    moves ``[(layer index, expert, source rank, destination rank), ...]`` (the same list on every rank)."""
    me = comm.rank
    moves = []
    for li, layer in enumerate(layers):
        pl = layer.placement
        if not pl.is_trivial:
            raise ValueError(f"layer {li}: migrate_owners moves owners; the placement has replicas")
        if len(new_owners[li]) != pl.num_experts:
            raise ValueError(f"layer {li}: {len(new_owners[li])} owners for {pl.num_experts} experts")
        for e in range(pl.num_experts):
            dst = int(new_owners[li][e])
            if not 0 <= dst < pl.world_size:
                raise ValueError(f"layer {li}, expert {e}: owner {dst} is not a rank of 0..{pl.world_size - 1}")
            if pl.owner(e) != dst:
                moves.append((li, e, pl.owner(e), dst))
    if not moves:
        return []
    stacked = [layer.experts.stacked() for layer in layers]
    states = [_state(optimizer, ps) for ps in stacked]
    shapes = [expert_param_shapes(layer.experts) for layer in layers]

    def row(li, e):
        s = layers[li].experts.experts.index(e)
        ps = stacked[li]
        parts = [flatten_slot(ps, s)]
        for st in states[li]:
            full = [x if x is not None else z for x, z in zip(st, _zeros_like_params(ps))]
            parts.append(flatten_slot(full, s))
        return torch.cat(parts)

    members = list(comm.group_ranks(group))
    pos = {r: i for i, r in enumerate(members)}
    send = sorted((dst, li, e) for li, e, src, dst in moves if src == me)
    recv = sorted((src, li, e) for li, e, src, dst in moves if dst == me)
    in_rows, out_rows = [0] * len(members), [0] * len(members)
    for dst, _, _ in send:
        in_rows[pos[dst]] += 1
    for src, _, _ in recv:
        out_rows[pos[src]] += 1
    numel = sum(0 if s is None else int(torch.Size(s).numel()) for s in shapes[0])
    ref = next(p for p in stacked[0] if p is not None)
    x = torch.stack([row(li, e) for _, li, e in send]) if send else ref.new_empty((0, 3 * numel))
    with torch.no_grad(), comm.rec.tagged(phase="migrate"):
        out = comm.all_to_all_raw(x.detach(), out_rows, in_rows, group=group)
    got = {(li, e): out[i] for i, (_, li, e) in enumerate(recv)}
    changed = sorted({li for li, *_ in moves})
    for li in changed:
        _swap(layers[li], li, new_owners[li], got, stacked[li], states[li], shapes[li], numel, optimizer)
    return moves


def _swap(layer, li, owners, got, params, states, shapes, numel, optimizer) -> None:
    """Rebuild ``layer``'s stacked slots for its new owners from kept slots and received rows."""
    me, old = layer.comm.rank, layer.experts.experts
    mine = [e for e in range(len(owners)) if int(owners[e]) == me]

    def piece(e, k):  # k = 0 params, 1 exp_avg, 2 exp_avg_sq: the expert's [w1, b1, w2, b2]
        if e in old:
            s = old.index(e)
            src = params if k == 0 else [x if x is not None else z for x, z in zip(states[k - 1], _zeros_like_params(params))]
            return [None if t is None else t[s].detach() for t in src]
        return unflatten(got[(li, e)][k * numel:(k + 1) * numel], shapes)

    def stack(k):
        out = []
        for j, p in enumerate(params):
            if p is None:
                out.append(None)
            elif mine:
                out.append(torch.stack([piece(e, k)[j] for e in mine]).to(p.dtype).clone())
            else:
                out.append(p.new_empty((0,) + tuple(p.shape[1:])))
        return out

    new_params, new_states = stack(0), [stack(1), stack(2)]
    pl = layer.placement
    layer.set_placement(Placement(pl.num_experts, pl.world_size, tuple((int(o),) for o in owners), pl.rule),
                        new_params)
    if optimizer is None:
        return
    for j, (old_p, new_p) in enumerate(zip(params, layer.experts.stacked())):
        if old_p is None:
            continue
        for g in optimizer.param_groups:
            g["params"] = [new_p if q is old_p else q for q in g["params"]]
        st = optimizer.state.pop(old_p, None)
        if st:  # Adam has stepped: the moved moments, the common step
            optimizer.state[new_p] = {**st, "exp_avg": new_states[0][j], "exp_avg_sq": new_states[1][j]}


def owners_of(layer) -> list:
    """The owner of every expert of ``layer``'s static placement."""
    return [layer.placement.owner(e) for e in range(layer.placement.num_experts)]


def changed_layers(layers, new_owners) -> Optional[list]:
    """Indices of layers whose owners ``new_owners`` changes (empty: no migration needed)."""
    return [li for li, layer in enumerate(layers) if owners_of(layer) != [int(o) for o in new_owners[li]]]
