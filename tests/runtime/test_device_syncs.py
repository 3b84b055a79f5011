"""Every place one training step reads tensor values on the host, listed and justified.

On a GPU each read of a device tensor's value (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ...)
stalls the host until the device is done. This test runs one step of the tiny model on one rank, records
each such call made from moelab code, and fails on any site not in :data:`HOT_PATH_READS`, so a new
read on the hot path needs a reason here. The device reads that remain are 2 per MoE layer (the counts
and the routes, which the all-to-all's splits need on the host) and 1 per step (the reduced loss for
the progress line); everything else reads host tensors. The GPU suite checks the same with CUDA's own
sync detector (``tests/e2e/test_gpu.py``).
"""
import collections
import os
import traceback

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")
# (file, function, read) -> why
HOT_PATH_READS = {
    ("moelab/moe/dispatch.py", "plan_from_counts", "cpu"): "DEVICE READ: the gathered counts and this rank's "
                                                           "routes, once per MoE layer (all-to-all splits)",
    ("moelab/moe/dispatch.py", "plan_from_counts", "tolist"): "host tensors (after the copy above)",
    ("moelab/moe/dispatch.py", "plan_from_counts", "nonzero"): "host tensors",
    ("moelab/moe/dispatch.py", "plan_from_counts", "numpy"): "host tensors",
    ("moelab/moe/dispatch.py", "block_permutation", "__int__"): "host tensors",
    ("moelab/moe/layer.py", "plan_record", "tolist"): "host tensors (the plan's counts)",
    ("moelab/runtime/train.py", "step", "tolist"): "host tensors (the plan's counts, for loads.csv)",
    ("moelab/runtime/train.py", "step", "__float__"): "DEVICE READ: the reduced loss, once per step (progress)",
}


def _one_step_reads():
    import torch.distributed as dist

    from moelab.config import RunConfig
    from moelab.runtime.ranks import hosted_store, join_hosted
    from moelab.runtime.train import Trainer
    from moelab.testing import TINY_TRAIN

    store = hosted_store(60)
    join_hosted(0, 1, store.port, 60)
    try:
        cfg = RunConfig().with_overrides({**TINY_TRAIN, "parallel.nproc": 1, "train.iters": 2}).validate()
        trainer = Trainer.build(cfg)
        trainer.step(0)  # warm-up (lazy state)
        seen = collections.Counter()
        originals = {name: getattr(torch.Tensor, name) for name in READS}

        def counting(name):
            original = originals[name]

            def read(self, *args, **kwargs):
                frame = traceback.extract_stack(limit=3)[-2]
                path = os.path.relpath(frame.filename, REPO)
                if path.startswith("moelab/"):
                    seen[(path, frame.name, name)] += 1
                return original(self, *args, **kwargs)
            return read

        try:
            for name in READS:
                setattr(torch.Tensor, name, counting(name))
            trainer.step(1)
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
        return seen, len(trainer.model.moe_layers())
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_every_host_read_of_a_training_step_is_listed():
    seen, layers = _one_step_reads()
    unlisted = sorted(set(seen) - set(HOT_PATH_READS))
    assert not unlisted, f"new host reads on the hot path (justify them in HOT_PATH_READS or remove them): {unlisted}"
    device_reads = {k: n for k, n in seen.items() if HOT_PATH_READS[k].startswith("DEVICE READ")}
    assert device_reads == {("moelab/moe/dispatch.py", "plan_from_counts", "cpu"): 2 * layers,
                            ("moelab/runtime/train.py", "step", "__float__"): 1}, device_reads
