"""Left padding of a site's sequence, read from the model's attention mask."""

from __future__ import annotations

import torch

from kvpass.runtime.call import mask_row, valid_from_mask


class Padding:
    """Whether a site's sequence is a left-padded batch, decided where the sequence starts or grows by
    several tokens (prefill, chunked prefill, an adopted cache), where a host sync is paid anyway.

    A decode step appends one real token per row (``generate()`` extends the attention mask with ones,
    also for rows that finished), so its padding is the prefill's: a steady step reads the mask only
    when the batch is padded, and never syncs. ``first (B,)`` is each row's first real position and
    ``first_min`` / ``first_max`` their extremes as Python ints (0 without padding)."""

    def __init__(self) -> None:
        self.padded: bool | None = None  # None: no sequence seen yet
        self.first: torch.Tensor | None = None
        self.first_min = self.first_max = 0

    def valid(self, attn_mask: torch.Tensor | None, length: int, event: bool) -> torch.Tensor | None:
        """(B, L) bool validity (None: no padding). ``event``: a prefill, a multi-token step or an
        adoption, where the mask is read in full."""
        if attn_mask is None:
            if event:
                self._set(None)
            return None
        if event or self.padded is None:
            valid = valid_from_mask(attn_mask, length)
            self._set(valid)
            return valid
        return mask_row(attn_mask, length) if self.padded else None

    def _set(self, valid: torch.Tensor | None) -> None:
        self.padded = valid is not None
        if valid is None:
            self.first, self.first_min, self.first_max = None, 0, 0
        else:
            self.first = valid.to(torch.int8).argmax(dim=1)  # first real token of each row
            self.first_min, self.first_max = int(self.first.min()), int(self.first.max())
