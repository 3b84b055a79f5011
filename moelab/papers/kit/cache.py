"""Result caching for reproductions: an expensive experiment (a real-rank suite, a paper-scale
simulation) runs once per arguments in a process and is shared by every figure that reads it; callers
get deep copies, so a figure that edits its frame cannot change another's."""
from __future__ import annotations

import copy
import functools
import inspect


def cached(fn):
    """Cache ``fn`` per (hashable) arguments, up to 16 results; return deep copies. Arguments are
    bound to the signature first, so ``f(x)``, ``f(x, None)`` and ``f(x, arg=None)`` (with a default of
    None) are one entry, not three runs. ``fn.cache_clear()`` empties it."""
    sig = inspect.signature(fn)

    @functools.lru_cache(maxsize=16)
    def memo(key):
        return fn(**dict(key))

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        bound = sig.bind(*args, **kw)
        bound.apply_defaults()
        return copy.deepcopy(memo(tuple(bound.arguments.items())))

    wrapper.cache_clear = memo.cache_clear
    return wrapper
