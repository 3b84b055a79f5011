"""SmartMoE's MoE layer: the core layer (plain EP on whatever permutation the update placed); it only adds
``"smartmoe": {owners, moved, decision}`` to its plan record."""
from __future__ import annotations

from moelab.moe.layer import MoELayer


class SmartMoELayer(MoELayer):
    def __init__(self, *args, options=None, **kw):
        super().__init__(*args, **kw)
        self.options = options
        self.smart_record = {"owners": [self.placement.owner(e) for e in range(self.cfg.num_experts)],
                             "moved": [], "decision": "none"}

    def plan_record(self) -> dict:
        rec = super().plan_record()
        rec["smartmoe"] = {k: (list(v) if isinstance(v, list) else v) for k, v in self.smart_record.items()}
        return rec
