"""Bad input fails in validate(), before any process starts, with a message naming the option."""
from __future__ import annotations

import pytest

from moelab.config import ConfigError, RunConfig


@pytest.mark.parametrize("overrides, message", [
    ({"model.d_model": 0}, "model.d_model must be >= 1, got 0"),
    ({"model.d_model": 16.5}, "model.d_model must be an integer, got 16.5"),
    ({"model.d_ff": -4}, "model.d_ff must be >= 1, got -4"),
    ({"model.n_layers": 0}, "model.n_layers must be >= 1, got 0"),
    ({"model.n_heads": 0}, "model.n_heads must be >= 1, got 0"),
    ({"model.seq_len": 0}, "model.seq_len must be >= 1, got 0"),
    ({"model.vocab_size": 1}, "model.vocab_size must be >= 2, got 1"),
    ({"model.arch": "bert", "model.vocab_size": 2}, "model.vocab_size must be >= 3, got 2"),
    ({"model.moe.num_experts": 0}, "model.moe.num_experts must be >= 1, got 0"),
    ({"model.moe.capacity_factor": 0}, "model.moe.capacity_factor must be > 0"),
    ({"model.moe.capacity_factor": float("nan")}, "model.moe.capacity_factor must be > 0"),
    ({"model.moe.min_capacity": -1}, "model.moe.min_capacity must be >= 0, got -1"),
    ({"model.moe.balance_loss_coef": -0.1}, "model.moe.balance_loss_coef must be >= 0"),
    ({"model.moe.z_loss_coef": -1}, "model.moe.z_loss_coef must be >= 0"),
    ({"model.moe.activation": "tanh"}, "model.moe.activation must be one of ('gelu', 'relu')"),
    ({"parallel.nproc": 0}, "parallel.nproc must be >= 1, got 0"),
    ({"parallel.topology.nodes": 0}, "parallel.topology.nodes must be >= 1, got 0"),
    ({"parallel.topology.ranks_per_node": 0}, "parallel.topology.ranks_per_node must be >= 1, got 0"),
    ({"parallel.grad_sync": "sometimes"}, "parallel.grad_sync must be one of"),
    ({"parallel.grad_sync": "ddp_overlap", "parallel.bucket_mb": 0}, "parallel.bucket_mb must be > 0, got 0"),
    ({"parallel.bucket_mb": -5}, "parallel.bucket_mb must be > 0, got -5"),
    ({"parallel.strategy": "zero", "parallel.grad_sync": "ddp_overlap"},
     "strategy 'zero' brings its own gradient sync"),
    ({"train.iters": 0}, "train.iters must be >= 1, got 0"),
    ({"train.batch_size": 0}, "train.batch_size must be >= 1, got 0"),
    ({"train.lr": 0}, "train.lr must be > 0, got 0"),
    ({"train.lr": float("inf")}, "train.lr must be > 0, got inf"),
    ({"train.seed": -1}, "train.seed must be >= 0, got -1"),
    ({"train.threads_per_rank": 0}, "train.threads_per_rank must be >= 1, got 0"),
    ({"train.timeout_s": 0}, "train.timeout_s must be > 0, got 0"),
    ({"train.fault_iter": -1}, "train.fault_iter must be >= 0, got -1"),
    ({"train.eval_every": -1}, "train.eval_every must be >= 0, got -1"),
    ({"train.eval_batches": 0}, "train.eval_batches must be >= 1, got 0"),
    ({"train.checkpoint_every": -2}, "train.checkpoint_every must be >= 0, got -2"),
    ({"train.dataset": "wiki"}, "train.dataset must be one of ('pydocs', 'pytests', 'pytext', 'random')"),
    ({"parallel.strategy": "zero", "train.checkpoint_every": 2}, "checkpoints cover the data-parallel updates"),
    ({"emulation.intra_bw_GBps": 0}, "emulation.intra_bw_GBps must be > 0, got 0"),
    ({"emulation.inter_bw_GBps": -1}, "emulation.inter_bw_GBps must be > 0, got -1"),
    ({"emulation.intra_latency_us": -1}, "emulation.intra_latency_us must be >= 0, got -1"),
    ({"emulation.interference_gamma": 0.5}, "emulation.interference_gamma must be >= 1, got 0.5"),
    ({"emulation.inter_latency_us": -0.5}, "emulation.inter_latency_us must be >= 0, got -0.5"),
    ({"train.batch_size": True}, "train.batch_size must be an integer, got True"),
    ({"train.resume_from": "/nonexistent/run"}, "train.resume_from: no checkpoint at /nonexistent/run"),
])
def test_every_numeric_field_is_range_checked(overrides, message):
    with pytest.raises(ConfigError) as info:
        RunConfig().with_overrides(overrides).validate()
    assert message in str(info.value)


