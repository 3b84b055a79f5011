"""The serving path on real gloo ranks (spec §5 I10, I12, bad input): requests flow through the
ranks; every placement variant but Ideal answers exactly what one process answers; phase 2 re-plans
iff the estimated and actual top sets differ; malformed requests are rejected, not fatal."""
from __future__ import annotations

import pytest

from moelab.config import RunConfig
from moelab.runtime.preflight import serve_errors
from moelab.runtime.ranks import run_ranks
from moelab.strategies.lina.placement import load_off, needs_replan

SERVE = {
    "model.d_model": 16, "model.d_ff": 32, "model.n_layers": 4, "model.n_heads": 2, "model.seq_len": 16,
    "model.moe.num_experts": 4, "model.moe.top_k": 1, "model.moe.gate": "switch", "model.moe.capacity_factor": None,
    "train.dtype": "float64", "train.batch_size": 2, "train.trace": False,
    "serve.requests": 10, "serve.batch_size": 4, "serve.rate_per_s": 2000.0, "serve.max_wait_ms": 2.0,
    "serve.strategy": "lina", "serve.strategy_options.path_len": 2, "serve.strategy_options.profile_batches": 2,
}
VARIANTS = ("baseline", "lina", "lina_no_estimation", "lina_no_finetune", "ideal")
LOAD = ("lina_load", "lina", {"serve.strategy_options.replan_test": "load"})  # phase 2 by the kept plan's busiest load
# layers before path_len planned from the counts
FIRST = ("lina_first", "lina", {"serve.strategy_options.first_layers": "actual"})


def _serve(rank, world, variants, extra):
    from moelab.runtime.serve import run

    out = {}
    for entry in variants:  # a variant, or (name, variant, its own overrides)
        name, v, own = (entry, entry, {}) if isinstance(entry, str) else entry
        cfg = RunConfig().with_overrides({**SERVE, "parallel.nproc": world, "serve.strategy_options.variant": v,
                                          **extra, **own}).validate()
        assert not serve_errors(cfg)
        if name != "lina":
            out[name] = run(cfg)
            continue
        import csv
        import tempfile

        with tempfile.TemporaryDirectory() as d:  # and its comm records
            out[name] = run(cfg, d)
            with open(f"{d}/comm_rank{rank}.csv") as f:
                out[name]["comm"] = list(csv.DictReader(f))
    return out


@pytest.fixture(scope="module")
def served():
    return run_ranks(_serve, 4, VARIANTS + (LOAD, FIRST), {}, timeout=300), run_ranks(_serve, 1, ("baseline",), {},
                                                                                timeout=120)


def test_every_request_is_served_once_with_the_single_process_answers(served):
    four, one = served
    ref = {r["id"]: r for r in one[0]["baseline"]["requests"]}
    assert sorted(ref) == list(range(10))
    for v in VARIANTS + LOAD[:1] + FIRST[:1]:
        got = {r["id"]: r for r in four[0][v]["requests"]}
        assert sorted(got) == list(range(10)), v
        assert all(r["latency_s"] >= r["end_s"] - r["start_s"] - 1e-9 for r in got.values())
        if v == "ideal":
            continue  # a different routing on purpose: timing only
        for i, r in got.items():
            assert r["next_token"] == ref[i]["next_token"], (v, i)
            assert r["nll"] == pytest.approx(ref[i]["nll"], rel=1e-10), (v, i)


def test_phase_two_replans_iff_the_top_sets_differ(served):
    """Layers before path_len have no estimate: static for lina and lina_no_finetune, planned from the
    actual counts with first_layers=actual; lina_no_estimation plans every layer from the counts."""
    four, _ = served
    for v in ("lina", "lina_no_finetune", "lina_no_estimation", FIRST[0]):
        rows = [r for r in four[0][v]["layers"] if r["batch"] >= 0]
        assert rows
        for r in rows:
            import json

            counts = json.loads(r["counts"])  # the all-gathered [N, E] counts the simulator's prediction prices
            assert len(counts) == 4 and sum(map(sum, counts)) == r["tokens"]
            assert [sum(c) / r["tokens"] for c in zip(*counts)] == pytest.approx(json.loads(r["pop"]), abs=1e-12)
            assert ("p1_devs" in r) == (r["planned_from"] == "estimate"), r  # phase 1's plan, where it made one
            if v == "lina_no_estimation" or (v == FIRST[0] and r["layer"] < 2):
                assert r["planned_from"] == "actual" and not r["replanned"] and "pop_hat" not in r, (v, r)
                devs = json.loads(r["devs"])
                assert {e for d in devs for e in d} == {0, 1, 2, 3}
                continue
            if r["layer"] < 2:
                assert r["planned_from"] == "static"
                continue
            pop_hat, pop = json.loads(r["pop_hat"]), json.loads(r["pop"])
            assert r["planned_from"] == "estimate"
            assert r["replanned"] == (v in ("lina", FIRST[0]) and needs_replan(pop_hat, pop, 2)), r
            devs = json.loads(r["devs"])
            assert len(devs) == 4 and {e for d in devs for e in d} == {0, 1, 2, 3}


