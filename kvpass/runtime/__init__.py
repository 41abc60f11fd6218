"""Per-site state, owned by the backend that compiled the model (never global)."""

from kvpass.runtime.call import AttentionCall, SiteInfo
from kvpass.runtime.runtime import Runtime
from kvpass.runtime.state import SiteState

__all__ = ["AttentionCall", "Runtime", "SiteInfo", "SiteState"]
