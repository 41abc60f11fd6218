"""Site states of the token-selection baselines: StreamingLLM and Quest.

Both keep the model's own cache and choose, at each decode step, which cached tokens to attend.
Index lists are ``(B, H_kv, N)`` positions into the logical cache, -1 for padding.
"""

from __future__ import annotations

import torch

from kvpass.kernels.quest import (
    BOUNDS_DTYPE, quest_bounds, quest_fold_key_, quest_page_minmax_ref, quest_select_torch,
    quest_top_pages_cpu_available, quest_top_pages_torch, quest_update_minmax_, QuestStep
)
from kvpass.kernels.sparse_attention import paged_decode_attention_ref, segments_decode_attention
from kvpass.lowering.dispatch import quest_scores
from kvpass.runtime.call import AttentionCall
from kvpass.runtime.rows import first_positions
from kvpass.runtime.state import SiteState


class StreamingState(SiteState):
    """StreamingLLM: the first ``sinks`` real tokens of each row plus the last ``window`` tokens."""

    _offsets: tuple | None = None  # (key, base, shift) of the unpadded selection (see select)

    def select(self, call: AttentionCall) -> torch.Tensor | None:
        sinks, window = self.policy.sinks, self.policy.window
        length, dev = call.length, call.k.device
        batch, h_kv = call.k.shape[0], call.k.shape[1]
        if self.pad.first_min + sinks >= length - window:
            return None  # the budget covers every row's context: exact attention
        if self.pad.first is None:
            # every row starts at 0 and every sink is before the window: [0, sinks) + [L - window, L) is
            # one op on cached offsets (a steady step's selection costs one small op)
            key = (sinks, window, dev)
            if self._offsets is None or self._offsets[0] != key:
                base = torch.cat([torch.arange(sinks), torch.arange(-window, 0)]).to(dev)
                shift = torch.cat([torch.zeros(sinks, dtype=torch.long), torch.ones(window, dtype=torch.long)])
                self._offsets = (key, base, shift.to(dev))
            _, base, shift = self._offsets
            return torch.add(base, shift, alpha=length).expand(batch, h_kv, -1)
        first = self.pad.first.expand(batch)  # a mask shared by the batch gives one row
        sink_idx = first[:, None] + torch.arange(sinks, device=dev)
        sink_idx = torch.where(sink_idx < length - window, sink_idx, -1)
        recent = torch.arange(length - window, length, device=dev).expand(batch, -1)
        idx = torch.cat([sink_idx, recent], dim=1)
        return idx[:, None, :].expand(batch, h_kv, -1)

    def attend_selected(self, call: AttentionCall, idx: torch.Tensor) -> torch.Tensor:
        # no padding: the C kernel reads the two ranges in place through the list select() made (building
        # the ranges' positions again would cost two aranges and a cat a site and step)
        out = self.attend_listed_in_c(call, idx)
        if out is not None:
            return out
        q = call.q
        if not (q.device.type == "cpu" and q.dtype == call.k.dtype == torch.float32 and call.valid is None):
            return super().attend_selected(call, idx)
        # no padding, no C kernel: the selection is two ranges of the cache, attended in place
        sinks, length = self.policy.sinks, call.length
        ranges = [(0, sinks)] if sinks else []
        ranges.append((length - self.policy.window, length))
        return segments_decode_attention(q[:, :, 0], call.k, call.v, ranges, call.scale).unsqueeze(2)


def _unopened(meta: torch.Tensor) -> None:
    """Quest metadata ``[max | min]`` of pages with no token yet: -inf | +inf, the identity of a merge."""
    d = meta.shape[-1] // 2
    meta[..., :d] = float("-inf")
    meta[..., d:] = float("inf")


