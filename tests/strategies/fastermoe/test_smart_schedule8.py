"""FasterMoE smart schedule on 8 gloo ranks (spec §5.2: N in {2, 4, 8}); its own file for time."""
from __future__ import annotations

from moelab.runtime.ranks import run_ranks
from tests.strategies.fastermoe.test_smart_schedule import _run_cases, check, moe, reference  # noqa: F401 (spawned ranks import it)


def test_smart_schedule_on_8_ranks_every_group_size():
    """N = 8: G in {8, 4, 2, 1}; uneven batches with a zero-token rank, E = 1."""
    world = 8
    case = dict(moe=moe(num_experts=8), tokens=[5, 0, 9, 3, 7, 1, 6, 4],
                variants=[{}] + [dict(smart=True, group_size=g) for g in (1, 2, 4, 8)])
    results = run_ranks(_run_cases, world, [case], timeout=150)
    ref = reference(case)
    for vi, opts in enumerate(case["variants"]):
        try:
            check(case, [r[0][vi] for r in results], ref)
        except AssertionError as e:
            raise AssertionError(f"options {opts}: {e}") from None
