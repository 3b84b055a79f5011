"""Hecate reproduction: the experiments behind every figure and table moelab makes of the paper
(``experiments/hecate/manifest.yaml``), their plot builders (:mod:`.figures`) and the registered
products (:mod:`.products`) the notebook ``notebooks/hecate.ipynb`` shows."""
from .common import SCALES, ScaleSpec, assumptions, scale_spec  # noqa: F401
