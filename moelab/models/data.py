"""Training data that needs no download: byte-level text of the Python installation, or random bytes.

Text domains (``train.dataset``): ``pydocs`` the stdlib's text files in path order (library code,
docstrings, docs: the default), ``pytests`` the stdlib's own test suite (``test/``: test code),
``pytext`` its prose and markup (``.txt``, ``.html``: licences, data files, docs pages) - three
corpora every installation has, with different token statistics (Lina's Table 6 substitute trains
and serves on each).

Why the stdlib: every machine that runs moelab has it, it is real language (code, comments,
docstrings, docs) with real token statistics, so MoE routing shows the imbalance and drift the
papers study, and no dataset has to be fetched. Bytes are tokens (vocab 256 by default).

Sampling rule (deterministic, no RNG state): the corpus is cut into ``W`` aligned, non-overlapping
windows of ``seq_len + 1`` bytes. Sample number ``n = (iteration * world + rank) * batch_size + b``
reads window ``(a * n + c) mod W`` with ``a`` coprime to ``W`` (a bijection, seeded by ``seed``).
Hence ranks and iterations see disjoint windows until ``W`` samples have been drawn, a run is
reproducible, and the global batch of an iteration does not depend on how it is split over ranks
(world=1, B=8 reads the same 8 windows as world=2, B=4) — what EP=1 vs EP=N tests need.

Held-out windows: the last ``max(1, W // HELDOUT_DIVISOR)`` aligned windows are never drawn for
training (the bijection above runs over the first ``W_train`` windows only); evaluation batches
(:func:`make_eval_batch`) read only those, in a fixed order, so every evaluation of a run scores the
same text and no evaluated window was trained on. The random dataset draws evaluation rows from a
separate seed stream.

Batch format (matches :func:`moelab.models.transformer.lm_loss`)::

    {"inputs": LongTensor[B, S], "targets": LongTensor[B, S], "sample_ids": LongTensor[B]}

gpt: ``targets`` = ``inputs`` shifted by one (next byte). bert: 15% of positions are selected;
of those 80% become the mask token (``vocab_size - 1``, reserved: text bytes are folded into
``0 .. vocab_size - 2``; with vocab 256 that reserves byte 0xFF, which never occurs in UTF-8),
10% a random regular token, 10% unchanged; ``targets`` is the original token there and -100
elsewhere.
"""
from __future__ import annotations

import functools
import math
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

TEXT_DOMAINS = {  # dataset -> (top-level stdlib directories read, None: all; file suffixes)
    "pydocs": (None, (".py", ".txt", ".rst", ".md")),
    "pytests": (("test",), (".py",)),
    "pytext": (None, (".txt", ".html")),
}
DATASETS = (*TEXT_DOMAINS, "random")
DEFAULT_MAX_BYTES = 4 << 20  # 4 MiB: ~1 s to read, ~65k windows of 64 bytes
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # installed packages vary per machine
IGNORE_INDEX = -100
HELDOUT_DIVISOR = 32  # 1/32 of the windows are held out for evaluation


def dataset_errors(cfg) -> list:
    """``train.dataset`` names one of :data:`DATASETS`."""
    d = cfg.train.dataset
    return [] if d in DATASETS else [f"train.dataset must be one of {DATASETS}, got {d!r}"]


@functools.lru_cache(maxsize=4)
def stdlib_text(max_bytes: int = DEFAULT_MAX_BYTES, domain: str = "pydocs") -> bytes:
    """The first ``max_bytes`` of the stdlib's text files of ``domain`` (:data:`TEXT_DOMAINS`; sorted
    relative paths, joined by newlines).

    Cached per process, so every batch of a run reads the same bytes. Deterministic on one Python
    installation; another Python version gives another (equally valid) corpus.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    tops, suffixes = TEXT_DOMAINS[domain]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        if tops is not None and (not rel.parts or rel.parts[0] not in tops):
            continue
        files += [(rel / f).as_posix() for f in filenames if f.endswith(suffixes)]
    files.sort()
    chunks, n = [], 0
    for rel in files:
        try:
            b = (root / rel).read_bytes()
        except OSError:
            continue
        b = b[: max_bytes - n] + b"\n"
        chunks.append(b)
        n += len(b)
        if n >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    if len(data) < 1 << 16:
        raise RuntimeError(f"found only {len(data)} bytes of {domain} text under {root}; use another dataset "
                           "or 'random'")
    return data


def _seed_int(*xs: int) -> list:
    """Non-negative entropy words for numpy's SeedSequence."""
    return [int(x) & (2**63 - 1) for x in xs]


