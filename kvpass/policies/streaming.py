"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024)."""

from __future__ import annotations

import dataclasses

from kvpass.policies.base import Policy, check_int, register_policy


@register_policy
@dataclasses.dataclass(frozen=True)
class StreamingLLM(Policy):
    """Attend to the first ``sinks`` tokens and the most recent ``window`` tokens (the current one
    included). Token budget: ``sinks + window``. With left padding, sinks are the first real tokens."""

    sinks: int = 4
    window: int = 1020
    name = "StreamingLLM"

    def __post_init__(self):
        check_int(self.name, "sinks", self.sinks, 0)
        check_int(self.name, "window", self.window, 1)

    @property
    def budget(self) -> int:
        return self.sinks + self.window

    @classmethod
    def with_budget(cls, budget: int, sinks: int = 4) -> StreamingLLM:
        if budget <= sinks:
            raise ValueError(f"kvpass: StreamingLLM needs budget > sinks ({sinks}), got budget={budget}")
        return cls(sinks=sinks, window=budget - sinks)

    def new_state(self, info):
        from kvpass.runtime.selection import StreamingState

        return StreamingState(self, info)
