"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024)."""

from __future__ import annotations

import dataclasses

from kvpass.policies.base import Policy, check_int, register_policy
from kvpass.runtime.selection import StreamingState


@register_policy
@dataclasses.dataclass(frozen=True)
class StreamingLLM(Policy):
    """Attend to the first ``sinks`` tokens and the most recent ``window`` tokens (the current one
    included). Token budget: ``sinks + window``. With left padding, sinks are the first real tokens.

    ``sinks <= window``: the sinks are the few first tokens attention rests on (the paper keeps 4) and
    the window carries the context; more sinks than window is almost always the two swapped."""

    sinks: int = 4
    window: int = 1020
    name = "StreamingLLM"

    def __post_init__(self):
        check_int(self.name, "sinks", self.sinks, 0)
        check_int(self.name, "window", self.window, 1)
        if self.sinks > self.window:
            raise ValueError(
                f"kvpass: StreamingLLM needs sinks <= window ({self.window}): the sinks are a few first "
                f"tokens, the window holds the recent context, got sinks={self.sinks}; did you mean "
                f"StreamingLLM(sinks={self.window}, window={self.sinks})?"
            )

    @property
    def budget(self) -> int:
        return self.sinks + self.window

    @classmethod
    def with_budget(cls, budget: int, sinks: int = 4) -> StreamingLLM:
        check_int(cls.name, "budget", budget, 1)
        check_int(cls.name, "sinks", sinks, 0)
        if budget <= sinks:
            raise ValueError(f"kvpass: StreamingLLM needs budget > sinks ({sinks}), got budget={budget}")
        if budget < 2 * sinks:
            raise ValueError(
                f"kvpass: StreamingLLM needs budget >= 2 * sinks ({2 * sinks}) so that the window is at "
                f"least as long as the sinks, got budget={budget}; lower sinks or raise budget"
            )
        return cls(sinks=sinks, window=budget - sinks)

    def new_state(self, info):
        return StreamingState(self, info)
