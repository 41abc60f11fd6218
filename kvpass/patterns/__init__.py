"""Finding attention sites in post-grad FX graphs."""

from kvpass.patterns.attention import SiteMatch, Unmatched, find_sites

__all__ = ["SiteMatch", "Unmatched", "find_sites"]
