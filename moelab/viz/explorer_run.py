"""From drawing to run: the explorer's placement as a run config that ``moelab run`` takes, a REAL run of it on
this machine's ranks (the quickstart's launcher, with its progress bar), and that run's MoE layer time beside
the simulator's for the same config, loads and placement.

- :func:`run_config`: the base config (default the quickstart's tiny GPT-MoE) with the state's experts, top-k,
  ranks, nodes and placement (``parallel.placement``, every MoE layer), and EMULATED links slow enough that
  communication is most of a layer (the simulator's validation set's rates,
  :func:`moelab.measure.local.validation_configs`). The model stays the base's (a CPU run); only the
  placement, the cluster's shape and the expert count come from the drawing.
- :func:`export_config`: writes it as YAML; refuses a placement that is invalid or does not fit memory.
- :func:`real_vs_simulated`: a stored run folder read back as a :class:`moelab.measure.realruns.RealRun`
  (communicator records, trace spans, the dispatcher's per-source counts from ``plans.jsonl``) and compared
  by :func:`moelab.measure.validate.compare` with the simulator on this machine's EMULATED profile
  (:func:`moelab.measure.local.machine_profile`: compute measured on this model, links as emulated). The
  layer time is validate's: the layer's collectives, each call's span once every member is in, plus the
  busiest rank's forward gate and experts.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from moelab.config import RunConfig
from moelab.measure.local import machine_profile
from moelab.measure.realruns import RealRun
from moelab.measure.validate import compare, simulate_real
from moelab.runtime.project import project_path
from moelab.runtime.results import RunResult
from moelab.runtime.train import placement_for
from moelab.viz.explorer_cost import check_fits, evaluate
from moelab.viz.explorer_state import ExplorerState, mapping, profile_of, trace_shape, world_of

QUICKSTART = "experiments/core/quickstart.yaml"
# the validation set's emulated links (moelab.measure.local.validation_configs): 2 and 1 MB/s per rank, so the
# tiny CPU model's layer is mostly communication and the prediction tests the simulator, not CPU jitter
EMULATED_LINKS = {"emulation.enabled": True, "emulation.intra_bw_GBps": 0.002, "emulation.inter_bw_GBps": 0.001}


def run_config(state: ExplorerState, *, base: str = QUICKSTART, iters: int = 6, batch_size: int = 4,
               emulate: bool = True, overrides: Optional[dict] = None):
    """The RunConfig of a REAL run of ``state``'s placement (module doc); ValueError if the placement is not
    valid or does not fit memory on the state's profile."""

    check_fits(evaluate(state))  # also validates the placement (evaluate builds it)
    p = profile_of(state)
    ov = {"parallel.nproc": world_of(state), "parallel.topology.nodes": p.nodes,
          "parallel.topology.ranks_per_node": p.gpus_per_node, "model.moe.num_experts": trace_shape(state)[2],
          "model.moe.top_k": state.top_k, "parallel.placement": {int(e): h for e, h in mapping(state).items()},
          "train.iters": int(iters), "train.batch_size": int(batch_size), "name": "explorer",
          **(EMULATED_LINKS if emulate else {}), **(overrides or {})}
    return RunConfig.load(project_path(base)).with_overrides(ov).validate()


def export_config(state: ExplorerState, path, **kw) -> Path:
    """Write :func:`run_config` as YAML to ``path`` (``moelab run PATH`` runs it); returns the path."""
    import yaml

    cfg = run_config(state, **kw)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # whole or not at all: a reader never sees half a config
    tmp.write_text("# written by the placement explorer (moelab.viz.explorer_run.export_config)\n"
                   + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(path)
    return path


def launch_config(path, out_root="runs", *, progress: bool = True, reuse: bool = False):
    """Run an exported config on this machine's ranks through the quickstart's launcher (``moelab.launch``)."""
    import moelab

    return moelab.launch(str(path), out_root=str(out_root), progress=progress, reuse=reuse)


def real_run_of(run):
    """A stored run (folder or :class:`moelab.runtime.results.RunResult`) as the validation's ``RealRun``."""
    import pandas as pd

    run = run if isinstance(run, RunResult) else RunResult(run)
    cfg = run.config
    N, E = cfg.parallel.nproc, cfg.model.moe.num_experts
    tr = run.trace()
    it = tr[tr.cat == "iteration"].copy()
    it["iter"] = [a["iter"] for a in it.args]
    steps = it.pivot_table(index="iter", columns="rank", values="dur", aggfunc="sum").sort_index() / 1e6
    sp = tr[tr.cat.isin(["gate", "expert"])]
    spans = pd.DataFrame({"rank": sp["rank"].to_numpy(), "name": sp.name.to_numpy(), "cat": sp.cat.to_numpy(),
                          "t_start": sp.ts.to_numpy() / 1e6, "t_end": (sp.ts + sp.dur).to_numpy() / 1e6,
                          "iter": [a.get("iter", -1) for a in sp.args], "layer": [a.get("layer", -1) for a in sp.args]})
    plans = run.plans
    iters, layers = int(steps.index.max()) + 1, int(plans.layer.max()) + 1
    loads = np.zeros((iters, layers, N, E), dtype=np.int64)
    recs = [[] for _ in range(iters)]
    for row in plans.itertuples():
        loads[row.iter, row.layer] = np.asarray(row.counts, dtype=np.int64).reshape(N, E)
        recs[row.iter].append({k: v for k, v in row._asdict().items() if k not in ("Index", "iter", "layer")})
    return RealRun(cfg, steps.to_numpy(), loads, run.comm, spans, plans=recs)


def real_vs_simulated(run, *, warmup: int = 2, compute="model") -> dict:
    """REAL and SIMULATED MoE layer time of a stored run (module doc): ``{"real_s", "sim_s", "rel_err",
    "layers" (validate's per-(iter, layer) frame), "bytes_exact" (every rank's bytes per link class, iteration
    and collective equal on both sides), "real_label", "sim_label"}`` (means over the timed
    iterations and layers)."""

    real = real_run_of(run)
    cfg = real.cfg
    prof = machine_profile(cfg, None, compute=compute)
    sim = simulate_real(cfg, real.loads, prof, placement_for(cfg, cfg.parallel.nproc), plans=None)
    cmp = compare([real], [sim], warmup=warmup, names=["explorer"], warn=False)
    lay = cmp.layers
    r, s = float(lay.real_s.mean()), float(lay.sim_s.mean())
    return {"real_s": r, "sim_s": s, "rel_err": (s - r) / r if r else float("nan"), "layers": lay,
            "bytes_exact": bool(cmp.metrics["bytes_exact"]),
            "real_label": real.label, "sim_label": f"SIMULATED: {prof.name} (this machine, links as emulated)"}


__all__ = ["run_config", "export_config", "launch_config", "real_run_of", "real_vs_simulated", "QUICKSTART",
           "EMULATED_LINKS"]
