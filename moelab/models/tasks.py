"""Task objectives beyond language modelling, selected by ``train.task`` (LSH-MoE's quality runs).

Why: LSH-MoE's Fig. 6 (right), Table 2 and Table 3 measure quality on span-corrupted pre-training,
GLUE fine-tuning and image classification. Their data and checkpoints cannot be had here, so these
substitutes run through the unchanged data-parallel/MoE training loop (spec §4):

- ``lm`` (default): the arch's own objective (gpt: next byte; bert: 80/10/10 masked LM).
- ``span`` (bert): T5-like span corruption. Spans of mean length ``SPAN_MEAN`` covering
  ``SPAN_NOISE`` of the tokens are replaced by the mask id, every token of a span, and the loss is
  on the corrupted positions only. An *encoder-only* substitute: T5 replaces each span with one
  sentinel and decodes the spans; here the sequence keeps its length and the encoder predicts each
  corrupted byte in place. Seeded per (seed, global sample number), i.e. per (seed, rank, iteration).
- ``acceptability`` / ``topic`` / ``paraphrase`` (bert): sequence classification built from
  ``pydoc_data.topics`` (the English prose of the shipped corpus): original vs word-shuffled window
  (CoLA-like, 2 classes); which of the ``train.task_classes`` largest topics a window comes from
  (SST/MNLI-like); whether the second half of the input restates the first (MRPC/QQP-like: the same
  text shifted vs another passage of the same topic).
- ``digits`` (bert blocks): patch-token image classification (:mod:`moelab.models.vision`).

Classification inputs have a fixed length (``model.seq_len`` bytes, or the image's patches), no
padding. The head (:class:`TaskTransformer`) mean-pools the final hidden states over positions and
applies one linear layer: the byte vocabulary has no [CLS] token, and a mean gives every token's
expert output a gradient path. A pair task (``paraphrase``) pools each half apart, u and v, and
classifies ``[u, v, |u - v|]`` (Sentence-BERT's classification head): one mean over both halves is
their sum, from which no linear layer can tell "same" from "different". Attention still spans both
halves. Measured on the default substitute (200 fine-tuning iterations, Origin / LSH-MoE, 2026-11-27):
the earlier pair task (two passages of the same topic or not) stayed at chance with one mean (45 / 48 %,
3 seeds) and with the pair head (54 / 49 %, seed 0); the restatement task reaches 73 / 73 % (seed 0).

Logits come back as ``[B, 1, C]`` with ``targets`` ``[B, 1]`` so the unchanged ``lm_loss`` is the
classification cross entropy and the trainer's evaluation adds accuracy. Held-out data: for text, the
last ``1/HELDOUT_DIVISOR`` (at least 2) of each topic's aligned windows; for digits, a fixed fifth of
the images; training never draws them.

Fine-tuning: ``train.init_from`` names a checkpoint (or a run folder: its latest) of a run with the
same ``model`` section, e.g. a ``task: lm`` pre-training; :func:`init_from_checkpoint` copies every
parameter it holds (dense by name, experts by global id) and keeps the seeded initialisation of the
task's extra modules (``head``, ``patch_emb``) the checkpoint lacks. Optimizer state and iteration
count start fresh.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn as nn

from moelab.models.data import get_corpus
from moelab.models.transformer import IGNORE_INDEX, MoETransformer
from moelab.models.vision import IMAGE_SIDE, digits_batch, num_patches, sklearn_missing

TASKS = ("lm", "span", "acceptability", "topic", "paraphrase", "digits")
TEXT_CLASSIFICATION = ("acceptability", "topic", "paraphrase")
PAIR_TASKS = ("paraphrase",)  # two halves compared: TaskTransformer pools each apart
CLASSIFICATION = TEXT_CLASSIFICATION + ("digits",)
HEAD_MODULES = ("head", "patch_emb")  # a task's extra modules: absent from an LM checkpoint
SPAN_MEAN, SPAN_NOISE = 3.0, 0.15
HELDOUT_DIVISOR = 8
MIN_WINDOWS = 4  # a topic needs at least this many windows to hold out two
MIN_ACCEPTABILITY_LEN = 16
STREAMS = {"span": 4, "acceptability": 5, "topic": 6, "paraphrase": 7}


def _seed_int(*xs: int) -> list:
    return [int(x) & (2**63 - 1) for x in xs]


def num_classes(cfg) -> int:
    t = cfg.train
    return {"acceptability": 2, "paraphrase": 2, "digits": 10}.get(t.task, t.task_classes)


# ---- span corruption (pure) --------------------------------------------------------------------
def _positive_parts(total: int, k: int, rng) -> np.ndarray:
    """A uniformly random composition of ``total`` into ``k`` parts >= 1."""
    cuts = np.sort(rng.choice(total - 1, k - 1, replace=False) + 1) if k > 1 else np.array([], dtype=int)
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(int)


def span_mask(length: int, rng, noise: float = SPAN_NOISE, mean_span: float = SPAN_MEAN) -> np.ndarray:
    """Boolean mask of ``round(noise * length)`` positions in ``~n_noise / mean_span`` contiguous
    spans, separated by at least one kept position (T5's random_spans_noise_mask, with kept runs
    allowed at both ends)."""
    if length < 2:
        raise ValueError(f"span corruption needs length >= 2, got {length}")
    n_noise = min(max(1, round(noise * length)), length - 1)
    n_keep = length - n_noise
    n_spans = max(1, min(round(n_noise / mean_span), n_noise, n_keep + 1))
    spans = _positive_parts(n_noise, n_spans, rng)
    # kept runs: n_spans + 1 of them, the inner ones >= 1, the two ends >= 0
    free = n_keep - (n_spans - 1)
    cuts = np.sort(rng.integers(0, free + 1, size=n_spans))
    keeps = np.diff(np.concatenate([[0], cuts, [free]])) + np.r_[0, np.ones(n_spans - 1, int), 0]
    mask, pos = np.zeros(length, dtype=bool), 0
    for k, s in zip(keeps[:-1], spans):
        pos += int(k)
        mask[pos:pos + int(s)] = True
        pos += int(s)
    return mask


def span_corrupt(seq: np.ndarray, rng, mask_id: int) -> tuple:
    """(inputs, targets): spans replaced by ``mask_id``; targets the original there, -100 elsewhere."""
    m = span_mask(len(seq), rng)
    return np.where(m, mask_id, seq), np.where(m, seq, IGNORE_INDEX)


# ---- text classification data -------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def topic_texts() -> dict:
    """pydoc's topic help texts (79 topics on CPython 3.x), UTF-8 bytes, by sorted topic name."""
    from pydoc_data.topics import topics

    return {k: topics[k].encode("utf-8") for k in sorted(topics)}


