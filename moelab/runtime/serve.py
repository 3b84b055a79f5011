"""A real multi-process serving path beside the training loop (``moelab serve``).

Every rank runs :func:`serve`. Rank 0 owns the requests: drawn held-out windows of ``model.seq_len``
tokens arriving as a seeded Poisson process (``serve.rate_per_s``) or a closed loop (``serve.batch_size``
clients, each sending again when answered), or read from ``serve.requests_file`` (malformed rows are
rejected into the results, never a crash). It closes a batch when ``serve.batch_size`` requests wait
or the first has waited ``serve.max_wait_ms``, and broadcasts it through the door; each rank takes a
contiguous share (possibly none), runs the server's no-grad forward, and the answers (next byte, the
window's mean NLL) come back to rank 0 by an all-gather.

**The serving seam.** The model is the server of the strategy ``serve.strategy`` names (its ``serve`` in the
registry, :class:`moelab.registry.Strategy`; options in ``serve.strategy_options``). A server has
``model`` (the serving module: ``[tokens, S] -> logits``), ``prepare()`` (before the clock starts, with the
door's records paused: e.g. fitting an estimator on routing traces; returns the traces to store, or None),
``new_batch(b)`` (before each batch's forward), ``records`` (its per-(batch, MoE layer) rows of the last
batch: plans, estimates, swaps, times) and ``close()``.

Records: per request arrival, start, end, latency; per batch size and time; the server's layer rows.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import time
from datetime import timedelta

import numpy as np
import torch

from moelab.comm.cpu_priority import compute_yields
from moelab.comm.door import Communicator, Recorder
from moelab.config import RunConfig
from moelab.models.data import get_corpus
from moelab.registry import get
from moelab.runtime.preflight import serve_errors
from moelab.runtime.runfolder import RunFolder
from moelab.runtime.train import topology_for
from moelab.runtime.worker import load_config

STOP = -1


def draw_requests(cfg: RunConfig) -> list:
    """``[{id, arrival_s, tokens}]``: held-out windows (the eval split) with seeded Poisson arrivals
    (closed loop: arrivals decided while serving, here 0)."""
    m, sv = cfg.model, cfg.serve
    seqs = get_corpus(m.arch, m.vocab_size, cfg.train.dataset).sequences(np.arange(sv.requests), m.seq_len + 1,
                                                                          cfg.train.seed, split="eval")
    rng = np.random.default_rng((cfg.train.seed, 0xA11))
    gaps = rng.exponential(1.0 / sv.rate_per_s, size=sv.requests)
    arrivals = np.cumsum(gaps) - gaps[0] if sv.arrival == "poisson" else np.zeros(sv.requests)
    return [{"id": i, "arrival_s": float(a), "tokens": s} for i, (a, s) in enumerate(zip(arrivals, seqs))]


def read_requests(path: str, cfg: RunConfig) -> tuple:
    """(valid requests, rejected rows) from a CSV ``id,arrival_s,text``: text as bytes (mod the vocab),
    cut or padded (spaces) to ``model.seq_len + 1``; a row without a non-negative arrival, an integer
    id or any text is rejected with its reason."""
    m = cfg.model
    ok, bad = [], []
    with open(path, newline="") as f:
        for n, row in enumerate(csv.DictReader(f)):
            why = None
            try:
                rid, arrival, text = int(row["id"]), float(row["arrival_s"]), row["text"]
                if arrival < 0 or not np.isfinite(arrival):
                    why = f"arrival_s {arrival} is not a finite non-negative number"
                elif not text:
                    why = "empty text"
            except (KeyError, TypeError, ValueError) as e:
                why = f"malformed row {n}: {e!r}"
            if why:
                bad.append({"id": row.get("id"), "status": "rejected", "reason": why})
                continue
            raw = np.frombuffer(text.encode()[: m.seq_len + 1].ljust(m.seq_len + 1, b" "), dtype=np.uint8)
            ok.append({"id": rid, "arrival_s": arrival, "tokens": raw.astype(np.int64) % m.vocab_size})
    ok.sort(key=lambda r: r["arrival_s"])
    return ok, bad


def build(cfg: RunConfig, comm):
    """The server of ``serve.strategy`` for ``cfg`` on ``comm`` (see the module doc)."""
    return get(cfg.serve.strategy).server(cfg, comm)


def _share(n: int, world: int, rank: int) -> tuple:
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@torch.no_grad()
def serve(cfg: RunConfig, server, comm, requests=None) -> dict:
    """Serve every request (rank 0's list; the others pass None). Returns rank 0's records:
    ``requests``, ``batches``, ``layers`` (every rank returns its own ``layers``)."""
    sv, S = cfg.serve, cfg.model.seq_len
    B, N = sv.batch_size, comm.world_size
    queue, done, batches, layer_rows = list(requests or []), [], [], []
    closed = sv.arrival == "closed"
    if closed and comm.rank == 0:
        for i, r in enumerate(queue):
            r["arrival_s"] = 0.0 if i < B else float("inf")  # later ones arrive when one is answered
    comm.all_reduce_(torch.zeros(1), group="world")  # start together
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    b = 0
    while True:
        header = torch.full((B + 1,), STOP, dtype=torch.int64)
        tokens = torch.zeros(B, S + 1, dtype=torch.int64)
        batch = []
        if comm.rank == 0 and queue:
            while True:  # a full batch, or the first waiting request's deadline, or nothing more to wait for
                now = clock()
                ready = [r for r in queue if r["arrival_s"] <= now]
                deadline = min((r["arrival_s"] for r in ready), default=now) + sv.max_wait_ms / 1e3
                if len(ready) >= B or (ready and (now >= deadline or len(ready) == len(queue))):
                    break
                events = [r["arrival_s"] for r in queue if now < r["arrival_s"] < float("inf")]
                events += [deadline] if ready else []
                if not events:
                    break
                time.sleep(max(0.0, min(events) - now))
            batch = sorted(ready, key=lambda r: r["arrival_s"])[:B]
            for r in batch:
                queue.remove(r)
            header[0] = len(batch)
            for i, r in enumerate(batch):
                header[1 + i] = r["id"]
                tokens[i] = torch.as_tensor(r["tokens"][: S + 1])
        with comm.rec.tagged(phase="serve_io"):
            comm.broadcast_(header, 0, group="world")
        n = int(header[0])
        if n == STOP:
            break
        start = clock()
        with comm.rec.tagged(phase="serve_io"):
            comm.broadcast_(tokens, 0, group="world")
        lo, hi = _share(n, N, comm.rank)
        mine = tokens[lo:hi]
        server.new_batch(b)
        with comm.rec.tagged(iter=b):
            logits = server.model(mine[:, :-1])
        nll = torch.nn.functional.cross_entropy(logits.double().transpose(1, 2), mine[:, 1:],
                                                reduction="none").mean(1) \
            if len(mine) else torch.zeros(0, dtype=torch.float64)
        out = torch.full((-(-B // N), 3), -1.0, dtype=torch.float64)
        out[: hi - lo, 0] = header[1 + lo:1 + hi].double()
        out[: hi - lo, 1] = logits[:, -1].argmax(-1).double() if len(mine) else out[:0, 1]
        out[: hi - lo, 2] = nll
        with comm.rec.tagged(phase="serve_io"):
            got = comm.all_gather(out, group="world").reshape(-1, 3)
        end = clock()
        layer_rows += [{k: (json.dumps(v) if isinstance(v, list) else v) for k, v in rec.items()} | {"rank": comm.rank}
                       for rec in server.records]
        if comm.rank == 0:
            ans = {int(row[0]): row for row in got.tolist() if row[0] >= 0}
            for r in batch:
                row = ans[r["id"]]
                done.append({"id": r["id"], "status": "served", "arrival_s": r["arrival_s"], "start_s": start,
                             "end_s": end, "latency_s": end - r["arrival_s"], "batch": b,
                             "next_token": int(row[1]), "nll": row[2]})
                if closed:  # this client sends its next request now
                    waiting = [q for q in queue if q["arrival_s"] == float("inf")]
                    if waiting:
                        waiting[0]["arrival_s"] = end
            batches.append({"batch": b, "requests": n, "tokens": n * S, "start_s": start, "end_s": end,
                            "batch_s": end - start, "mean_nll": float(np.mean([d["nll"] for d in done[-n:]]))})
        b += 1
    return {"requests": done, "batches": batches, "layers": layer_rows}


def _write_csv(path, rows) -> None:
    with open(path, "w", newline="") as f:
        if rows:
            keys = list(dict.fromkeys(k for r in rows for k in r))
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)


def write_outputs(out_dir: str, comm, res: dict, rejected=(), traces=None) -> None:
    """Rank 0: requests.csv (served and rejected), batches.csv, metrics.csv (one row per batch, so the
    run summary's mean step time is the mean batch time), plans.jsonl; every rank: its layer records
    and comm records."""
    os.makedirs(out_dir, exist_ok=True)
    if comm.rank == 0:
        _write_csv(os.path.join(out_dir, "requests.csv"), list(res["requests"]) + list(rejected))
        _write_csv(os.path.join(out_dir, "batches.csv"), res["batches"])
        _write_csv(os.path.join(out_dir, "metrics.csv"), [{"iter": r["batch"], "loss": r["mean_nll"],
                                                            "step_time_s": r["batch_s"]} for r in res["batches"]])
        with open(os.path.join(out_dir, "plans.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in res["layers"])
        if traces is not None:
            np.save(os.path.join(out_dir, "routing_traces.npy"), traces.astype(np.int16))
    _write_csv(os.path.join(out_dir, f"layer_metrics_rank{comm.rank}.csv"), res["layers"])
    _write_csv(os.path.join(out_dir, f"comm_rank{comm.rank}.csv"), comm.rec.comm_rows())


def run(cfg: RunConfig, out_dir=None) -> dict:
    """On a rank of an initialised process group: build, profile, serve, write; return the records."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    comm = Communicator(topology_for(cfg, world), cfg.emulation, Recorder(rank))
    server = build(cfg, comm)
    with comm.rec.paused():
        traces = server.prepare()
    requests, rejected = (None, [])
    if rank == 0:
        requests, rejected = read_requests(cfg.serve.requests_file, cfg) if cfg.serve.requests_file else \
            (draw_requests(cfg), [])

    try:
        with compute_yields(cfg.emulation.compute_yields):
            res = serve(cfg, server, comm, requests)
    finally:
        server.close()
    if out_dir is not None:
        write_outputs(out_dir, comm, res, rejected, traces)
    comm.close()  # a process serving again (a suite's next variant) starts without this run's groups
    res["rejected"] = rejected
    return res


def main(argv=None) -> None:
    """torchrun entry point: ``python -m moelab.runtime.serve --config C --out DIR [--set k=v]``."""
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--shared-fs", action="store_true", help="every rank writes into --out itself")
    args = ap.parse_args(argv)

    started = time.monotonic()
    cfg = load_config(args.config, args.set)
    errs = serve_errors(cfg)
    if errs:
        raise SystemExit("invalid serve config:\n  - " + "\n  - ".join(errs))
    torch.set_num_threads(cfg.train.threads_per_rank)
    dist.init_process_group("gloo", timeout=timedelta(seconds=max(60.0, cfg.train.timeout_s)))
    try:
        with RunFolder.start(cfg, args.out, "moelab.runtime.serve", shared_fs=args.shared_fs,
                             started=started) as folder:
            run(cfg, folder.dir)
            folder.finish()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
