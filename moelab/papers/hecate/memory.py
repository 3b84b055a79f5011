"""Hecate reproduction, model-state memory per device (spec §5.7, §6.18-19; Figs. 13 and 14), analytic with the
byte factors as parameters: owned experts and the dense parts carry params, grads and optimizer state;
Hecate's replicas params and grads in every live layer (RM: the current and the prefetched layer);
FlexMoE's E/N + r slots per layer are full experts with their own optimizer state."""
from __future__ import annotations

from moelab.models.params import count_params

BYTES = dict(param=2, grad=2, optim=12)  # spec §6.19: fp16 params and grads, fp32 master + Adam m, v (12 B/param)


def max_replicas(plans, N: int) -> int:
    """The most replicas any device held in any layer of the replayed Hecate plans."""
    best = 0
    for p in plans:
        for hs in p["holders"]:
            per = [0] * N
            for h in hs:
                for r in h[1:]:
                    per[r] += 1
            best = max(best, max(per))
    return best


def state_bytes(model, N: int, E: int, *, replicas: int = 0, live_layers=None, extra_slots: int = 0) -> dict:
    """Per-device bytes by category: ``replicas`` per layer in ``live_layers`` layers (default all),
    ``extra_slots`` more full experts per layer (FlexMoE's r)."""
    L = model.n_layers
    Pe = 2 * model.d_model * model.d_ff
    dense = count_params(model, convention="hecate")["attention"]
    owned = (E // N + extra_slots) * L
    rep = replicas * (L if live_layers is None else live_layers)
    p = (dense + (owned + rep) * Pe) * BYTES["param"]
    g = (dense + (owned + rep) * Pe) * BYTES["grad"]
    o = (dense + owned * Pe) * BYTES["optim"]
    return dict(param=p, grad=g, optim=o, total=p + g + o)
