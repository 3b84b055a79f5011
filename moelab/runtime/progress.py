"""Rank 0's progress lines, turned into one progress bar in a terminal or a notebook.

The worker prints ``MOELAB_PROGRESS iter=<i> total=<n> loss=<float> step_time=<float>`` once per
iteration; everything else it prints is passed through above the bar.
"""
from __future__ import annotations

import sys

PREFIX = "MOELAB_PROGRESS"


def parse_progress(line: str) -> dict | None:
    """``{"iter": int, "total": int, "loss": float, "step_time": float}`` or None for other lines."""
    head, _, rest = line.strip().partition(" ")
    if head != PREFIX:
        return None
    rec = {}
    for item in rest.split():
        key, _, value = item.partition("=")
        try:
            rec[key] = int(value) if key in ("iter", "total") else float(value)
        except ValueError:
            return None
    return rec if "iter" in rec else None


class Progress:
    """A tqdm.auto bar fed with progress records; ``enabled=False`` makes it silent."""

    def __init__(self, desc: str, enabled: bool = True):
        self.desc, self.enabled, self.bar = desc, enabled, None

    def update(self, rec: dict) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=rec.get("total"), desc=self.desc, unit="it", leave=True)
        # iterations are 0-based; moving to the reported position (not by 1) survives a lost line
        done = min(rec["iter"] + 1, self.bar.total or rec["iter"] + 1)
        self.bar.set_postfix({k: f"{rec[k]:.4g}" for k in ("loss", "step_time") if k in rec}, refresh=False)
        self.bar.update(max(done - self.bar.n, 0))

    def write(self, line: str) -> None:
        """Show a worker's ordinary output line without breaking the bar."""
        if not self.enabled:
            return
        if self.bar is None:
            print(line, file=sys.stdout, flush=True)
        else:
            self.bar.write(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
