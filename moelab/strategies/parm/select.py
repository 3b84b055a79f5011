"""``schedule: auto``: Alg. 1 (spec §2.13) on alpha-beta fits taken on the live groups, once per run.

At the first forward of a layer every rank measures the fits Alg. 1 needs (AG_MP, A2A_EPESP, SAA)
through the door (:mod:`.fits`: max over ranks, so the numbers are identical everywhere), then
evaluates Alg. 1 for the layer's shape; equal inputs give the same choice on every rank without
another collective. The fits are cached on the communicator (one sweep per run); the choice and
the predicted tD1, tD2 go into the layer's plan record (``plans.jsonl``).
"""
from __future__ import annotations

from moelab.strategies.parm.fits import measure_fits
from moelab.strategies.parm.perf_model import ParmShape, from_dicts, select

NEEDED = ("AG_MP", "A2A_EPESP", "SAA")


def live_fits(comm, layout, **kw) -> dict:
    """This run's fits of :data:`NEEDED` (measured once, cached on ``comm``)."""
    cached = getattr(comm, "_parm_fits", None)
    if cached is None:
        cached = measure_fits(comm, layout, names=NEEDED, **kw)
        comm._parm_fits = cached
    return cached


def choose(layer, n_tokens: int, **kw) -> dict:
    """``{schedule, tD1_s, tD2_s, fits}`` for ``layer`` gating ``n_tokens`` tokens per MP group."""
    L = layer.layout
    if L.n_mp == 1:
        return {"schedule": "s1", "why": "N_MP = 1: S1 and S2 are one schedule"}
    fits = live_fits(layer.comm, L, **kw)
    shape = ParmShape(B=1, L=n_tokens, M=layer.w1.shape[1], E=L.num_experts, k=layer.k, f=layer.f,
                      n_mp=L.n_mp, n_esp=L.n_esp)
    ab = from_dicts(fits)
    choice, tD1, tD2 = select(shape, ab)
    return {"schedule": choice, "tD1_s": tD1, "tD2_s": tD2, "fits": fits}
