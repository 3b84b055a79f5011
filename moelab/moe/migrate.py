"""Moving experts between ranks with their optimizer state: the one migration routine of Hecate's
re-sharding (Alg. 2), SmartMoE's re-placement and FlexMoE's Migrate (spec ``papers/hecate.md`` §2.5,
§3).

Every rank calls :func:`migrate_holders` (or its one-holder case :func:`migrate_owners`) with the same
new holders (plans are pure functions of all-reduced loads, so they agree). Each moved expert travels
as one row of ``3 × numel`` elements — its parameters, Adam's ``exp_avg`` and ``exp_avg_sq`` (zeros
before the first step) — in ONE uneven all-to-all over all layers through the comm door (phase
``migrate``); with replicas, every new copy comes from the expert's first old holder and a dropped
copy is freed with its state. Adam's ``step`` is not sent: every expert steps every iteration (one
optimizer semantics), so all steps are equal. The layers then
swap their expert slots (:meth:`moelab.moe.layer.MoELayer.set_placement`) and the optimizer's entries
follow the new parameter objects. Nothing is issued when nothing moves. Parameters and states are
copied bitwise: a migration never re-initialises an expert.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from moelab.moe.experts import expert_numel, expert_param_shapes, flatten_slot, unflatten
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


def copies_between(old_holders, new_holders) -> list:
    """The copies a placement change needs, for one layer: ``[(expert, source, destination), ...]``, one
    per (expert, rank) in ``new_holders`` and not in ``old_holders``, sent by the expert's first old
    holder; expert-major, destinations in the new holders' order. Pure: the runtime (:func:`migrate_holders`)
    and the simulator (FlexMoE's migration bytes) price the same copies."""
    out = []
    for e, (h0, h1) in enumerate(zip(old_holders, new_holders)):
        out.extend((e, int(h0[0]), int(d)) for d in h1 if d not in h0)
    return out


def _check_holders(li, layer, holders) -> tuple:
    pl = layer.placement
    if len(holders) != pl.num_experts:
        raise ValueError(f"layer {li}: {len(holders)} holder sets for {pl.num_experts} experts")
    out = []
    for e, h in enumerate(holders):
        h = tuple(int(r) for r in h)
        bad = [r for r in h if not 0 <= r < pl.world_size]
        if bad:
            raise ValueError(f"layer {li}, expert {e}: holder {bad[0]} is not a rank of 0..{pl.world_size - 1}")
        if not h or len(set(h)) != len(h):
            raise ValueError(f"layer {li}, expert {e}: holders {list(h)} must be distinct ranks, at least one")
        out.append(h)
    return tuple(out)


def migrate_owners(comm, layers: Sequence, new_owners: Sequence[Sequence[int]], optimizer=None,
                   group: str = "world") -> list:
    """Give expert e of layer i the owner ``new_owners[i][e]``, moving parameters and Adam state.

    ``layers``: MoE layers whose static placement has one holder per expert (owners only). Returns the
    moves ``[(layer index, expert, source rank, destination rank), ...]`` (the same list on every rank).
    The one-holder case of :func:`migrate_holders`."""
    for li, layer in enumerate(layers):
        if not layer.placement.is_trivial:
            raise ValueError(f"layer {li}: migrate_owners moves owners; the placement has replicas")
    return migrate_holders(comm, layers, [[(o,) for o in owners] for owners in new_owners], optimizer, group)


def migrate_holders(comm, layers: Sequence, new_holders, optimizer=None, group: str = "world") -> list:
    """Give expert e of layer i the holders ``new_holders[i][e]`` (owner first, replicas after), each
    holding the parameters AND its own Adam state (FlexMoE's vExperts, spec §3).

    Every (layer, expert, rank) in the new holders and not in the old gets the expert's parameters and
    Adam moments from the expert's first old holder (:func:`copies_between`), all layers in ONE
    all-to-all through the door (deterministic order); a dropped copy is freed with its state. Returns
    the copies ``[(layer, expert, source, destination), ...]`` (the same on every rank); no collective
    when nothing is copied, and layers whose holders do not change are not touched."""
    moves, placements = [], {}
    for li, layer in enumerate(layers):
        pl = layer.placement
        new = _check_holders(li, layer, new_holders[li])
        if new != tuple(tuple(h) for h in pl.holders):
            placements[li] = Placement(pl.num_experts, pl.world_size, new, pl.rule)
            moves.extend((li, e, s, d) for e, s, d in copies_between(pl.holders, new))
    if placements:
        move_experts(comm, layers, moves, placements, optimizer, group)
    return moves


def move_experts(comm, layers: Sequence, moves, placements: dict, optimizer=None, group: str = "world") -> None:
    """Carry out ``moves`` ``[(layer, expert, source, destination), ...]`` (ranks of ``group``, the same
    list on every rank) in ONE all-to-all of rows ``[params | exp_avg | exp_avg_sq]``, then give each layer
    ``li`` in ``placements`` its new placement: the slots of ``placements[li].local_experts(layer.comm.rank)``
    rebuilt from kept slots and received rows, the optimizer's entries following the new parameters.
    ``placements`` is in each layer's own coordinates (its ``comm``, which a caller may have re-mapped
    before: Lina's packing changes a layer's expert-parallel group)."""
    me = comm.rank
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

    numel = expert_numel(layers[0].experts)
    got = {}
    if moves:
        members = list(comm.group_ranks(group))
        pos = {r: i for i, r in enumerate(members)}
        send = sorted((dst, li, e) for li, e, src, dst in moves if src == me)
        recv = sorted((src, li, e) for li, e, src, dst in moves if dst == me)
        in_rows, out_rows = [0] * len(members), [0] * len(members)
        for dst, _, _ in send:
            in_rows[pos[dst]] += 1
        for src, _, _ in recv:
            out_rows[pos[src]] += 1
        ref = next(p for p in stacked[0] if p is not None)
        x = torch.stack([row(li, e) for _, li, e in send]) if send else ref.new_empty((0, 3 * numel))
        with torch.no_grad(), comm.rec.tagged(phase="migrate"):
            out = comm.all_to_all_raw(x.detach(), out_rows, in_rows, group=group)
        got = {(li, e): out[i] for i, (_, li, e) in enumerate(recv)}
    for li, placement in placements.items():
        _swap(layers[li], li, placement, got, stacked[li], states[li], shapes[li], numel, optimizer)


def _swap(layer, li, placement, got, params, states, shapes, numel, optimizer) -> None:
    """Rebuild ``layer``'s stacked slots for ``placement`` from kept slots and received rows."""
    old = layer.experts.experts
    mine = list(placement.local_experts(layer.comm.rank))

    def piece(e, k):  # k = 0 params, 1 exp_avg, 2 exp_avg_sq: the expert's [w1, b1, w2, b2]
        if e in old:
            s = old.index(e)
            src = params if k == 0 else [x if x is not None else z
                                         for x, z in zip(states[k - 1], _zeros_like_params(params))]
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
    layer.set_placement(placement, new_params)
    if optimizer is None:
        return
    for j, (old_p, new_p) in enumerate(zip(params, layer.experts.stacked())):
        if old_p is None:
            continue
        st = replace_param(optimizer, old_p, new_p)
        if st:  # Adam has stepped: the moved moments, the common step
            optimizer.state[new_p] = {**st, "exp_avg": new_states[0][j], "exp_avg_sq": new_states[1][j]}


def replace_param(optimizer, old_p, new_p) -> dict:
    """Put ``new_p`` where ``old_p`` was in the optimizer's groups (a re-stacked expert slot,
    :meth:`moelab.moe.layer.MoELayer.set_placement`); return (and drop) ``old_p``'s state."""
    for g in optimizer.param_groups:
        g["params"] = [new_p if q is old_p else q for q in g["params"]]
    return optimizer.state.pop(old_p, None) or {}


def reslot(layer, placement: Placement, optimizer=None) -> None:
    """Give ``layer`` ``placement`` with zero slots for the experts it now holds, the optimizer's entries
    following the new parameters without state: for a caller that fills them next (a checkpoint's load)."""
    n_here, old = len(placement.local_experts(layer.comm.rank)), layer.experts.stacked()
    layer.set_placement(placement, [None if p is None else p.new_zeros((n_here,) + tuple(p.shape[1:])) for p in old])
    if optimizer is not None:
        for old_p, new_p in zip(old, layer.experts.stacked()):
            if old_p is not None:
                replace_param(optimizer, old_p, new_p)


def owners_of(layer) -> list:
    """The owner of every expert of ``layer``'s static placement."""
    return [layer.placement.owner(e) for e in range(layer.placement.num_experts)]


def changed_layers(layers, new_owners) -> Optional[list]:
    """Indices of layers whose owners ``new_owners`` changes (empty: no migration needed)."""
    return [li for li, layer in enumerate(layers) if owners_of(layer) != [int(o) for o in new_owners[li]]]
