"""This machine as a simulator profile, and the validation sets run on it.

:func:`machine_profile` lays this machine out as a config's declared topology from a calibration
(:func:`moelab.measure.calibrate.calibrate_local`: collective alpha-beta fits, compute lines; every
fitted number carries its kind and source); :func:`emulation_profile` replaces its links by the
EMULATED ones of ``cfg.emulation`` (the link emulator's declared hardware). :data:`GRID_4` and
:func:`validation_configs` / :func:`validation_configs_4` are the configs
:func:`moelab.measure.validate.validate` and ``benchmarks/sim_validation.py`` run. Measured accuracy on
this machine: :mod:`moelab.measure.validate`'s docstring.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Optional

from moelab.comm.cpu_priority import compute_yields
from moelab.comm.door import Communicator
from moelab.comm.topology import Topology
from moelab.config import RunConfig
from moelab.measure.realruns import measure_compute, measure_compute_line
from moelab.runtime.ranks import run_ranks
from moelab.runtime.timing import gather_floats, timed
from moelab.runtime.train import topology_for
from moelab.sim.profiles import ClusterProfile, local_profile_from_calibration

GB = 1e9


def cpu_cores() -> int:
    """Cores this process may run on (what ranks started from it share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine_profile(cfg: RunConfig, calibration: Optional[dict] = None, *, compute="model", share_cores=True,
                    name: Optional[str] = None):
    """This machine as a :class:`ClusterProfile` laid out as ``cfg``'s declared topology.

    ``calibration``: a :func:`moelab.measure.calibrate.calibrate_local` result (collective fits; its
    ``nproc`` need not equal ``cfg``'s: loopback gloo fits are per byte); may be None when
    ``cfg.emulation`` is on (then every link is the emulated one). ``compute``:

    - a number: FLOP/s per rank measured elsewhere (:func:`measure_compute_concurrent`: the ranks
      already shared the cores while measuring, so no core share is applied);
    - ``"model"``: effective FLOP/s of this model on one process (:func:`measure_compute`);
    - ``"model_line"``: this model's compute line on one process, a rate and a cost per compute op
      (:func:`measure_compute_line`: the large ops at the rate they run, the fixed costs per op);
    - ``"gemm"``: the calibrated GEMM rate (raw, under-predicts tiny CPU models);
    - ``"calibrated"``: the calibration's one-process compute line (``calibration["compute"]``,
      :func:`moelab.measure.calibrate.fit_compute`) with the host's cores as a pool the ranks share
      while they compute (the engine slows R ranks computing at once on C cores by R/C, and gives a
      waiting rank's core to the others), collectives by their alpha-beta lines on ``nproc`` ranks;
    - ``"in_context"``: ``calibration["in_context"]`` (:func:`moelab.measure.calibrate.fit_in_context`):
      a compute line and a per-call cost fitted on real multi-rank training steps of held-out
      shapes, so the sharing of the cores is in those two terms (no pool).

    ``share_cores`` (for ``"model"``/``"model_line"``/``"gemm"``): ranks beyond the core count time-share
    the cores.
    ``True``: each rank's rate is scaled by ``min(1, cores / nproc)``, a static factor, whether or not
    they compute at the same time; ``"pool"``: the engine's CPU pool instead (k ranks computing at once
    each run at ``min(1, cores / k)``; a rank waiting for a collective leaves its core to the others, so
    the one busiest rank of an imbalanced layer computes at full speed); ``False``: no sharing. With
    emulation on, the links are the emulated ones (:func:`emulation_profile`).
    """
    if calibration is not None:
        base = local_profile_from_calibration(calibration, name=name or "local")
    elif cfg.emulation.enabled and compute not in ("gemm", "calibrated", "in_context"):
        # every link is emulated: nothing of loopback gloo is used, only compute needs measuring
        base = ClusterProfile(name=name or "local", nodes=1, gpus_per_node=cfg.parallel.nproc, gpu="cpu",
                              peak_flops=1.0, achieved_flops=1.0, intra_bw_GBps=1.0, intra_latency_us=0.0,
                              inter_bw_GBps=1.0, inter_latency_us=0.0, mem_GB=0.0,
                              sources={"*": "this machine; links EMULATED, compute measured"})
    else:
        raise ValueError("machine_profile needs a calibration (calibrate_local) unless every link is emulated")
    topo = Topology.from_config(cfg.parallel.nproc, cfg.parallel.topology.nodes, cfg.parallel.topology.ranks_per_node)
    if share_cores not in (True, False, "pool"):
        raise ValueError(f"share_cores must be True (a static share), 'pool' or False, got {share_cores!r}")
    share, pool = 1.0, {"shared_cores": 0, "op_overhead_s": 0.0, "call_overhead_s": 0.0}
    if compute in ("calibrated", "in_context"):
        ctx = (calibration or {}).get("in_context") if compute == "in_context" else None
        fit = ctx or (calibration or {}).get("compute")
        if fit is None or (compute == "in_context" and ctx is None):
            raise ValueError(f"compute={compute!r} needs a calibration with a compute fit (calibrate_local(..., "
                             "compute_models=COMPUTE_MODELS), and train_models=TRAIN_MODELS for 'in_context')")
        flops, tag = float(fit["flops_per_s"]), compute
        if ctx:  # fitted on multi-rank steps: the sharing of the cores is already in both terms
            pool = {"shared_cores": 0, "op_overhead_s": float(ctx["op_overhead_s"]),
                    "call_overhead_s": float(ctx["call_overhead_s"])}
            src = (f"fitted: {ctx['source']}; op overhead {ctx['op_overhead_s'] * 1e6:.0f} us, "
                   f"call overhead {ctx['call_overhead_s'] * 1e6:.0f} us")
        else:
            pool = {"shared_cores": int(calibration.get("cores") or cpu_cores()),
                    "op_overhead_s": float(fit["op_overhead_s"])}
            src = f"fitted: {fit['source']}; op overhead {fit['op_overhead_s'] * 1e6:.0f} us, cores shared by the ranks"
    elif isinstance(compute, (int, float)):
        flops, tag = float(compute), "model"
        src = f"effective FLOP/s of this model, {cfg.parallel.nproc} processes at once (measure_compute_concurrent)"
    elif compute in ("model", "model_line", "gemm"):
        if compute == "model":
            flops, src = (measure_compute(cfg)["flops_per_s"],
                          "effective FLOP/s of this model on 1 process (measure_compute)")
        elif compute == "model_line":
            fit = measure_compute_line(cfg)
            flops, pool["op_overhead_s"] = fit["flops_per_s"], fit["op_overhead_s"]
            src = (f"fitted: {fit['source']}: {fit['flops_per_s'] / 1e9:.1f} GFLOP/s and "
                   f"{fit['op_overhead_s'] * 1e3:.2f} ms per compute op")
        else:
            flops, src = float(calibration["gemm_flops"]), "GEMM FLOP/s (calibrate_local)"
        tag, cores = compute, cpu_cores()
        if share_cores == "pool" and cores < cfg.parallel.nproc:  # "model": no per-op cost, the rate has it
            pool["shared_cores"] = cores
            src += f" x {cores} cores pooled by the ranks"
        elif share_cores is True:
            share = min(1.0, cores / cfg.parallel.nproc)
            src += f" x {share:g} core share"
    else:
        raise ValueError("compute must be a FLOP/s number, 'model', 'model_line', 'gemm', 'calibrated' or "
                         f"'in_context', got {compute!r}")
    prof = dataclasses.replace(base, name=name or f"local-{tag}", nodes=topo.nodes, **pool,
                               gpus_per_node=topo.ranks_per_node, achieved_flops=flops * share,
                               sources={**base.sources, "achieved_flops": src})
    if cfg.emulation.enabled:
        prof = emulation_profile(cfg, prof)
    return prof


def emulation_profile(cfg: RunConfig, base):
    """``base`` with the links of ``cfg.emulation`` (labelled EMULATED in the name).

    The emulator (``Communicator.emulated_time``) declares per-rank links: every rank has its own
    intra-node port (``intra_bw_GBps``) and its own NIC (``inter_bw_GBps``), per direction. The
    profile declares the same hardware in the simulator's terms: ``nics_per_node = ranks per node``
    and the node's inter bandwidth = ``ranks_per_node x`` the per-rank NIC (``link_capacities``
    gives each NIC its share), intra bandwidth and latencies as emulated. Both sides then price a
    collective alike: all-to-all and p2p as direct transfers on those links (max(out, in) per port
    or NIC, tested; a call spanning nodes pays the inter latency in the simulator even where an
    intra port binds, the emulator that port's latency: at most their difference apart),
    all-reduce / all-gather / reduce-scatter as the same rings (``costs.ring_channels``: one channel
    per NIC across nodes; steps x latency + slowest link, tested), broadcast and reduce as the same
    pipelined chain from the root (tested). No number here is fitted to measured times.
    """
    e = cfg.emulation
    if not e.enabled:
        return base
    rpn = base.gpus_per_node
    return dataclasses.replace(
        base, name=f"{base.name}+EMULATED", intra_bw_GBps=e.intra_bw_GBps, intra_latency_us=e.intra_latency_us,
        inter_bw_GBps=e.inter_bw_GBps * rpn, inter_latency_us=e.inter_latency_us, nics_per_node=rpn, fits={},
        one_host=False,  # emulated nodes are apart
        allreduce="ring",  # the emulator runs gloo's ring
        sources={**base.sources, "intra_bw_GBps": "emulation.intra_bw_GBps (EMULATED, per rank)",
                 "inter_bw_GBps": f"emulation.inter_bw_GBps x {rpn} ranks per node (EMULATED: one NIC per rank)",
                 "nics_per_node": f"{rpn}: the emulator gives every rank its own NIC (EMULATED)",
                 "fits": "broadcast/reduce inside a node: one emulated latency + bytes sent / emulated bandwidth"})


# ---- validation sets ---------------------------------------------------------------------------------------
BASE_MODEL = {"model.d_model": 32, "model.d_ff": 32, "model.n_layers": 2, "model.n_heads": 2,
              "model.seq_len": 32, "train.trace": False, "train.dataset": "pydocs"}


# (nodes, experts, top_k, batch, seed) of the 4-rank set: 4 ranks on this machine's 2 cores, the case
# a FLOP/byte model without shared cores and per-call costs got wrong (R^2 about -0.9 unemulated)
GRID_4 = [(1, 4, 1, 2, 0), (2, 8, 2, 16, 1), (1, 8, 2, 48, 2), (2, 4, 2, 96, 3), (1, 16, 1, 160, 4), (2, 8, 2, 256, 5)]


def validation_configs_4(emulated: bool = False, *, iters: int = 7, intra_bw_GBps: float = 0.002,
                         inter_bw_GBps: float = 0.001) -> list:
    """``[(name, RunConfig)]`` of :data:`GRID_4`: 4 ranks, batch 2-256 so step times spread several-fold
    (batch 2-64 spread them only 1.6x: the tiny model's step is mostly fixed per-op and per-call costs, and
    one iteration on a shared 2-core machine moves by more than that; R^2 needs the spread)."""
    out = []
    for nodes, E, k, B, seed in GRID_4:
        ov = {**BASE_MODEL, "parallel.nproc": 4, "parallel.topology.nodes": nodes, "model.moe.num_experts": E,
              "model.moe.top_k": k, "train.batch_size": B, "train.seed": seed, "train.iters": iters,
              "emulation.enabled": emulated}
        if emulated:
            ov.update({"emulation.intra_bw_GBps": intra_bw_GBps, "emulation.inter_bw_GBps": inter_bw_GBps})
        out.append((f"n4x{nodes}-e{E}k{k}-b{B}-s{seed}" + ("-emu" if emulated else ""),
                    RunConfig().with_overrides(ov).validate()))
    return out


def validation_configs(scale: str = "smoke", emulated: bool = True, *, intra_bw_GBps: float = 0.002,
                       inter_bw_GBps: float = 0.001, iters: Optional[int] = None) -> list:
    """``[(name, RunConfig)]``: a spread of configs (ranks 2 and 4, experts, top-k, tokens, seeds).

    With ``emulated``, slow links (intra ``intra_bw_GBps``, inter ``inter_bw_GBps`` per rank) make
    communication dominate, so what is predicted is mostly the emulated transfer time. Why so slow
    (2 and 1 MB/s by default): the model is tiny (d_model 32, fp32: 128 bytes per token and
    all-to-all) and a CPU rank computes it at a few GFLOP/s, so links of 0.05-0.2 GB/s would leave
    communication at 10-30% of a step and the prediction would mostly test compute timing on a
    shared 2-core machine; at these rates it is 80-95% (``Comparison.iters.comm_share_sim``).
    Seeds change the gate's initial weights and therefore how skewed the measured loads are.
    """
    if scale not in ("smoke", "default", "full"):
        raise ValueError(f"scale must be smoke, default or full, got {scale!r}")
    it = iters or {"smoke": 7, "default": 10, "full": 14}[scale]
    # (nproc, nodes, experts, top_k, batch, seed)
    grid = [(2, 1, 2, 1, 2, 0), (2, 1, 4, 2, 8, 1), (2, 1, 8, 2, 24, 2),
            (4, 2, 4, 2, 4, 0), (4, 2, 8, 1, 16, 3), (4, 1, 8, 2, 12, 1)]
    if scale != "smoke":
        grid += [(2, 1, 4, 1, 12, 4), (2, 1, 8, 2, 4, 5), (4, 2, 4, 2, 16, 6), (4, 2, 8, 2, 8, 7)]
    if scale == "full":
        grid += [(2, 1, 2, 2, 32, 8), (4, 1, 4, 1, 16, 9), (4, 2, 16, 2, 24, 10), (4, 4, 8, 2, 6, 11)]
    out = []
    for n, nodes, E, k, B, seed in grid:
        ov = {**BASE_MODEL, "parallel.nproc": n, "parallel.topology.nodes": nodes, "model.moe.num_experts": E,
              "model.moe.top_k": k, "train.batch_size": B, "train.seed": seed, "train.iters": it,
              "emulation.enabled": emulated}
        if emulated:
            ov.update({"emulation.intra_bw_GBps": intra_bw_GBps, "emulation.inter_bw_GBps": inter_bw_GBps})
        name = f"n{n}x{nodes}-e{E}k{k}-b{B}-s{seed}" + ("-emu" if emulated else "")
        out.append((name, RunConfig().with_overrides(ov).validate()))
    return out


def emulated_call_costs(comm, group: str = "world", op: str = "all_to_all", reps: int = 25,
                        busy: bool = False, yields: bool = False) -> dict:
    """Fixed costs of one call through ``comm``'s emulated door, measured on 1-element calls of ``op``
    over ``group`` with every member calling at once (run it on every member; the slowest member's
    medians): ``sync_s``, what the emulation adds after a call's real completion (the members agree on
    the emulated finish), and ``call_s``, the rest less the call's emulated time alone: its software
    cost, which the emulated links overlap. A simulator of an EMULATED run prices them as
    ``ClusterProfile(call_overhead_s=call_s, emulated_sync_s=sync_s)``
    (:meth:`moelab.sim.engine.OpGraph.transfer`). ``busy``: a thread computes beside the calls on every
    member, as a comm thread's calls run beside backward; where ranks share a host's cores such a call
    waits for a core (``busy_call_overhead_s``, ``busy_emulated_sync_s``); ``yields``: that thread
    computes at SCHED_IDLE, as a run's compute threads do under ``emulation.compute_yields``
    (:mod:`moelab.comm.cpu_priority`). Held out: nothing here is fitted to the run's times."""
    import statistics

    import torch

    n = len(comm.group_ranks(group))
    if op == "all_to_all":
        one = [1] * n
        call = lambda: comm.all_to_all_raw(torch.zeros(n, 1), one, one, group)  # noqa: E731
    elif op == "all_reduce":
        call = lambda: comm.all_reduce_(torch.zeros(1), group=group)  # noqa: E731
    else:
        raise ValueError(f"emulated_call_costs measures all_to_all or all_reduce, got {op!r}")
    walls, syncs, alone = [], [], 0.0
    with _computing(busy, yields):
        for _ in range(reps + 2):
            walls.append(timed(comm, call, group)[1].slowest_s)
            r = comm.rec.comm[-1]
            alone = comm.emulated_time(r.bytes, r.recv, op, comm.group_ranks(group))
            real = r.t_end - r.t_start - r.emulated_s
            syncs.append(max(0.0, r.emulated_s - max(0.0, alone - real)))  # less the sleep for the links' own time
    comm.rec.comm.clear()
    sync = max(gather_floats(comm, statistics.median(syncs[2:]), group))
    return {"call_s": max(0.0, statistics.median(walls[2:]) - sync - alone), "sync_s": sync}


def transport_cpu_per_byte(comm, group: str = "world", peer_bytes: int = 1 << 23, reps: int = 16) -> float:
    """CPU seconds a member spends per byte it sends to or receives from the others, measured on ``comm``'s
    door: the process CPU time (every thread, kernel included) of all-to-alls of ``peer_bytes`` and of
    ``peer_bytes / 8`` to each member, alternated, the slope between their medians over the bytes moved;
    the members' mean. CPU time, not wall time: the emulated links' sleep and who waits for whom do not
    enter, and the slope leaves out what a call costs whatever its size (its fixed costs are measured apart,
    :func:`emulated_call_costs`). So this is what the loopback transport and the door copy per byte on the
    host's cores. Held out: all-to-alls of fixed sizes, nothing of a run (``cpu_s_per_byte`` of a profile with
    ``software_on_cores``, :meth:`moelab.sim.engine.OpGraph.transfer`)."""
    import statistics
    import time

    import torch

    n = len(comm.group_ranks(group))
    sizes = (max(1, peer_bytes // 32), max(2, peer_bytes // 4))  # rows of 4 bytes: 1/8 and all of peer_bytes
    xs = [(torch.zeros(n * k, 1), [k] * n) for k in sizes]
    cpu: list = [[], []]
    for _ in range(reps + 1):
        for i, (x, per) in enumerate(xs):
            c0 = time.process_time()
            comm.all_to_all_raw(x, per, per, group)
            cpu[i].append(time.process_time() - c0)
    comm.rec.comm.clear()
    small, large = (statistics.median(c[1:]) for c in cpu)
    per_byte = (large - small) / (2 * (n - 1) * (sizes[1] - sizes[0]) * 4)
    return max(0.0, statistics.mean(gather_floats(comm, per_byte, group)))


@contextlib.contextmanager
def _computing(on: bool = True, yields: bool = False):
    """While the block runs, a thread runs single-threaded GEMMs (which release the GIL) beside it
    (``yields``: at SCHED_IDLE, see :func:`moelab.comm.cpu_priority.compute_yields`)."""
    if not on:
        yield
        return
    import threading

    import torch

    stop = threading.Event()

    def work():
        with compute_yields(yields):
            a = torch.randn(256, 256) / 16
            while not stop.is_set():
                a = torch.tanh(a @ a)

    t = threading.Thread(target=work, name="moelab-busy", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def _emulated_call_costs_rank(rank, world, cfg, busy=False):
    comm = Communicator(topology_for(cfg, world), cfg.emulation)
    idle = {**emulated_call_costs(comm), "cpu_s_per_byte": transport_cpu_per_byte(comm)}
    return {**idle, "busy": emulated_call_costs(comm, busy=True, yields=cfg.emulation.compute_yields)} if busy else idle


def measure_emulated_call_costs(cfg: RunConfig, timeout: float = 120.0, busy: bool = False) -> dict:
    """:func:`emulated_call_costs` of an all-to-all over the world on ``cfg``'s ranks, topology and
    emulated links (one spawn of ``cfg.parallel.nproc`` ranks), with :func:`transport_cpu_per_byte` under
    ``"cpu_s_per_byte"``; ``busy``: also with the ranks computing,
    under the key ``"busy"``, in the same spawn (at SCHED_IDLE under ``emulation.compute_yields``)."""
    if not cfg.emulation.enabled:
        raise ValueError("measure_emulated_call_costs needs cfg.emulation.enabled")
    return run_ranks(_emulated_call_costs_rank, cfg.parallel.nproc, cfg, busy, timeout=timeout)[0]