@functools.lru_cache(maxsize=16)
def topic_windows(length: int) -> list:
    """[(topic, train windows uint8 [W-H, length], held-out windows [H, length])], largest first
    (ties by name), topics with fewer than MIN_WINDOWS aligned windows left out."""
    out = []
    for name, text in topic_texts().items():
        W = len(text) // length
        if W < MIN_WINDOWS:
            continue
        win = np.frombuffer(text[: W * length], dtype=np.uint8).reshape(W, length)
        H = max(2, W // HELDOUT_DIVISOR)
        out.append((W, name, win[: W - H], win[W - H:]))
    out.sort(key=lambda r: (-r[0], r[1]))
    return [(name, tr, he) for _, name, tr, he in out]


def _distinct_words(window: np.ndarray) -> int:
    return len(set(window.tobytes().split(b" ")))


@functools.lru_cache(maxsize=8)
def acceptability_pool(length: int, split: str) -> np.ndarray:
    """Windows of every topic (of ``split``) holding at least 4 distinct space-separated words."""
    rows = np.concatenate([w[1 if split == "train" else 2] for w in topic_windows(length)])
    return rows[[_distinct_words(r) >= 4 for r in rows]]


def shuffle_words(window: bytes, rng) -> bytes:
    """The window's space-separated words in another order (same bytes, same length, never the
    original text): the negative class of ``acceptability``."""
    words = window.split(b" ")
    if len(set(words)) < 2:
        raise ValueError("a window with fewer than two distinct words cannot be shuffled")
    for _ in range(8):
        out = b" ".join(words[i] for i in rng.permutation(len(words)))
        if out != window:
            return out
    return b" ".join(words[1:] + words[:1])  # a rotation differs when two words differ


def _text_example(task: str, rng, length: int, n_classes: int, split: str) -> tuple:
    """(uint8 window [length], label) of one sample drawn with ``rng``."""
    col = 1 if split == "train" else 2
    if task == "acceptability":
        pool = acceptability_pool(length, split)
        w, label = pool[rng.integers(len(pool))], int(rng.integers(2))
        if label == 0:
            w = np.frombuffer(shuffle_words(w.tobytes(), rng), dtype=np.uint8)
        return w, label
    if task == "topic":
        label = int(rng.integers(n_classes))
        pool = topic_windows(length)[label][col]
        return pool[rng.integers(len(pool))], label
    return _paraphrase_example(rng, length // 2, n_classes, col)


def _paraphrase_example(rng, half: int, n_classes: int, col: int) -> tuple:
    """Two passages of ``half`` bytes side by side: the second restates the first (1: the same text
    shifted by half/4..half/2 bytes, so 50-75 % of it is shared, as a duplicate question or a reworded
    sentence shares most of its words) or is another passage of the same topic (0: no shared text, the
    same vocabulary). Both come from one of the ``n_classes`` largest topics, within ``col``'s split."""
    c = int(rng.integers(n_classes))
    pool = topic_windows(half)[c][col]
    j = int(rng.integers(len(pool) - 1))
    first, label = pool[j], int(rng.integers(2))
    if label:
        shift = int(rng.integers(half // 4, half // 2 + 1))
        return np.concatenate([first, np.concatenate([first, pool[j + 1]])[shift:shift + half]]), label
    others = [k for k in range(len(pool)) if k not in (j, j + 1)]  # aligned windows: none overlaps the first
    if not others:  # a split of two windows (long inputs): the passage comes from the next topic
        pool = topic_windows(half)[(c + 1) % n_classes][col]
        others = range(len(pool))
    return np.concatenate([first, pool[others[int(rng.integers(len(others)))]]]), label


def text_task_batch(task: str, ids: np.ndarray, length: int, vocab_size: int, n_classes: int,
                    seed: int, split: str) -> dict:
    """Inputs [B, length] (bytes folded into the bert arch's regular ids) and labels [B, 1] for the
    global sample numbers ``ids``; each sample depends only on (task, seed, sample number, split)."""
    n_regular = vocab_size - 1
    inputs = np.empty((len(ids), length), dtype=np.int64)
    labels = np.empty((len(ids), 1), dtype=np.int64)
    for i, n in enumerate(ids):
        key = int(n) if split == "train" else -1 - int(n)
        rng = np.random.default_rng(_seed_int(seed, key, STREAMS[task]))
        w, labels[i, 0] = _text_example(task, rng, length, n_classes, split)
        inputs[i] = w if n_regular >= 256 else w % n_regular
    return {"inputs": torch.from_numpy(inputs), "targets": torch.from_numpy(labels)}


def task_batch(cfg, rank: int, world: int, iteration: int, split: str = "train") -> dict:
    """This rank's slice of global batch ``iteration`` of ``cfg.train.task`` (held-out batch number
    ``iteration`` with ``split='eval'``); the global batch does not depend on the split over ranks."""
    m, t = cfg.model, cfg.train
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside 0..{world - 1}")
    if t.task == "digits":
        return digits_batch(rank, world, iteration, t.batch_size, t.patch_size, t.seed, split)
    first = (iteration * world + rank) * t.batch_size
    ids = np.arange(first, first + t.batch_size, dtype=np.int64)
    if t.task == "span":
        corpus = get_corpus("bert", m.vocab_size, t.dataset)
        seqs = corpus.sequences(ids, m.seq_len + 1, t.seed, split)[:, :-1]  # the MLM run's windows
        inputs, targets = np.empty_like(seqs), np.empty_like(seqs)
        for i, n in enumerate(ids):
            key = int(n) if split == "train" else -1 - int(n)
            rng = np.random.default_rng(_seed_int(t.seed, key, STREAMS["span"]))
            inputs[i], targets[i] = span_corrupt(seqs[i], rng, corpus.mask_id)
        out = {"inputs": torch.from_numpy(inputs), "targets": torch.from_numpy(targets)}
    elif t.task in TEXT_CLASSIFICATION:
        out = text_task_batch(t.task, ids, m.seq_len, m.vocab_size, num_classes(cfg), t.seed, split)
    else:
        raise ValueError(f"train.task {t.task!r} has no task batches (one of {TASKS[1:]})")
    out["sample_ids"] = torch.from_numpy(ids)
    return out


# ---- model ----------------------------------------------------------------------------------------
class TaskTransformer(MoETransformer):
    """The MoE encoder with a mean-pool classification head (and a patch embedding for images).

    Parameter names of the backbone are those of :class:`MoETransformer`, so an LM checkpoint loads
    into it; ``head`` (and ``patch_emb``) are extra, initialised from ``seed`` like every dense
    parameter. With a patch embedding the token embedding is unused (it gets zero gradients).
    ``pair=True``: the head reads ``[u, v, |u - v|]``, the means of the two halves (a pair task).
    """

    def __init__(self, cfg, *, num_classes: int, patch_dim: int | None = None, pair: bool = False, **kw):
        super().__init__(cfg, **kw)
        dtype = self.tok_emb.weight.dtype
        self.pair = pair
        with torch.random.fork_rng(devices=[]):
            self.head = nn.Linear((3 if pair else 1) * cfg.d_model, num_classes, dtype=dtype)
            self.patch_emb = nn.Linear(patch_dim, cfg.d_model, dtype=dtype) if patch_dim else None
        self._init_dense()  # re-derives every dense tensor from its name: backbone values unchanged

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] long, or patches [B, S, patch_dim] -> class logits [B, 1, C]."""
        B, S = inputs.shape[:2]
        if S > self.cfg.seq_len:
            raise ValueError(f"sequence length {S} exceeds the model's seq_len={self.cfg.seq_len}")
        if self.patch_emb is not None:
            x = self.patch_emb(inputs.to(self.patch_emb.weight.dtype))
        else:
            x = self.tok_emb(inputs)
        return self.head(self.pooled(self.features(self.with_positions(x)))).unsqueeze(1)

    def pooled(self, h: torch.Tensor) -> torch.Tensor:
        """[B, S, d] final hidden states -> the head's input: their mean, or ``[u, v, |u - v|]`` of the halves."""
        if not self.pair:
            return h.mean(1)
        if h.shape[1] % 2:
            raise ValueError(f"a pair task needs an even sequence length, got {h.shape[1]}")
        u, v = (half.mean(1) for half in h.chunk(2, dim=1))
        return torch.cat([u, v, (u - v).abs()], dim=-1)


def build_model(cfg, **kw) -> MoETransformer:
    """The model of RunConfig ``cfg``: the LM for ``lm``/``span``, else a TaskTransformer."""
    t = cfg.train
    if t.task not in CLASSIFICATION:
        return MoETransformer(cfg.model, **kw)
    patch = t.patch_size ** 2 if t.task == "digits" else None
    return TaskTransformer(cfg.model, num_classes=num_classes(cfg), patch_dim=patch, pair=t.task in PAIR_TASKS, **kw)


def task_errors(cfg) -> list:
    """Why ``cfg``'s task options cannot work (empty: they can). Part of the pre-flight (moelab.runtime.preflight)."""
    m, t = cfg.model, cfg.train
    if t.task not in TASKS:
        return [f"train.task must be one of {TASKS}, got {t.task!r}"]
    errs = []
    if t.task != "lm" and m.arch != "bert":
        errs.append(f"train.task={t.task!r} runs on the non-causal encoder: set model.arch='bert' "
                    f"(got {m.arch!r})")
    if t.task in TEXT_CLASSIFICATION and t.dataset != "pydocs":
        errs.append(f"train.task={t.task!r} reads pydoc's topics: train.dataset must be 'pydocs', got {t.dataset!r}")
    if t.task == "acceptability" and m.seq_len < MIN_ACCEPTABILITY_LEN:
        errs.append(f"train.task='acceptability' needs model.seq_len >= {MIN_ACCEPTABILITY_LEN} "
                    f"(several words), got {m.seq_len}")
    if t.task == "paraphrase" and (m.seq_len % 2 or m.seq_len < 8):
        errs.append(f"train.task='paraphrase' puts two windows of seq_len/2 side by side: model.seq_len "
                    f"must be even and >= 8, got {m.seq_len}")
    if t.task in ("topic", "paraphrase") and not errs:
        length = m.seq_len if t.task == "topic" else m.seq_len // 2
        avail = len(topic_windows(length))
        if not 2 <= t.task_classes <= avail:
            errs.append(f"train.task_classes must be in 2..{avail} (topics with >= {MIN_WINDOWS} windows "
                        f"of {length} bytes), got {t.task_classes}")
    if t.task == "digits":
        if t.patch_size not in (1, 2, 4, 8):
            errs.append(f"train.patch_size must divide the {IMAGE_SIDE}x{IMAGE_SIDE} digits (1, 2, 4 or 8), "
                        f"got {t.patch_size}")
        elif m.seq_len < num_patches(t.patch_size):
            errs.append(f"model.seq_len={m.seq_len} is shorter than the {num_patches(t.patch_size)} patches "
                        f"of train.patch_size={t.patch_size}")
        missing = sklearn_missing()
        if missing:
            errs.append(missing)
    return errs


# ---- every objective's batches: the training loop's single entry point --------------------------------
def make_batch(cfg, rank: int, world: int, iteration: int) -> dict:
    """The training loop's single entry point: this rank's batch for ``iteration`` of RunConfig ``cfg``."""
    m, t = cfg.model, cfg.train
    if getattr(t, "task", "lm") != "lm":  # span corruption, classification (moelab.models.tasks)
        return task_batch(cfg, rank, world, iteration)
    corpus = get_corpus(m.arch, m.vocab_size, t.dataset)
    return corpus.batch(rank, world, iteration, t.batch_size, m.seq_len, t.seed)


def make_eval_batch(cfg, rank: int, world: int, index: int) -> dict:
    """This rank's slice of held-out batch ``index`` (windows training never draws)."""
    m, t = cfg.model, cfg.train
    if getattr(t, "task", "lm") != "lm":
        return task_batch(cfg, rank, world, index, split="eval")
    corpus = get_corpus(m.arch, m.vocab_size, t.dataset)
    return corpus.batch(rank, world, index, t.batch_size, m.seq_len, t.seed, split="eval")
