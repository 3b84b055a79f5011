"""The systems: one subpackage per strategy, each registering a :class:`moelab.registry.Strategy` of its own
name (its options, layer, update, simulator graph, process groups). The core finds them by name through
:mod:`moelab.registry` and never imports them; a strategy may use every core package.

Each subpackage's docstring lists every file where that system lives (mechanism, simulator graph,
reproduction in :mod:`moelab.papers`).
"""
