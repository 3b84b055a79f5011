"""Result caching for reproductions: an expensive experiment (a real-rank suite, a paper-scale
simulation) runs once per arguments in a process and is shared by every figure that reads it; callers
get deep copies, so a figure that edits its frame cannot change another's."""
from __future__ import annotations

import copy
import functools


def cached(fn):
    """Cache ``fn`` per (hashable) arguments, up to 16 results; return deep copies.
    ``fn.cache_clear()`` empties it."""
    memo = functools.lru_cache(maxsize=16)(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        return copy.deepcopy(memo(*args, **kw))

    wrapper.cache_clear = memo.cache_clear
    return wrapper
