"""The reproduction kit every paper uses: a manifest of the paper's tables and figures, one registered
function per product, a session the notebook drives, and a paper-vs-moelab comparison from data.

Adding a paper, in five steps:

1. **Experiments**: ``moelab/papers/<paper>/<family>.py`` — functions returning labelled
   pandas frames (``frame.attrs["label"]`` says REAL / EMULATED / SIMULATED / SUBSTITUTE and of what),
   one module per figure family, each under ~400 lines; real runs spawn ranks with
   :func:`moelab.runtime.ranks.run_ranks` and time steps with :func:`moelab.runtime.timing.measure` (a step's
   slowest-rank time with the door records and spans it produced).
2. **Data**: ``experiments/<paper>/`` — ``manifest.yaml`` (every table and figure of the paper, each with
   its products and their class, or the reason it is not reproduced: :mod:`.manifest`), ``paper.yaml``
   (the paper's numbers and where moelab's counterparts come from: :mod:`.compare`), ``assumptions.yaml``
   (every guessed or fitted constant with its kind and source: :mod:`.assumptions`), and the notebook
   parameters per scale (``smoke.yaml``, ``default.yaml``, ``full.yaml``).
3. **Products**: ``moelab/papers/<paper>/products.py`` registers one function per manifest product with
   :func:`.registry.product` (id, ``needs_real``, the :class:`.registry.Quantity` of each compared column),
   returning :class:`.registry.Made` (figures, tables, value, notes). It exports ``scale_spec(name)``.
4. **Notebook**: ``notebooks/<paper>.ipynb`` — a parameters cell, ``S = Session("<paper>", scale, out_dir, ...)``,
   then one ``S.show("<product id>")`` per product under a heading, and ``S.finish()``.
5. **Tests**: add the paper to ``PAPERS`` in ``tests/papers/kit/test_kit.py`` (registry = manifest = notebook
   calls, paper.yaml quantities declared) and test its mechanisms in its own test files at smoke scale.
"""
from moelab.papers.kit.manifest import Item, Manifest, ManifestError, load_manifest  # noqa: F401
from moelab.papers.kit.registry import Context, Made, Quantity, product, products  # noqa: F401
from moelab.papers.kit.session import ProductError, Session  # noqa: F401
