"""Parm's rank layout (spec §2.3), pure: who is in which MP, ESP, EP and dense-DP group.

Rank r is read two ways: ``(ep, esp) = divmod(r, N_ESP)`` (which experts' shard it holds) and
``(dp, mp) = divmod(r, N_MP)`` (which micro-batch it holds, replicated over its MP group). MP and
ESP groups are contiguous blocks (the smaller nests in the larger), EP groups are strided, and the
fused EP&ESP all-to-all spans every rank. The groups are declared as data
(:meth:`ParmLayout.groups`); the communicator creates them once, in one order, on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

# group names Parm declares (``ep`` is the core's all-ranks group, so Parm's strided EP is ``ep_strided``)
MP, ESP, EP, EPESP, SAA, DENSE_DP = "mp", "esp", "ep_strided", "ep_esp", "ep_esp_saa", "dense_dp"


@dataclass(frozen=True)
class ParmLayout:
    world: int  # P
    n_mp: int
    n_esp: int
    num_experts: int  # E
    ranks_per_node: int  # g
    allow_cross_node: bool = False

    def errors(self) -> list:
        """Every reason this layout cannot run, naming the option and values (empty when it can)."""
        P, g = self.world, self.ranks_per_node
        errs = []
        for name, v in (("parallel.nproc", P), ("mp", self.n_mp), ("esp", self.n_esp),
                        ("model.moe.num_experts", self.num_experts), ("ranks per node", g)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                errs.append(f"{name} must be a positive integer, got {v!r}")
        if errs:
            return errs
        for name, n in (("mp", self.n_mp), ("esp", self.n_esp)):
            if P % n:
                errs.append(f"strategy_options.{name}={n} does not divide parallel.nproc={P}")
            elif n > 1 and g % n and not self.allow_cross_node:
                errs.append(f"strategy_options.{name}={n}: {name.upper()} groups would cross nodes of {g} ranks "
                            f"({name} must divide the ranks per node, or set allow_cross_node: true)")
        if P % g:
            errs.append(f"parallel.nproc={P} does not split into nodes of {g} ranks")
        if not errs and self.num_experts % self.n_ep:
            errs.append(f"N_EP = nproc/esp = {self.n_ep} does not divide model.moe.num_experts={self.num_experts}")
        return errs

    def check(self) -> "ParmLayout":
        errs = self.errors()
        if errs:
            raise ValueError("; ".join(errs))
        return self

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def n_ep(self) -> int:
        return self.world // self.n_esp

    @property
    def n_dp(self) -> int:
        return self.world // self.n_mp

    @property
    def e_local(self) -> int:
        return self.num_experts // self.n_ep

    # ---- one rank ------------------------------------------------------------------------------
    def coords(self, rank: int) -> dict:
        ep, esp = divmod(rank, self.n_esp)
        dp, mp = divmod(rank, self.n_mp)
        return {"ep": ep, "esp": esp, "dp": dp, "mp": mp}

    def experts_of(self, rank: int) -> list:
        """Global experts whose shard ``esp`` this rank holds."""
        ep = rank // self.n_esp
        return list(range(ep * self.e_local, (ep + 1) * self.e_local))

    def rank_of(self, ep: int, esp: int) -> int:
        return ep * self.n_esp + esp

    # ---- groups ----------------------------------------------------------------------------------
    def blocks(self, n: int) -> list:
        return [list(range(b, b + n)) for b in range(0, self.world, n)]

    def groups(self) -> dict:
        """``{name: [[ranks], ...]}``, each a partition of the ranks (the communicator's declaration)."""
        everyone = [list(range(self.world))]
        return {
            MP: self.blocks(self.n_mp),
            ESP: self.blocks(self.n_esp),
            EP: [[esp + self.n_esp * i for i in range(self.n_ep)] for esp in range(self.n_esp)],
            EPESP: everyone,
            SAA: everyone,  # a second group over the same ranks: SAA's all-to-all stream
            DENSE_DP: [[mp + self.n_mp * i for i in range(self.n_dp)] for mp in range(self.n_mp)],
        }

    def describe(self) -> str:
        return (f"P={self.world} (N_MP={self.n_mp}, N_ESP={self.n_esp}, N_EP={self.n_ep}), E={self.num_experts} "
                f"(E_l={self.e_local}), nodes of {self.ranks_per_node}")


SAA_MODES = ("raw", "combined")


def saa_combine(layout: "ParmLayout", saa_mode: str) -> int:
    """How many consecutive ranks' partials SAA sums before forwarding: N_ESP (``combined``: an expert's
    N_ESP shard holders are consecutive ranks) or 1 (``raw``, the paper's kernel)."""
    return layout.n_esp if saa_mode == "combined" else 1
