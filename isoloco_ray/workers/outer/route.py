"""How one run's outer steps move data, chosen once (docs/design.md, "The outer sync").

Two independent choices:

- **What a rank sends** (`sums`): when the merge needs only the replicas' mean and the wire
  carries a plain cast of it, one sum per tensor of its good replicas' Δ_r; otherwise every
  hosted Δ_r, for per-replica merges and for codes that are each replica's own (int8/float8
  rows, top-k, error feedback: what each replica loses on the wire stays its own).
- **Who merges** (`everyone_merges`): every rank, with every payload (replicated placement, and
  sharded for elementwise means sent losslessly, whose float32 all-reduce is balanced
  already); else each tensor's owner (plan.py), who sends the update back.

Together: an all-reduce of sums, an all-gather of every Δ_r, or payloads to owners and
updates back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from isoloco_ray.strategies import WIRE_FORMATS, OuterMerge

if TYPE_CHECKING:  # config imports this module: it checks settings against the route
    from isoloco_ray.config import OuterConfig


@dataclass(frozen=True)
class Route:
    """The route of a run's outer steps."""

    sums: bool  # each rank sends the sum of its good replicas' Δ_r (else every hosted Δ_r)
    everyone_merges: bool  # every rank merges every tensor (else owners merge theirs)

    @classmethod
    def choose(cls, outer: OuterConfig, merge: OuterMerge) -> Route:
        """The route of `outer` (a validated OuterConfig) with its resolved merge."""
        wire = WIRE_FORMATS[outer.comm_dtype]
        own_codes = wire.per_replica or outer.topk is not None or outer.error_feedback
        everyone = outer.placement == "replicated" or (
            outer.placement == "sharded" and merge.elementwise and wire.lossless)
        return cls(sums=merge.of_mean and not own_codes, everyone_merges=everyone)

    @property
    def name(self) -> str:
        """How it reads in docs and benchmarks."""
        if self.everyone_merges:
            return "all-reduce of sums" if self.sums else "all-gather of every Δ_r"
        return f"{'sums' if self.sums else 'every Δ_r'} to owners, updates back"
