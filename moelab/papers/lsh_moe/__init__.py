"""LSH-MoE reproduction: the experiments behind ``notebooks/lsh_moe.ipynb`` (products in :mod:`.products`,
items in ``experiments/lsh_moe/manifest.yaml``, sizes in ``experiments/lsh_moe/scales.yaml``)."""
from .common import scale_spec  # noqa: F401, E402
