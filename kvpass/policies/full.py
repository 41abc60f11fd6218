"""Full: the identity rewrite (the exact, uncompressed cache)."""

from __future__ import annotations

import dataclasses

from kvpass.policies.base import Policy, register_policy
from kvpass.runtime.state import SiteState


@register_policy
@dataclasses.dataclass(frozen=True)
class Full(Policy):
    """Attend to every cached token exactly as the model would. The reference every policy is measured
    against: compiled generation with ``Full`` equals eager generation token for token."""

    name = "Full"
    exact = True  # NaN/Inf keys give eager's NaNs, never an error

    @classmethod
    def with_budget(cls, budget: int | None = None) -> Full:
        return cls()

    def new_state(self, info):
        return SiteState(self, info)