def test_phase_one_estimates_ride_the_count_exchange_before_the_layer_they_estimate(served):
    """No call of their own: every call is on the world group, and a batch's count exchanges (its
    all-gathers outside the request and answer transfers) carry E counts, plus E estimate sums and a token
    count before each layer phase 1 estimates (layers 2 and 3 at path_len 2: the exchanges of layers 1, 2)."""
    from moelab.strategies.lina.infer import piggyback_bytes

    four, _ = served
    E, L = 4, 4
    want = [8 * E + (piggyback_bytes(E) if 2 <= j + 1 < L else 0) for j in range(L)]
    for rank in range(4):
        rows = four[rank]["lina"]["comm"]
        assert rows and {r["group"] for r in rows} == {"world"}
        sent = lambda r: sum(float(v) for k, v in r.items() if k.startswith("bytes_"))  # noqa: E731
        batches = sorted({int(r["iter"]) for r in rows if int(r["iter"]) >= 0})
        assert batches
        for b in batches:
            got = [sent(r) for r in rows
                   if int(r["iter"]) == b and r["op"] == "all_gather" and r["phase"] != "serve_io"]
            assert len(got) == L and got[0] > 0, (rank, b, got)
            assert [x / got[0] for x in got] == pytest.approx([w / want[0] for w in want]), (rank, b, got)


def test_phase_two_by_load_replans_iff_phase_ones_plan_carries_more_than_its_estimate(served):
    import json

    four, _ = served
    rows = [r for r in four[0][LOAD[0]]["layers"] if r["batch"] >= 0 and r["planned_from"] == "estimate"]
    assert rows
    for r in rows:
        pop_hat, pop = json.loads(r["pop_hat"]), json.loads(r["pop"])
        kept = json.loads(r["p1_devs"]) if r["replanned"] else json.loads(r["devs"])
        assert load_off(kept, pop_hat, pop, 0.1) == r["replanned"], r


def test_phase_one_loads_the_next_layers_experts_ahead_and_a_kept_plan_swaps_nothing(served):
    four, _ = served
    for v in ("lina", "lina_no_finetune"):
        for rank in range(4):
            rows = [r for r in four[rank][v]["layers"] if r["batch"] >= 0 and r["planned_from"] == "estimate"]
            assert rows and sum(r["prefetched"] for r in rows) > 0, (v, rank)  # phase 1 loaded experts
            for r in rows:
                if not r["replanned"]:  # phase 1's plan stands: its experts were loaded during the layer before
                    assert r["swapped"] == 0 and r["swap_s"] < r["prefetch_s"] + 0.05, (v, rank, r)
    static = [r for r in four[0]["lina"]["layers"] if r["batch"] >= 0 and r["planned_from"] == "static"]
    assert static and all(r["prefetched"] == 0 for r in static)


def test_malformed_requests_are_rejected_not_fatal(tmp_path):
    p = tmp_path / "requests.csv"
    p.write_text("id,arrival_s,text\n0,0.0,hello world\nx,0.1,bad id\n2,-1,negative\n3,0.2,\n4,0.001,more text\n")
    res = run_ranks(_serve, 2, ("lina",), {"serve.requests_file": str(p)}, timeout=120)[0]["lina"]
    assert sorted(r["id"] for r in res["requests"]) == [0, 4]
    assert len(res["rejected"]) == 3 and all(r["status"] == "rejected" and r["reason"] for r in res["rejected"])


@pytest.mark.parametrize("over,msg", [
    ({"serve.strategy_options.path_len": 4}, "path_len=4 must be below"),
    ({"serve.strategy_options.k_est": 5}, "k_est must lie in 1..num_experts"),
    ({"serve.strategy_options.k_cmp": 0}, "k_cmp must lie in 1..num_experts"),
    ({"serve.strategy_options.max_pack": 1, "parallel.nproc": 2}, "cannot hold 4 experts"),
    ({"model.moe.capacity_factor": 1.0}, "no drops"),
    ({"serve.strategy_options.variant": "magic"}, "variant must be one of"),
    ({"serve.strategy_options.replica_rounding": "ceil"}, "replica_rounding must be"),
    ({"serve.strategy_options.replan_test": "magic"}, "replan_test must be one of"),
    ({"serve.strategy_options.replan_tol": -0.1}, "replan_tol must be a number >= 0"),
    ({"serve.strategy_options.first_layers": "dynamic"}, "first_layers must be one of ['static', 'actual']"),
    ({"serve.strategy_options.magic": 1}, "unknown lina serve option(s) ['magic']"),
    ({"serve.strategy": None}, "serve.strategy must name a strategy with a server, one of ['lina']"),
    ({"serve.strategy": "zero"}, "strategy 'zero' has no server"),
    ({"serve.arrival": "burst"}, "serve.arrival must be one of ('poisson', 'closed'), got 'burst'"),
    ({"serve.requests": 0}, "serve.requests must be >= 1, got 0"),
    ({"serve.max_wait_ms": 0.0}, "serve.max_wait_ms must be > 0, got 0.0"),
])
def test_bad_serve_config_is_reported_before_launch(over, msg):
    cfg = RunConfig().with_overrides({**SERVE, "parallel.nproc": 4, **over})
    assert any(msg in e for e in serve_errors(cfg)), serve_errors(cfg)


