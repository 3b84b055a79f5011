"""LSH-MoE's gap ladders (``experiments/lsh_moe/ladders.yaml``, walked by :mod:`moelab.papers.kit.ladder`): the
headline speedups, each exactly as its paper-vs-moelab row reads it, as functions of the assumptions.

Each function is ``fn(scale, overrides) -> float`` with ``overrides`` ``((assumption, value), ...)``; with none it
returns the row's moelab value (the speed tables' "measured on the substitute" rows: the same code path,
:func:`moelab.papers.lsh_moe.speed.glue_step` / :func:`~moelab.papers.lsh_moe.speed.swin_step` at
:func:`~moelab.papers.lsh_moe.speed.experiment_rate`). The paper's numbers are references only: nothing here is
tuned toward them.
"""
from __future__ import annotations

from . import speed


def _name(scale):
    return getattr(scale, "name", scale)  # the session hands a ScaleSpec; the speed tables cache by name


def glue_speedups(scale, overrides: tuple = ()) -> dict:
    """model -> Table 2's SIMULATED speedup (GPT-MoE 15B/52B on lsh_v100) at the rate the row prices."""
    scale = _name(scale)
    rho = speed.experiment_rate(scale, "rate_at_L6", overrides)
    return {m: speed.glue_step(scale, m, rho, overrides)["speedup"] for m in speed.GLUE_MODELS}


def glue_speed_15b(scale, overrides: tuple = ()) -> float:
    """``glue_speed_15b``: GPT-MoE 15B's speedup (the paper's: its six GLUE tasks' mean)."""
    return glue_speedups(scale, overrides)["GPT-MoE-15B"]


def glue_speed_52b(scale, overrides: tuple = ()) -> float:
    """``glue_speed_52b``: GPT-MoE 52B's speedup (the paper's: its six GLUE tasks' mean)."""
    return glue_speedups(scale, overrides)["GPT-MoE-52B"]


def speedup_min(scale, overrides: tuple = ()) -> float:
    """``speedup_min``: the Swin-MoE-L stand-in's speedup on lsh_a100 (Table 3) at the rate the row prices."""
    scale = _name(scale)
    return speed.swin_step(scale, speed.experiment_rate(scale, "swin_rate", overrides), overrides)["speedup"]
