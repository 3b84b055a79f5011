"""Named groups are real process groups: declared as data, validated before launch, usable from two
threads at once."""
from __future__ import annotations

import threading

import pytest
import torch

from moelab.comm.groups import default_groups, instance_of, validate_groups
from moelab.comm.topology import Topology
from moelab.runtime.ranks import run_ranks


# ---- the validator (pure) ---------------------------------------------------------------------------
def test_validator_accepts_partitions_and_normalises():
    g = validate_groups({"esp": [[1, 0], [3, 2]], "sparse": [[0, 1, 2, 3]]}, 4)
    assert g == {"esp": [[0, 1], [2, 3]], "sparse": [[0, 1, 2, 3]]}
    assert instance_of(g["esp"], 3) == [2, 3]
    d = default_groups(Topology(4, 2))
    assert d["node"] == [[0, 1], [2, 3]] and d["ep"] == d["dp"] == d["world"] == [[0, 1, 2, 3]]


@pytest.mark.parametrize("groups, message", [
    ({"mp": [[0, 1], [1, 2, 3]]}, "groups['mp']: rank 1 is in instances 0 and 1"),
    ({"mp": [[0, 1], [2]]}, "groups['mp']: ranks [3] are in no instance"),
    ({"mp": [[0, 1], [2, 3, 4]]}, "groups['mp']: rank 4 is not a rank of a world of 4"),
    ({"mp": []}, "groups['mp'] must be a non-empty list"),
    ({"mp": [[0, 1], []]}, "groups['mp'] must be a non-empty list"),
    ({"ep": [[0, 1, 2, 3]]}, "groups['ep']: 'ep' is a built-in group"),
    ({"mp": [[0, 1.5], [2, 3]]}, "rank 1.5 is not a rank"),
    ([[0, 1]], "groups must map group names"),
])
def test_validator_rejects_with_the_group_named(groups, message):
    with pytest.raises(ValueError) as e:
        validate_groups(groups, 4)
    assert message in str(e.value)