def test_all_range_errors_are_reported_together():
    with pytest.raises(ConfigError) as info:
        RunConfig().with_overrides({"model.d_model": 0, "model.n_heads": 0, "train.lr": -1}).validate()
    msg = str(info.value)
    assert "model.d_model" in msg and "model.n_heads" in msg and "train.lr" in msg  # no ZeroDivisionError first


def test_defaults_and_edges_are_valid():
    RunConfig().validate()
    RunConfig().with_overrides({"train.eval_every": 0, "train.checkpoint_every": 0, "model.moe.min_capacity": 0,
                                "emulation.intra_latency_us": 0, "parallel.grad_sync": "ddp_overlap",
                                "parallel.bucket_mb": 0.001}).validate()


def _ruled_fields(section, prefix=""):
    import dataclasses

    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        if dataclasses.is_dataclass(v):
            yield from _ruled_fields(v, f"{prefix}{f.name}.")
        elif "min" in f.metadata or "choices" in f.metadata:
            yield prefix + f.name, f.metadata


def test_each_section_checks_its_own_fields_from_their_metadata():
    """Every field carrying a rule (moelab.config.at_least / one_of) is refused just past it, by name, from the
    config alone (field_errors: no other package asked); a value on the bound passes."""
    from moelab.config import field_errors

    ruled = dict(_ruled_fields(RunConfig()))
    assert {"model.moe.num_experts", "model.arch", "train.lr", "emulation.interference_gamma",
            "parallel.topology.nodes"} <= set(ruled)
    for name, md in ruled.items():
        if "choices" in md:  # a value of the field's type outside its choices
            bad = max(md["choices"]) + 1 if isinstance(md["choices"][0], int) else "magic"
        else:
            bad = md["min"] - (0 if md["strict"] else 1)
        errs = field_errors(RunConfig().with_overrides({name: bad}), "")
        assert any(e.startswith(f"{name} must ") for e in errs), (name, errs)
        if "min" in md and not md["strict"]:
            on_bound = RunConfig().with_overrides({name: md["min"]})
            assert not any(e.startswith(f"{name} ") for e in field_errors(on_bound, "")), name


def test_a_stored_config_of_an_older_version_still_loads_with_its_id():
    """Before the serving seam the serve section held the server's own settings; such a stored config loads: the
    defaults then are dropped (a training run keeps its id), the rest become serve.strategy_options."""
    from moelab.config import ServeConfig

    new = RunConfig().with_overrides({"train.iters": 3})
    old = new.to_dict()
    old["serve"] = {**old["serve"], **ServeConfig.MOVED}
    del old["serve"]["strategy"], old["serve"]["strategy_options"]
    assert RunConfig.from_dict(old).short_hash() == new.short_hash()
    old["serve"].update(variant="lina", path_len=2)
    cfg = RunConfig.from_dict(old)
    assert cfg.serve.strategy_options == {"variant": "lina", "path_len": 2} and cfg.serve.strategy is None


def test_the_config_layer_runs_the_owners_checks_without_importing_them(tmp_path):
    """moelab.config imports no other moelab package (the lowest layer), yet validate() runs the owners'
    pre-flight (installed by the package root): an unknown gate, known only to moelab.moe.gates, is refused."""
    import subprocess
    import sys

    script = tmp_path / "check.py"
    script.write_text(
        "import sys\n"
        "from moelab.config import ConfigError, RunConfig\n"
        "assert not [m for m in sys.modules if m.startswith('moelab.') and m != 'moelab.config'], sys.modules\n"
        "try:\n"
        "    RunConfig().with_overrides({'model.moe.gate': 'nope'}).validate()\n"
        "except ConfigError as e:\n"
        "    assert 'model.moe.gate must be one of' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('validate() accepted an unknown gate')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
