"""Hecate's sparse collectives (spec ``papers/hecate.md`` §2.2): SparseAllGather and SparseReduceScatter.

A buffer is split into equal chunks (here: one expert's flat parameters, ``numel`` elements). A plan
of one layer gives, per expert, its holders before and after: ``holders_from`` (a partition: the owner
only) and ``holders_to`` ⊇ it (owner first, then replicas) — the :class:`moelab.placement.Placement`
format, identical on every rank, so the plan needs no communication.

- ``spAG(P, P')``: every (e, d) in P' afterwards holds the owner's bytes;
- ``spRS(P', P)``: the owner receives the sum of the replicas' chunks (its own is added by the caller,
  :func:`accumulate_`), summed in ascending source-rank order, so repeated runs are bitwise equal.

Both run through the comm door (records, bytes per peer, emulation), on their own process group
(``"sparse"`` by default: the strategy declares it, so they never pair with the token all-to-all on
another group). Backends (:data:`BACKENDS`):

- ``a2a`` (default): one uneven all-to-all (rows = experts), the paper's group of broadcasts/reduces
  as one collective call;
- ``p2p``: batched point-to-point sends/receives;
- ``hier``: two stages — an expert crosses to each other node once (to one of that node's new holders,
  its *leader*; leaders rotate over the new holders from one crossing expert to the next, so t experts
  crossing into a node arrive over up to G ranks' links at once, as t's node-NIC sizing assumes), then
  the leader fans it out inside its node; spRS mirrors it (replicas reduce
  into the leader, leaders and same-node replicas into the owner). Stage 2 is issued by ``wait()``.

A plan without any new copy issues nothing (every rank sees the same plan, so all agree).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

BACKENDS = ("a2a", "p2p", "hier")
Transfer = Tuple[int, int, int]  # (source rank, destination rank, expert)


@dataclass(frozen=True)
class SparsePlan:
    """One layer's sparse gather plan as seen by ``rank`` (every rank builds the same global lists)."""

    rank: int
    world_size: int
    ranks_per_node: int
    holders_from: tuple
    holders_to: tuple

    @functools.cached_property
    def new_copies(self) -> tuple:
        """``(expert, rank)`` pairs of P' \\ P, by expert then rank."""
        return tuple((e, d) for e, (a, b) in enumerate(zip(self.holders_from, self.holders_to))
                     for d in sorted(b) if d not in a)

    @property
    def empty(self) -> bool:
        return not self.new_copies

    @functools.cached_property
    def send(self) -> Dict[int, tuple]:
        """peer -> experts this rank owns that ``peer`` newly holds (flat plan), ascending."""
        out: dict = {}
        for e, d in self.new_copies:
            if self.holders_from[e][0] == self.rank:
                out.setdefault(d, []).append(e)
        return {q: tuple(v) for q, v in sorted(out.items())}

    @functools.cached_property
    def recv(self) -> Dict[int, tuple]:
        """peer (the owner) -> experts this rank newly holds, ascending."""
        out: dict = {}
        for e, d in self.new_copies:
            if d == self.rank:
                out.setdefault(self.holders_from[e][0], []).append(e)
        return {q: tuple(v) for q, v in sorted(out.items())}

    @property
    def replicas_here(self) -> tuple:
        return tuple(sorted(e for v in self.recv.values() for e in v))

    def node(self, r: int) -> int:
        return r // self.ranks_per_node

    def bytes_in(self, numel: int, elem: int) -> int:
        return len(self.replicas_here) * numel * elem

    def bytes_out(self, numel: int, elem: int) -> int:
        return sum(len(v) for v in self.send.values()) * numel * elem

    # ---- the transfers of each backend, all ranks (gather direction) --------------------------------
    @functools.lru_cache(maxsize=4)
    def gather_stages(self, backend: str) -> tuple:
        """Stages of ``(src, dst, e)`` transfers of spAG; spRS runs them reversed, last stage first."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown sparse backend {backend!r}; known: {BACKENDS}")
        if backend != "hier":
            return (tuple((self.holders_from[e][0], d, e) for e, d in self.new_copies),)
        if self.world_size // self.ranks_per_node < 2:
            raise ValueError("the hier sparse backend needs more than one node (parallel.topology.nodes > 1)")
        first, second = [], []
        crossings: dict = {}  # node -> experts crossed into it so far: the leaders rotate over its new holders
        for e, (a, b) in enumerate(zip(self.holders_from, self.holders_to)):
            owner, new = a[0], [d for d in sorted(b) if d not in a]
            by_node: dict = {}
            for d in new:
                by_node.setdefault(self.node(d), []).append(d)
            for n, ds in sorted(by_node.items()):
                if n == self.node(owner):
                    first += [(owner, d, e) for d in ds]
                else:
                    k = crossings.get(n, 0)
                    crossings[n] = k + 1
                    lead = ds[k % len(ds)]
                    first.append((owner, lead, e))
                    second += [(lead, d, e) for d in ds if d != lead]
        return tuple(s for s in (tuple(first), tuple(second)) if s)


@functools.lru_cache(maxsize=256)
def _plan(holders_from, holders_to, rank, world_size, ranks_per_node) -> SparsePlan:
    if len(holders_from) != len(holders_to):
        raise ValueError(f"plans of {len(holders_from)} and {len(holders_to)} experts")
    for e, (a, b) in enumerate(zip(holders_from, holders_to)):
        if len(a) != 1:
            raise ValueError(f"expert {e}: the gather's source plan must give one owner, got {list(a)}")
        if a[0] not in b or b[0] != a[0]:
            raise ValueError(f"expert {e}: P' {list(b)} must contain P {list(a)} with the owner first")
        if any(not 0 <= d < world_size for d in b) or len(set(b)) != len(b):
            raise ValueError(f"expert {e}: holders {list(b)} are not distinct ranks of 0..{world_size - 1}")
    if world_size % ranks_per_node:
        raise ValueError(f"{world_size} ranks do not split into nodes of {ranks_per_node}")
    return SparsePlan(rank, world_size, ranks_per_node, holders_from, holders_to)


def sparse_plan(holders_from, holders_to, rank: int, world_size: int, ranks_per_node: Optional[int] = None) -> SparsePlan:
    """The (cached) :class:`SparsePlan` of spAG(``holders_from`` → ``holders_to``) on ``rank``."""
    canon = lambda hs: tuple(tuple(int(r) for r in h) for h in hs)  # noqa: E731
    return _plan(canon(holders_from), canon(holders_to), int(rank), int(world_size), int(ranks_per_node or world_size))


# ---- execution -----------------------------------------------------------------------------------------
class SparseHandle:
    """``wait()`` finishes the collective (issuing a later stage if any) and returns its result once."""

    def __init__(self, run):
        self._gen = run
        self._result = None
        self.done = False

    def wait(self):
        if not self.done:
            self._result = self._gen()
            self.done = True
        return self._result


def _members(comm, group: str) -> list:
    return list(comm.group_ranks(group))


def _stage(comm, transfers, rows: dict, numel: int, like: torch.Tensor, group: str, backend: str):
    """Post one stage: send ``rows[(dst, e)]`` for my transfers; returns ``finish() -> {(src, e): tensor}``."""
    me = comm.rank
    mine_out = sorted((d, e) for s, d, e in transfers if s == me)
    mine_in = sorted((s, e) for s, d, e in transfers if d == me)
    if backend == "p2p":
        sends, recvs = {}, {}
        for d in sorted({d for d, _ in mine_out}):
            sends[d] = torch.cat([rows[(d, e)].reshape(-1) for dd, e in mine_out if dd == d])
        for s in sorted({s for s, _ in mine_in}):
            recvs[s] = like.new_empty(numel * sum(1 for ss, _ in mine_in if ss == s))
        h = comm.exchange(sends, recvs, async_op=True)

        def finish():
            h.wait()
            out, off = {}, {}
            for s, e in mine_in:
                k = off.get(s, 0)
                out[(s, e)] = recvs[s][k * numel:(k + 1) * numel]
                off[s] = k + 1
            return out

        return finish
    members = _members(comm, group)
    pos = {r: i for i, r in enumerate(members)}
    in_rows, out_rows = [0] * len(members), [0] * len(members)
    for d, _ in mine_out:
        in_rows[pos[d]] += 1
    for s, _ in mine_in:
        out_rows[pos[s]] += 1
    x = torch.stack([rows[k].reshape(-1) for k in mine_out]) if mine_out else like.new_empty((0, numel))
    h = comm.all_to_all_raw(x, out_rows, in_rows, group=group, async_op=True)

    def finish():
        out = h.wait()
        return {k: out[i] for i, k in enumerate(mine_in)}  # rows arrive by source rank, then expert

    return finish


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown sparse backend {backend!r}; known: {BACKENDS}")


def sp_all_gather(comm, plan: SparsePlan, owned: Dict[int, torch.Tensor], numel: int, dtype=torch.float32,
                  group: str = "sparse", backend: str = "a2a", async_op: bool = True):
    """spAG: post the gather of ``plan`` (``owned[e]``: this rank's flat parameters, ``numel`` elements of
    ``dtype``, of each expert it owns that someone newly holds). Returns a :class:`SparseHandle` whose
    ``wait()`` gives ``{e: flat tensor}`` for the replicas this rank receives (with ``async_op=False``,
    that dict)."""
    _check_backend(backend)
    stages = plan.gather_stages(backend) if not plan.empty else ()
    if not stages:
        h = SparseHandle(dict)
        return h if async_op else h.wait()
    like = torch.empty(0, dtype=dtype)
    have = {e: t.reshape(-1) for e, t in owned.items()}
    me = comm.rank
    first = _stage(comm, stages[0], {(d, e): have[e] for s, d, e in stages[0] if s == me}, numel, like, group,
                   "p2p" if backend == "p2p" else "a2a")

    def run():
        got = {e: t for (s, e), t in first().items()}
        for st in stages[1:]:  # hier: leaders fan out inside their node
            fin = _stage(comm, st, {(d, e): got[e] for s, d, e in st if s == me}, numel, like, group, "a2a")
            got.update({e: t for (s, e), t in fin().items()})
        return got

    h = SparseHandle(run)
    return h if async_op else h.wait()


def sp_reduce_scatter(comm, plan: SparsePlan, grads: Dict[int, torch.Tensor], numel: int, dtype=torch.float32,
                      group: str = "sparse", backend: str = "a2a", async_op: bool = True):
    """spRS, the mirror of :func:`sp_all_gather` on the same ``plan``: ``grads[e]`` is this rank's flat
    gradient of every replica it holds (zeros for a replica that got no tokens: the traffic is the
    plan's). ``wait()`` gives ``{e: sum of the received segments}`` for each expert this rank owns that
    has replicas, summed in ascending source-rank order; add it to the own gradient with :func:`accumulate_`."""
    _check_backend(backend)
    stages = plan.gather_stages(backend) if not plan.empty else ()
    if not stages:
        h = SparseHandle(dict)
        return h if async_op else h.wait()
    missing = [e for e in plan.replicas_here if e not in grads]
    if missing:
        raise ValueError(f"sp_reduce_scatter: no gradient for replicas {missing} (pass zeros for an unused replica)")
    like = torch.empty(0, dtype=dtype)
    me = comm.rank
    rev = [tuple((d, s, e) for s, d, e in st) for st in reversed(stages)]
    partial = {e: g.reshape(-1) for e, g in grads.items()}

    def post(i):
        st = rev[i]
        return _stage(comm, st, {(d, e): partial[e] for s, d, e in st if s == me}, numel, like, group,
                      "p2p" if backend == "p2p" else "a2a")

    fin = post(0)

    def run():
        nonlocal fin
        out: dict = {}
        for i in range(len(rev)):
            got = fin()
            last = i == len(rev) - 1
            sums: dict = {}
            for (s, e), t in sorted(got.items()):  # ascending source rank per expert
                sums[e] = t.clone() if e not in sums else sums[e].add_(t)
            if last:
                out = sums
            else:  # hier leaders: own replica grad + the node's, then on to the owner
                for e, t in sums.items():
                    partial[e] = partial[e] + t
                fin = post(i + 1)
        return out

    h = SparseHandle(run)
    return h if async_op else h.wait()


def accumulate_(own: torch.Tensor, received: Optional[torch.Tensor]) -> torch.Tensor:
    """``own += received`` (the sum of the replicas' segments), in place; the fixed order of
    :func:`sp_reduce_scatter` makes the result bitwise repeatable."""
    if received is not None:
        own.add_(received.reshape(own.shape))
    return own