# ---- real groups, used concurrently ------------------------------------------------------------------
def _two_threads(rank, world, rounds):
    from moelab.comm.door import Communicator

    comm = Communicator(Topology(world, world))
    out, errs = {}, []
    barrier = threading.Barrier(2)

    def worker(group, scale):
        try:
            barrier.wait()
            sums = []
            for i in range(rounds):
                x = torch.full((64,), float(scale * (rank + 1) + i), dtype=torch.float64)
                sums.append(float(comm.all_reduce_(x, group=group)[0]))
            out[group] = sums
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errs.append(repr(e))

    ts = [threading.Thread(target=worker, args=a) for a in (("ep", 1), ("dp", 1000))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    distinct = comm.group("ep")[0] is not comm.group("dp")[0] and comm.group("ep")[0] is not None
    return dict(out=out, errs=errs, distinct=distinct)


@pytest.mark.parametrize("world", [2, 4])
def test_two_threads_on_two_groups_get_correct_sums(world):
    rounds = 30
    res = run_ranks(_two_threads, world, rounds, timeout=120)
    tri = world * (world + 1) // 2
    for r in res:
        assert not r["errs"] and r["distinct"]
        assert r["out"]["ep"] == [float(tri + world * i) for i in range(rounds)]
        assert r["out"]["dp"] == [float(1000 * tri + world * i) for i in range(rounds)]


def _crossed_order(rank, world, same_pg):
    """Rank 0 issues A then B, the others B then A (what two racing threads may do): separate process
    groups pair each call with its own; one process group pairs A with B."""
    from moelab.comm.door import Communicator

    comm = Communicator(Topology(world, world))
    if same_pg:  # the old aliasing: both names on one process group
        comm.add_group("dp", comm.group_ranks("ep"), comm.group("ep")[0])
    a = torch.full((8,), float(rank + 1))
    b = torch.full((8,), 100.0 * (rank + 1))
    calls = [("ep", a), ("dp", b)] if rank == 0 else [("dp", b), ("ep", a)]
    hs = [comm.all_reduce_(t, group=g, async_op=True) for g, t in calls]
    for h in hs:
        h.wait()
    return float(a[0]), float(b[0])


@pytest.mark.parametrize("world", [2, 4])
def test_crossed_issue_order_pairs_correctly_only_on_separate_groups(world):
    tri = world * (world + 1) // 2
    assert run_ranks(_crossed_order, world, False, timeout=60) == [(tri, 100.0 * tri)] * world
    mixed = run_ranks(_crossed_order, world, True, timeout=60)
    assert any(m != (tri, 100.0 * tri) for m in mixed)  # the failure the real groups prevent


def _declared(rank, world):
    from moelab.comm.door import Communicator

    half = world // 2
    comm = Communicator(Topology(world, world), groups={"esp": [list(range(half)), list(range(half, world))],
                                                        "sparse": [list(range(world))]})
    x = torch.tensor([float(rank + 1)])
    comm.all_reduce_(x, group="esp")
    y = torch.tensor([float(rank + 1)])
    comm.all_reduce_(y, group="sparse")
    return dict(esp=comm.group_ranks("esp"), esp_sum=float(x), sparse_sum=float(y),
                node=comm.group_ranks("node"), pgs=len({id(comm.group(n)[0]) for n in ("world", "ep", "dp", "sparse")}))


@pytest.mark.parametrize("world", [2, 4])
def test_declared_groups_reduce_over_their_instance(world):
    half = world // 2
    for r, res in enumerate(run_ranks(_declared, world, timeout=60)):
        mine = list(range(half)) if r < half else list(range(half, world))
        assert res["esp"] == mine and res["esp_sum"] == sum(m + 1 for m in mine)
        assert res["sparse_sum"] == world * (world + 1) / 2 and res["node"] == list(range(world))
        assert res["pgs"] == 4  # world, ep, dp and the declared group over the same ranks: 4 process groups


def test_single_process_without_a_process_group_runs_locally():
    from moelab.comm.door import Communicator

    comm = Communicator(Topology(1, 1), groups={"esp": [[0]]})
    x = torch.arange(4.0)
    assert torch.equal(comm.all_reduce_(x.clone(), group="esp"), x)
    assert torch.equal(comm.all_to_all_raw(x.view(4, 1), [4], [4], async_op=True).wait().view(-1), x)
    with pytest.raises(ValueError, match="groups\\[.esp.\\]: rank 1 is not a rank"):
        Communicator(Topology(1, 1), groups={"esp": [[0, 1]]})


# ---- strategies declare groups; validation before launch; the trainer creates them -------------------
def _register_toy(groups_of):
    """Register strategy ``toy`` (the EP layer) declaring ``groups_of(cfg)``; returns an undo."""
    import moelab.registry as S

    S.register_strategy(S.Strategy("toy", groups=groups_of))

    def undo():
        S._REGISTRY.pop("toy", None)

    return undo


def _halves(cfg):
    n = cfg.parallel.nproc
    return {"esp": [list(range(n // 2)), list(range(n // 2, n))]}


@pytest.mark.parametrize("groups_of, message", [
    (lambda cfg: {"esp": [[0, 1], [1]]}, "process groups of parallel.strategy 'toy'['esp']: rank 1 is in instances"),
    (lambda cfg: {"esp": [[0]]}, "process groups of parallel.strategy 'toy'['esp']: ranks [1] are in no instance"),
    (lambda cfg: 1 / 0, "process groups of parallel.strategy 'toy': ZeroDivisionError"),
])
def test_config_validation_rejects_bad_declarations(groups_of, message):
    from moelab.config import ConfigError, RunConfig

    undo = _register_toy(groups_of)
    try:
        with pytest.raises(ConfigError) as e:
            RunConfig().with_overrides({"parallel.strategy": "toy"}).validate()
        assert message in str(e.value)
        _register_toy(_halves)
        RunConfig().with_overrides({"parallel.strategy": "toy", "parallel.nproc": 4}).validate()
    finally:
        undo()


def _trainer_groups(rank, world):
    from moelab.config import RunConfig
    from moelab.runtime.train import Trainer

    _register_toy(_halves)
    cfg = RunConfig().with_overrides({"parallel.strategy": "toy", "parallel.nproc": world, "model.n_layers": 1,
                                      "model.d_model": 16, "model.d_ff": 16, "model.seq_len": 8,
                                      "model.moe.num_experts": world, "train.dataset": "random"})
    tr = Trainer.build(cfg)
    x = torch.tensor([float(rank + 1)])
    tr.comm.all_reduce_(x, group="esp")
    return tr.comm.group_ranks("esp"), float(x)


@pytest.mark.parametrize("world", [2, 4])
def test_trainer_creates_the_declared_groups(world):
    half = world // 2
    for r, (ranks, s) in enumerate(run_ranks(_trainer_groups, world, timeout=90)):
        mine = list(range(half)) if r < half else list(range(half, world))
        assert ranks == mine and s == sum(m + 1 for m in mine)


def _built_and_closed(rank, world, runs, close):
    import os

    from moelab.comm.door import Communicator
    from moelab.config import EmulationConfig

    def threads():
        return len(os.listdir(f"/proc/{os.getpid()}/task"))

    emu = EmulationConfig(enabled=True, intra_bw_GBps=10.0, inter_bw_GBps=10.0)
    counts, sums, reused, prev = [threads()], [], [], None
    for k in range(runs):  # a benchmark's configurations, one after another in one process
        comm = Communicator(Topology(world, world), emu, groups={"esp": [list(range(world))]})
        x = torch.tensor([float(rank + k)])
        comm.all_reduce_(x, group="esp")
        comm.replica_group(list(range(world)))
        sums.append(float(x))
        groups = {id(pg) for _, pg in comm._made}
        reused.append(prev is not None and groups == prev)
        prev = groups
        if close:
            comm.close()
            comm.close()  # idempotent
        counts.append(threads())
    return counts, sums, reused


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_closed_communicator_leaves_no_process_group_threads_behind():
    """``Communicator.close``: a process building one communicator per configuration keeps a bounded
    number of threads (the next build takes the closed one's groups from the pool), where without it
    every build adds its groups' gloo threads; the pooled groups compute the right sums."""
    closed = run_ranks(_built_and_closed, 2, 6, True, timeout=120)
    kept = run_ranks(_built_and_closed, 2, 6, False, timeout=120)
    for r in range(2):
        assert closed[r][1] == kept[r][1] == [float(2 * k + 1) for k in range(6)]
        c, k = closed[r][0], kept[r][0]
        assert max(c[1:]) <= c[1] + 2, c  # after the first build, no build adds threads
        assert k[-1] >= k[1] + 5 * 4, k  # each build without close adds its groups' threads
        assert closed[r][2] == [False] + [True] * 5  # every later build took the same groups back
        assert not any(kept[r][2])  # nothing given back, nothing reused


def _across_worlds(rank, world):
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from moelab.comm.door import Communicator

    def build_and_sum(k):
        comm = Communicator(Topology(world, world), groups={"esp": [list(range(world))]})
        x = torch.tensor([float(rank + k)])
        comm.all_reduce_(x, group="esp")
        made = [pg for _, pg in comm._made]  # held: an id alone could be reused by a later object
        comm.close()
        return float(x), made

    first, old = build_and_sum(0)  # its groups go to the pool ...
    dist.destroy_process_group()  # ... and die with the world
    store = dist.PrefixStore("second world", dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), None, False,
                                                           timedelta(seconds=60)))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    second, new = build_and_sum(1)
    return first, second, sum(a is b for a in old for b in new)


def test_a_new_world_does_not_take_the_old_worlds_groups():
    """The pool empties when the default group changes: a communicator built after the world was destroyed
    and initialised again creates its groups, and they compute the right sums."""
    for first, second, shared in run_ranks(_across_worlds, 2, timeout=90):
        assert (first, second, shared) == (1.0, 3.0, 0)
