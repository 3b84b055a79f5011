"""Checkpoints: written atomically, resumed bit-for-bit, and resumable at another EP size.

Layout (``<run folder>/checkpoints/step_<k>/``, ``k`` = iterations done)::

    meta.json       written last by rank 0: step, world size, config (and its hash), placement and
                    routing-RNG counter (``forward_calls``) of every MoE layer, the global batch
    dense.pt        rank 0: every non-expert parameter and its Adam state, by parameter name (not written
                    when the update ``saves_params``: Parm's TP and ESP shards live in each rank's file)
    rank<r>.pt      rank r: the experts it *owns*, keyed by (MoE layer, global expert id), each with
                    its parameters and Adam state; the rank's torch RNG state; its update's own state
                    (``Update.checkpoint_state``: the iteration and load windows of SmartMoE, FlexMoE, Hecate;
                    Lina's iteration and packing block)

Experts are stored per global expert id, not per rank slot, and dense state once, so a checkpoint
saved on 4 ranks loads on 2 (each rank picks the experts its placement gives it, replicas too).

Atomicity: every rank writes into ``checkpoints/.tmp-step_<k>/``; an all-reduce of success flags
follows; only if every rank succeeded does rank 0 write ``meta.json`` and rename the folder to
``step_<k>`` (one atomic rename), then delete older checkpoints. A failure anywhere removes the temp
folder and raises on every rank: the previous checkpoint is never touched.

Resuming continues the same run exactly: parameters, Adam moments and step counts, the MoE
layers' routing-RNG counters and the rank's torch RNG (when the world size is the same) are
restored, and the batches of iteration ``k`` onward are the ones the uninterrupted run reads; a run
that moved its experts (Hecate's Alg. 2, SmartMoE, FlexMoE) resumes on the placement it saved, with its update's state,
so later re-placement rounds decide as they would have. The
resumed run is a new run folder whose metrics start at iteration ``k``. Not restored: other
per-layer state (FasterMoE's previous shadow set, the topology gate's hint), recomputed from the
first resumed iteration on. Strategies whose own update does not save its state
(``Update.checkpoint_ready``: ZeRO, Parm, ...) are rejected by validation. A packed layer (Lina: EP over a
block of ranks) keeps its placement in block coordinates; block 0's ranks own (and save) one copy of each
expert.
At another world size the data stay the same iff the global batch ``parallel.nproc x
train.batch_size`` is kept (checked); losses then match the uninterrupted run up to floating-point
summation order, provided the run's math does not depend on the split itself: dropless routing
(``capacity_factor: null``, per-source-rank capacities otherwise) and no ``random_routing`` (its draws
are keyed by rank). The auxiliary losses do not depend on it: the balance loss is taken over the global
batch (first-choice counts all-reduced over the data-parallel ranks, :func:`moelab.moe.layer.global_aux_losses`)
and the z-loss is a mean over equal per-rank token counts, so any ``balance_loss_coef`` and ``z_loss_coef``
resume alike (measured: 4 ranks x 1 resumed on 2 x 2 at the default 0.01, losses within 2e-16 relative).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from moelab.models.tasks import HEAD_MODULES
from moelab.moe.migrate import reslot
from moelab.placement import Placement
from moelab.registry import get_update

FORMAT = 1
PARAM_NAMES = ("w1", "b1", "w2", "b2")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the previous checkpoint is intact."""


