"""Lina reproduction, shared pieces: the scale spec (sizes in ``experiments/lina/scales.yaml``)."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class ScaleSpec:
    """Sizes of every Lina experiment at one scale (smoke: CI on 2 cores; default: a laptop; full: the
    largest this machine class does). Paper-scale parts are SIMULATED (profile ``lina``) at every scale."""

    name: str
    # training policies on 4 gloo ranks (2 nodes x 2), EMULATED links
    t_d: int
    t_layers: int
    t_seq: int
    t_batch: int
    t_iters: int
    t_warmup: int
    t_S: float  # partition bytes (the paper's 30 MB, scaled to the model)
    t_bucket_mb: float  # DDP bucket (the paper's 25 MiB, scaled with S)
    intra_GBps: float
    inter_GBps: float
    # the inference model: trained on 4 ranks, then served through them (REAL)
    i_d: int
    i_layers: int
    i_experts: int
    i_seq: int
    i_batch: int
    i_iters: int
    requests: int
    serve_batch: int
    rate_per_s: float
    path_lens: tuple  # Table 5's sweep (the paper: 1, 3, 6)
    profile_batches: int
    # paper scale (SIMULATED): layers of the three models and the experts swept
    sim_layers: tuple
    sim_experts: tuple


def scale_spec(scale) -> ScaleSpec:
    from moelab.papers.kit.scales import load_scale  # here: the kit loads plotly, this module does not

    return load_scale("lina", ScaleSpec, scale)


P = "lina"  # the paper id products register under


def paper(key: str) -> float:
    """Lina's own number ``key`` from ``experiments/lina/paper.yaml`` (a note quoting the paper reads it here)."""
    from moelab.papers.kit.compare import paper_value  # here: the kit loads plotly, this module does not

    return paper_value(P, key)


_OVERRIDES: ContextVar[tuple] = ContextVar("lina_assumption_overrides", default=())


def assumption(name: str):
    """The value of ``name`` in ``experiments/lina/assumptions.yaml`` (the kit parses the file once per version),
    or its override where :func:`overriding` set one (a gap ladder's rung, a sensitivity sweep)."""
    from moelab.papers.kit.assumptions import load_assumptions  # here: the kit loads plotly, this module does not

    a, over = load_assumptions(P), dict(_OVERRIDES.get())
    return (a.with_values({name: over[name]}) if name in over else a).value(name)


@contextmanager
def overriding(overrides: tuple):
    """Within the block, :func:`assumption` reads ``overrides`` (``((name, value), ...)``, each checked against the
    assumption's stated range) over the file's values; :func:`cached` results are kept apart per override set."""
    from moelab.papers.kit.assumptions import load_assumptions  # here: the kit loads plotly, this module does not

    load_assumptions(P).with_values(dict(overrides))  # a name not in the file or a value out of range is refused
    token = _OVERRIDES.set(tuple(overrides))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def cached(fn):
    """The kit's result cache (:func:`moelab.papers.kit.cache.cached`), keyed also by the overrides in force, so a
    ladder's rung never reads a result priced with other assumptions (and computes it with them in force)."""
    import functools
    import inspect

    from moelab.papers.kit.cache import cached as kit_cached  # here: the kit loads plotly, this module does not

    sig = inspect.signature(fn)

    @kit_cached
    def memo(overrides: tuple, arguments: tuple):
        with overriding(overrides):
            return fn(**dict(arguments))

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        bound = sig.bind(*args, **kw)
        bound.apply_defaults()
        return memo(_OVERRIDES.get(), tuple(bound.arguments.items()))

    wrapper.cache_clear = memo.cache_clear
    return wrapper


def paper_at(key: str) -> str:
    """Where the paper measured ``key`` (its paper.yaml ``at``)."""
    from moelab.papers.kit.compare import paper_entry  # here: the kit loads plotly, this module does not

    return paper_entry(P, key).get("at", "")


def fired(df, col: str, what: str) -> list:
    """A note when ``what`` did not fire in this run (``col`` zero on every row), else nothing."""
    return [] if (df[col] != 0).any() else [f"{what} did not fire in this run"]


def labelled(df, label: str):
    """``df`` with its label (REAL / EMULATED / SIMULATED / SUBSTITUTE first) in ``attrs``, for a product to read."""
    df.attrs["label"] = label
    return df
