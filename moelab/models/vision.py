"""Patch-token image classification data: scikit-learn's bundled ``load_digits`` (LSH-MoE Table 3
substitute for Swin-MoE on ImageNet).

Why digits: 1797 8x8 grey images in 10 classes ship inside the scikit-learn wheel, so nothing is
downloaded, and a tiny ViT-style MoE reaches well-above-chance accuracy in a few hundred steps on
CPU ranks. Each image is cut into ``patch x patch`` patches (row-major), the patches' pixels scaled
to [0, 1]; :class:`moelab.models.tasks.TaskTransformer` embeds them with a linear patch embedding
plus the learned position embedding and runs the same (non-causal) blocks.

Split (deterministic, independent of the run's seed): a fixed permutation of the 1797 images;
every ``HELDOUT_EVERY``-th image of it is held out (360 images), the rest are training images.
Training sample ``n`` reads training image ``perm_e[n mod N]`` where ``perm_e`` is a permutation
seeded by (seed, epoch ``e = n // N``): ranks and iterations see disjoint images within an epoch,
and the global batch does not depend on how it is split over ranks. Held-out batch ``i`` reads the
held-out images in a fixed order.

Batch format (what ``lm_loss`` and the trainer's evaluation read)::

    {"inputs": FloatTensor[B, P, patch*patch], "targets": LongTensor[B, 1], "sample_ids": LongTensor[B]}
"""
from __future__ import annotations

import functools

import numpy as np
import torch

IMAGE_SIDE = 8
NUM_CLASSES = 10
HELDOUT_EVERY = 5  # 1 image in 5 is held out
SPLIT_SEED = 0xD161  # the split never depends on train.seed: every run scores the same images


def patchify(images: np.ndarray, patch: int) -> np.ndarray:
    """[N, H, W] -> [N, (H/patch)*(W/patch), patch*patch], patches in row-major order."""
    N, H, W = images.shape
    if patch < 1 or H % patch or W % patch:
        raise ValueError(f"patch={patch} does not tile {H}x{W} images")
    x = images.reshape(N, H // patch, patch, W // patch, patch).transpose(0, 1, 3, 2, 4)
    return np.ascontiguousarray(x.reshape(N, (H // patch) * (W // patch), patch * patch))


def num_patches(patch: int) -> int:
    return (IMAGE_SIDE // patch) ** 2


def sklearn_missing() -> str | None:
    """Why the digits cannot be loaded (None: they can)."""
    try:
        import sklearn.datasets  # noqa: F401
    except ImportError:
        return "task 'digits' needs scikit-learn (a moelab dependency: pip install scikit-learn)"
    return None


@functools.lru_cache(maxsize=1)
def digits() -> tuple:
    """(images float32 [1797, 8, 8] in [0, 1], labels int64 [1797]) from the sklearn wheel."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images / 16.0).astype(np.float32), d.target.astype(np.int64)


@functools.lru_cache(maxsize=1)
def train_heldout() -> tuple:
    """(training image indices, held-out image indices), disjoint, fixed."""
    n = len(digits()[1])
    perm = np.random.default_rng(SPLIT_SEED).permutation(n)
    held = np.zeros(n, dtype=bool)
    held[perm[::HELDOUT_EVERY]] = True
    return perm[~held[perm]], perm[held[perm]]


@functools.lru_cache(maxsize=64)
def _epoch_perm(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([int(seed) & (2**63 - 1), epoch, 0xD1]).permutation(n)


def image_indices(sample_ids: np.ndarray, seed: int, split_name: str) -> np.ndarray:
    """Image index of each global sample number of ``split_name`` ('train' or 'eval')."""
    train, held = train_heldout()
    ids = np.asarray(sample_ids, dtype=np.int64)
    if split_name == "eval":
        return held[ids % len(held)]
    if split_name != "train":
        raise ValueError(f"split must be 'train' or 'eval', got {split_name!r}")
    N = len(train)
    return np.array([train[_epoch_perm(seed, int(n) // N, N)[int(n) % N]] for n in ids], dtype=np.int64)


def digits_batch(rank: int, world: int, iteration: int, batch_size: int, patch: int, seed: int = 0,
                 split: str = "train") -> dict:
    """This rank's slice of global batch ``iteration`` (held-out batch number with ``split='eval'``)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside 0..{world - 1}")
    first = (iteration * world + rank) * batch_size
    ids = np.arange(first, first + batch_size, dtype=np.int64)
    images, labels = digits()
    idx = image_indices(ids, seed, split)
    return {"inputs": torch.from_numpy(patchify(images[idx], patch)),
            "targets": torch.from_numpy(labels[idx][:, None].copy()),
            "sample_ids": torch.from_numpy(ids)}
