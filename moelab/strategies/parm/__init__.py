"""Parm (arXiv 2407.00599) in moelab: MP x EP x ESP with MP paused inside the MoE layer. Spec:
``shared/papers/parm.md``.

- :mod:`.layout`: the pure rank layout (§2.3) and the process groups it declares;
- :mod:`.gating`: DeepSpeed gating and the (E, T, M) capacity buffers, ``einsum`` and ``index`` (§2.2);
- :mod:`.layer`: the MoE layer on real groups: schedules ``baseline`` (Fig. 3a, ``ds081``), ``s1``,
  ``s2`` (SAA, :mod:`moelab.comm.saa`), ``s2_aas`` (§2.5-2.8);
- :mod:`.perf_model`: the alpha-beta model, Alg. 1 and its closed form (§2.10a, §2.11, §2.13);
- :mod:`.grid`: the Table III grid, the memory filter, per-schedule token counts and FLOPs.

Not registered as a ``parallel.strategy`` yet: the trainer path (tensor-parallel dense parts, data
drawn per MP group, the §2.9 update) comes next; until then the layer runs on real ranks through
its own tests.
"""