def test_moelab_serve_stores_a_run_with_requests_and_batches(tmp_path):
    from moelab.runtime.launch import SERVE_WORKER, launch

    res = launch("experiments/lina/serve.yaml", 2, overrides={"serve.requests": 6, "serve.batch_size": 4,
                                                               "model.n_layers": 4,
                                                               "serve.strategy_options.path_len": 2,
                                                               "serve.strategy_options.profile_batches": 1},
                 out_root=str(tmp_path), progress=False, worker=SERVE_WORKER)
    assert sorted(res.requests["id"]) == list(range(6)) and (res.requests["status"] == "served").all()
    assert res.batches["requests"].sum() == 6 and res.summary["iters"] == len(res.batches)
    assert len(res.plans) == len(res.batches) * 4  # one record per (batch, MoE layer)


def test_a_repeated_suite_serves_every_run_in_interleaved_rounds_and_pools_their_records(tmp_path):
    """``inference_suite(repeat=R)`` (the benchmark's ``--serve ... --repeat R``): each run served R times,
    every record tagged with its round, the rounds' records pooled under the run's key."""
    from moelab.papers.lina.runs import _suite_rank

    cfg = RunConfig().with_overrides({**SERVE, "parallel.nproc": 2, "train.iters": 2}).validate().to_dict()
    runs = {"base": {"serve.strategy_options.variant": "baseline"}, "lina": {"serve.strategy_options.variant": "lina"}}
    once = run_ranks(_suite_rank, 2, cfg, runs, str(tmp_path / "a"), timeout=300)[0]["serve"]
    twice = run_ranks(_suite_rank, 2, cfg, runs, str(tmp_path / "b"), 2, timeout=300)[0]["serve"]
    assert list(twice) == list(runs)
    for key in runs:
        for part in ("requests", "batches", "layers"):
            rounds = [row["round"] for row in twice[key][part]]  # batches per run depend on arrival timing
            assert rounds == sorted(rounds) and set(rounds) == {0, 1} and once[key][part], (key, part)
        ids = [q["id"] for q in twice[key]["requests"]]
        assert sorted(ids) == sorted(2 * [q["id"] for q in once[key]["requests"]])


def test_an_emulated_suite_is_predicted_from_its_own_records(tmp_path):
    """An EMULATED suite also measures, held out after serving, one call's fixed costs and the baseline over
    free links; predict_suite prices every run's recorded batches from them (benchmarks/lina.py --serve)."""
    from moelab.papers.lina.frames import predict_suite
    from moelab.papers.lina.runs import _suite_rank

    cfg = RunConfig().with_overrides({**SERVE, "parallel.nproc": 2, "train.iters": 2}).validate().to_dict()
    links = {"emulation.enabled": True, "emulation.intra_bw_GBps": 0.05, "emulation.inter_bw_GBps": 0.01,
             "parallel.topology.nodes": 2}
    runs = {"base": {"serve.strategy_options.variant": "baseline", **links},
            "noest": {"serve.strategy_options.variant": "lina_no_estimation", **links}}
    su = run_ranks(_suite_rank, 2, cfg, runs, str(tmp_path), timeout=300)[0]
    assert su["call_costs"]["call_s"] >= 0 and su["call_costs"]["sync_s"] >= 0
    free = su["free_links"]
    assert {r["variant"] for r in free["static"]["layers"]} == {"baseline"} and free["static"]["batches"]
    assert {r["variant"] for r in free["replicated"]["layers"]} == {"lina_no_estimation"}
    pred = predict_suite(su).set_index("variant")
    assert list(pred.index) == ["base", "noest"] and (pred.host_layer_s >= 0).all() and (pred.host_expert_s >= 0).all()
    for key in runs:
        assert 0 < pred.loc[key, "median_batch_s"] <= pred.loc[key, "p95_batch_s"] <= pred.loc[key, "p95_latency_s"]
    assert pred.loc["noest", "o_plan_s"] > 0 and pred.loc["base", "o_plan_s"] == 0  # planning priced where it ran
    with pytest.raises(ValueError, match="EMULATED"):
        predict_suite({k: v for k, v in su.items() if k != "call_costs"})
