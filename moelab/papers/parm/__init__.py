"""Parm's reproduction (``notebooks/parm.ipynb``, ``moelab reproduce parm``): every table and figure of the
paper, REAL/EMULATED at small scale on gloo ranks, SIMULATED at paper scale (``experiments/parm/``)."""
from .common import scale_spec  # noqa: F401 - the scale lookup the kit and the tests use
