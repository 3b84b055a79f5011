"""FasterMoE (PPoPP'22) reproduction: the data behind every figure and table of the paper, as pandas
frames (spec ``shared/papers/fastermoe.md`` §4), one module per figure family (``popularity``, ``roofline``,
``suite`` + ``shadowing`` + ``schedule`` for the real layer benchmark, ``predictor``, ``end_to_end``,
``sensitivity``, ``convergence``; ``common`` and ``traces`` hold scales, paper models and T2). ``products``
registers one function per manifest product (``experiments/fastermoe/manifest.yaml``); the notebook
calls ``moelab.papers.kit.Session.show(id)`` for each. This package re-exports the public names.

Every experiment function takes ``scale`` (``"smoke"`` | ``"default"`` | ``"full"``, sizes in
:func:`scale_spec`) and returns pandas frames; every frame carries a ``label`` column (or attribute
``frame.attrs["label"]``) that says what its numbers are, in the words of the spec's classification:

- **REAL** / **EMULATED** (spec class (a)): spawned gloo ranks on this CPU machine. Where the spec asks
  for topology or overlap effects, links are *emulated* (the comm door sleeps until a declared
  "2 nodes x N/2 ranks" network would be done), always labelled EMULATED. Default scale runs
  2 nodes x 4 ranks, smoke 2 x 2.
- **SIMULATED** (class (b)): the paper's clusters, ``fastermoe_johnny`` (16 V100-PCIe) and
  ``fastermoe_trevor`` (64 V100-SXM2), priced by :mod:`moelab.sim` (op graphs of the same plans the
  runtime executes: :func:`.shadow.select_shadows`, the smart schedule of :mod:`.schedule`) or by the
  performance model of :mod:`.perf_model` (theoretical speedup, DDL-Roofline, pipeline model).
- **SUBSTITUTE**: the paper's recorded expert-selection traces (``dumps.tgz``, unreachable) are
  replaced by T1 (real gate decisions of a tiny MoE-GPT trained here with no balance loss) and T2 (a
  synthetic drifting-popularity generator calibrated to "4 of 16 experts at about 20 % each",
  :func:`t2_popularity`); days of 16-GPU training (Fig. 14, Table 3) by a tiny REAL run whose
  time axis is *modelled* at paper scale.

Workload mechanics follow the AE: Figs. 9-13 are MoE-*layer* benchmarks (a trace-replay gate,
:class:`TraceGate`, as the AE's ``TraceRepGate``), a model's time is the sum over its layers of a
time-weighted mean over trace iterations 500 / 5500 / 80500 with weights 500 : 5000 : 75000
(:data:`TRACE_ITERS`, :data:`TRACE_WEIGHTS`).

Sizes per scale are data (``experiments/fastermoe/scales.yaml``, :func:`scale_spec`). Caching
(:func:`moelab.papers.kit.cache.cached`): the expensive real suites (:func:`layer_suite`,
:func:`convergence_suite`, :func:`predictor_sweep`) and the paper-scale simulations
(:func:`paper_layer_sims`) run once per (scale, arguments) in a process and are shared by the figures
that read them (Figs. 5a, 6, 8, 11a, 12a and 13a all read one layer suite); frames returned are copies.

The layer suite replays a skewed trace (one expert at 40 %) at every scale, since on T2 (seed 0) the
shadow policy never fires (:func:`shadow_decisions` records what it compared each iteration; Figs. 11a
and 13a say in their labels whether it fired).

ZeRO (Fig. 10): at paper scale ZeRO-1/2/3 are priced with the spec's §3 volume model on the simulator's
cost functions (:func:`zero_layer_time`: ring all-gathers / reduce-scatters of the whole layer's parameters
on the profile's links, plus compute with no imbalance, overlap factor ``zero_overlap``), labelled as
such; :func:`fig10_full_iteration` cross-checks with whole-iteration makespans from the simulator's
``"zero"`` graph when it is registered, and :func:`fig10_real` runs moelab's ``zero`` strategy for real
(tiny model, EMULATED links) beside FastMoE and FasterMoE.

Every guessed constant (ZeRO's overlap, trevor's P, BERT-Wide's sizes, ...) is read from
``experiments/fastermoe/assumptions.yaml`` (:func:`assumptions`); figures that depend on one list it in
``attrs["assumptions"]`` and their label, and :func:`fig10_sensitivity` shows how far each moves the
speedup over ZeRO-3. BASE Layers (Fig. 14, Table 3) joins the
convergence comparison when moelab has the ``base`` gate.

The link emulator and the simulator price a broadcast / reduce alike, as a pipelined chain from / to the
owner (since 2026-11-27; before, the emulator priced a flat tree and the runtime shadow policy used
``c = N_inter + 1``); the policy now runs with the paper's ``c = 2`` (:func:`run_layer_suite`).
"""

from __future__ import annotations

from moelab.papers.kit.traces import TraceGate, popularity_summary, rescale_counts, top2_counts, top2_shares  # noqa: F401,E402
from moelab.strategies.fastermoe.shadow import select_shadows  # noqa: F401,E402

from .common import (  # noqa: F401
    MODEL_CLUSTERS,
    MODEL_FIELDS,
    PAPER_LAYER_MODELS,
    SCALES,
    TRACE_ITERS,
    TRACE_WEIGHTS,
    ZERO_OVERLAP,
    PaperLayerModel,
    ScaleSpec,
    assumes,
    assumptions,
    cluster_preset,
    mark_assumptions,
    moe_layer_times,
    paper_layer_models,
    policy_constants,
    scale_spec,
    sim_profile,
    table2_models,
)
from .convergence import (  # noqa: F401
    FASTERMOE_OPTS,
    GSHARD,
    TABLE3_TARGET_FRACTION,
    TOPO_FRACTION,
    base_gate_available,
    convergence_suite,
    convergence_systems,
    fig14_convergence,
    paper_iteration_time,
    table3_time_to_loss,
)
from .end_to_end import (  # noqa: F401
    CLUSTERS,
    PRICING_ONLY,
    fig10_end_to_end,
    fig10_full_iteration,
    fig10_real,
    fig13_breakdown,
    fig13_breakdown_real,
    paper_layer_sims,
    paper_trace,
    paper_variant_options,
    weighted_model_times,
    zero_available,
    zero_layer_time,
)
from .popularity import (  # noqa: F401
    FIG3_COUNTS,
    fig3_ep_example,
    fig4_popularity,
)
from .predictor import (  # noqa: F401
    RUN_KIND,
    fig9_predictor,
    parts_metrics,
    predictor_sweep,
)
from .roofline import (  # noqa: F401
    fig5_roofline,
    fig5_roofline_measured,
)
from .schedule import (  # noqa: F401
    fig7_schedule,
    fig8_schedules,
    fig12_smart,
    fig12_smart_real,
    pipeline_gantt,
)
from .sensitivity import (  # noqa: F401
    clusters_of,
    fig10_sensitivity,
    fig10_speedups,
)
from .shadowing import (  # noqa: F401
    fig6_shadow_bytes,
    fig11_shadowing,
    fig11_shadowing_real,
)
from .suite import (  # noqa: F401
    TRACE_KINDS,
    EmulatedCluster,
    layer_suite,
    predict_layer_variants,
    run_layer_suite,
    shadow_decisions,
    shadowing_note,
    simulate_layer_variants,
    suite_cluster,
    suite_medians,
    suite_trace,
    suite_variants,
)
from .traces import (  # noqa: F401
    t2_constants,
    t2_counts,
    t2_popularity,
)
