"""Per-site state, owned by the backend that compiled the model (never global)."""

from kvpass.runtime.state import AttentionCall, Runtime, SiteInfo, SiteState

__all__ = ["AttentionCall", "Runtime", "SiteInfo", "SiteState"]
