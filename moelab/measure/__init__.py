"""The simulator against this machine: calibrate a local profile (collectives, GEMMs, per-op and per-call
costs), run small real trainings and price the same iterations (``local``, ``realruns``), and report how
far the predictions land from the measurements (``validate``).

Apart from :mod:`moelab.sim` because it spawns ranks and trains for real: the simulator itself stays a
pure function of a profile and a plan, and this package sits above the strategies it measures.
"""
from moelab.measure.calibrate import (
                                      COMPUTE_MODELS,
                                      TRAIN_MODELS,
                                      calibrate_gpu,
                                      calibrate_local,
                                      fit_collectives,
                                      fit_compute,
                                      fit_in_context,
                                      measure_collectives,
                                      measure_gemm,
                                      measure_model_compute,
)

__all__ = ["COMPUTE_MODELS", "TRAIN_MODELS", "calibrate_gpu", "calibrate_local", "fit_collectives", "fit_compute",
           "fit_in_context", "measure_collectives", "measure_gemm", "measure_model_compute"]
