"""train.task: span corruption, text classification and digits patch tokens (LSH-MoE quality substitutes)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moelab.config import ConfigError, RunConfig
from moelab.models.data import get_corpus
from moelab.models.tasks import (
    TaskTransformer,
    build_model,
    make_batch,
    make_eval_batch,
    shuffle_words,
    span_corrupt,
    span_mask,
    topic_windows,
)
from moelab.models.transformer import MoETransformer
from moelab.models.vision import digits, image_indices, patchify, train_heldout
from moelab.runtime.ranks import run_ranks
from moelab.testing import TINY_TRAIN

torch.set_num_threads(1)

ITERS = 20
TASK_LEN = {"span": 32, "acceptability": 32, "topic": 32, "paraphrase": 32, "digits": 4}  # digits: 4x4 patches
SMALL = {**TINY_TRAIN, "model.arch": "bert", "model.d_model": 32, "model.d_ff": 64, "train.batch_size": 8,
         "train.lr": 3e-3}


def _cfg(task, **over) -> RunConfig:
    extra = {"train.patch_size": 4} if task == "digits" else {}  # 4x4 patches learn within 20 steps, 2x2 not yet
    return RunConfig().with_overrides({**SMALL, "train.task": task, "model.seq_len": TASK_LEN[task], **extra, **over})


# ---- data ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", list(TASK_LEN))
def test_batches_are_deterministic_shaped_and_split_independent(task):
    cfg = _cfg(task, **{"train.batch_size": 4}).validate()
    a, b = make_batch(cfg, 1, 2, 3), make_batch(cfg, 1, 2, 3)
    for k in a:
        assert torch.equal(a[k], b[k])
    S = TASK_LEN[task]
    if task == "digits":
        assert a["inputs"].shape == (4, 4, 16) and a["inputs"].dtype == torch.float32
    else:
        assert a["inputs"].shape == (4, S) and a["inputs"].dtype == torch.int64
        assert int(a["inputs"].max()) < cfg.model.vocab_size
    assert a["targets"].shape == ((4, S) if task == "span" else (4, 1))
    assert not torch.equal(a["inputs"], make_batch(cfg, 1, 2, 4)["inputs"])
    # the global batch of an iteration does not depend on its split over ranks
    one = make_batch(_cfg(task, **{"train.batch_size": 8}), 0, 1, 3)
    two = [make_batch(cfg, r, 2, 3) for r in range(2)]
    for k in ("inputs", "targets", "sample_ids"):
        assert torch.equal(one[k], torch.cat([t[k] for t in two]))
    ev = make_eval_batch(cfg, 0, 2, 0)
    assert (ev["inputs"].shape == a["inputs"].shape
            and torch.equal(ev["inputs"], make_eval_batch(cfg, 0, 2, 0)["inputs"]))


@pytest.mark.parametrize("task,classes", [("acceptability", 2), ("topic", 4), ("paraphrase", 2), ("digits", 10)])
def test_labels_are_balanced_ish(task, classes):
    cfg = _cfg(task, **{"train.batch_size": 50})
    labels = torch.cat([make_batch(cfg, r, 2, it)["targets"][:, 0] for r in range(2) for it in range(4)])
    counts = torch.bincount(labels, minlength=classes).double()
    assert len(counts) == classes and counts.min() > 0.6 * counts.mean() and counts.max() < 1.4 * counts.mean()


def test_span_corruption_masks_15_percent_in_spans_of_mean_three():
    rng = np.random.default_rng(0)
    masks = np.stack([span_mask(128, rng) for _ in range(200)])
    assert abs(masks.mean() - 0.15) < 0.01
    spans = [len(r) for m in masks for r in "".join("1" if x else " " for x in m).split()]
    assert 2.5 < np.mean(spans) < 3.5
    seq = np.arange(64) % 200
    inputs, targets = span_corrupt(seq, np.random.default_rng(1), mask_id=255)
    m = targets != -100
    assert (inputs[m] == 255).all() and (targets[m] == seq[m]).all() and (inputs[~m] == seq[~m]).all()
    # the span run reads the masked-LM run's windows, loss on the corrupted positions only
    cfg = _cfg("span").validate()
    b = make_batch(cfg, 0, 2, 1)
    mlm = get_corpus("bert", 256, "pydocs").batch(0, 2, 1, 8, 32, cfg.train.seed)
    hit = b["targets"] != -100
    orig = torch.where(mlm["targets"] != -100, mlm["targets"], mlm["inputs"])
    assert torch.equal(b["inputs"][~hit], orig[~hit]) and torch.equal(b["targets"][hit], orig[hit])
    assert (b["inputs"][hit] == 255).all() and 0.1 < hit.double().mean() < 0.2


def test_text_splits_are_disjoint_and_evaluation_reads_held_out_windows():
    for _, train, held in topic_windows(32):
        assert not {r.tobytes() for r in train} & {r.tobytes() for r in held}
    held_rows = {r.tobytes() for _, _, he in topic_windows(32)[:4] for r in he}
    cfg = _cfg("topic", **{"train.batch_size": 64})
    ev = make_eval_batch(cfg, 0, 1, 0)["inputs"].numpy().astype(np.uint8)
    tr = make_batch(cfg, 0, 1, 0)["inputs"].numpy().astype(np.uint8)
    assert all(r.tobytes() in held_rows for r in ev)
    assert not any(r.tobytes() in held_rows for r in tr)


def _restates(x: np.ndarray) -> bool:
    """The second half begins with the first half's text from a shift of half/4..half/2 bytes on."""
    h = len(x) // 2
    return any(np.array_equal(x[s:h], x[h:2 * h - s]) for s in range(h // 4, h // 2 + 1))


def test_paraphrase_positives_restate_the_first_half_and_negatives_do_not():
    for split in ("train", "eval"):
        b = (make_batch if split == "train" else make_eval_batch)(_cfg("paraphrase", **{"train.batch_size": 64}),
                                                                  0, 1, 0)
        x, y = b["inputs"].numpy(), b["targets"][:, 0].numpy()
        hits = np.array([_restates(r) for r in x])
        assert 0 < y.sum() < len(y) and np.array_equal(hits, y == 1), split


def test_paraphrase_negatives_come_from_the_next_topic_when_a_split_has_two_windows():
    """At 2048-byte halves a held-out split of three windows leaves no non-overlapping passage for some firsts."""
    from moelab.models.tasks import _paraphrase_example

    assert min(len(he) for _, _, he in topic_windows(2048)[:4]) <= 3
    for n in range(40):
        x, label = _paraphrase_example(np.random.default_rng(n), 2048, 4, col=2)
        assert x.shape == (4096,) and _restates(x) == (label == 1)


def test_digits_split_patches_and_epoch_cover():
    train, held = train_heldout()
    images, labels = digits()
    assert len(set(train) | set(held)) == len(labels) == 1797 and not set(train) & set(held)
    assert abs(len(held) - 1797 / 5) < 1
    seen = image_indices(np.arange(len(train)), seed=3, split_name="train")
    assert sorted(seen.tolist()) == sorted(train.tolist())  # one epoch reads every training image once
    p = patchify(images[:2], 2)
    assert p.shape == (2, 16, 4) and np.array_equal(p[0, 1], images[0, 0:2, 2:4].reshape(-1))
    assert np.array_equal(patchify(images[:1], 4)[0, 3], images[0, 4:8, 4:8].reshape(-1))
    with pytest.raises(ValueError, match="patch=3"):
        patchify(images[:1], 3)


def test_shuffled_words_keep_length_and_words_but_not_order():
    w = b"the quick brown fox jumps over  the lazy dog"
    for seed in range(20):
        s = shuffle_words(w, np.random.default_rng(seed))
        assert len(s) == len(w) and s != w and sorted(s.split(b" ")) == sorted(w.split(b" "))
    with pytest.raises(ValueError):
        shuffle_words(b"aa aa aa", np.random.default_rng(0))


def test_task_model_shares_the_lm_backbone_init_and_adds_a_seeded_head():
    cfg = _cfg("digits")
    lm = MoETransformer(cfg.model, seed=5)
    task = build_model(cfg, seed=5)
    assert isinstance(task, TaskTransformer)
    lm_p = dict(lm.named_parameters())
    for n, p in task.named_parameters():
        if n.split(".")[0] in ("head", "patch_emb"):
            continue
        assert torch.equal(p, lm_p[n]), n
    again = build_model(cfg, seed=5)
    assert torch.equal(task.head.weight, again.head.weight) and task.head.weight.abs().sum() > 0
    x = make_batch(cfg, 0, 1, 0)["inputs"]
    assert task(x).shape == (8, 1, 10)
    assert type(build_model(_cfg("span"), seed=5)) is MoETransformer


def test_pair_task_head_reads_each_half_and_their_distance():
    """paraphrase: the head reads [u, v, |u - v|] of the two halves' means, so swapping the halves
    changes the logits (a single mean over the sequence would not see the order of its halves)."""
    cfg = _cfg("paraphrase")
    model = build_model(cfg, seed=5, dtype=torch.float64)
    assert model.pair and model.head.in_features == 3 * cfg.model.d_model
    assert not build_model(_cfg("topic"), seed=5).pair
    x = make_batch(cfg, 0, 1, 0)["inputs"]
    h = model.features(model.with_positions(model.tok_emb(x)))
    u, v = h[:, :16].mean(1), h[:, 16:].mean(1)
    ref = torch.cat([u, v, (u - v).abs()], -1) @ model.head.weight.t() + model.head.bias
    torch.testing.assert_close(model(x)[:, 0], ref, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(model(x), model(torch.cat([x[:, 16:], x[:, :16]], 1)))
    with pytest.raises(ValueError, match="even sequence length"):
        model.pooled(h[:, :15])


# ---- training on ranks -----------------------------------------------------------------------------
def _train_tasks(rank, world, tasks, iters):
    from moelab.runtime.train import Trainer

    out = {}
    for task in tasks:
        cfg = _cfg(task, **{"parallel.nproc": world, "train.iters": iters, "train.eval_every": iters,
                            "train.eval_batches": 4}).validate()
        rows = Trainer.build(cfg).run()
        out[task] = dict(losses=[r["loss"] for r in rows], last=rows[-1])
    return out


@pytest.fixture(scope="module")
def trained():
    return run_ranks(_train_tasks, 2, list(TASK_LEN), ITERS, timeout=120)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("task", list(TASK_LEN))
def test_two_rank_training_runs_and_reports_eval(trained, task):
    res = trained[0][task]
    assert trained[1][task]["losses"] == res["losses"]  # the global mean, on every rank
    L = res["losses"]
    assert all(math.isfinite(x) for x in L)
    if task in ("span", "topic", "digits"):  # learnable within ITERS tiny steps on this seed
        assert np.mean(L[-5:]) < np.mean(L[:5])
    last = res["last"]
    assert math.isfinite(last["eval_loss"])
    if task == "span":
        assert "eval_acc" not in last
    else:
        assert 0 <= last["eval_acc"] <= last["eval_top2_acc"] <= 1
        if task in ("acceptability", "paraphrase"):
            assert last["eval_top2_acc"] == 1.0  # two classes: top-2 always hits


@pytest.mark.timeout(120)
@pytest.mark.parametrize("task", ["topic", "digits"])
def test_two_ranks_match_the_single_process_reference(trained, task):
    """fp64: the 2-rank run (batch 8 each) equals one process on the global batch of 16."""
    from moelab.runtime.train import Trainer

    cfg = _cfg(task, **{"parallel.nproc": 1, "train.batch_size": 16, "train.iters": ITERS, "train.eval_every": ITERS,
                        "train.eval_batches": 4})
    # the reference's eval batches hold 4 x 16 samples, the 2-rank run's 4 x 2 x 8: the same ones
    rows = Trainer.build(cfg.validate()).run()
    np.testing.assert_allclose([r["loss"] for r in rows], trained[0][task]["losses"], rtol=1e-9, atol=1e-10)
    assert rows[-1]["eval_acc"] == pytest.approx(trained[0][task]["last"]["eval_acc"])


# ---- pretrain -> fine-tune ---------------------------------------------------------------------------
def _pretrain_then_finetune(rank, world, out):
    from moelab.runtime.train import Trainer

    pre = _cfg("topic", **{"parallel.nproc": world, "train.task": "lm", "train.iters": 4,
                           "train.checkpoint_every": 4}).validate()
    tr = Trainer.build(pre)
    tr.out_dir = out
    tr.run()
    trained = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    fine = _cfg("topic", **{"parallel.nproc": world, "train.iters": 6, "train.init_from": out,
                            "train.eval_every": 6, "train.seed": 1}).validate()
    ft = Trainer.build(fine)
    start = {n: p.detach().clone() for n, p in ft.model.named_parameters()}
    rows = ft.run()
    return dict(
        backbone_loaded=all(torch.equal(start[n], trained[n]) for n in trained),
        head_start=start["head.weight"],
        head_trained=not torch.equal(ft.model.head.weight, start["head.weight"]),
        eval_acc=rows[-1]["eval_acc"], losses=[r["loss"] for r in rows])


@pytest.mark.timeout(120)
def test_pretrained_lm_checkpoint_fine_tunes_with_a_fresh_head(tmp_path):
    res = run_ranks(_pretrain_then_finetune, 2, str(tmp_path), timeout=100)
    fresh = build_model(_cfg("topic"), seed=1, dtype=torch.float64).head.weight
    for r in res:  # every rank's backbone (its own experts included) is the pre-trained one
        assert r["backbone_loaded"] and r["head_trained"]
        assert torch.equal(r["head_start"], fresh)  # the LM checkpoint has no head: seeded init kept
        assert 0 <= r["eval_acc"] <= 1 and all(math.isfinite(x) for x in r["losses"])
    # a model of another shape cannot be fine-tuned from it
    with pytest.raises(ConfigError, match="train.init_from.*another model"):
        _cfg("topic", **{"train.init_from": str(tmp_path), "model.d_model": 64}).validate()
    with pytest.raises(ConfigError, match="exclude each other"):
        _cfg("topic", **{"train.init_from": str(tmp_path), "train.resume_from": str(tmp_path),
                         "train.iters": 9}).validate()
    with pytest.raises(ConfigError, match="trained task 'lm'"):
        _cfg("topic", **{"train.resume_from": str(tmp_path), "train.iters": 9}).validate()


# ---- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("over,match", [
    ({"train.task": "glue"}, "train.task must be one of"),
    ({"train.task": "topic", "model.arch": "gpt"}, "non-causal encoder"),
    ({"train.task": "span", "model.arch": "gpt"}, "model.arch='bert'"),
    ({"train.task": "topic", "train.dataset": "random"}, "train.dataset must be 'pydocs'"),
    ({"train.task": "topic", "train.task_classes": 500}, "train.task_classes must be in 2.."),
    ({"train.task": "topic", "train.task_classes": 1}, "train.task_classes must be >= 2"),
    ({"train.task": "paraphrase", "model.seq_len": 31}, "must be even"),
    ({"train.task": "acceptability", "model.seq_len": 8}, "seq_len >= 16"),
    ({"train.task": "digits", "train.patch_size": 3}, "train.patch_size must divide"),
    ({"train.task": "digits", "train.patch_size": 1, "model.seq_len": 32}, "shorter than the 64 patches"),
    ({"train.task": "topic", "train.init_from": "/nonexistent/run"}, "no checkpoint at"),
])
def test_bad_task_options_fail_before_launch(over, match):
    cfg = RunConfig().with_overrides({**SMALL, "model.seq_len": 32, **over})
    with pytest.raises(ConfigError, match=match):
        cfg.validate()
