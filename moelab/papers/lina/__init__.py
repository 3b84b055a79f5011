"""Lina's reproduction (``notebooks/lina.ipynb``, ``moelab reproduce lina``): real/emulated runs (:mod:`.runs`),
paper-scale simulation (:mod:`.paper_scale`), frames (:mod:`.frames`), figures (:mod:`.figures`) and the
registered products (:mod:`.products`); sizes in ``experiments/lina/``."""
from .common import scale_spec  # noqa: F401 - the scale lookup the kit and the tests use
