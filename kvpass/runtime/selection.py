"""Site states of the token-selection baselines: StreamingLLM and Quest.

Both keep the model's own cache and choose, at each decode step, which cached tokens to attend.
Index lists are ``(B, H_kv, N)`` positions into the logical cache, -1 for padding.
"""

from __future__ import annotations

import torch

from kvpass.runtime.state import AttentionCall, KVPassError, SiteState


class StreamingState(SiteState):
    """StreamingLLM: the first ``sinks`` real tokens of each row plus the last ``window`` tokens."""

    def select(self, call: AttentionCall) -> torch.Tensor | None:
        sinks, window = self.policy.sinks, self.policy.window
        length, dev = call.length, call.k.device
        batch, h_kv = call.k.shape[0], call.k.shape[1]
        if call.valid is None:
            first = torch.zeros(batch, dtype=torch.long, device=dev)
        else:
            first = call.valid.to(torch.int8).argmax(dim=1)  # first real token of each row
        if bool((first + sinks >= length - window).all()):
            return None  # the budget covers every row's context: exact attention
        sink_idx = first[:, None] + torch.arange(sinks, device=dev)
        sink_idx = torch.where(sink_idx < length - window, sink_idx, -1)
        recent = torch.arange(length - window, length, device=dev).expand(batch, -1)
        idx = torch.cat([sink_idx, recent], dim=1)
        return idx[:, None, :].expand(batch, h_kv, -1)


class QuestState(SiteState):
    """Quest: per page of ``page_size`` tokens the channel-wise min and max key (fp32, grown by doubling)."""

    def reset(self) -> None:
        super().reset()
        self.kmin: torch.Tensor | None = None
        self.kmax: torch.Tensor | None = None

    def metadata_bytes(self) -> int:
        if self.kmin is None:
            return 0
        return 2 * self.kmin.numel() * self.kmin.element_size()

    def _ensure_capacity(self, call: AttentionCall, pages: int) -> None:
        if self.kmin is not None and self.kmin.shape[2] >= pages:
            return
        b, h, _, d = call.k.shape
        cap = max(pages, 2 * (self.kmin.shape[2] if self.kmin is not None else 0), 64)
        kmin = call.k.new_empty((b, h, cap, d), dtype=torch.float32)
        kmax = call.k.new_empty((b, h, cap, d), dtype=torch.float32)
        if self.kmin is not None:
            old = self.kmin.shape[2]
            kmin[:, :, :old] = self.kmin
            kmax[:, :, :old] = self.kmax
        self.kmin, self.kmax = kmin, kmax

    def observe(self, call: AttentionCall) -> None:
        from kvpass.kernels.quest import quest_page_minmax_ref, quest_update_minmax_

        if call.valid is not None:
            raise KVPassError(
                "kvpass: Quest does not support left-padded batches (its pages would straddle padding "
                "and real tokens); run each prompt alone or use StreamingLLM/Full for padded batches"
            )
        ps = self.policy.page_size
        pages = -(-call.length // ps)
        self._ensure_capacity(call, pages)
        if call.start == 0:
            kmin, kmax = quest_page_minmax_ref(call.k_logical, ps)
            self.kmin[:, :, :pages] = kmin
            self.kmax[:, :, :pages] = kmax
        else:
            quest_update_minmax_(self.kmin, self.kmax, call.k[:, :, call.start : call.length], call.start, ps)

    def select(self, call: AttentionCall) -> torch.Tensor | None:
        from kvpass.lowering.dispatch import quest_scores

        budget, ps, length = self.policy.budget, self.policy.page_size, call.length
        if length <= budget:
            return None
        pages = -(-length // ps)
        scores = quest_scores(call.q[:, :, 0], self.kmin, self.kmax, pages)  # (B, H_q, P_cap)
        b, h_kv = call.k.shape[0], call.k.shape[1]
        scores = scores[..., : pages - 1].reshape(b, h_kv, call.group, pages - 1)
        scores = scores.sum(2) if self.policy.gqa == "sum" else scores.amax(2)
        n_pages = min(budget // ps - 1, pages - 1)
        top = scores.topk(n_pages, dim=-1).indices
        last = torch.full((b, h_kv, 1), pages - 1, dtype=top.dtype, device=top.device)
        chosen = torch.cat([top, last], dim=-1)  # (B, H_kv, n_pages + 1)
        idx = (chosen[..., None] * ps + torch.arange(ps, device=top.device)).flatten(-2)
        return torch.where(idx < length, idx, -1)
