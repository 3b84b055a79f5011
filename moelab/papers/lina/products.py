"""Lina's products: one registered function per figure or table moelab makes of the paper (ids as in
``experiments/lina/manifest.yaml``); the notebook calls ``Session.show(id)`` once per product. Importing
this module registers both halves: :mod:`.products_train` and :mod:`.products_infer`."""
from . import products_infer, products_train  # noqa: F401 - registration
from .common import scale_spec  # noqa: F401 - the Session's scale lookup
