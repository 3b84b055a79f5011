"""``launch_agreement: plan`` in the simulator: the runtime's planned windows on the simulated timeline.

The runtime (:class:`moelab.strategies.lina.priority.PriorityScheduler` with ``plan``) launches, in each backward
window, the micro-ops planned from the last step: a window runs from the backward's start or a backward all-to-all's
end to the next backward all-to-all's arrival; the ranks agree on each window's free time (the least) and each
micro-op's duration (the most), and :func:`moelab.strategies.lina.priority.plan_windows` fills the windows in FIFO
order.
A planned op launches once its window opens, the window's call waits for it, the ops no window holds launch after
the last backward call. A window opens only while no backward call is in flight: none inside a pipelined layer.

The simulator follows the same rule on its own timeline (:func:`steady_plan`): it prices the iteration with
nothing planned (the runtime's first step: every micro-op in the drain), measures the windows and the micro-ops
there (:func:`measure`), plans with the runtime's function, prices again with that plan, and repeats until the
plan repeats, the steady state the benchmark's timed steps run in, or ``passes`` run out (then the last).

Not modelled: the combine marker ending a window early (the runtime's window ends at the first of the marker and
the call; the combine's backward between them is short next to a window).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from moelab.sim.engine import simulate
from moelab.strategies.lina.priority import plan_windows


@dataclass
class WindowLayout:
    """What :func:`measure` reads from a priced graph; the graph builder leaves it in ``graph.meta["window_layout"]``.

    ``calls``: the backward all-to-alls in issue order, each ``(its last op, the ops it waits for as issued)``
    (arrival = those deps' end, before any planned op it also waits for); ``opens``: per rank, the op whose
    start is the backward's (window 0 opens there); ``units``: per micro-op in FIFO order, ``(its calls' last
    ops, per-rank gradient-ready ops)``; ``inner``: the windows that never open, inside a pipelined layer's
    backward (the runtime waits its chunks' calls after the last chunk, and opens no window while a call is in
    flight)."""

    calls: list = field(default_factory=list)
    opens: list = field(default_factory=list)
    units: list = field(default_factory=list)
    inner: set = field(default_factory=set)


def measure(graph, result, layout: WindowLayout) -> tuple:
    """``(free, queued, durations)`` as the runtime's ranks would agree on them after this iteration: per
    window the least free time over ranks and the least number of micro-ops queued by its call's arrival; per
    micro-op its duration from launch to end."""
    ops, start, end = graph.ops, result.start, result.end
    ranks = range(len(layout.opens))

    def arrival(deps, r):
        mine = [end[d] for d in deps if r in ops[d].ranks]
        return max(mine or [end[d] for d in deps] or [0.0])

    def launched(last):
        return min(start[h] for h in graph.call_heads.get(last, (last,)))

    free, queued = [], []
    for w, (call, deps) in enumerate(layout.calls):
        at = [arrival(deps, r) for r in ranks]
        if w == 0:
            opened = [start[layout.opens[r]] for r in ranks]
        else:
            opened = [end[layout.calls[w - 1][0]]] * len(at)
        # arrived before it opened, or never opens: 0
        free.append(0.0 if w in layout.inner else float(min(max(0.0, a - o) for a, o in zip(at, opened))))
        queued.append(min(sum(end[ready[r]] <= at[r] + 1e-12 for _, ready in layout.units) for r in ranks))
    durations = [float(max(end[x] - launched(x) for x in lasts)) for lasts, _ in layout.units]
    return free, queued, durations


def steady_plan(build: Callable, passes: int = 4):
    """The graph of the plan's steady state: ``build(windows) -> graph`` prices one iteration with
    ``windows`` planned (cumulative micro-ops launched by the end of each window; ``[]``: none). The graph's
    ``meta`` says the plan and how many passes found it (``plan_converged``: False where it kept changing)."""
    windows: list = []
    for n in range(1, passes + 1):
        g = build(windows)
        nxt = plan_windows(*measure(g, simulate(g), g.meta["window_layout"]))
        if nxt == windows or n == passes:
            break
        windows = nxt
    g.meta.update(plan_windows=list(windows), plan_passes=n, plan_converged=nxt == windows)
    return g


def window_of(windows: list, n: int):
    """The window micro-op ``n`` is planned in (None: none, it launches after the last backward call)."""
    return next((w for w, k in enumerate(windows) if k > n), None)

