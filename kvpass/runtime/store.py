"""The runtime-owned KV store of a site whose cache grows by ``cat`` (DynamicCache).

The graph pass hands the model's cache a *stub* instead of the concatenated keys: a tensor of the
right logical shape ``(B, H_kv, L, D)`` whose sequence stride is 0, so it holds one row per batch
entry and head, not L. Positions, masks and ``get_seq_length`` see the true length (invariant 3)
while the real keys and values live here, appended in place (no per-step copy of the whole cache).

Each stub row carries its batch row's index, so that a reordering done by the caller between steps
(beam search's ``reorder_cache``) is seen and applied to the store, and a crop (assisted decoding)
shows up as a shorter stub.
"""

from __future__ import annotations

import torch

from kvpass.runtime.state import KVPassError


def make_stub(k: torch.Tensor, length: int) -> torch.Tensor:
    """(B, H, length, D) with sequence stride 0; row b holds the value b (the batch row's index)."""
    b, h, _, d = k.shape
    base = torch.arange(b, device=k.device, dtype=k.dtype).view(b, 1, 1).expand(b, h, d).contiguous()
    return base.as_strided((b, h, length, d), (h * d, d, 0, 1))


def stub_rows(t: torch.Tensor) -> torch.Tensor | None:
    """The batch-row indices a stub carries, or None when ``t`` holds real keys.

    A stub that the caller reordered (``index_select`` over the batch, as beam search does) comes
    back materialised, so a dense tensor that is constant per batch row and integral is a stub too;
    real keys are never exactly constant over all positions and channels."""
    if t.dim() != 4 or t.shape[2] == 0:
        return None
    rows = t[:, 0, 0, 0]
    if t.stride(2) == 0 and t.shape[0] == 1:
        return rows.long()  # the common decode step: one row, nothing to verify per element
    if t.stride(2) != 0:
        if not bool((t == rows.view(-1, 1, 1, 1)).all()):
            return None
    if not bool((rows == rows.round()).all()) or bool((rows < 0).any()):
        return None
    return rows.round().long()


def grow_seq(
    buf: torch.Tensor | None,
    need: int,
    *,
    live: int | None = None,
    slack: int = 0,
    factor: float = 1.0,
    fill: float = 0,
    like: torch.Tensor | None = None,
) -> torch.Tensor:
    """A buffer with room for ``need`` slots along dim 2 (the sequence axis of every runtime buffer).

    ``buf`` itself when it has room; otherwise a new tensor of ``max(need + slack, factor · capacity)``
    slots, its first ``live`` slots (default: all of ``buf``) copied and the rest ``fill``. With ``buf``
    None, a new buffer shaped like ``like`` along the other dims."""
    if buf is not None and buf.shape[2] >= need:
        return buf
    ref = buf if buf is not None else like
    cap = max(need + slack, int(factor * buf.shape[2]) if buf is not None else 0)
    out = ref.new_full((*ref.shape[:2], cap, *ref.shape[3:]), fill)
    if buf is not None:
        n = buf.shape[2] if live is None else live
        if n:
            out[:, :, :n] = buf[:, :, :n]
    return out


class OwnedKV:
    """Keys and values of one site, (B, H_kv, capacity, D) each, the first ``length`` slots valid."""

    GROWTH = 1.5
    SLACK = 256  # slots beyond the prefill, so that decoding does not regrow at once

    def __init__(self, host: bool = False) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0
        # host=True: the buffers live in CPU memory (pinned when CUDA is present) whatever device the
        # model runs on: the host tier of an offloading policy
        self.host = host

    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def clear(self) -> None:
        self.k = self.v = None
        self.length = 0

    def _reserve(self, like_k: torch.Tensor, like_v: torch.Tensor, need: int) -> None:
        if self.k is not None and self.k.shape[2] >= need and self.k.shape[:2] == like_k.shape[:2]:
            return
        if self.k is None or self.length == 0:
            cap = need + self.SLACK  # a new sequence: room for decoding, no growth factor
        else:
            cap = max(need, int(self.k.shape[2] * self.GROWTH))
        b, h, _, dk = like_k.shape
        cap = -(-cap // 64) * 64  # whole pages for page-granular policies (page sizes dividing 64)
        # zeros, not empty: page-granular gathers read the unwritten tail of the last page (masked,
        # but 0 * NaN would still be NaN)
        if self.host:
            pin = torch.cuda.is_available()
            k = torch.zeros((b, h, cap, dk), dtype=like_k.dtype, pin_memory=pin)
            v = torch.zeros((b, h, cap, like_v.shape[3]), dtype=like_v.dtype, pin_memory=pin)
        else:
            k = like_k.new_zeros((b, h, cap, dk))
            v = like_v.new_zeros((b, h, cap, like_v.shape[3]))
        if self.k is not None and self.length and self.k.shape[:2] == like_k.shape[:2]:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def append(
        self,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
    ) -> bool:
        """Bring the store in line with the model's cache ``past`` and append the new tokens.

        Returns True when the sequence was (re)started here, so that metadata must be rebuilt from
        position 0: a prefill, a crop, or a cache that was filled outside kvpass."""
        rebuilt = False
        if past_k is None or past_k.shape[2] == 0:
            self.length = 0
            rebuilt = True
        elif (rows := stub_rows(past_k)) is None:
            # a real cache filled elsewhere (eager prefill, a cache passed in by hand): adopt it
            self.length = 0
            self._reserve(past_k, past_v, past_k.shape[2] + k_new.shape[2])
            self.k[:, :, : past_k.shape[2]] = past_k
            self.v[:, :, : past_v.shape[2]] = past_v
            self.length = past_k.shape[2]
            rebuilt = True
        else:
            past = past_k.shape[2]
            if self.k is None or past > self.length:
                raise KVPassError(
                    f"kvpass: the model's cache says {past} tokens but this backend holds {self.length}; "
                    "a cache produced by another backend or model cannot be continued here"
                )
            if rows.shape[0] != self.k.shape[0] or (
                rows.shape[0] > 1 and not torch.equal(rows, torch.arange(rows.shape[0], device=rows.device))
            ):
                if int(rows.min()) < 0 or int(rows.max()) >= self.k.shape[0]:
                    raise KVPassError("kvpass: the cache rows were changed in a way kvpass cannot follow")
                # beam search reordered (or expanded) the batch between steps
                self.k = self.k.index_select(0, rows)
                self.v = self.v.index_select(0, rows)
            if past < self.length:  # cropped (assisted decoding rolled back)
                self.length = past
                rebuilt = True
        end = self.length + k_new.shape[2]
        self._reserve(k_new, v_new, end)
        self.k[:, :, self.length : end] = k_new
        self.v[:, :, self.length : end] = v_new
        self.length = end
        return rebuilt

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, : self.length], self.v[:, :, : self.length]