class QuestState(SiteState):
    """Quest: per page of ``page_size`` tokens the channel-wise max and min key, kept as one fp16
    buffer ``meta (B, H_kv, P_cap, 2D)`` = [max | min] (grown by doubling; each max rounded up and
    each min down, :func:`kvpass.kernels.quest.quest_bounds`: still bounds, half the bytes a step reads),
    so that a page's bound ``sum_d max(q_d max_d, q_d min_d) = relu(q)·max + min(q, 0)·min`` is one
    product with ``[relu(q) | min(q, 0)]`` (kmin <= kmax holds for this metadata).

    A left-padded batch is served in place (``rows_native``): row ``b``'s pages start at its first real
    position ``f_b`` (``pad.first``), so ``meta[b, :, p]`` covers cache positions ``[f_b + p * page_size,
    f_b + (p + 1) * page_size)``, the pages of the prompt alone, and the row's budget counts its own
    tokens only (:func:`kvpass.kernels.quest.quest_select_cpu`). Padding is never in a page."""

    per_row_metadata = True

    def reset(self) -> None:
        super().reset()
        self.meta: torch.Tensor | None = None
        self.pages: torch.Tensor | None = None  # (B, H_kv, n) pages chosen at the last step
        self._step = None  # the CPU selection's QuestStep, made for meta and pad.first (select)
        # the first position whose key is not yet in its page: steps whose budget covers the context attend
        # everything and leave their keys out (select), folded in when the context outgrows the budget
        self.lag: int | None = None

    def metadata_bytes(self) -> int:
        return 0 if self.meta is None else self.meta.numel() * self.meta.element_size()

    def _ensure_capacity(self, call: AttentionCall, pages: int) -> None:
        if self.meta is not None and self.meta.shape[2] >= pages:
            return
        b, h, _, d = call.k.shape
        cap = max(pages, 2 * (self.meta.shape[2] if self.meta is not None else 0), 64)
        meta = call.k.new_empty((b, h, cap, 2 * d), dtype=BOUNDS_DTYPE)
        _unopened(meta)
        if self.meta is not None:
            meta[:, :, : self.meta.shape[2]] = self.meta
        self.meta = meta

    def observe(self, call: AttentionCall) -> None:
        ps = self.policy.page_size
        pages = -(-call.length // ps)
        meta = self.meta
        if meta is None or meta.shape[2] < pages:
            self._ensure_capacity(call, pages)
        if call.new_tokens == 1 and call.start > 0:
            return  # a steady step: select() merges the key into its page, in its C call where it runs one
        self._fold(call, call.start if self.lag is None else min(self.lag, call.start))

    def _fold(self, call: AttentionCall, start: int) -> None:
        """The keys of positions ``[start, call.length)`` into their pages (all of them where ``start`` is 0),
        at an event: a prefill, a chunk, an adopted cache, the step where the context outgrows the budget."""
        self.lag = None
        ps, d = self.policy.page_size, call.k.shape[3]
        kmax, kmin = self.meta[..., :d], self.meta[..., d:]
        if self.pad.padded:
            self._observe_rows(call, start)
        elif start == 0:
            pages = -(-call.length // ps)
            lo, hi = quest_page_minmax_ref(call.k_logical, ps)
            kmin[:, :, :pages] = quest_bounds(lo, kmin.dtype, up=False)
            kmax[:, :, :pages] = quest_bounds(hi, kmax.dtype, up=True)
            _unopened(self.meta[:, :, pages:])
        else:
            quest_update_minmax_(kmin, kmax, call.k[:, :, start : call.length], start, ps)

    def _observe_rows(self, call: AttentionCall, start: int) -> None:
        """:meth:`_fold` for a left-padded batch: each row's tokens go to its own pages."""
        ps, d, batch = self.policy.page_size, call.k.shape[3], call.k.shape[0]
        kmax, kmin = self.meta[..., :d], self.meta[..., d:]
        # an event (prefill, chunk, adopted cache, the step that outgrows the budget): the mask is read, rows
        # one by one
        first = first_positions(call.valid, batch, "in its prefill")
        if start == 0:
            _unopened(self.meta)
        for b, f in enumerate(first):
            s = max(start, f)
            if s >= call.length:
                continue
            if s == f:
                lo, hi = quest_page_minmax_ref(call.k[b : b + 1, :, f : call.length], ps)
                kmin[b : b + 1, :, : lo.shape[2]] = quest_bounds(lo, kmin.dtype, up=False)
                kmax[b : b + 1, :, : hi.shape[2]] = quest_bounds(hi, kmax.dtype, up=True)
            else:
                quest_update_minmax_(kmin[b : b + 1], kmax[b : b + 1], call.k[b : b + 1, :, s : call.length],
                                     s - f, ps)

    def reorder_rows(self, rows: torch.Tensor) -> None:
        super().reorder_rows(rows)
        if self.meta is not None:
            self.meta = self.meta.index_select(0, rows.to(self.meta.device))
        self.pages = None  # made again at the next selection

    def page_scores(self, call: AttentionCall, pages: int) -> torch.Tensor:
        """(B, H_kv, pages) upper bounds of the query group's q·k per page, on CUDA (the Triton scorer;
        the CPU paths score and choose in one call: :func:`kvpass.kernels.quest.quest_select_cpu`, or
        :func:`~kvpass.kernels.quest.quest_top_pages_torch` where C is not built)."""
        b, h_kv, _, d = call.k.shape
        per_q = quest_scores(call.q[:, :, 0], self.meta[..., d:], self.meta[..., :d], pages)
        per_q = per_q[..., :pages].reshape(b, h_kv, call.group, pages)
        return per_q.sum(2) if self.policy.gqa == "sum" else per_q.amax(2)

    def _top_in_c(self, q: torch.Tensor) -> bool:
        return (type(q) is torch.Tensor and q.is_cpu and q.dtype == torch.float32 and q.stride(-1) == 1
                and quest_top_pages_cpu_available())

    def _fold_key(self, call: AttentionCall) -> None:
        """A steady step's metadata update in torch: the new key (position L - 1) joins its row's page
        (the same ops every step; no host read)."""
        quest_fold_key_(self.meta, call.k[:, :, call.length - 1], self.pad.first if self.pad.padded else None,
                        call.length, self.policy.page_size)

    def select(self, call: AttentionCall) -> torch.Tensor | None:
        budget, ps, length = self.policy.budget, self.policy.page_size, call.length
        steady = call.new_tokens == 1 and call.start > 0  # observe() left the key's merge to this step
        covered = length - self.pad.first_min <= budget
        if covered:
            if steady and self.lag is None:
                self.lag = length - 1  # the pages are not read until the context outgrows the budget
            self.pages = None
            return None  # every row fits in the budget: exact attention, as each alone
        if self.lag is not None:
            self._fold(call, self.lag)  # the keys the covered steps left out, this one's too
            self.events += 1  # a step of other ops, once a sequence
        in_c = self._top_in_c(call.q)
        if steady and not in_c:
            self._fold_key(call)  # the C call merges it itself
        pages = -(-length // ps)
        n = budget // ps - 1
        padded = self.pad.padded
        # padded rows differ in length: a row that fits in the budget takes all its pages
        n_pages = max(n, -(-budget // ps) - 1) if padded else min(n, pages - 1)
        if padded or in_c:
            # the key's merge, scoring, the top pages (ascending, then the newest) and their token positions
            # in one C call
            first = self.pad.first if padded else None
            if in_c:  # the (B, H_q, 1, D) query as it came, the key read in the cache: no views per step
                step = self._step
                if step is None or not step.holds(self.meta, first):
                    step = self._step = QuestStep(self.meta, first, ps, budget, self.policy.gqa)
                k_new = call.k if steady else None
                # the attention in the same C call where it serves the cache (it lists no padding):
                # forward() returns it (select_out)
                done = step.select_attend(call.q, length, n, n_pages, call.k, call.v, call.scale, k_new)
                if done is not None:
                    self.pages, idx, self.select_out = done
                    return idx
                self.pages, idx = step.select(call.q, length, n, n_pages, k_new=k_new)
            else:
                self.pages, idx = quest_select_torch(call.q[:, :, 0], self.meta, first, length, ps, budget, n,
                                                     n_pages, self.policy.gqa)
            return idx
        q = call.q[:, :, 0]
        if not q.is_cuda:
            self.pages = quest_top_pages_torch(q, self.meta, pages - 1, n_pages, self.policy.gqa)
        else:
            scores = self.page_scores(call, pages - 1)  # the newest page is always taken
            top = scores.topk(n_pages, dim=-1, sorted=False).indices
            last = top.new_full((*top.shape[:2], 1), pages - 1)
            self.pages = torch.cat([top, last], dim=-1)  # (B, H_kv, n_pages + 1)
        idx = (self.pages[..., None] * ps + torch.arange(ps, device=q.device)).flatten(-2)
        return torch.where(idx < length, idx, -1)

    def attend_selected(self, call: AttentionCall, idx: torch.Tensor) -> torch.Tensor:
        # select()'s token list, read in place; it lists no padding, so a padded batch is served too
        out = self.attend_listed_in_c(call, idx, lists_padding=False)
        if out is not None:
            return out
        store = self.store
        paged = (
            not call.q.is_cuda
            and call.valid is None  # the paged path counts pages from position 0
            and store.k is not None
            and call.k.data_ptr() == store.k.data_ptr()  # the owned store, not the model's cache
            and store.k.shape[2] % self.policy.page_size == 0
        )
        if not paged:
            return super().attend_selected(call, idx)
        out = paged_decode_attention_ref(
            call.q[:, :, 0], store.k, store.v, self.pages, self.policy.page_size, call.length, call.scale,
            self.workspace, self.choose_dense(self.pages.shape[2] * self.policy.page_size, call.length),
            newest_last=True,  # select() lists the newest page last
        )
        return out.unsqueeze(2)
