"""LSH-MoE reproduction, shared pieces: the scale spec (sizes in ``experiments/lsh_moe/scales.yaml``) and the
tiny models every substitute experiment trains (spec §4: RoBERTa-like masked LM on shipped text)."""
from __future__ import annotations

from dataclasses import dataclass

SCALES = ("smoke", "default", "full")


@dataclass(frozen=True)
class ScaleSpec:
    """Sizes of every LSH-MoE experiment at one scale (smoke: CI on 2 cores; default: a laptop; full:
    the largest this machine class does). Paper-scale parts are SIMULATED at every scale."""

    name: str
    # the tiny masked-LM MoE whose dispatched rows stand in for the paper's tokens (Figs. 4, 7 middle, EC error)
    d: int
    layers: int
    experts: int
    heads: int
    seq: int
    batch: int
    capture_iters: int  # pretraining iterations before capturing (REAL, 1 rank, at q_nproc x batch sequences)
    capture_batches: int  # batches captured, each one source rank's rows (groups = (batch, expert), as in a run)
    # rate sweeps (Fig. 7 middle)
    Ls: tuple
    rs: tuple
    # quality runs (Fig. 6 left): REAL/EMULATED gloo ranks
    q_nproc: int
    q_nodes: int
    q_iters: int
    q_eval_every: int
    q_eval_batches: int
    q_seeds: int
    q_lr: float
    # fine-tuning from the pretrained capture model (Table 2, Fig. 7 left/right) and digits (Table 3)
    ft_iters: int
    ft_lr: float  # fine-tuning's learning rate (below pretraining's, as usual for fine-tuning)
    ft_low_L: object  # Table 2's low-rate setting: L calibrated on fine-tuning runs (data, see scales.yaml); null: none
    ft_eval_every: int
    f7_seeds: int  # Fig. 7's sweeps (12 fine-tunings per seed)
    v_iters: int
    v_patch: int  # digits patch side (pixels)
    intra_GBps: float  # emulated per-rank links of the quality runs
    inter_GBps: float
    latency_us: float


def scale_spec(scale) -> ScaleSpec:
    """The :class:`ScaleSpec` of ``scale`` (a name in ``experiments/lsh_moe/scales.yaml``, or a spec)."""
    from moelab.papers.kit.scales import load_scale  # here: the kit loads plotly, this module does not

    return load_scale("lsh_moe", ScaleSpec, scale)


def tiny_overrides(s: ScaleSpec, *, iters: int, seed: int = 0) -> dict:
    """The RoBERTa-like substitute (bert arch, masked LM on the stdlib's text, every other layer MoE,
    top-2, d_ff = 4d) at scale ``s``. Positions are ALiBi's distance bias, not RoBERTa's learned embedding:
    with the learned one the byte-level masked LM sat on a plateau (held-out ppl ~19-22) from iteration ~100
    to ~450-700, past a default quality run's 300 iterations, so Fig. 6's curves ended flat for every variant;
    with ALiBi it fell steadily (13.1 at 300; one rank, batch 32, measured 2026-11-27)."""
    return {"model.arch": "bert", "model.positions": "alibi", "model.d_model": s.d, "model.d_ff": 4 * s.d,
            "model.n_layers": s.layers,
            "model.n_heads": s.heads, "model.seq_len": s.seq, "model.moe_every": 2, "model.moe.num_experts": s.experts,
            "model.moe.top_k": 2, "train.batch_size": s.batch, "train.iters": iters, "train.seed": seed,
            "train.trace": False}


def runs_timeout(n_runs: int) -> float:
    """Seconds a spawn of ``n_runs`` short trainings may take before it counts as hung: generous, so a busy
    machine is not mistaken for a hang (a default reproduce beside other jobs needed more than 300 + 60 s a run)."""
    return 600.0 + 180.0 * n_runs
