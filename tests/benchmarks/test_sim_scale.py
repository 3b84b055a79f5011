"""benchmarks/sim_scale.py runs at a small size (a smoke run of the script, not a timed test)."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_sim_scale_benchmark_runs_small():
    out = subprocess.run([sys.executable, "benchmarks/sim_scale.py", "--min-ranks", "16", "--max-ranks", "32",
                          "--strategies", "ep,parm", "--layers", "2"], cwd=REPO, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [ln.split() for ln in out.stdout.splitlines() if ln.split()[:1] in (["ep"], ["parm"])]
    assert [(r[0], r[1]) for r in rows if r[1].isdigit()] == [("ep", "16"), ("ep", "32"),
                                                              ("parm", "16"), ("parm", "32")]
    assert out.stdout.count("growth exponent") == 2


def test_sim_scale_benchmark_refuses_a_bad_range():
    out = subprocess.run([sys.executable, "benchmarks/sim_scale.py", "--min-ranks", "64", "--max-ranks", "32"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--min-ranks" in out.stderr
