"""The SIMULATED baseline's collectives, one by one, against the paper's Eq. 1 / Fig. 3a (``fig3a``, Table IV's
baseline) and against what DeepSpeed-MoE v0.8.1 runs where it has a path of its own (``ds081``; v0.8.1
``deepspeed/moe/sharded_moe.py`` MOELayer.forward, ``mappings.py``, ``utils/groups.py``; the table in
experiments/parm/README.md)."""
from __future__ import annotations

from moelab.strategies.parm import gating
from moelab.strategies.parm.layout import EP, EPESP, ESP, MP, ParmLayout
from moelab.strategies.parm.plan import Shape, steps

S, M = 64, 16
SHAPE = Shape(S=S, M=M, H=32, k=1, f=1.2)
B = SHAPE.elem_bytes


def _comms(lay, variant):
    return [(s.phase, s.op, s.group, s.args.get("nbytes"), s.args.get("splits"))
            for s in steps(lay, SHAPE, "baseline", variant) if s.is_comm]


def test_fig3a_is_eq1_per_pass():
    """Eq. 1 per pass: AG_ESP of the MP group's tokens, 2 x A2A_EP and AR_ESP of E*T*M with T from N_ESP*S tokens;
    the backward mirrors it (ESP split -> all-gather, all-reduce -> all-reduce, all-to-all -> all-to-all)."""
    for n_mp, n_esp in ((2, 2), (2, 4), (4, 2), (4, 4)):
        lay = ParmLayout(16, n_mp, n_esp, 16 // n_esp, 4)
        E = lay.num_experts
        T = gating.capacity(n_esp * S, E, 1, 1.2)
        a2a = [lay.e_local * T * M * B] * lay.n_ep
        want = []
        for phase in ("fwd", "bwd"):
            want += [(phase, "all_gather", ESP, S * M * B, None), (phase, "all_to_all", EP, None, a2a),
                     (phase, "all_reduce", ESP, E * T * M * B, None), (phase, "all_to_all", EP, None, a2a)]
        assert _comms(lay, "fig3a") == want, (n_mp, n_esp)


def test_ds081_paths_are_deepspeeds():
    """ESP = MP (expert tensor parallelism): the input is MP-replicated, so no ESP all-gather and the gate sees S
    tokens; N_ESP = 1 with MP > 1: drop_tokens before the first all-to-all (local) and gather_tokens (an MP
    all-gather) after the second, i.e. S2 without SAA; N_ESP != N_MP > 1 has no DeepSpeed path: Fig. 3a."""
    lay = ParmLayout(16, 4, 4, 4, 4)
    T = gating.capacity(S, lay.num_experts, 1, 1.2)
    got = _comms(lay, "ds081")
    assert [g[1] for g in got] == ["all_to_all", "all_reduce", "all_to_all"] * 2
    assert all(g[2] != ESP or g[3] == lay.num_experts * T * M * B for g in got)
    lay1 = ParmLayout(16, 4, 1, 16, 4)
    got1 = _comms(lay1, "ds081")
    assert [(g[1], g[2]) for g in got1 if g[0] == "fwd"] == [("all_to_all", EPESP), ("all_to_all", EPESP),
                                                            ("all_gather", MP)]
    lay2 = ParmLayout(16, 2, 4, 4, 4)
    assert _comms(lay2, "ds081") == _comms(lay2, "fig3a")
