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
  into the leader, leaders and same-node replicas into the owner). Stage 2 is issued by ``wait()``, or
  with ``later`` by a comm stream as soon as stage 1 has completed.
- ``stripe``: ``hier`` with a crossing expert cut into G chunks (G = ranks per node): the owner scatters
  chunk i to rank i of its node, which sends it to rank i of every other node holding the expert, which
  passes it to that node's other new holders. One crossing then uses all G NICs of both nodes, as t's
  node-NIC sizing assumes (``hier`` sends it over the owner's one NIC), at one more stage of fixed costs
  (NCCL's multi-channel broadcasts split a buffer over channels and NICs the same way). spRS runs each
  transfer backwards with what flowed down it.
- ``relay``: ``stripe`` whose chunks leave the owner's node once: chunk i crosses to rank i of one destination
  node (the destination nodes in turn, chunk by chunk), which passes it on to rank i of the other destination
  nodes, which fan it out inside their nodes. The owner's node sends a crossing expert out once however many
  nodes hold it (``stripe``: once per destination node), as a broadcast that forwards along the nodes does
  (NCCL's ring broadcast), at one more stage; each destination node still receives it once.

A transfer is ``(source, destination, expert, part)``: ``part`` is :data:`WHOLE` or a chunk index
(:func:`part_range`); between two ranks a stage's pieces travel in (expert, part) order in one call.

A plan without any new copy issues nothing (every rank sees the same plan, so all agree).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

BACKENDS = ("a2a", "p2p", "hier", "stripe", "relay")
NODE_BACKENDS = ("hier", "stripe", "relay")  # cross each node once per expert: t is sized on a node's NICs
WHOLE = -1  # a transfer's part: the whole expert
Transfer = Tuple[int, int, int, int]  # (source rank, destination rank, expert, part)


def part_range(numel: int, part: int, parts: int) -> Tuple[int, int]:
    """Elements ``[lo, hi)`` of chunk ``part`` of ``parts`` (:data:`WHOLE`: all ``numel``)."""
    if part == WHOLE:
        return 0, numel
    return part * numel // parts, (part + 1) * numel // parts


def part_numel(numel: int, part: int, parts: int) -> int:
    lo, hi = part_range(numel, part, parts)
    return hi - lo


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
        """Stages of ``(src, dst, e, part)`` transfers of spAG (``part``: :data:`WHOLE` or a chunk index of
        ``ranks_per_node``, :func:`part_range`); spRS runs them reversed, last stage first."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown sparse backend {backend!r}; known: {BACKENDS}")
        if backend in ("a2a", "p2p"):
            return (tuple((self.holders_from[e][0], d, e, WHOLE) for e, d in self.new_copies),)
        if self.world_size // self.ranks_per_node < 2:
            raise ValueError(f"the {backend} sparse backend needs more than one node (parallel.topology.nodes > 1)")
        stages = {"stripe": self._striped, "relay": self._relayed}.get(backend, self._hier)()
        return tuple(tuple(st) for st in stages if st)

    def _by_node(self, e: int) -> tuple:
        """Expert ``e``'s owner and its new holders grouped by node, ascending."""
        owner, b = self.holders_from[e][0], self.holders_to[e]
        by_node: dict = {}
        for d in sorted(b):
            if d != owner:
                by_node.setdefault(self.node(d), []).append(d)
        return owner, sorted(by_node.items())

    def _hier(self) -> tuple:
        first, second = [], []
        crossings: dict = {}  # node -> experts crossed into it so far: the leaders rotate over its new holders
        for e in range(len(self.holders_from)):
            owner, by_node = self._by_node(e)
            for n, ds in by_node:
                if n == self.node(owner):
                    first += [(owner, d, e, WHOLE) for d in ds]
                else:
                    k = crossings.get(n, 0)
                    crossings[n] = k + 1
                    lead = ds[k % len(ds)]
                    first.append((owner, lead, e, WHOLE))
                    second += [(lead, d, e, WHOLE) for d in ds if d != lead]
        return first, second

    def _striped(self) -> tuple:
        """Chunk i of a crossing expert goes owner -> rank i of its node -> rank i of each destination node
        -> that node's other new holders: every rank's NIC carries 1/G of it (t's node-NIC sizing)."""
        G = self.ranks_per_node
        scatter, cross, fan = [], [], []
        for e in range(len(self.holders_from)):
            owner, by_node = self._by_node(e)
            home = self.node(owner)
            local = next((ds for n, ds in by_node if n == home), [])
            scatter += [(owner, d, e, WHOLE) for d in local]  # same node: whole, as flat
            away = [(n, ds) for n, ds in by_node if n != home]
            for i in range(G) if away else ():
                src = home * G + i
                if src != owner and src not in local:  # a local new holder slices chunk i from its copy
                    scatter.append((owner, src, e, i))
                for n, ds in away:
                    dst = n * G + i
                    cross.append((src, dst, e, i))
                    fan += [(dst, d, e, i) for d in ds if d != dst]
        return scatter, cross, fan


    def _relayed(self) -> tuple:
        """:meth:`_striped` with one crossing per chunk: chunk i enters the destination nodes at rank i of one of
        them (in turn over chunks), which relays it to rank i of the others; each then fans it out in its node."""
        G = self.ranks_per_node
        scatter, cross, relay, fan = [], [], [], []
        for e in range(len(self.holders_from)):
            owner, by_node = self._by_node(e)
            home = self.node(owner)
            local = next((ds for n, ds in by_node if n == home), [])
            scatter += [(owner, d, e, WHOLE) for d in local]
            away = [(n, ds) for n, ds in by_node if n != home]
            for i in range(G) if away else ():
                src, entry = home * G + i, away[i % len(away)][0] * G + i
                if src != owner and src not in local:
                    scatter.append((owner, src, e, i))
                cross.append((src, entry, e, i))
                for n, ds in away:
                    dst = n * G + i
                    if dst != entry:
                        relay.append((entry, dst, e, i))
                    fan += [(dst, d, e, i) for d in ds if d != dst]
        return scatter, cross, relay, fan


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


def sparse_plan(holders_from, holders_to, rank: int, world_size: int,
                ranks_per_node: Optional[int] = None) -> SparsePlan:
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


def _stage(comm, transfers, piece, numel: int, parts: int, like: torch.Tensor, group: str, backend: str):
    """Post one stage: send ``piece(e, part)`` (flat) for each of my transfers, one call; returns
    ``finish() -> {(src, e, part): tensor}``. Between two ranks the pieces go in (expert, part) order."""
    me = comm.rank
    mine_out = sorted((d, e, p) for s, d, e, p in transfers if s == me)
    mine_in = sorted((s, e, p) for s, d, e, p in transfers if d == me)
    size = {p: part_numel(numel, p, parts) for p in {p for *_, p in transfers}}
    pieces = [piece(e, p).reshape(-1) for _, e, p in mine_out]
    if backend == "p2p":
        sends = {d: torch.cat([t for (dd, _, _), t in zip(mine_out, pieces) if dd == d])
                 for d in sorted({d for d, _, _ in mine_out})}
        recvs = {s: like.new_empty(sum(size[p] for ss, _, p in mine_in if ss == s))
                 for s in sorted({s for s, _, _ in mine_in})}
        h = comm.exchange(sends, recvs, async_op=True)
    else:
        recvs = None
        members = list(comm.group_ranks(group))
        pos = {r: i for i, r in enumerate(members)}
        mine_in.sort(key=lambda k: (pos[k[0]], k[1], k[2]))  # the all-to-all delivers by member position
        n_out, n_in = [0] * len(members), [0] * len(members)
        for (d, _, p) in mine_out:
            n_out[pos[d]] += size[p]
        for (s, _, p) in mine_in:
            n_in[pos[s]] += size[p]
        h = comm.all_to_all_raw(torch.cat(pieces) if pieces else like.new_empty(0), n_in, n_out, group=group,
                                async_op=True)

    def finish():
        got = h.wait()
        out, off = {}, {}
        for s, e, p in mine_in:  # p2p: one buffer per source; a2a: one, by member position
            buf, key = (recvs[s], s) if recvs is not None else (got, None)
            k = off.get(key, 0)
            out[(s, e, p)] = buf[k:k + size[p]]
            off[key] = k + size[p]
        return out

    return finish


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown sparse backend {backend!r}; known: {BACKENDS}")


def _wire(backend: str) -> str:
    return "p2p" if backend == "p2p" else "a2a"


def sp_all_gather(comm, plan: SparsePlan, owned: Dict[int, torch.Tensor], numel: int, dtype=torch.float32,
                  group: str = "sparse", backend: str = "a2a", async_op: bool = True, later=None):
    """spAG: post the gather of ``plan`` (``owned[e]``: this rank's flat parameters, ``numel`` elements of
    ``dtype``, of each expert it owns that someone newly holds). Returns a :class:`SparseHandle` whose
    ``wait()`` gives ``{e: flat tensor}`` for the replicas this rank receives (with ``async_op=False``,
    that dict). ``later``: where the stages after the first run (:func:`_handle`)."""
    _check_backend(backend)
    stages = plan.gather_stages(backend) if not plan.empty else ()
    if not stages:
        h = SparseHandle(dict)
        return h if async_op else h.wait()
    like, G = torch.empty(0, dtype=dtype), plan.ranks_per_node
    whole = {e: t.reshape(-1) for e, t in owned.items()}  # experts held whole here
    chunks: dict = {}  # (e, part) -> a chunk passing through (stripe)

    def piece(e, p):
        if e in whole:
            lo, hi = part_range(numel, p, G)
            return whole[e][lo:hi]
        return chunks[(e, p)]

    first = _stage(comm, stages[0], piece, numel, G, like, group, _wire(backend))

    def run(next_group):
        fin = first
        for i in range(len(stages)):
            for (_, e, p), t in fin().items():
                if p == WHOLE:
                    whole[e] = t
                else:
                    chunks[(e, p)] = t
            if i + 1 < len(stages):  # hier / stripe / relay: the next stage forwards what arrived
                fin = _stage(comm, stages[i + 1], piece, numel, G, like, next_group, "a2a")
        return {e: whole[e] if e in whole else torch.cat([chunks[(e, p)] for p in range(G)])
                for e in plan.replicas_here}

    return _handle(run, group, later, async_op)


def sp_reduce_scatter(comm, plan: SparsePlan, grads: Dict[int, torch.Tensor], numel: int, dtype=torch.float32,
                      group: str = "sparse", backend: str = "a2a", async_op: bool = True, later=None):
    """spRS, the mirror of :func:`sp_all_gather` on the same ``plan``: ``grads[e]`` is this rank's flat
    gradient of every replica it holds (zeros for a replica that got no tokens: the traffic is the
    plan's). ``wait()`` gives ``{e: sum of the received segments}`` for each expert this rank owns that
    has replicas, summed in ascending source-rank order; add it to the own gradient with :func:`accumulate_`.

    Each transfer of the gather runs backwards carrying what flowed down it: the receiver's own gradient
    (if it holds the replica: every transfer into a holder is part of its copy) plus what came back up
    the transfers it forwarded that piece on."""
    _check_backend(backend)
    stages = plan.gather_stages(backend) if not plan.empty else ()
    if not stages:
        h = SparseHandle(dict)
        return h if async_op else h.wait()
    missing = [e for e in plan.replicas_here if e not in grads]
    if missing:
        raise ValueError(f"sp_reduce_scatter: no gradient for replicas {missing} (pass zeros for an unused replica)")
    like, G, me = torch.empty(0, dtype=dtype), plan.ranks_per_node, comm.rank
    rev = [tuple((d, s, e, p) for s, d, e, p in st) for st in reversed(stages)]
    own = {e: grads[e].reshape(-1) for e in plan.replicas_here}
    back: dict = {}  # (x, e, part) -> what came back from x, up my gather transfer of that piece

    def summed(e, p):
        """Received pieces of ``e`` that fall within part ``p``, in ascending (source, part) order."""
        lo, hi = part_range(numel, p, G)
        v = like.new_zeros(hi - lo)
        for (x, e2, p2), t in sorted(back.items()):
            if e2 == e and (p2 == p or p == WHOLE):
                a, b = part_range(numel, p2, G)
                v[a - lo:b - lo] += t
        return v

    def piece(e, p):
        v = summed(e, p)
        if e in own:
            lo, hi = part_range(numel, p, G)
            v += own[e][lo:hi]
        return v

    first = _stage(comm, rev[0], piece, numel, G, like, group, _wire(backend))

    def run(next_group):
        fin = first
        for i in range(len(rev)):
            back.update(fin())
            if i + 1 < len(rev):
                fin = _stage(comm, rev[i + 1], piece, numel, G, like, next_group, "a2a")
        mine = sorted({e for _, e, _ in back if plan.holders_from[e][0] == me})
        return {e: summed(e, WHOLE) for e in mine}

    return _handle(run, group, later, async_op)


def _handle(run, group: str, later, async_op: bool):
    """The handle of a posted first stage: ``run(group)`` finishes it and runs the later stages on ``group``.

    ``later = (stream, group2)``: ``run`` goes to that in-order :class:`moelab.comm.stream.CommStream` now,
    so each later stage is posted as soon as the one before has completed (beside the caller's compute),
    on ``group2``: first stages are posted by the caller in program order on ``group``, later ones by the
    stream in the same order on ``group2``, so each group's calls pair up across ranks. Every call of a
    backend with later stages must pass ``later`` (its first stages are then all waited on the stream, in
    order). Without ``later``, ``wait()`` runs the later stages."""
    if later is None:
        h = SparseHandle(lambda: run(group))
    else:
        stream, group2 = later
        h = SparseHandle(stream.submit(run, group2, name="sparse stages").wait)
    return h if async_op else h.wait()


def accumulate_(own: torch.Tensor, received: Optional[torch.Tensor]) -> torch.Tensor:
    """``own += received`` (the sum of the replicas' segments), in place; the fixed order of
    :func:`sp_reduce_scatter` makes the result bitwise repeatable."""
    if received is not None:
        own.add_(received.reshape(own.shape))
    return own
