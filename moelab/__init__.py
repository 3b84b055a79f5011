"""moelab: a research workbench for distributed Mixture-of-Experts systems.

Real multi-process implementations (torch.distributed; gloo on CPU, NCCL on GPU), a paper-scale
simulator that prices the same plans, and notebooks that rebuild the papers' figures.
"""
__version__ = "0.1.0"

from moelab.config import ConfigError, RunConfig, install_preflight  # noqa: E402


def _preflight(cfg) -> list:
    """The owners' checks of a config (:func:`moelab.runtime.preflight.owner_errors`), installed as
    ``RunConfig.validate()``'s pre-flight step: the package root wires the runtime into the config layer, which
    may not import it. Imported on first use: the pre-flight reaches torch and the registries, and
    ``import moelab`` stays light."""
    from moelab.runtime.preflight import owner_errors

    return owner_errors(cfg)


install_preflight(_preflight)


def launch(config=None, nproc=None, **overrides):
    """Run a real multi-process job, or continue one with ``resume=RUN`` (see :func:`moelab.runtime.launch.launch`)."""
    from moelab.runtime.launch import launch as _launch

    return _launch(config, nproc=nproc, **overrides)


__all__ = ["RunConfig", "ConfigError", "launch", "__version__"]
