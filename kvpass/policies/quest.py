"""Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
ICML 2024, arXiv 2406.10774): page-level recall by an upper bound of q·k from per-page key min/max."""

from __future__ import annotations

import dataclasses

from kvpass.policies.base import Policy, check_int, register_policy
from kvpass.runtime.selection import QuestState


@register_policy
@dataclasses.dataclass(frozen=True)
class Quest(Policy):
    """Per page of ``page_size`` tokens keep the channel-wise min and max key. At each decode step score
    a page by ``sum_d max(q_d * max_d, q_d * min_d)`` and attend to the top pages up to ``budget``
    tokens; the page holding the newest token is always included.

    GQA: one page selection per KV head; the scores of the head's query group are summed
    (``gqa="sum"``) or maxed (``gqa="max"``)."""

    budget: int = 1024
    page_size: int = 16
    gqa: str = "sum"
    name = "Quest"

    def __post_init__(self):
        check_int(self.name, "page_size", self.page_size, 1)
        check_int(self.name, "budget", self.budget, 1)
        if self.budget < 2 * self.page_size:
            raise ValueError(
                f"kvpass: Quest needs budget >= 2 * page_size ({2 * self.page_size}) so that at least one "
                f"page besides the newest can be recalled, got budget={self.budget}; lower page_size or "
                f"raise budget"
            )
        if self.gqa not in ("sum", "max"):
            raise ValueError(f"kvpass: Quest needs gqa in ('sum', 'max'), got gqa={self.gqa!r}")

    @classmethod
    def with_budget(cls, budget: int, page_size: int = 16) -> Quest:
        return cls(budget=budget, page_size=page_size)

    def new_state(self, info):
        return QuestState(self, info)
