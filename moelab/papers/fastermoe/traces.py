"""FasterMoE's synthetic trace T2 (spec §4, SUBSTITUTE for the paper's recorded traces): the kit's
drifting popularity (:func:`moelab.papers.kit.traces.drifting_popularity`) calibrated so that 4 of 16 experts
start at the paper's Fig. 4 share (read from paper.yaml: the comparison of that number with T2 is marked
circular), with moelab's walk constants from assumptions.yaml."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from moelab.papers.kit.compare import paper_value
from moelab.papers.kit.traces import drifting_popularity, top2_counts

from .common import assumptions


def t2_constants(overrides: tuple = ()) -> dict:
    """hot_share (the paper's, paper.yaml), noise, step0, decay (moelab's, assumptions.yaml; ``overrides``
    varies them, as the sensitivity sweep does)."""
    A = assumptions(overrides)
    return dict(hot_share=paper_value("fastermoe", "popularity_top4_share"), noise=A.value("t2_noise"),
                step0=A.value("t2_step0"), decay=A.value("t2_step_decay"))


def t2_popularity(iters: Sequence[int], E: int = 16, layer: int = 0, seed: int = 0,
                  overrides: tuple = ()) -> np.ndarray:
    """SUBSTITUTE T2: expert popularity of one layer at the given iterations, ``[len(iters), E]``,
    seeded by (seed, layer)."""
    return drifting_popularity(iters, E, seed=(int(seed), int(layer), E, 20220402), **t2_constants(overrides))


def t2_counts(iters: Sequence[int], layers: int, sources: int, E: int, tokens: int, seed: int = 0,
              overrides: tuple = ()) -> np.ndarray:
    """SUBSTITUTE T2 counts ``[len(iters), layers, sources, E]`` (top-2, ``tokens`` per source)."""
    out = np.zeros((len(iters), layers, sources, E), dtype=np.int64)
    for layer in range(layers):
        P = t2_popularity(iters, E, layer, seed, overrides)
        rng = np.random.default_rng([int(seed), int(layer), sources, tokens, 7])
        for i in range(len(iters)):
            out[i, layer] = top2_counts(P[i], tokens, sources, rng)
    return out