# ---- finding and checking checkpoints (no process group needed) --------------------------------
def checkpoint_root(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(path) -> Path | None:
    """``path`` itself if it is a checkpoint, else the newest complete one under ``path/checkpoints``."""
    p = Path(path)
    if (p / "meta.json").is_file():
        return p
    root = checkpoint_root(p)
    done = sorted(d for d in root.glob("step_*") if (d / "meta.json").is_file()) if root.is_dir() else []
    return done[-1] if done else None


def read_meta(ckpt) -> dict:
    return json.loads((Path(ckpt) / "meta.json").read_text())


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_errors(cfg) -> list:
    """Why ``cfg`` cannot continue from ``cfg.train.resume_from`` (empty: it can)."""
    t = cfg.train
    ckpt = latest_checkpoint(t.resume_from)
    if ckpt is None:
        return [f"train.resume_from: no checkpoint at {t.resume_from} (expected meta.json there, or "
                "checkpoints/step_* under a run folder)"]
    meta = read_meta(ckpt)
    saved = meta["config"]
    errs = []
    if meta.get("format") != FORMAT:
        errs.append(f"train.resume_from: checkpoint format {meta.get('format')} is not {FORMAT}")
    diff = {k: (v, _flat(cfg.to_dict()["model"]).get(k)) for k, v in _flat(saved["model"]).items()
            if _flat(cfg.to_dict()["model"]).get(k) != v}
    if diff:
        what = ", ".join(f"model.{k}={now!r} (checkpoint: {was!r})" for k, (was, now) in sorted(diff.items()))
        errs.append(f"train.resume_from: the checkpoint {ckpt} is of another model: {what}")
    for key in ("dtype", "seed", "dataset"):
        if saved["train"][key] != getattr(t, key):
            errs.append(f"train.{key}={getattr(t, key)!r} differs from the checkpoint's {saved['train'][key]!r}")
    batch = cfg.parallel.nproc * t.batch_size
    if batch != meta["global_batch"]:
        errs.append(f"the global batch parallel.nproc x train.batch_size = {cfg.parallel.nproc} x {t.batch_size} "
                    f"= {batch} must equal the checkpoint's {meta['global_batch']} (the data of each iteration "
                    "depends on it)")

    if getattr(get_update(cfg.parallel.strategy), "saves_params", False):
        p, was = cfg.parallel, saved["parallel"]
        if (p.nproc, p.strategy_options) != (was["nproc"], was["strategy_options"]):
            errs.append(f"train.resume_from: a {p.strategy} checkpoint holds each rank's own shards: resume with its "
                        f"parallel.nproc={was['nproc']} and parallel.strategy_options={was['strategy_options']} "
                        f"(got {p.nproc}, {p.strategy_options})")
    if meta["step"] >= t.iters:
        errs.append(f"train.iters={t.iters} must exceed the checkpoint's step {meta['step']}")
    return errs


# ---- saving ------------------------------------------------------------------------------------
def _adam_state(optimizer, p) -> dict:
    return {k: v.detach().clone() for k, v in optimizer.state.get(p, {}).items() if torch.is_tensor(v)}


def _expert_params(layer) -> dict:
    ex = layer.experts
    return {n: getattr(ex, n) for n in PARAM_NAMES if getattr(ex, n) is not None}


def rank_state(trainer) -> dict:
    """This rank's part: the experts it owns (by global id) with their Adam state, and its RNG (an update
    that ``saves_params``: its own state holds every parameter of the rank)."""
    opt, me = trainer.update.optimizer, trainer.rank
    experts = {}
    for li, layer in enumerate([] if trainer.update.saves_params else trainer.model.moe_layers()):
        params = _expert_params(layer)
        for s, e in enumerate(layer.experts.experts):
            if layer.placement.owner(e) != me:  # a packed layer's owners are block ranks: block 0's save
                continue
            rec = {"params": {}, "adam": {}}
            for n, p in params.items():
                rec["params"][n] = p.detach()[s].clone()
                rec["adam"][n] = {k: (v if v.dim() == 0 else v[s].clone()) for k, v in _adam_state(opt, p).items()}
            experts[(li, e)] = rec
    return {"experts": experts, "rng": torch.get_rng_state(), "update": trainer.update.checkpoint_state()}


def dense_state(trainer) -> dict:
    opt, expert_ids = trainer.update.optimizer, {id(p) for p in trainer.model.expert_parameters()}
    named = [(n, p) for n, p in trainer.model.named_parameters() if id(p) not in expert_ids]
    return {"params": {n: p.detach().clone() for n, p in named}, "adam": {n: _adam_state(opt, p) for n, p in named}}


def save(trainer, run_dir, step: int) -> Path:
    """Write ``step_<step>`` under ``run_dir/checkpoints`` (a collective: call it on every rank)."""
    comm, cfg = trainer.comm, trainer.cfg
    root = checkpoint_root(run_dir)
    final, tmp = root / f"step_{step:06d}", root / f".tmp-step_{step:06d}"
    leader = trainer.rank == 0
    err = None
    try:
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _all_ok(comm, True)  # the folder exists before anyone writes into it
        torch.save(rank_state(trainer), tmp / f"rank{trainer.rank}.pt")
        if leader and not trainer.update.saves_params:
            torch.save(dense_state(trainer), tmp / "dense.pt")
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        err = e
    if not _all_ok(comm, err is None):
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint at step {step} failed on some rank; the previous one is intact") from err
    if leader:
        try:
            meta = {"format": FORMAT, "step": step, "world": comm.world_size, "config": cfg.to_dict(),
                    "config_hash": cfg.short_hash(), "global_batch": comm.world_size * cfg.train.batch_size,
                    "layers": [{"layer": li, "forward_calls": getattr(layer, "forward_calls", 0),
                                "holders": ([list(h) for h in layer.placement.holders]
                                            if hasattr(layer, "placement") else [])}
                               for li, layer in enumerate(trainer.model.moe_layers())]}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
            os.replace(tmp, final)
            for old in root.glob("step_*"):
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        except Exception as e:  # noqa: BLE001
            err = e
            shutil.rmtree(tmp, ignore_errors=True)
    if not _all_ok(comm, err is None):
        raise CheckpointError(f"checkpoint at step {step} could not be committed; the previous one is intact") from err
    return final


def _all_ok(comm, ok: bool) -> bool:
    """Every rank's flag, through the door but unrecorded (bookkeeping, not training traffic)."""
    flag = torch.tensor([1.0 if ok else 0.0], dtype=torch.float64)
    with comm.rec.paused():
        comm.all_reduce_(flag)
    return int(flag.item()) == comm.world_size


# ---- loading -----------------------------------------------------------------------------------
def _restore_placements(trainer, meta) -> None:
    """A run that moved its experts (Hecate's Alg. 2, SmartMoE, FlexMoE) resumes on the placement it
    saved (same world size): each layer's slots are re-stacked for the saved holders, the optimizer
    and the update follow the new parameter objects; :func:`load` then fills them from the checkpoint."""
    moved = False
    for li, layer in enumerate(trainer.model.moe_layers()):
        pl = layer.placement
        saved = tuple(tuple(int(r) for r in h) for h in meta["layers"][li].get("holders", ()))
        if not saved or saved == tuple(tuple(h) for h in pl.holders):
            continue
        reslot(layer, Placement(pl.num_experts, pl.world_size, saved, pl.rule), trainer.update.optimizer)
        moved = True
    if moved:
        trainer.update.refresh_params()


@torch.no_grad()
def load(trainer, path) -> int:
    """Restore the trainer's model, optimizer, layer counters and RNG; return the step to resume at."""
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise CheckpointError(f"no checkpoint at {path}")
    meta = read_meta(ckpt)
    if trainer.update.saves_params:  # the rank's own file holds everything (same world and layout: checked)
        part = torch.load(ckpt / f"rank{trainer.rank}.pt", weights_only=False)
        trainer.update.restore_state(part["update"])
        torch.set_rng_state(part["rng"])
        return int(meta["step"])
    opt, model = trainer.update.optimizer, trainer.model
    dense = torch.load(ckpt / "dense.pt", weights_only=False)
    expert_ids = {id(p) for p in model.expert_parameters()}
    for n, p in model.named_parameters():
        if id(p) in expert_ids:
            continue
        p.copy_(dense["params"][n])
        if dense["adam"][n]:
            opt.state[p] = {k: v.clone() for k, v in dense["adam"][n].items()}
    experts, rng, update = {}, None, None
    for f in sorted(ckpt.glob("rank*.pt")):
        part = torch.load(f, weights_only=False)
        experts.update(part["experts"])
        if f.name == f"rank{trainer.rank}.pt":
            rng, update = part["rng"], part.get("update")
    if meta["world"] == trainer.comm.world_size:
        if update:  # first: an update may change the layers' expert groups (Lina's packing block)
            trainer.update.restore_state(update)
        _restore_placements(trainer, meta)
    for li, layer in enumerate(model.moe_layers()):
        slots = layer.experts.experts
        if not slots:
            continue
        missing = [e for e in slots if (li, e) not in experts]
        if missing:
            raise CheckpointError(f"{ckpt} lacks experts {missing} of MoE layer {li}")
        for n, p in _expert_params(layer).items():
            for s, e in enumerate(slots):
                p[s].copy_(experts[(li, e)]["params"][n])
            states = [experts[(li, e)]["adam"][n] for e in slots]
            if not states[0]:
                continue
            steps = {float(st["step"]) for st in states}
            if len(steps) != 1:
                raise CheckpointError(f"experts of MoE layer {li} took different Adam step counts {sorted(steps)}")
            opt.state[p] = {"step": states[0]["step"].clone(),
                            **{k: torch.stack([st[k] for st in states]) for k in states[0] if k != "step"}}
        layer.forward_calls = meta["layers"][li]["forward_calls"]
    if meta["world"] == trainer.comm.world_size and rng is not None:
        torch.set_rng_state(rng)
    return int(meta["step"])


# ---- starting a model from a checkpoint (fine-tuning) -----------------------------------------
@torch.no_grad()
def init_from_checkpoint(model: torch.nn.Module, path) -> dict:
    """Copy a checkpoint's parameters into ``model`` (non-strict only for HEAD_MODULES).

    A checkpoint holds the full model (dense parameters by name, every expert whole). An MoE layer
    that keeps only a shard of its gate and experts in its own layout (Parm: ESP slices of the
    hidden dimension) defines ``load_full(own, experts) -> count``: ``own`` its dense entries by
    name relative to the layer, ``experts`` ``{e: {w1, b1, w2, b2}}`` of its layer; it copies its
    shard and raises CheckpointError for what it cannot hold.

    Returns ``{"loaded": n, "fresh": [names kept at their seeded init]}``. Raises CheckpointError
    when a backbone parameter or an expert is missing or shaped differently.
    """

    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise CheckpointError(f"no checkpoint at {path}")
    dense = torch.load(ckpt / "dense.pt", weights_only=False)["params"]
    names = {id(m): n for n, m in model.named_modules()}
    own = {id(p) for m in model.moe_layers() if hasattr(m, "load_full") for p in m.parameters()}
    skip = {id(p) for p in model.expert_parameters()} | own
    loaded, fresh = 0, []
    for n, p in model.named_parameters():
        if id(p) in skip:
            continue
        src = dense.get(n)
        if src is None or src.shape != p.shape:
            if n.split(".")[0] in HEAD_MODULES:
                fresh.append(n)
                continue
            what = "lacks" if src is None else f"has shape {tuple(src.shape)} for"
            raise CheckpointError(f"{ckpt} {what} parameter {n} {tuple(p.shape)}")
        p.copy_(src)
        loaded += 1
    experts = {}
    for f in sorted(ckpt.glob("rank*.pt")):
        experts.update(torch.load(f, weights_only=False)["experts"])

    def expert(li, e):
        if (li, e) not in experts:
            raise CheckpointError(f"{ckpt} lacks expert {e} of MoE layer {li}")
        return experts[(li, e)]["params"]

    for li, layer in enumerate(model.moe_layers()):
        if hasattr(layer, "load_full"):
            prefix = names[id(layer)] + "."
            mine = {k[len(prefix):]: v for k, v in dense.items() if k.startswith(prefix)}
            E = sum(1 for (lj, _) in experts if lj == li)
            loaded += layer.load_full(mine, {e: expert(li, e) for e in range(E)})
            continue
        ex = layer.experts
        for s, e in enumerate(ex.experts):
            for name in PARAM_NAMES:
                p = getattr(ex, name)
                if p is not None:
                    p[s].copy_(expert(li, e)[name])
                    loaded += 1
    return {"loaded": loaded, "fresh": fresh}


# ---- validation (no process started) -----------------------------------------------------------


def checkpoint_errors(cfg) -> list:
    """Why ``train.init_from`` / ``train.resume_from`` cannot work for ``cfg`` (empty: they can)."""
    t, errs = cfg.train, []
    if t.init_from is not None:
        if t.resume_from is not None:
            errs.append("train.init_from (fine-tune: parameters only) and train.resume_from (continue a run) "
                        "exclude each other")
        ckpt = latest_checkpoint(t.init_from)
        if ckpt is None:
            errs.append(f"train.init_from: no checkpoint at {t.init_from}")
        elif not (ckpt / "dense.pt").is_file():
            errs.append(f"train.init_from: {ckpt} holds each rank's own shards (a parm run's checkpoint), not the full "
                        "model: start from another strategy's run, or continue this one with train.resume_from")
        else:
            saved = read_meta(ckpt)["config"]["model"]
            if saved != cfg.to_dict()["model"]:
                diff = sorted(k for k in saved if saved[k] != cfg.to_dict()["model"].get(k))
                errs.append(f"train.init_from: the checkpoint {ckpt} is of another model "
                            f"(model.{', model.'.join(diff)} differ): fine-tuning keeps the model section")
    if t.resume_from is not None:
        ckpt = latest_checkpoint(t.resume_from)
        was = read_meta(ckpt)["config"]["train"].get("task", "lm") if ckpt is not None else t.task
        if was != t.task:
            errs.append(f"train.resume_from: the checkpoint trained task {was!r}, not train.task={t.task!r} "
                        "(to fine-tune from it use train.init_from)")
    return errs