class ByteCorpus:
    """Deterministic batches for ``arch`` ('gpt' or 'bert') from ``dataset`` (a text domain or 'random')."""

    def __init__(self, arch: str = "gpt", vocab_size: int = 256, dataset: str = "pydocs",
                 max_bytes: int = DEFAULT_MAX_BYTES, mask_prob: float = 0.15):
        if arch not in ("gpt", "bert"):
            raise ValueError(f"arch must be 'gpt' or 'bert', got {arch!r}")
        if dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
        self.arch, self.vocab_size, self.dataset, self.mask_prob = arch, vocab_size, dataset, mask_prob
        # BERT reserves the last id for [MASK]; the regular tokens are 0 .. n_regular-1
        self.n_regular = vocab_size - 1 if arch == "bert" else vocab_size
        self.mask_id = vocab_size - 1 if arch == "bert" else None
        if self.n_regular < 2:
            raise ValueError(f"vocab_size={vocab_size} is too small for arch {arch!r}")
        self._tokens = None
        if dataset in TEXT_DOMAINS:
            raw = np.frombuffer(stdlib_text(max_bytes, dataset), dtype=np.uint8)
            self._tokens = raw if self.n_regular >= 256 else (raw % self.n_regular).astype(np.uint8)

    def __len__(self) -> int:
        """Corpus length in tokens (0 for the random dataset)."""
        return 0 if self._tokens is None else len(self._tokens)

    def split_windows(self, window: int) -> tuple:
        """(training windows W_train, held-out windows H) of the aligned windows of ``window`` tokens."""
        W = len(self._tokens) // window
        if W < 2:
            raise ValueError(f"corpus of {len(self._tokens)} bytes holds fewer than two windows of {window}")
        H = max(1, W // HELDOUT_DIVISOR)
        return W - H, H

    def _window_index(self, n: np.ndarray, window: int, seed: int) -> np.ndarray:
        """The seeded bijection n -> (a*n + c) mod W over the training windows."""
        W, _ = self.split_windows(window)
        rng = np.random.default_rng(_seed_int(seed, window, 0x5EED))
        a = int(W * 0.6180339887) + int(rng.integers(0, 1 << 16))  # golden-ratio stride: spread out
        a = a % W or 1
        while math.gcd(a, W) != 1:
            a = a % W + 1
        c = int(rng.integers(0, W))
        return (a * (n % W) + c) % W

    def sequences(self, sample_ids: np.ndarray, length: int, seed: int = 0, split: str = "train") -> np.ndarray:
        """Raw token windows [len(sample_ids), length] (int64) for global sample numbers of ``split``
        ('train' or 'eval': the held-out windows)."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if self._tokens is None:
            out = np.empty((len(sample_ids), length), dtype=np.int64)
            stream = 1 if split == "train" else 3
            for i, n in enumerate(sample_ids):
                out[i] = np.random.default_rng(_seed_int(seed, n, stream)).integers(0, self.n_regular, length)
            return out
        ids = np.asarray(sample_ids, dtype=np.int64)
        if split == "train":
            windows = self._window_index(ids, length, seed)
        else:
            W_train, H = self.split_windows(length)
            windows = W_train + ids % H
        starts = windows * length
        return self._tokens[starts[:, None] + np.arange(length)[None, :]].astype(np.int64)

    def _mask(self, seqs: np.ndarray, sample_ids: np.ndarray, seed: int):
        """BERT 80/10/10 masking; each sample's mask depends only on (seed, sample id)."""
        inputs, targets = seqs.copy(), np.full_like(seqs, IGNORE_INDEX)
        S = seqs.shape[1]
        for i, n in enumerate(sample_ids):
            rng = np.random.default_rng(_seed_int(seed, n, 2))
            selected = rng.random(S) < self.mask_prob
            how = rng.random(S)
            rand_tok = rng.integers(0, self.n_regular, S)
            targets[i, selected] = seqs[i, selected]
            inputs[i, selected & (how < 0.8)] = self.mask_id
            swap = selected & (how >= 0.8) & (how < 0.9)
            inputs[i, swap] = rand_tok[swap]
        return inputs, targets

    def batch(self, rank: int, world: int, iteration: int, batch_size: int, seq_len: int,
              seed: int = 0, split: str = "train") -> dict:
        """This rank's slice of the global batch of ``iteration`` (see the module docstring); with
        ``split='eval'``, of held-out batch number ``iteration``."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside 0..{world - 1}")
        first = (iteration * world + rank) * batch_size
        ids = np.arange(first, first + batch_size, dtype=np.int64)
        seqs = self.sequences(ids, seq_len + 1, seed, split)
        if self.arch == "gpt":
            inputs, targets = seqs[:, :-1], seqs[:, 1:]
        else:
            inputs, targets = self._mask(seqs[:, :-1], ids if split == "train" else -1 - ids, seed)
        return {
            "inputs": torch.from_numpy(np.ascontiguousarray(inputs)),
            "targets": torch.from_numpy(np.ascontiguousarray(targets)),
            "sample_ids": torch.from_numpy(ids),
        }


@functools.lru_cache(maxsize=8)
def get_corpus(arch: str, vocab_size: int, dataset: str, max_bytes: int = DEFAULT_MAX_BYTES) -> ByteCorpus:
    """One ByteCorpus per (arch, vocab, dataset) per process."""
    return ByteCorpus(arch=arch, vocab_size=vocab_size, dataset=dataset, max_bytes=max_bytes)
