"""What a simulation returns (:func:`moelab.sim.engine.simulate`): start and end of every op, and the
views of them the figures need - per-op frame, per-rank timeline, critical path, MoE-layer times,
compute-busy fractions, breakdowns, peak memory."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence, Union

import numpy as np

if TYPE_CHECKING:
    from moelab.sim.engine import OpGraph


@dataclass
class SimResult:
    graph: OpGraph
    start: np.ndarray
    end: np.ndarray
    blocker: np.ndarray  # op whose finish let this op start (-1: started at t=0)
    makespan: float
    _cache: dict = field(default_factory=dict, repr=False)

    def ops_frame(self):
        """One row per op: id, name, category, kind, stream, n_ranks, layer, phase, start, end, duration."""
        import pandas as pd

        g = self.graph.ops
        return pd.DataFrame({
            "id": np.arange(len(g)), "name": [o.name for o in g], "category": [o.category for o in g],
            "kind": [o.kind for o in g], "stream": [o.stream for o in g],
            "n_ranks": [len(o.ranks) for o in g], "layer": [o.meta.get("layer") for o in g],
            "phase": [o.meta.get("phase") for o in g], "start": self.start, "end": self.end,
            "duration": self.end - self.start})

    def timeline(self):
        """Gantt rows: one per (op, member rank): rank, stream, name, category, start, end."""
        import pandas as pd

        g = self.graph.ops
        idx = np.repeat(np.arange(len(g)), [len(o.ranks) for o in g])
        ranks = np.fromiter((r for o in g for r in o.ranks), dtype=np.int64, count=len(idx))
        df = pd.DataFrame({"rank": ranks, "op": idx,
                           "stream": [g[i].stream for i in idx], "name": [g[i].name for i in idx],
                           "category": [g[i].category for i in idx],
                           "start": self.start[idx], "end": self.end[idx]})
        return df.sort_values(["rank", "start", "op"], kind="stable").reset_index(drop=True)

    def critical_path(self) -> list:
        """Op ids from the first to the last-finishing op, each one having started when the previous ended."""
        if not len(self.end):
            return []
        i = int(np.argmax(self.end))
        path = []
        while i >= 0:
            path.append(i)
            i = int(self.blocker[i])
        return path[::-1]

    def moe_layer_spans(self, layer_ids, phases: Sequence[str] = ("fwd", "bwd")) -> list:
        """``[(layer, phase, start, end)]``: each MoE layer's span per pass over its non-attention ops
        (gate, count exchange, all-to-alls, experts, materialization), every rank together."""
        ops = self.ops_frame()
        ops = ops[ops.layer.notna() & ~ops.category.isin(["attention", "ffn", "head"])]
        out = []
        for i in layer_ids:
            for ph in phases:
                o = ops[(ops.layer == i) & (ops.phase == ph)]
                if len(o):
                    out.append((i, ph, float(o.start.min()), float(o.end.max())))
        return out

    def moe_layer_times(self, layer_ids, phases: Sequence[str] = ("fwd", "bwd")) -> np.ndarray:
        """Seconds of each MoE layer, its spans in ``phases`` summed (:meth:`moe_layer_spans`): the
        MoE-layer-only time papers' layer benchmarks report (FasterMoE spec §6.15, Hecate Fig. 11,
        Lina Figs. 11/12 per pass)."""
        t = dict.fromkeys(layer_ids, 0.0)
        for i, _, a, b in self.moe_layer_spans(layer_ids, phases):
            t[i] += b - a
        return np.asarray([t[i] for i in layer_ids])

    def compute_busy(self, windows: Union[None, str, Sequence] = None):
        """Per rank, the fraction of time its compute ops run (the stand-in for "GPU utilization"):
        of the whole run (``windows`` None), of the time inside the rank's ops of one category
        (``"a2a"``: Lina's pipelining efficiency, compute busy while all-to-alls move), or of given
        ``[(start, end)]`` intervals (e.g. :meth:`moe_layer_spans`). A pandas Series by rank."""
        import pandas as pd

        tl = self.timeline()
        comp = tl[[self.graph.ops[i].kind == "compute" for i in tl.op]]
        out = {}
        for r in range(self.graph.world_size):
            if windows is None:
                win = [(0.0, self.makespan)]
            elif isinstance(windows, str):
                w = tl[(tl["rank"] == r) & (tl.category == windows)]
                win = list(zip(w.start, w.end))
            else:
                win = list(windows)
            c = comp[comp["rank"] == r]
            out[r] = covered_fraction(win, zip(c.start, c.end))
        return pd.Series(out, name="compute_busy").rename_axis("rank")

    def breakdown(self, by: str = "category") -> dict:
        """Seconds of the critical path per op category (``by='kind'``: compute / comm); sums to makespan."""
        out: dict = {}
        for i in self.critical_path():
            op = self.graph.ops[i]
            key = getattr(op, by)
            out[key] = out.get(key, 0.0) + float(self.end[i] - self.start[i])
        gap = self.makespan - sum(out.values())
        if gap > 1e-12 * max(1.0, self.makespan):
            out["idle"] = gap
        return out

    def rank_breakdown(self):
        """Per rank: busy seconds per category, and ``idle`` = makespan minus the union of its busy time."""
        import pandas as pd

        tl = self.timeline()
        busy = tl.assign(t=tl.end - tl.start).pivot_table(index="rank", columns="category", values="t",
                                                          aggfunc="sum", fill_value=0.0)
        idle = {}
        for r, grp in tl.groupby("rank"):
            idle[r] = self.makespan - union_seconds(grp.start, grp.end)
        busy["idle"] = pd.Series(idle)
        return busy

    def peak_memory(self):
        """Per rank: each category's own peak bytes, and ``total`` = the peak of their sum.

        Ops add ``alloc`` at their start and remove ``free`` at their end; at equal times frees
        go first, so back-to-back buffers do not count twice. (Vectorized: figures price thousands
        of graphs.)
        """
        import pandas as pd

        rows = [(r, when, order, c, sign * b)  # (rank, time, 0 = free / 1 = alloc, category, delta)
                for o in self.graph.ops
                for order, when, sign, d in ((1, self.start[o.id], 1.0, o.alloc), (0, self.end[o.id], -1.0, o.free))
                for c, b in (d or {}).items() for r in o.ranks]
        if not rows:
            return pd.DataFrame(columns=["total"])
        rank, t, order, cat, delta = zip(*rows)
        rank, cat, delta = np.asarray(rank), np.asarray(cat, dtype=object), np.asarray(delta, dtype=np.float64)
        ev = np.lexsort((order, t, rank))  # stable: ties keep the ops' order
        out = {}
        for r in np.unique(rank):
            idx = ev[rank[ev] == r]
            cats, col = np.unique(cat[idx], return_inverse=True)
            wide = np.zeros((len(idx), len(cats)))
            wide[np.arange(len(idx)), col] = delta[idx]
            run = np.cumsum(wide, axis=0)
            peaks = {c: float(v) for c, v in zip(cats, run.max(axis=0))}
            peaks["total"] = float(run.sum(axis=1).max())
            out[r.item()] = peaks
        return pd.DataFrame.from_dict(out, orient="index").fillna(0.0).rename_axis("rank")


def interval_union(intervals) -> list:
    """Sorted disjoint intervals covering ``intervals`` (empty ones dropped)."""
    out = []
    for a, b in sorted((float(a), float(b)) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union_seconds(starts, ends) -> float:
    """Length of the union of intervals: the time some op of a set was running (pipelined or
    concurrent calls overlap each other, so their durations must not be summed)."""
    return sum(b - a for a, b in interval_union(zip(starts, ends)))


def covered_fraction(windows, intervals) -> float:
    """The share of the union of ``windows`` that the union of ``intervals`` covers (nan: no window time)."""
    W = interval_union(windows)
    total = sum(b - a for a, b in W)
    return overlap_seconds(interval_union(intervals), W) / total if total > 0 else float("nan")


def overlap_seconds(U, V) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    tot = 0.0
    while i < len(U) and j < len(V):
        a, b = max(U[i][0], V[j][0]), min(U[i][1], V[j][1])
        if b > a:
            tot += b - a
        if U[i][1] < V[j][1]:
            i += 1
        else:
            j += 1
    return tot
