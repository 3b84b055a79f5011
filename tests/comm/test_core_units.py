"""Pure units: config validation, topology, placement routing rule, byte accounting, emulation, trace."""
from __future__ import annotations

import json
import time

import pytest
import torch

from moelab.comm.bytes import by_link_class, peer_bytes
from moelab.comm.topology import Topology
from moelab.config import ConfigError, RunConfig
from moelab.placement import Placement
from moelab.runtime.ranks import run_ranks


@pytest.mark.parametrize("overrides, message", [
    ({"parallel.nproc": 3}, "not divisible by parallel.nproc=3"),
    ({"model.moe.capacity_factor": 0}, "capacity_factor must be > 0"),
    ({"model.moe.capacity_factor": -1.0}, "capacity_factor must be > 0"),
    ({"parallel.strategy": "nope"}, "strategy 'nope' is unknown"),
    ({"parallel.nproc": 4, "parallel.topology.nodes": 3}, "does not fit nproc=4"),
    ({"parallel.nproc": 4, "parallel.topology.nodes": 2, "parallel.topology.ranks_per_node": 4},
     "does not fit nproc=4"),
    ({"model.moe.gate": "gshard", "model.moe.top_k": 1}, "top-2 gate"),
    ({"model.moe.dispatcher": "dense"}, "pads to a capacity"),
    ({"model.moe.top_k": 9}, "model.moe.top_k must be an integer in 1..model.moe.num_experts=8, got 9"),
    ({"model.moe.top_k": 0}, "model.moe.top_k must be an integer in 1..model.moe.num_experts=8, got 0"),
    ({"parallel.placement": {0: [0, 5]}}, "parallel.placement"),
    ({"train.fault_rank": 7}, "fault_rank=7"),
    ({"parallel.strategy_options": {"shadow": True}}, "'ep' takes no strategy_options"),
])
def test_invalid_configs_fail_clearly(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunConfig().with_overrides(overrides).validate()


def test_config_round_trip_and_overrides():
    cfg = RunConfig().with_overrides({"model.moe.top_k": "1", "train.lr": "3e-4"}, parallel__nproc=4)
    assert cfg.model.moe.top_k == 1 and cfg.train.lr == 3e-4 and cfg.parallel.nproc == 4
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.short_hash() != RunConfig().short_hash()
    with pytest.raises(ConfigError, match="unknown config key"):
        cfg.with_overrides({"model.nonsense": 1})
    with pytest.raises(ConfigError, match="unknown field"):
        RunConfig.from_dict({"model": {"d_modle": 3}})


def test_topology_link_classes():
    t = Topology(8, 4)
    assert t.nodes == 2 and t.node_of(5) == 1 and t.node_ranks(1) == [4, 5, 6, 7]
    assert [t.link_class(1, r) for r in (1, 2, 6)] == ["local", "intra", "inter"]
    with pytest.raises(ValueError):
        Topology(6, 4)


def test_placement_ep_and_replica_rule():
    ep = Placement.expert_parallel(8, 4)
    assert ep.local_experts(1) == (2, 3) and ep.owner(5) == 2 and ep.is_trivial
    with pytest.raises(ValueError, match="not divisible"):
        Placement.expert_parallel(6, 4)
    pl = ep.with_replicas({0: [1, 2, 3]})
    assert pl.holders[0] == (0, 1, 2, 3) and pl.local_experts(2) == (0, 4, 5)
    # a holder keeps its own tokens; others split evenly and deterministically over holders
    assert pl.blocks(2, 0, 10) == [(2, 10)]
    counts = torch.zeros(8, dtype=torch.int64)
    counts[0] = 10
    split = Placement(8, 6, pl.holders).split_counts(5, counts)  # source 5 starts at holder 5 % 4 = 1
    assert split[0].tolist() == [2, 3, 3, 2, 0, 0]
    assert pl.slot_table[2, 0] == 0 and pl.slot_table[2, 4] == 1 and pl.slot_table[2, 2] == -1


def test_peer_bytes_rules():
    t = Topology(4, 2)
    # ring all-reduce: 2(N-1)/N * S over the network per rank
    ar = by_link_class(t, 0, peer_bytes("all_reduce", range(4), 0, 400))
    assert ar["intra"] + ar["inter"] == 2 * 3 * 400 // 4
    a2a = by_link_class(t, 1, peer_bytes("all_to_all", range(4), 1, splits=[10, 20, 30, 40]))
    assert a2a == {"local": 20, "intra": 10, "inter": 70}
    assert peer_bytes("broadcast", range(4), 1, 50, root=0) == {}
    assert sum(peer_bytes("broadcast", range(4), 0, 50, root=0).values()) == 200
    assert peer_bytes("reduce", range(4), 2, 50, root=0) == {0: 50}


def _emulated_a2a(rank, world):
    from moelab.comm.door import Communicator
    from moelab.config import EmulationConfig

    emu = EmulationConfig(enabled=True, intra_bw_GBps=100.0, inter_bw_GBps=0.0005, inter_latency_us=1000.0)
    comm = Communicator(Topology(world, 2), emu)
    comm.rec.enabled = False  # unrecorded, so not emulated: gloo sets its connections up outside the timed calls
    comm.all_to_all_raw(torch.ones(world, 1), [1] * world, [1] * world)
    comm.rec.enabled = True
    x = torch.ones(4 * 250, 10, dtype=torch.float32)  # 1000 rows of 40 B; 250 rows to each rank
    t0 = time.time()
    with comm.rec.tagged(iter=0, layer=1):
        y = comm.all_to_all(x, [250] * world, [250] * world)
    elapsed = time.time() - t0
    events = comm.rec.chrome_events()
    z = torch.ones(10_000, dtype=torch.float32)  # 40 kB all-reduced over 2 nodes x 2 ranks
    comm.all_reduce_(z)
    ar = comm.rec.comm[1]
    return dict(elapsed=elapsed, rec=comm.rec.comm[0], events=events, ok=bool(torch.equal(y, x)),
                ar=ar, ar_ok=bool((z == world).all()),
                ar_target=comm.emulated_time(ar.bytes, ar.bytes, "all_reduce", list(range(world))))


def test_link_emulation_slows_inter_node_traffic():
    res = run_ranks(_emulated_a2a, 4, timeout=60)
    for r in res:
        # inter-node bytes per rank: 2 peers x 250 rows x 40 B = 20 kB at 0.5 MB/s = 40 ms + 1 ms latency
        assert r["rec"].bytes == {"local": 10000, "intra": 10000, "inter": 20000}
        assert r["elapsed"] >= 0.041 - 1e-4 and r["rec"].emulated_s > 0
        assert r["ok"]
        names = [e["name"] for e in r["events"] if e.get("ph") == "X"]
        assert names == ["all_to_all L1"]
        json.dumps(r["events"])  # valid Chrome trace payload
        # all-reduce: the records keep the pairwise bytes (2 (S // 4) to every member) ...
        assert r["ar"].bytes == {"local": 20000, "intra": 20000, "inter": 40000} and r["ar_ok"]
        # ... the time is the ring's: 2 channels, each NIC carries half of 2(n-1)/n S = 60 kB, so
        # 30 kB at 0.5 MB/s = 60 ms, plus 2(n-1) = 6 inter latencies (the pairwise rule would say 81 ms)
        assert r["ar_target"] == pytest.approx(0.066)
        assert r["ar"].t_end - r["ar"].t_start >= 0.066 - 1e-4
