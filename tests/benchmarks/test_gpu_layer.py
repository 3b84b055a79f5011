"""benchmarks/gpu_layer.py runs in its CPU mode (small shapes, torch implementations) and writes its rows."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_gpu_layer_benchmark_cpu_mode(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_layer.py"), "--device", "cpu",
                        "--tokens", "256,512", "--iters", "2", "--warmup", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr
    assert "CPU mode" in r.stdout and "GPU numbers are owed" in r.stdout
    data = json.loads(out.read_text())
    rows, fit = data["rows"], data["fit"]
    assert [(row["shape"], row["T"]) for row in rows] == [("mixtral", 32), ("mixtral", 64), ("deepseek", 32),
                                                          ("deepseek", 64)]
    for row in rows:
        assert row["gemm_torch"] > 0 and row["layer_torch"] > 0 and row["floor_torch"] > 0
    assert fit["n"] == 4 and len(fit["predicted_s"]) == 4 and "R^2 of the predicted layer times" in r.stdout
